"""The rank side of tests/test_sharded_handover.py: what a sharded optimizer hands to
code around it and takes from it — state-dict hooks registered on it, torch's
``get_optimizer_state_dict`` called on one rank alone, the gathered state dict handed
out, the plain loop's dict of a model with frozen parameters — against plain DDP + the
plain optimizer doing the same, on gloo ranks whose DDP model is (where a rank could be
left waiting) on a process group with a short timeout.

Each function returns what differed (a :class:`~helpers.Comparison`), the errors
raised (:func:`~helpers.error_of`) or the figures measured.
"""

from __future__ import annotations

import copy
import datetime
import time
from typing import Any

import numpy
import torch
import torch.distributed as dist
from helpers import compare, error_of, values
from sharded_state_ranks import (
    LR,
    Net,
    _loss,
    batches,
    build,
    build_reference,
    compare_state_dicts,
)
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

#: the DDP group's timeout: what a rank left waiting at a collective would take
TIMEOUT_SECONDS = 10


def _pair(optim_cls: Any = torch.optim.AdamW, **options: Any) -> tuple[Any, Any, Any, Any]:
    """Plain DDP + ``optim_cls`` and DDP + the sharded one, on a group timing out in
    :data:`TIMEOUT_SECONDS`."""
    group = dist.new_group(list(range(dist.get_world_size())),
                           timeout=datetime.timedelta(seconds=TIMEOUT_SECONDS))
    reference, ddp = build_reference(process_group=group), build(process_group=group)
    options = options or {"lr": LR}
    plain = optim_cls(reference.parameters(), **options)
    opt = overlapkit.overlap_ddp(ddp, optim_cls, shard_optimizer_state=True, **options)
    return reference, plain, ddp, opt


def _train(ddp: Any, opt: Any, data: list[torch.Tensor]) -> None:
    for tokens in data:
        _loss(ddp, tokens).backward()
        opt.step()
        opt.zero_grad()


def _gathered(opt: Any, rank: int) -> dict[str, Any] | None:
    opt.consolidate_state_dict(0)
    return copy.deepcopy(opt.state_dict()) if rank == 0 else None


class _Hooks:
    """What a loop's state-dict hooks do with the optimizer they are handed: a post-hook
    logging every parameter's ``step`` into the dict, a load post-hook reading it."""

    def __init__(self, opt: Any) -> None:
        self.opt = opt
        self.handed: list[bool] = []  # each call: handed the optimizer registered on
        self.read_errors: list[str] = []
        opt.register_state_dict_post_hook(self.post)
        opt.register_load_state_dict_post_hook(self.load_post)

    def _steps(self, optimizer: Any) -> list[Any]:
        return [optimizer.state[p].get("step")
                for group in optimizer.param_groups for p in group["params"]]

    def post(self, optimizer: Any, state_dict: dict[str, Any]) -> None:
        self.handed.append(optimizer is self.opt)
        state_dict["logged"] = sum(s is not None for s in self._steps(optimizer))

    def load_post(self, optimizer: Any) -> None:
        self.handed.append(optimizer is self.opt)
        try:
            [float(optimizer.state[p]["step"])
             for group in optimizer.param_groups for p in group["params"]]
        except KeyError as error:
            self.read_errors.append(type(error).__name__)


