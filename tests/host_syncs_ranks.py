"""The rank side of tests/test_host_syncs.py: the aten ops that a training loop runs,
seen by a ``TorchDispatchMode``, counted per case (plain loop, ``overlap_ddp``,
``optimizer_in_backward``) and split into those inside ``backward()`` and the rest."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

import overlapkit

STEPS = 3
#: aten ops that wait for the device and read a value back to the host (on a GPU each
#: one stalls the CPU until the stream has caught up)
HOST_SYNCS = frozenset({"_local_scalar_dense", "item", "is_nonzero", "equal", "allclose",
                        "nonzero", "masked_select", "unique", "_unique2"})
#: what torch's single-tensor (for-loop) Adam runs per parameter, absent from the
#: foreach one and from the backward of the model below
SINGLE_TENSOR_ADAM = frozenset({"lerp_", "addcmul_", "addcdiv_", "sqrt"})
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adam_foreach": (torch.optim.Adam, {"lr": 0.01, "foreach": True}),
    "sgd_foreach": (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9, "foreach": True}),
    "adam_for_loop": (torch.optim.Adam, {"lr": 0.01, "foreach": False}),
    # clip_grad_norm=1.0 given to overlapkit; the plain loop calls clip_grad_norm_ itself
    "sgd_foreach_clipped": (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9, "foreach": True}),
}
#: the norm the clipped cases clip to
MAX_NORM = 1.0
#: loop -> (the model is DDP, how the optimizer is built)
LOOPS = ("plain_ddp", "overlap_ddp", "optimizer_in_backward_ddp", "plain_module",
         "optimizer_in_backward_module")


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched on this thread (and autograd's, which carries the
    mode) by name, without changing what runs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _loop(loop: str, optimizer: str) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32),
                                      nn.Tanh(), nn.Linear(32, 4))
    cls, kwargs = OPTIMIZERS[optimizer]
    if optimizer.endswith("_clipped") and not loop.startswith("plain"):
        kwargs = {**kwargs, "clip_grad_norm": MAX_NORM}
    if loop.endswith("ddp"):
        model = DDP(model, bucket_cap_mb=0.001)  # about one parameter per bucket
    if loop.startswith("plain"):
        return model, cls(model.parameters(), **kwargs)
    if loop == "overlap_ddp":
        return model, overlapkit.overlap_ddp(model, cls, **kwargs)
    return model, overlapkit.optimizer_in_backward(model, cls, **kwargs)


def count_ops(rank: int, world_size: int) -> dict[tuple[str, str], dict[str, Counter[str]]]:
    """Per (loop, optimizer): the ops of ``STEPS`` training steps from the first
    (``all``) and those that ran inside ``backward()`` (``backward``)."""
    found = {}
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))
    for optimizer in OPTIMIZERS:
        for loop in LOOPS:
            model, opt = _loop(loop, optimizer)
            counter = OpCounter()
            in_backward: Counter[str] = Counter()
            with counter:
                for _ in range(STEPS):
                    loss = model(x).square().mean()
                    before = Counter(counter.ops)
                    loss.backward()
                    in_backward += counter.ops - before
                    if optimizer.endswith("_clipped"):
                        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
                    opt.step()
                    opt.zero_grad()
            found[loop, optimizer] = {"all": counter.ops, "backward": in_backward}
    return found
