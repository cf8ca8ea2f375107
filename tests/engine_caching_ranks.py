"""The rank side of tests/test_engine_caching.py: a model with many DDP buckets, tied,
unused, frozen and integer parameters, trained by overlap_ddp and by plain DDP +
step() with several optimizers; midway a param group is added, the optimizer state is
reloaded, and an LR scheduler changes ``lr`` every step. Everything the engine and the
bucket stepper now keep from one backward to the next (bucket layouts, step plans) must
follow: DDP rebuilding its buckets after the first iteration, the new group, the reload.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from helpers import compare, rank_batches, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

STEPS = 7
#: 100 floats: about one parameter per bucket
BUCKET_CAP_MB = 0.0004

#: name -> (optimizer class, kwargs); the first four go through the functional path
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "Adam": (torch.optim.Adam, {"lr": 0.01}),
    "AdamW-amsgrad-maximize": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1,
                                                   "amsgrad": True, "maximize": True}),
    "SGD-nesterov": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True,
                                       "weight_decay": 0.01}),
    "SGD-tensor-lr": (torch.optim.SGD, {"lr": torch.tensor(0.1)}),
    "Adam-foreach": (torch.optim.Adam, {"lr": 0.01, "foreach": True}),
    "RMSprop": (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.9}),
}


#: DDP set-up name -> (DDP options, whether the model has a branch no rank uses).
#: Without find_unused_parameters DDP rebuilds its buckets after the first iteration
#: (in another order: the tied weight's gradient is ready last), which every bucket
#: layout kept from that iteration must follow.
DDP_SETUPS: dict[str, tuple[dict[str, Any], bool]] = {
    "default": ({}, False),
    "bucket_view": ({"gradient_as_bucket_view": True}, False),
    "find_unused": ({"find_unused_parameters": True}, True),
    "static_graph bucket_view": ({"static_graph": True, "gradient_as_bucket_view": True},
                                 True),
}


class Tangled(nn.Module):
    """Twelve small layers (many buckets), one weight used twice (tied), a frozen layer,
    an integer parameter and, ``with_unused``, a branch no rank uses."""

    def __init__(self, with_unused: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(12, 12) for _ in range(12))
        self.tied = nn.Linear(12, 12, bias=False)
        self.frozen = nn.Linear(12, 12)
        self.frozen.requires_grad_(False)
        if with_unused:
            self.unused = nn.Linear(12, 3)
        self.head = nn.Linear(12, 3)
        self.counter = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.tied(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        x = self.frozen(self.tied(x))
        return self.head(x)


def _model(with_unused: bool = True) -> Tangled:
    torch.manual_seed(0)
    return Tangled(with_unused)


def _train(rank: int, overlap: bool, optim_cls: type[torch.optim.Optimizer],
           kwargs: dict[str, Any], setup: str) -> tuple[list[torch.Tensor], int]:
    ddp_options, with_unused = DDP_SETUPS[setup]
    model = _model(with_unused)
    ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB, **ddp_options)
    # the head joins later (add_param_group); frozen and integer ones are not DDP's
    first = [p for name, p in model.named_parameters()
             if p.requires_grad and not name.startswith("head")]
    kwargs = copy.deepcopy(kwargs)
    opt: Any = (overlapkit.overlap_ddp(ddp, optim_cls, params=first, **kwargs) if overlap
                else optim_cls(first, **kwargs))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    for step, x in enumerate(rank_batches(rank, STEPS, shape=(8, 12))):
        ddp(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        if step == 1:
            opt.add_param_group({"params": list(model.head.parameters()), "lr": 0.02})
            # a scheduler knows the groups it was built with: one for all of them now
            sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.7)
        if step == 3:
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    buckets = len(opt.last_buckets()) if overlap else 0
    return values(model), buckets


def many_buckets_run(rank: int, world_size: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for setup, (_, with_unused) in DDP_SETUPS.items():
        initial = values(_model(with_unused))
        for name, (optim_cls, kwargs) in OPTIMIZERS.items():
            ours, buckets = _train(rank, True, optim_cls, kwargs, setup)
            plain, _ = _train(rank, False, optim_cls, kwargs, setup)
            results[f"{name} {setup}"] = {
                "equal": compare(plain, ours), "moved": not compare(initial, ours),
                "buckets": buckets}
    dist.barrier()
    return results


def comm_hook_run(rank: int, world_size: int) -> dict[str, Any]:
    """overlapkit's ``allreduce`` comm hook registered by hand against torch's
    allreduce_hook and against DDP without a hook."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    trained = {}
    for name in ("none", "torch", "overlapkit"):
        model = _model()
        ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB, find_unused_parameters=True)
        if name == "torch":
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        elif name == "overlapkit":
            ddp.register_comm_hook(*overlapkit.build_comm_hook("allreduce"))
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        for x in rank_batches(rank, 3, shape=(8, 12)):
            ddp(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        trained[name] = values(model)
    return {"torch": compare(trained["torch"], trained["overlapkit"]),
            "no hook": compare(trained["none"], trained["overlapkit"])}


def one_rank_hook_run(rank: int, world_size: int) -> dict[str, Any]:
    """What overlapkit's ``allreduce`` comm hook returns for each bucket of a one-rank
    group: whether every future was complete when returned, holding the bucket itself,
    and how many collectives the hook ran (the group's sequence number)."""
    from overlapkit.comm_hooks import allreduce_hook

    seen: list[tuple[bool, bool]] = []
    group = dist.group.WORLD
    collectives = 0

    def watching_hook(state, bucket):  # type: ignore[no-untyped-def]
        nonlocal collectives
        before = group._get_sequence_number_for_group()
        future = allreduce_hook(state, bucket)
        collectives += group._get_sequence_number_for_group() - before
        seen.append((future.done(), future.done() and future.value() is bucket.buffer()))
        return future

    ddp = DDP(_model(), bucket_cap_mb=BUCKET_CAP_MB, find_unused_parameters=True)
    ddp.register_comm_hook(None, watching_hook)
    for x in rank_batches(rank, 2, shape=(8, 12)):
        ddp(x).square().mean().backward()
    return {"buckets": len(seen), "complete": all(done for done, _ in seen),
            "collectives": collectives,
            "the bucket itself": all(same for _, same in seen)}


def three_ranks_run(rank: int, world_size: int) -> dict[str, Any]:
    """overlap_ddp against plain DDP (no comm hook) at a group size that is not a power
    of two, where averaging by dividing and by multiplying with the inverse differ in
    the last bit: each (optimizer, DDP set-up) trained both ways. With
    ``gradient_as_bucket_view=True`` the head's gradients, kept from one iteration to
    the next until it joins the optimizer, are divided by plain DDP itself (they are
    the bucket's views), the others multiplied (overlap/ddp/kept_gradients.py)."""
    results: dict[str, Any] = {}
    for setup in DDP_SETUPS:
        for name in ("Adam", "SGD-nesterov", "Adam-foreach"):
            optim_cls, kwargs = OPTIMIZERS[name]
            ours, _ = _train(rank, True, optim_cls, kwargs, setup)
            plain, _ = _train(rank, False, optim_cls, kwargs, setup)
            results[f"{name} {setup}"] = compare(plain, ours)
    for set_to_none in (False, True):
        ours = _kept_grads_train(rank, True, set_to_none)
        plain = _kept_grads_train(rank, False, set_to_none)
        results[f"gradient_as_bucket_view, zero_grad(set_to_none={set_to_none})"] = \
            compare(plain, ours)
    for case in ("create_graph", "unused"):
        results[f"gradient_as_bucket_view, {case}"] = compare(
            _tested_late_train(rank, False, case), _tested_late_train(rank, True, case))
    dist.barrier()
    return results


def _kept_grads_train(rank: int, overlap: bool, set_to_none: bool) -> list[torch.Tensor]:
    """A ``gradient_as_bucket_view=True`` loop zeroing gradients in place (or freeing
    them), with a branch no rank uses (its gradient is kept, never recomputed)."""
    model = _model(with_unused=True)
    ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB, gradient_as_bucket_view=True,
              find_unused_parameters=True)
    params = [p for p in model.parameters() if p.requires_grad]
    opt: Any = (overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=0.01, params=params)
                if overlap else torch.optim.AdamW(params, lr=0.01))
    for x in rank_batches(rank, 4, shape=(8, 12)):
        ddp(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return values(model)


class _TwoBranches(nn.Module):
    """A first layer always used, a second one only while ``use_b``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        x = self.a(x)
        return self.b(x) if use_b else x


def _tested_late_train(rank: int, overlap: bool, case: str) -> list[torch.Tensor]:
    """``gradient_as_bucket_view=True`` loops where what DDP tests differs from what
    ``.grad`` was when backward began: ``create_graph=True`` (accumulated out of place:
    a gradient of its own), and a branch unused in the last iteration whose ``.grad``
    was set to a tensor of its own (tested when backward reaches the first parameter)."""
    # create_graph: one linear layer, whose gradients need no gradient themselves
    torch.manual_seed(0)
    model: nn.Module = _TwoBranches() if case == "unused" else nn.Linear(8, 8)
    ddp = DDP(model, gradient_as_bucket_view=True,
              find_unused_parameters=case == "unused")
    opt: Any = (overlapkit.overlap_ddp(ddp, torch.optim.SGD, lr=0.1) if overlap
                else torch.optim.SGD(model.parameters(), lr=0.1))
    generator = torch.Generator().manual_seed(rank)
    for step in range(3):
        use_b = case != "unused" or step < 2
        if not use_b:
            for param in model.get_submodule("b").parameters():
                param.grad = torch.randn(param.shape,
                                         generator=torch.Generator().manual_seed(1))
        batch = torch.randn(4, 8, generator=generator)
        loss = (ddp(batch, use_b=use_b) if case == "unused" else ddp(batch)).sum()
        loss.backward(create_graph=case == "create_graph")
        opt.step()
        opt.zero_grad(set_to_none=False)
    return values(model)


class _SparseNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, 8, sparse=True)
        self.head = nn.Linear(8, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens)).sum()


def sparse_hook_run(rank: int, world_size: int) -> dict[str, Any]:
    """overlapkit's ``allreduce`` hook on a model with a sparse gradient, against plain
    DDP: gradients after one backward (the sparse one divided, as DDP divides it)."""
    tokens = torch.randint(0, 50, (40,), generator=torch.Generator().manual_seed(rank))
    grads = {}
    for name in ("plain", "overlapkit"):
        ddp = DDP(_SparseNet())
        if name == "overlapkit":
            ddp.register_comm_hook(*overlapkit.build_comm_hook("allreduce"))
        ddp(tokens).backward()
        grads[name] = [p.grad.coalesce().to_dense() if p.grad.is_sparse else p.grad
                       for p in ddp.module.parameters()]
    return {"equal": compare(grads["plain"], grads["overlapkit"])}
