"""What the tests and their rank modules share: seeded batches, parameter snapshots, and
comparisons that say which tensor differed and by how much.

Rank functions run in spawned gloo processes and return their findings to the test; a
bare ``False`` would make a failing parity test say nothing, so comparisons return a
:class:`Comparison`, which is true when everything matched bitwise and otherwise prints
the tensors that differed with their largest absolute difference.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from torch import nn

import overlapkit


@attrs.frozen
class Comparison:
    """The outcome of comparing two lists of tensors: true when bitwise equal.

    ``differences`` names each tensor that differs (``"trunk.0.weight: max |diff| 3e-08"``);
    it is picklable, so rank functions can return it to the test process.
    """

    differences: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return not self.differences

    def __repr__(self) -> str:
        if not self.differences:
            return "Comparison(bitwise equal)"
        return "Comparison(" + "; ".join(self.differences) + ")"


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.dtype.is_floating_point or a.dtype.is_complex:
        return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
    return float((a.long() - b.long()).abs().max()) if a.numel() else 0.0


def compare(expected: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
            actual: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
            names: Iterable[str] | None = None, *, equal_nan: bool = False) -> Comparison:
    """Compare tensors pairwise, bitwise; name each that differs (by key, name or index).
    ``equal_nan``: NaNs in the same places count as equal (upstream PyTorch tests'
    ``assertEqual`` does so; a diverging run stays comparable)."""
    if isinstance(expected, Mapping) and isinstance(actual, Mapping):
        if expected.keys() != actual.keys():
            return Comparison((f"keys differ: missing {sorted(set(expected) - set(actual))}, "
                               f"extra {sorted(set(actual) - set(expected))}",))
        labels = list(expected)
        pairs = [(expected[k], actual[k]) for k in labels]
    else:
        exp, act = list(expected.values() if isinstance(expected, Mapping) else expected), \
            list(actual.values() if isinstance(actual, Mapping) else actual)
        if len(exp) != len(act):
            return Comparison((f"{len(exp)} tensors expected, {len(act)} given",))
        labels = list(names) if names is not None else [f"#{i}" for i in range(len(exp))]
        pairs = list(zip(exp, act, strict=True))
    found = []
    for label, (a, b) in zip(labels, pairs, strict=True):
        if a.shape != b.shape or a.dtype != b.dtype:
            found.append(f"{label}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}")
        elif not (torch.equal(a, b) or (
                equal_nan and bool(((a == b) | (a.isnan() & b.isnan())).all()))):
            found.append(f"{label}: max |diff| {_max_abs_diff(a, b):.3g}")
    return Comparison(tuple(found))


def values(model: nn.Module) -> list[torch.Tensor]:
    """A detached copy of every parameter (the full tensor of a DTensor)."""
    out = []
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(full.detach().clone())
    return out


def named_values(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of every parameter and buffer, by name."""
    state = dict(model.named_parameters())
    state.update(model.named_buffers())
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in state.items()}