def hooks_handed_the_optimizer(rank: int, world_size: int) -> dict[str, Any]:
    """The hooks registered on the optimizer, run before the first step (the gathered
    dict on rank 0 only), then torch's ``set_optimizer_state_dict`` on every rank, then
    training, a ``local_state_dict()`` and a load: what the hooks were handed, the state
    each rank holds, and the parameters against the plain run's."""
    reference, plain, ddp, opt = _pair()
    plain_hooks, hooks = _Hooks(plain), _Hooks(opt)
    data = batches(rank, 3)
    plain.state_dict()
    _gathered(opt, rank)  # the post-hook ran on rank 0, before any state
    held_after_hook = (len(opt.state), len(opt.owned_parameters()))
    named = copy.deepcopy(get_optimizer_state_dict(reference, plain))
    started = time.monotonic()
    loaded = error_of(lambda: set_optimizer_state_dict(ddp, opt, named))
    seconds = time.monotonic() - started
    out: dict[str, Any] = {"set": loaded, "seconds": seconds, "held after hook":
                           held_after_hook}
    if loaded is not None:
        return out
    _train(reference, plain, data[:2])
    _train(ddp, opt, data[:2])
    local = opt.local_state_dict()
    whole = _gathered(opt, rank)
    saved = copy.deepcopy(plain.state_dict())
    hooks.read_errors.clear()  # (torch's loads before training read unset entries)
    plain_hooks.read_errors.clear()
    plain.load_state_dict(copy.deepcopy(saved))
    opt.load_state_dict(copy.deepcopy(saved))
    held = (len(opt.state), len(opt.owned_parameters()))
    _train(reference, plain, data[2:])
    _train(ddp, opt, data[2:])
    return {**out, "handed": hooks.handed, "plain handed": plain_hooks.handed,
            "read errors": hooks.read_errors, "plain read errors": plain_hooks.read_errors,
            "logged": (local.get("logged"), len(opt.owned_parameters())),
            "whole logged": None if whole is None else whole.get("logged"),
            "state": True if whole is None else compare_state_dicts(
                {k: v for k, v in saved.items() if k != "logged"},
                {k: v for k, v in whole.items() if k != "logged"}),
            "held": held, "values": compare(values(reference), values(ddp))}


class _Shrinking(torch.optim.Optimizer):
    """An optimizer whose update does not scale with ``lr``: each step shrinks the
    parameters (torch's initialising step at ``lr`` 0 changes them)."""

    def __init__(self, params: Any, lr: float = LR, shrink: float = 0.01) -> None:
        super().__init__(params, {"lr": lr, "shrink": shrink})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    state["step"] = state.get("step", 0) + 1
                    p.mul_(1 - group["shrink"]).add_(p.grad, alpha=-group["lr"])


def torch_s_get_on_one_rank(rank: int, world_size: int) -> dict[str, Any]:
    """torch's ``get_optimizer_state_dict`` on rank 0 alone before the first step (the
    plain optimizer's recipe to save from one rank), plain and sharded, then every rank
    meets at a barrier and trains; and, with an optimizer whose update does not scale
    with ``lr``, torch's initialising step on every rank.

    SGD with momentum: its state made by torch's initialising step (a zero momentum
    buffer) steps as no state does, so the plain replicas stay equal (Adam's ``step``
    count on rank 0 alone would be one ahead: plain DDP's replicas then differ)."""
    reference, plain, ddp, opt = _pair(torch.optim.SGD, lr=0.1, momentum=0.9)
    data = batches(rank, 3)
    got: dict[str, Any] | None = None
    started = time.monotonic()
    if rank == 0:
        get_optimizer_state_dict(reference, plain)
        got = error_of(lambda: get_optimizer_state_dict(ddp, opt))
    seconds = time.monotonic() - started
    met = error_of(lambda: dist.barrier(group=ddp.process_group))
    trained = error_of(lambda: _train(ddp, opt, data))
    _train(reference, plain, data)
    whole = _gathered(opt, rank) if trained is None else None
    _, _, shrinking_ddp, shrinking = _pair(_Shrinking)
    before = values(shrinking_ddp)
    shrunk = error_of(lambda: get_optimizer_state_dict(shrinking_ddp, shrinking))
    return {"get": got, "seconds": seconds, "barrier": met, "trained": trained,
            "values": compare(values(reference), values(ddp)),
            "state": True if whole is None else compare_state_dicts(plain.state_dict(),
                                                                     whole),
            "shrunk": shrunk, "owns": bool(shrinking.owned_parameters()),
            "put back": compare(before, values(shrinking_ddp))}


