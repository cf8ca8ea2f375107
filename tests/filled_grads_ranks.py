"""The rank side of tests/test_filled_grads.py: ``overlap_ddp`` over the simulated link,
its steps filling the parameters' own ``.grad`` while later buckets are on the wire,
against plain DDP over the same link."""

from __future__ import annotations

from typing import Any

import torch
from helpers import compare
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit
from overlapkit.cli.bench.link import HOOK_NAME, SimulatedLink, link_hook, register
from overlapkit.overlap.ddp.inline_schedule import FILL

#: 3 buckets of one 4 MiB weight each: ~30 ms apiece on the link, a few ms of backward
LAYERS = 3
STEPS = 3


def _model() -> DDP:
    torch.manual_seed(0)
    return DDP(nn.Sequential(*(nn.Linear(1024, 1024, bias=False) for _ in range(LAYERS))),
               bucket_cap_mb=4)


def _fresh(hook: Any) -> Any:
    """``hook``, its future holding a copy of the reduced bucket (a tensor of its own,
    as some compression hooks return), not the bucket itself."""
    def fresh(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
        def copied(fut: Any) -> torch.Tensor:
            value = fut.value()
            return (value[0] if isinstance(value, list) else value).clone()
        return hook(state, bucket).then(copied)
    return fresh


def filled_over_the_link(rank: int, world_size: int, order: str, clip_value: float | None,
                         poison: bool, fresh_result: bool = False) -> dict[str, Any]:
    """``STEPS`` steps of plain DDP and of ``overlap_ddp`` (its order fixed), both over
    a 2 Gb/s link, with ``clip_grad_value`` or not. After each backward and each step:
    the gradients, bitwise, and whether each is a tensor of its own (not a view of
    DDP's bucket). How many parameters the stepper lent DDP's finalize, per backward.

    ``poison``: just before the lend, the filled parameters' own gradients are set to
    NaN, so that a gradient DDP's finalize wrote after all would show (it writes the
    bucket's view instead, onto itself): whether each ``.grad`` is NaN after backward.

    ``fresh_result``: both run the link's hook with its future holding a tensor of its
    own (:func:`_fresh`), which DDP's finalize copies into ``.grad``.
    """
    register()
    link = SimulatedLink(gbps=2.0)
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(rank))
    plain = _model()
    state, hook = link_hook(link)
    plain.register_comm_hook(state, _fresh(hook) if fresh_result else hook)
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.01)
    ours = _model()
    ours_opt = overlapkit.overlap_ddp(ours, torch.optim.Adam, lr=0.01, comm_hook=HOOK_NAME,
                                      comm_hook_options={"link": link},
                                      clip_grad_value=clip_value)
    stepper = ours_opt._stepper
    stepper.schedule.fixed = order
    if fresh_result:  # the same wrapping around the stepper's inner hook
        stepper.inner_hook = _fresh(stepper.inner_hook)
    filled = stepper.filled_grads
    lend = filled.lend
    lent_counts: list[int] = []

    def counted_lend() -> None:
        if poison:  # before the lend: a lend that left them .grad lets DDP overwrite them
            for _, local, _ in filled._filled:
                local.fill_(float("nan"))
        lend()
        lent_counts.append(len(filled._lent))

    filled.lend = counted_lend  # type: ignore[method-assign]
    grads_after_backward, grads_own, poisoned = [], [], []
    for _ in range(STEPS):
        plain(x).square().mean().backward()
        if clip_value is not None:
            nn.utils.clip_grad_value_(plain.parameters(), clip_value)
        expected = [p.grad.clone() for p in plain.parameters()]
        plain_opt.step()
        plain_opt.zero_grad()
        ours(x).square().mean().backward()
        got = [p.grad for p in ours.parameters()]
        poisoned.append([bool(g.isnan().all()) for g in got])
        grads_after_backward.append(compare(expected, got))
        grads_own.append(all(g._base is None for g in got))
        ours_opt.step()
        ours_opt.zero_grad()
    return {"grads": grads_after_backward, "grads_own": grads_own, "lent": lent_counts,
            "poisoned": poisoned,
            "params": compare(list(plain.parameters()), list(ours.parameters()))}


class _UsersModel(nn.Module):
    """What a user's model holds: a tied weight (used twice), a layer never used (DDP's
    find_unused_parameters), a frozen layer, an integer parameter, BatchNorm buffers,
    and several 4 MiB buckets, so that runs step while later buckets are on the link."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(1024, 1024)
        self.trunk = nn.Sequential(*(nn.Linear(1024, 1024, bias=False) for _ in range(3)))
        self.norm = nn.BatchNorm1d(1024)
        self.out = nn.Linear(1024, 1024)
        self.out.weight = self.inp.weight  # tied
        self.unused = nn.Linear(8, 8)
        self.frozen = nn.Linear(1024, 1024).requires_grad_(False)
        self.steps = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.frozen(self.inp(x)))
        return self.out(torch.tanh(self.norm(self.trunk(h))))


def users_model_over_the_link(rank: int, world_size: int, loop: str) -> dict[str, Any]:
    """3 steps of ``_UsersModel`` under plain DDP and ``overlap_ddp`` ("fill" order),
    both over a 2 Gb/s link, with ``find_unused_parameters=True``; ``loop``: "step"
    (backward, step, zero_grad) or "backward" (backward only, PyTorch's convention for
    a step taken in backward). Gradients after each backward, parameters and buffers
    after the last step, bitwise; how many parameters the stepper lent per backward."""
    register()
    link = SimulatedLink(gbps=2.0)
    generator = torch.Generator().manual_seed(rank)
    batches = [torch.randn(8, 1024, generator=generator) for _ in range(STEPS)]
    plain = DDP(_UsersModel(), bucket_cap_mb=4, find_unused_parameters=True)
    plain.register_comm_hook(*link_hook(link))
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.01)
    ours = DDP(_UsersModel(), bucket_cap_mb=4, find_unused_parameters=True)
    ours_opt = overlapkit.overlap_ddp(ours, torch.optim.Adam, lr=0.01, comm_hook=HOOK_NAME,
                                      comm_hook_options={"link": link})
    stepper = ours_opt._stepper
    stepper.schedule.fixed = FILL
    filled = stepper.filled_grads
    lend = filled.lend
    lent: list[int] = []

    def counted_lend() -> None:
        lend()
        lent.append(len(filled._lent))

    filled.lend = counted_lend  # type: ignore[method-assign]
    grads = []
    for x in batches:
        plain(x).square().mean().backward()
        expected = [None if p.grad is None else p.grad.clone() for p in plain.parameters()]
        plain_opt.step()
        plain_opt.zero_grad()
        ours(x).square().mean().backward()
        got = [p.grad for p in ours.parameters()]
        grads.append([(a is None and b is None) or (a is not None and b is not None
                                                    and torch.equal(a, b) and b._base is None)
                      for a, b in zip(expected, got, strict=True)])
        if loop == "step":
            ours_opt.step()
            ours_opt.zero_grad()
    return {"grads": grads, "lent": lent,
            "params": compare(list(plain.parameters()), list(ours.parameters())),
            "buffers": compare(list(plain.buffers()), list(ours.buffers()))}

