"""A comm hook plugin whose future holds something other than the reduced bucket, under
``overlap_ddp(..., comm_hook=NAME)``, one gloo rank.

f2b92e2: a tensor of one element (or a scalar) was broadcast into the bucket and the
parameters stepped with it, then DDP's finalize failed with torch's bare "setStorage:
... out of bounds"; None failed with a bare AttributeError; a larger tensor with a bare
size mismatch (plain DDP reads its first elements); the tensor itself, no future,
failed with torch's bare "Unable to cast Python instance". Now each is refused with a
ConfigurationError naming the hook and the bucket when backward ends, nothing stepped.
What plain DDP takes (a half-precision or a reshaped tensor of the bucket's size) stays
bitwise plain DDP's.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit
from overlapkit.distributed import run_distributed
from overlapkit.plugin.manager import get_plugin_manager

REFUSED = ["one element", "scalar", "none", "larger", "two tensors", "no future"]
TAKEN = ["bucket", "half", "reshaped"]


def _result(kind: str, reduced: torch.Tensor) -> Any:
    return {"one element": lambda t: t[:1].clone(), "scalar": lambda t: t.sum(),
            "none": lambda t: None, "larger": lambda t: torch.cat([t, t]),
            "two tensors": lambda t: [t, t], "bucket": lambda t: t,
            "half": lambda t: t.half(), "reshaped": lambda t: t.view(1, -1)}[kind](reduced)


def _hook(kind: str) -> Any:
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        if kind == "no future":  # the reduced tensor itself
            dist.all_reduce(bucket.buffer())
            return bucket.buffer()
        future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        return future.then(lambda fut: _result(kind, fut.value()[0]))
    return hook


def _build(kind: str) -> Any:
    return lambda *, process_group=None: (process_group, _hook(kind))


@overlapkit.hookimpl
def overlapkit_register_comm_hooks() -> list[overlapkit.CommHookRecord]:
    return [overlapkit.CommHookRecord(name=f"returns {kind}", build=_build(kind))
            for kind in REFUSED + TAKEN]


def _model() -> DDP:
    torch.manual_seed(0)
    return DDP(torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(),
                                   torch.nn.Linear(6, 2)), bucket_cap_mb=0.0002)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _train(ddp: DDP, opt: torch.optim.Optimizer) -> torch.Tensor:
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(3, 4, generator=gen), torch.randn(3, 2, generator=gen)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return _flat(ddp)


def _run(rank: int, world_size: int) -> dict[str, Any]:
    get_plugin_manager().register(SimpleNamespace(
        overlapkit_register_comm_hooks=overlapkit_register_comm_hooks), name="bad-hooks")
    found: dict[str, Any] = {}
    for kind in REFUSED:
        ddp = _model()
        overlapkit.overlap_ddp(ddp, torch.optim.SGD, lr=0.1, comm_hook=f"returns {kind}")
        before = _flat(ddp)
        try:
            ddp(torch.randn(3, 4)).sum().backward()
            found[kind] = ("no error", "", True)
        except Exception as error:
            found[kind] = (type(error).__name__, str(error), torch.equal(before, _flat(ddp)))
    for kind in TAKEN:
        plain = _model()
        plain.register_comm_hook(None, _hook(kind))
        ddp = _model()
        opt = overlapkit.overlap_ddp(ddp, torch.optim.SGD, lr=0.1, comm_hook=f"returns {kind}")
        found[kind] = torch.equal(_train(plain, torch.optim.SGD(plain.parameters(), lr=0.1)),
                                  _train(ddp, opt))
    return found


@pytest.fixture(scope="module")
def found() -> dict[str, Any]:
    return run_distributed(_run, 1, timeout=120)[0]


@pytest.mark.parametrize("kind", REFUSED)
def test_a_future_not_holding_the_bucket_is_refused_nothing_stepped(
        found: dict[str, Any], kind: str) -> None:
    name, message, unchanged = found[kind]
    assert name == "ConfigurationError", found[kind]
    assert "_hook.<locals>.hook" in message
    assert ("returned a Tensor for gradient bucket 0, not a torch.futures.Future"
            if kind == "no future" else "returned, for gradient bucket") in message
    assert unchanged, "parameters changed before the refusal"


@pytest.mark.parametrize("kind", TAKEN)
def test_a_future_holding_the_bucket_matches_plain_ddp_bitwise(
        found: dict[str, Any], kind: str) -> None:
    assert found[kind] is True


BUILT = {"a hook alone": (lambda *, process_group=None: _hook("bucket"),
                          "returned a function, not the pair (state, hook)"),
         "nothing": (lambda *, process_group=None: None,
                     "returned a NoneType, not the pair (state, hook)"),
         "three things": (lambda *, process_group=None: (None, _hook("bucket"), 1),
                          "returned a tuple of 3"),
         "no callable": (lambda *, process_group=None: (None, 5),
                         "returned a hook of type int, which is not callable"),
         "one argument": (lambda *, process_group=None: (None, lambda state: None),
                          "that cannot be called as hook(state, bucket)")}


class _Builders:
    @overlapkit.hookimpl
    def overlapkit_register_comm_hooks(self) -> list[overlapkit.CommHookRecord]:
        return [overlapkit.CommHookRecord(name=name.replace(" ", "_"), build=build)
                for name, (build, _) in BUILT.items()]


@pytest.mark.parametrize("case", list(BUILT))
def test_a_builder_not_returning_state_and_hook_is_refused_naming_it(
        overlapkit_plugin_manager: Any, case: str) -> None:
    # f2b92e2: "cannot unpack non-iterable function object" at set-up, or "'int' object
    # is not callable" in the first backward
    overlapkit_plugin_manager.register(_Builders(), name="bad-builders")
    name = case.replace(" ", "_")
    with pytest.raises(overlapkit.ConfigurationError) as refused:
        overlapkit.build_comm_hook(name)
    assert f"comm hook {name!r}" in str(refused.value) and BUILT[case][1] in str(refused.value)