def checkpoint_tensors(checkpoint: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an overlapkit (DCP) checkpoint — model and optimizer state — by
    dotted key, through DCP's own converter (its ``.pt`` written into ``scratch``)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = scratch / f"{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, out)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}", item)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value

    walk("", torch.load(out, weights_only=False))
    return flat


def max_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """The largest absolute difference over pairs of tensors (0.0 when bitwise equal)."""
    return max((_max_abs_diff(x, y) for x, y in zip(a, b, strict=True)), default=0.0)


def shard_linears(model: nn.Module) -> nn.Module:
    """FSDP2 over every rank (a CPU mesh): each ``nn.Linear`` of ``model`` its own group,
    then the root; returns ``model``. In a rank of an initialised process group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.modules():
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def rank_batches(rank: int, count: int, shape: tuple[int, ...] = (8, 16),
                 seed: int = 100) -> list[torch.Tensor]:
    """``count`` random inputs, different on each rank and the same on every run."""
    generator = torch.Generator().manual_seed(seed + rank)
    return [torch.randn(*shape, generator=generator) for _ in range(count)]


def error_of(call: Callable[[], Any]) -> dict[str, Any] | None:
    """Run ``call``; the class name and message of what it raised, or None."""
    try:
        call()
    except Exception as error:
        from overlapkit import OverlapkitError

        return {"type": type(error).__name__, "message": str(error),
                "overlapkit": isinstance(error, OverlapkitError)}
    return None


def failures(rank_results: Sequence[Mapping[str, Any]], key: str) -> dict[int, Any]:
    """Per rank, the result under ``key`` where it is false (empty when every rank passed)."""
    return {rank: r[key] for rank, r in enumerate(rank_results) if not r[key]}


def in_a_circle(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """The nodes of an import graph (module -> the modules it imports) that reach
    themselves: empty when the graph has no circle."""

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == target or (nxt not in seen and reaches(nxt, target, seen | {nxt})):
                return True
        return False

    return [node for node in graph if reaches(node, node, {node})]


class FailsInBackward(torch.autograd.Function):
    """Identity forward; its backward raises a simulated out-of-memory error (a backward
    that raises part-way, once the layers after it have their gradients)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("out of memory (simulated)")


def on_each_real_step(opt: Any, record: Callable[[torch.optim.Optimizer], Any]) -> None:
    """Have ``record(real)`` run at each step of the real optimizer behind the overlapped
    ``opt`` — each partial step inside backward, a full step at ``step()`` — by patching
    its ``step`` on the instance, marked to run per part (a step hook, or an unmarked
    patch, would have every step taken at ``step()``, in the plain order:
    ``overlap/core/step_hooks.py``)."""
    real = opt.optimizer
    step = real.step

    def recorded(*args: Any, **kwargs: Any) -> Any:
        record(real)
        return step(*args, **kwargs)

    recorded.overlapkit_per_part = True  # type: ignore[attr-defined]
    real.step = recorded


def stepped_once(params: Any = None) -> tuple[nn.Module, Any]:
    """A plain module under optimizer_in_backward after one ordinary step and the
    backward of the next."""
    import overlapkit

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = overlapkit.optimizer_in_backward(
        module, torch.optim.AdamW, lr=1e-2,
        params=None if params is None else params(module))
    first, second = rank_batches(0, 2)
    module(first).square().mean().backward()
    opt.step()
    opt.zero_grad()
    module(second).square().mean().backward()
    return module, opt


def learned_loop(overlap: bool, iteration: Callable[[nn.Module, Any, int, torch.Tensor], None],
             steps: int) -> tuple[list[torch.Tensor], list[str]]:
    """``steps`` iterations of AdamW (``iteration(module, opt, i, batch)`` each), plainly
    or under ``optimizer_in_backward`` told to ``learn_first_step``: the values, the
    warnings."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    if overlap:
        opt: Any = overlapkit.optimizer_in_backward(module, torch.optim.AdamW, lr=1e-2)
        opt.learn_first_step(module)
    else:
        opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, batch in enumerate(rank_batches(0, steps)):
            iteration(module, opt, i, batch)
    return values(module), [str(w.message) for w in caught]


def ranks_fixture(run: Callable[[int, int], Any], timeout: float = 300) -> Any:
    """A module-scoped fixture named ``ranks``: ``run`` (a rank module's) on 2 gloo ranks,
    each rank's findings. Assign it in the test module: ``ranks = ranks_fixture(run)``."""
    from overlapkit.distributed import run_distributed

    @pytest.fixture(scope="module")
    def ranks() -> list[Any]:
        return run_distributed(run, 2, timeout=timeout)

    return ranks


def each_setting(ranks: Sequence[Any], setting: str) -> Sequence[Any]:
    """The ranks' findings to check for ``setting``: every rank's for ``"DDP"``, rank 0's
    for another (a plain module is trained on rank 0 only)."""
    return ranks if setting == "DDP" else ranks[:1]