def gathered_dict_handed_out(rank: int, world_size: int) -> dict[str, Any]:
    """The gathered state dict on rank 0 after torch's ``get_optimizer_state_dict`` read
    it (torch renames its state's keys in place, to parameter names) and after the loop
    deleted an entry of the dict ``state_dict()`` returned: ``state_dict()`` again, and
    that dict loaded into a plain optimizer, against the plain optimizer's."""
    reference, plain, ddp, opt = _pair()
    data = batches(rank, 2)
    _train(reference, plain, data)
    _train(ddp, opt, data)
    # `to` as ZeroRedundancyOptimizer takes it: a NumPy integer, an integer tensor
    given = {"numpy to": error_of(lambda: opt.consolidate_state_dict(numpy.int64(0))),
             "tensor to": error_of(lambda: opt.consolidate_state_dict(torch.tensor(0)))}
    if rank != 0:
        return given
    expected = plain.state_dict()
    given["numpy state"] = compare_state_dicts(expected, opt.state_dict())
    named = compare_state_dicts(get_optimizer_state_dict(reference, plain),
                                get_optimizer_state_dict(ddp, opt))
    after_get = copy.deepcopy(opt.state_dict())
    returned = opt.state_dict()
    del returned["state"][next(iter(returned["state"]))]
    after_del = copy.deepcopy(opt.state_dict())
    loaded = torch.optim.AdamW(Net().parameters(), lr=LR)
    loaded.load_state_dict(copy.deepcopy(after_get))
    return {**given, "named": named, "after get": compare_state_dicts(expected, after_get),
            "after del": compare_state_dicts(expected, after_del),
            "plain loaded": compare_state_dicts(expected, loaded.state_dict())}


class _WithFrozen(torch.nn.Module):
    """A frozen layer between two trainable ones (``requires_grad=False``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(32, 16)
        self.frozen = torch.nn.Linear(16, 16).requires_grad_(False)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.frozen(self.embed(tokens).mean(dim=1)))


def plain_dict_with_frozen_parameters(rank: int, world_size: int) -> dict[str, Any]:
    """The plain loop's dict (``AdamW(model.parameters())``, holding a frozen layer)
    loaded into the sharded optimizer built without ``params=`` (refused, naming the
    layer, nothing loaded) and with ``params=ddp.parameters()`` (then trained
    bitwise the plain optimizer resumed from it on a new DDP model: at 3 ranks a new
    DDP model's first buckets sum in another order than the rebuilt ones)."""
    first = DDP(_WithFrozen(), bucket_cap_mb=0.001)
    plain = torch.optim.AdamW(first.parameters(), lr=LR)
    data = batches(rank, 3)
    first(data[0]).square().mean().backward()
    plain.step()
    saved = copy.deepcopy(plain.state_dict())

    def resumed() -> DDP:
        model = DDP(_WithFrozen(), bucket_cap_mb=0.001)
        model.load_state_dict(first.state_dict())
        return model

    ddp = resumed()
    default = overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=LR,
                                     shard_optimizer_state=True)
    before = default.local_state_dict()["sharded_state"]
    refused = error_of(lambda: default.load_state_dict(copy.deepcopy(saved)))
    unchanged = (before.keys() == default.local_state_dict()["sharded_state"].keys()
                 and default.param_groups[0]["lr"] == LR)
    reference, ddp = resumed(), resumed()
    plain = torch.optim.AdamW(reference.parameters(), lr=LR)
    plain.load_state_dict(copy.deepcopy(saved))
    opt = overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=LR, params=ddp.parameters(),
                                 shard_optimizer_state=True)
    opt.load_state_dict(copy.deepcopy(saved))
    for model, optimizer in ((reference, plain), (ddp, opt)):
        for tokens in data[1:]:
            model(tokens).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    return {"refused": refused, "unchanged": unchanged,
            "values": compare(values(reference), values(ddp))}


def hooks(rank: int, world_size: int) -> dict[str, Any]:
    """Every case of this module, in one spawned run."""
    return {"hooks": hooks_handed_the_optimizer(rank, world_size),
            "one rank": torch_s_get_on_one_rank(rank, world_size),
            "handed out": gathered_dict_handed_out(rank, world_size),
            "frozen": plain_dict_with_frozen_parameters(rank, world_size)}
