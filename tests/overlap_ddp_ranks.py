"""The rank side of tests/test_ddp_overlap.py: models, training loops and the two
spawned runs (``every_optimizer_run``, ``scenarios_run``) whose per-rank results the tests
assert on. Each run returns, per case, what it found (``helpers.Comparison`` for parity:
which tensor differed and by how much)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from helpers import compare, error_of, max_diff, rank_batches, values
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

STEPS = 6
BUCKET_CAP_MB = 0.001  # 250 floats: one to three parameters per bucket

#: name -> (optimizer class, kwargs, only 2-D parameters)
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any], bool]] = {
    "Adafactor": (torch.optim.Adafactor, {"lr": 0.01}, False),
    "Adadelta": (torch.optim.Adadelta, {"lr": 1.0}, False),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.05}, False),
    "Adam": (torch.optim.Adam, {"lr": 0.01}, False),
    "Adam-amsgrad-foreach": (torch.optim.Adam, {"lr": 0.01, "amsgrad": True,
                                                "foreach": True}, False),
    "Adamax": (torch.optim.Adamax, {"lr": 0.01}, False),
    "AdamW": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}, False),
    "ASGD": (torch.optim.ASGD, {"lr": 0.01, "t0": 2}, False),
    "Muon": (torch.optim.Muon, {"lr": 0.01}, True),
    "NAdam": (torch.optim.NAdam, {"lr": 0.01}, False),
    "RAdam": (torch.optim.RAdam, {"lr": 0.01}, False),
    "RMSprop": (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.9, "centered": True}, False),
    "Rprop": (torch.optim.Rprop, {"lr": 0.01}, False),
    "SGD-nesterov": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}, False),
}


# -- models and training loops (run inside the ranks) ---------------------------------


class Branchy(nn.Module):
    """A trunk and a head, plus two branches: with ``use_branch=None`` every parameter
    is used; with a bool, ``rank0_only`` is used when it is true and ``never_used``
    never (for ``find_unused_parameters=True``)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                                   nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, 4)
        self.rank0_only = nn.Linear(32, 4)
        self.never_used = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, use_branch: bool | None = None) -> torch.Tensor:
        hidden = self.trunk(x)
        out = self.head(hidden)
        if use_branch is None:
            return out + self.rank0_only(hidden) + self.never_used(hidden)
        return out + self.rank0_only(hidden) if use_branch else out


def _model() -> Branchy:
    torch.manual_seed(0)
    return Branchy()


def _loss(ddp: DDP, x: torch.Tensor, use_branch: bool | None = None) -> torch.Tensor:
    return ddp(x, use_branch).square().mean()


def _ddp(model: nn.Module, **options: Any) -> DDP:
    return DDP(model, bucket_cap_mb=BUCKET_CAP_MB, **options)


def _params_for(model: nn.Module, two_d_only: bool) -> list[nn.Parameter]:
    params = list(model.parameters())
    return [p for p in params if p.ndim == 2] if two_d_only else params


def _run_loop(
    rank: int,
    overlap: bool,
    optim_cls: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    *,
    two_d_only: bool = False,
    steps: int = STEPS,
    scheduler: bool = True,
    ddp_options: dict[str, Any] | None = None,
    overlap_options: dict[str, Any] | None = None,
    before_step: Callable[[DDP, Any], None] | None = None,
    use_branch: Callable[[int], bool | None] = lambda rank: None,
) -> tuple[list[torch.Tensor], Any]:
    model = _model()
    ddp = _ddp(model, **(ddp_options or {}))
    params = _params_for(model, two_d_only)
    if overlap:
        opt: Any = overlapkit.overlap_ddp(ddp, optim_cls, params=params, **kwargs,
                                          **(overlap_options or {}))
    else:
        opt = optim_cls(params, **kwargs)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if scheduler else None
    for x in rank_batches(rank, steps):
        _loss(ddp, x, use_branch(rank)).backward()
        if before_step is not None:
            before_step(ddp, opt)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    return values(model), opt


# -- spawned run 1: every optimizer ------------------------------------------------------


def every_optimizer_run(rank: int, world_size: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, (optim_cls, kwargs, two_d_only) in OPTIMIZERS.items():
        initial = values(_model())
        overlapped, opt = _run_loop(rank, True, optim_cls, kwargs, two_d_only=two_d_only)
        plain, plain_opt = _run_loop(rank, False, optim_cls, kwargs, two_d_only=two_d_only)
        results[name] = {
            "equal": compare(overlapped, plain),
            "moved": not compare(overlapped, initial),
            "buckets": len(opt.last_buckets()),
            "lr": opt.param_groups[0]["lr"],
            "plain_lr": plain_opt.param_groups[0]["lr"],
        }
    return results


def _parity(rank: int, optim_cls: type[torch.optim.Optimizer], kwargs: dict[str, Any],
            **options: Any) -> bool:
    overlapped, _ = _run_loop(rank, True, optim_cls, kwargs, **options)
    plain, _ = _run_loop(rank, False, optim_cls, kwargs, **options)
    return compare(overlapped, plain)


def _bucket_views_and_unused(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for as_view in (False, True):
        out[f"bucket_view={as_view}"] = _parity(
            rank, torch.optim.AdamW, {"lr": 0.01},
            ddp_options={"gradient_as_bucket_view": as_view})
        options = {"gradient_as_bucket_view": as_view, "find_unused_parameters": True}
        initial = _model()
        model_params = dict(initial.named_parameters())
        # rank 1 never uses rank0_only; nobody uses never_used.
        overlapped, _ = _run_loop(rank, True, torch.optim.Adam, {"lr": 0.01},
                                  ddp_options=options, use_branch=lambda r: r == 0)
        plain, _ = _run_loop(rank, False, torch.optim.Adam, {"lr": 0.01},
                             ddp_options=options, use_branch=lambda r: r == 0)
        names = [n for n, _ in initial.named_parameters()]
        index = {n: i for i, n in enumerate(names)}
        out[f"unused bucket_view={as_view}"] = {
            "equal": compare(overlapped, plain),
            "branch_moved": not torch.equal(overlapped[index["rank0_only.weight"]],
                                            model_params["rank0_only.weight"]),
        }
    out["static_graph"] = _parity(rank, torch.optim.Adam, {"lr": 0.01},
                                  ddp_options={"static_graph": True})
    for as_view in (False, True):
        out[f"comm thread bucket_view={as_view}"] = _parity(
            rank, torch.optim.NAdam, {"lr": 0.01},
            ddp_options={"gradient_as_bucket_view": as_view, "find_unused_parameters": True},
            overlap_options={"step_thread": "comm"}, use_branch=lambda r: r == 0)
    return out


def _no_sync(rank: int) -> dict[str, Any]:
    def run(overlap: bool) -> list[torch.Tensor]:
        model = _model()
        ddp = _ddp(model)
        opt: Any = (overlapkit.overlap_ddp(ddp, torch.optim.Adam, lr=0.01) if overlap
                    else torch.optim.Adam(ddp.parameters(), lr=0.01))
        for i, x in enumerate(rank_batches(rank, 9)):
            boundary = i % 3 == 2
            with contextlib.nullcontext() if boundary else ddp.no_sync():
                _loss(ddp, x).backward()
            if boundary:
                opt.step()
                opt.zero_grad()
        return values(model)

    return {"no_sync": compare(run(True), run(False))}


def _subset_and_groups(rank: int) -> dict[str, Any]:
    def run(overlap: bool) -> list[torch.Tensor]:
        model = _model()
        ddp = _ddp(model)
        weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
        groups = [{"params": weights[:2], "lr": 0.02}, {"params": weights[2:]}]
        opt: Any = (overlapkit.overlap_ddp(ddp, torch.optim.AdamW, params=groups, lr=0.01)
                    if overlap else torch.optim.AdamW(groups, lr=0.01))
        bias_opt = torch.optim.SGD(biases, lr=0.1)
        for x in rank_batches(rank, 4):
            _loss(ddp, x).backward()
            opt.step()
            bias_opt.step()
            opt.zero_grad()
            bias_opt.zero_grad()
        return values(model)

    return {"subset": compare(run(True), run(False))}


def _compress(rank: int) -> dict[str, Any]:
    def run(hook: str | None, overlap: bool) -> list[torch.Tensor]:
        model = _model()
        ddp = _ddp(model)
        if overlap:
            opt: Any = overlapkit.overlap_ddp(ddp, torch.optim.Adam, lr=0.01,
                                              comm_hook=hook or "allreduce")
        else:
            opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
            if hook is not None:
                ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        for x in rank_batches(rank, 4):
            _loss(ddp, x).backward()
            opt.step()
            opt.zero_grad()
        return values(model)

    overlapped = run("fp16_compress", True)
    return {
        "fp16_vs_plain_fp16": max_diff(overlapped, run("fp16_compress", False)),
        "fp16_vs_plain_fp32": max_diff(overlapped, run(None, False)),
    }


def _clipping(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    kwargs = {"lr": 0.1, "momentum": 0.9}

    def clip_value(ddp: DDP, opt: Any) -> None:
        torch.nn.utils.clip_grad_value_(ddp.parameters(), 0.01)

    overlapped, _ = _run_loop(rank, True, torch.optim.SGD, kwargs,
                              overlap_options={"clip_grad_value": 0.01})
    plain, _ = _run_loop(rank, False, torch.optim.SGD, kwargs, before_step=clip_value)
    out["clip_value"] = compare(overlapped, plain)

    # DDP rebuilds its buckets after the first iteration: record each step's partition.
    partitions: list[list[list[int]]] = []

    def record_buckets(ddp: DDP, opt: Any) -> None:
        partitions.append(_bucket_positions(opt))

    overlapped, _ = _run_loop(rank, True, torch.optim.SGD, kwargs, before_step=record_buckets,
                              overlap_options={"clip_grad_norm": 0.05,
                                               "clip_grad_norm_scope": "bucket"})
    steps_done: list[int] = []

    def clip_per_bucket(ddp: DDP, opt: Any) -> None:
        params = list(ddp.module.parameters())
        for bucket in partitions[len(steps_done)]:
            torch.nn.utils.clip_grad_norm_([params[i] for i in bucket], 0.05)
        steps_done.append(1)

    def clip_global(ddp: DDP, opt: Any) -> None:
        torch.nn.utils.clip_grad_norm_(list(ddp.module.parameters()), 0.05)

    plain, _ = _run_loop(rank, False, torch.optim.SGD, kwargs, before_step=clip_per_bucket)
    global_clip, _ = _run_loop(rank, False, torch.optim.SGD, kwargs, before_step=clip_global)
    out["clip_norm_per_bucket"] = compare(overlapped, plain)
    out["clip_norm_differs_from_global"] = not compare(overlapped, global_clip)
    out["clip_norm_buckets"] = len(partitions[-1])
    # the default scope: torch's global clip_grad_norm_ before step(), bitwise, with
    # clipping active (the total norm is above max_norm at every step)
    norms: list[float] = []

    def clip_global_and_record(ddp: DDP, opt: Any) -> None:
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(ddp.module.parameters()),
                                                          0.05)))

    for optim_cls, options in ((torch.optim.SGD, kwargs),
                               (torch.optim.AdamW, {"lr": 0.01})):
        norms.clear()
        overlapped, _ = _run_loop(rank, True, optim_cls, options,
                                  overlap_options={"clip_grad_norm": 0.05})
        plain, _ = _run_loop(rank, False, optim_cls, options,
                             before_step=clip_global_and_record)
        out[f"clip_norm_global {optim_cls.__name__}"] = compare(overlapped, plain)
        out[f"clip_norm_global {optim_cls.__name__} active"] = min(norms) > 0.05
    # and with find_unused_parameters: allowed in the global scope, still exact
    overlapped, _ = _run_loop(rank, True, torch.optim.SGD, kwargs, use_branch=lambda r: r == 0,
                              ddp_options={"find_unused_parameters": True},
                              overlap_options={"clip_grad_norm": 0.05})
    plain, _ = _run_loop(rank, False, torch.optim.SGD, kwargs, use_branch=lambda r: r == 0,
                         ddp_options={"find_unused_parameters": True},
                         before_step=clip_global)
    out["clip_norm_global unused"] = compare(overlapped, plain)
    return out


def _bucket_positions(opt: Any) -> list[list[int]]:
    """The optimizer's last buckets, as positions in its parameter list."""
    owned = [p for group in opt.param_groups for p in group["params"]]
    position_of = {id(p): i for i, p in enumerate(owned)}
    return [[position_of[id(p)] for p in bucket] for bucket in opt.last_buckets()]


def _contract(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    batches = rank_batches(rank, 7)

    # step() after a backward that stepped is a no-op; params changed during backward.
    model = _model()
    ddp = _ddp(model)
    opt = overlapkit.overlap_ddp(ddp, torch.optim.Adam, lr=0.01)
    before = values(model)
    _loss(ddp, batches[0]).backward()
    after_backward = values(model)
    opt.step()
    out["stepped_in_backward"] = not compare(before, after_backward)
    out["step_is_noop"] = compare(after_backward, values(model))
    out["is_optimizer"] = isinstance(opt, torch.optim.Optimizer)
    # zero_grad, both ways.
    opt.zero_grad(set_to_none=False)
    out["zero_grad_zeros"] = all(p.grad is not None and not p.grad.any()
                                 for p in ddp.parameters() if p.grad is not None)
    opt.zero_grad()
    out["zero_grad_none"] = all(p.grad is None for p in ddp.parameters())
    # A step() with no synchronised backward before it is an ordinary step.
    with ddp.no_sync():
        _loss(ddp, batches[1]).backward()
    reference = torch.optim.Adam(_model().parameters(), lr=0.01)
    reference.load_state_dict(copy.deepcopy(opt.state_dict()))
    ref_params = [p for group in reference.param_groups for p in group["params"]]
    with torch.no_grad():
        for mine, ref in zip(model.parameters(), ref_params, strict=True):
            ref.copy_(mine)
            ref.grad = mine.grad.clone()
    opt.step()
    reference.step()
    out["fallback_step_is_plain"] = compare(values(model), [p.detach() for p in ref_params])
    opt.zero_grad()
    # param_groups are live: lr 0 stops the overlapped steps.
    for group in opt.param_groups:
        group["lr"] = 0.0
    frozen = values(model)
    _loss(ddp, batches[2]).backward()
    opt.step()
    out["live_param_groups"] = compare(frozen, values(model))

    # state_dict round trips: overlap -> plain and plain -> overlap.
    overlapped, ov_opt = _run_loop(rank, True, torch.optim.Adam, {"lr": 0.01}, steps=3,
                                   scheduler=False)
    plain, pl_opt = _run_loop(rank, False, torch.optim.Adam, {"lr": 0.01}, steps=3,
                              scheduler=False)
    ov_state, pl_state = ov_opt.state_dict(), pl_opt.state_dict()
    out["state_dict_format"] = (
        ov_state["param_groups"] == pl_state["param_groups"]
        and ov_state["state"].keys() == pl_state["state"].keys()
        and all(ov_state["state"][k].keys() == pl_state["state"][k].keys()
                and all(torch.equal(ov_state["state"][k][s], pl_state["state"][k][s])
                        for s in pl_state["state"][k])
                for k in pl_state["state"])
    )
    out["overlap_to_plain"] = _resume(rank, ov_state, overlapped, overlap=False)
    out["plain_to_overlap"] = _resume(rank, pl_state, plain, overlap=True)
    out["resumed_reference"] = _resume(rank, pl_state, plain, overlap=False)
    return out


def _resume(rank: int, state: dict[str, Any], start: list[torch.Tensor],
            overlap: bool) -> list[torch.Tensor]:
    model = _model()
    with torch.no_grad():
        for p, v in zip(model.parameters(), start, strict=True):
            p.copy_(v)
    ddp = _ddp(model)
    params = _params_for(model, False)
    opt: Any = (overlapkit.overlap_ddp(ddp, torch.optim.Adam, params=params, lr=0.01)
                if overlap else torch.optim.Adam(params, lr=0.01))
    opt.load_state_dict(copy.deepcopy(state))  # loading aliases the state's tensors
    for x in rank_batches(rank + 10, 3):
        _loss(ddp, x).backward()
        opt.step()
        opt.zero_grad()
    return values(model)


def _generator_groups(rank: int) -> dict[str, Any]:
    """Group dicts whose "params" are generators (module.parameters()) are trained."""
    def run(overlap: bool) -> list[torch.Tensor]:
        model = _model()
        ddp = _ddp(model)
        groups = [{"params": model.trunk.parameters()},
                  {"params": model.head.parameters(), "lr": 0.02}]
        opt: Any = (overlapkit.overlap_ddp(ddp, torch.optim.AdamW, params=groups, lr=0.01)
                    if overlap else torch.optim.AdamW(groups, lr=0.01))
        for x in rank_batches(rank, 3):
            _loss(ddp, x).backward()
            opt.step()
            opt.zero_grad()
        return values(model)

    initial = dict(_model().named_parameters())
    ours = run(True)
    names = [n for n, _ in _model().named_parameters()]
    head = ours[names.index("head.weight")]
    return {"generator groups": {"equal": compare(ours, run(False)),
                                 "head_moved": not torch.equal(head, initial["head.weight"])}}


def _join(rank: int) -> dict[str, Any]:
    """DDP.join() with uneven inputs: rank 0 has 3 batches, rank 1 has 5."""
    def run(overlap: bool) -> list[torch.Tensor]:
        model = _model()
        ddp = _ddp(model)
        opt: Any = (overlapkit.overlap_ddp(ddp, torch.optim.SGD, lr=0.1, momentum=0.9)
                    if overlap else torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9))
        with ddp.join():
            for x in rank_batches(rank, 3 + 2 * rank):
                _loss(ddp, x).backward()
                opt.step()
                opt.zero_grad()
        return values(model)

    return {"join": compare(run(True), run(False))}


def _added_groups(rank: int) -> dict[str, Any]:
    """add_param_group: the new parameters are tracked (find_unused_parameters) and
    claimed, like those given at set-up."""
    model = _model()
    ddp = _ddp(model, find_unused_parameters=True)
    opt = overlapkit.overlap_ddp(ddp, torch.optim.SGD, params=model.trunk.parameters(),
                                 lr=0.1)
    opt.add_param_group({"params": model.head.parameters(), "lr": 0.05})
    _loss(ddp, rank_batches(rank, 1)[0]).backward()
    opt.step()
    stepped_in_buckets = {id(p) for bucket in opt.last_buckets() for p in bucket}
    other = _model()
    overlapkit.optimizer_in_backward(other, torch.optim.SGD, params=other.head.parameters(),
                                     lr=0.1)
    other_ddp = _ddp(other)
    return {
        "added in buckets": all(id(p) in stepped_in_buckets for p in model.head.parameters()),
        "added claimed": error_of(lambda: overlapkit.optimizer_in_backward(
            model, torch.optim.SGD, params=[model.head.weight], lr=0.1)),
        "add claimed elsewhere": error_of(lambda: overlapkit.overlap_ddp(
            other_ddp, torch.optim.SGD, params=other.trunk.parameters(), lr=0.1
        ).add_param_group({"params": other.head.parameters()})),
    }


def _errors(rank: int) -> dict[str, Any]:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def fresh() -> DDP:
        return _ddp(_model())

    registered = fresh()
    overlapkit.overlap_ddp(registered, torch.optim.SGD, lr=0.1)
    hooked = fresh()
    hooked.register_comm_hook(None, default_hooks.allreduce_hook)
    ignored = _model()  # a trainable parameter DDP is told not to reduce
    DDP._set_params_and_buffers_to_ignore_for_model(ignored, ["head.bias"])
    working = overlapkit.overlap_ddp(fresh(), torch.optim.SGD, lr=0.1)
    stranger = nn.Parameter(torch.zeros(3))
    return {
        "not an optimizer": error_of(lambda: overlapkit.overlap_ddp(fresh(), nn.Linear)),
        "LBFGS": error_of(lambda: overlapkit.overlap_ddp(fresh(), torch.optim.LBFGS)),
        "SparseAdam": error_of(lambda: overlapkit.overlap_ddp(fresh(), torch.optim.SparseAdam)),
        "second registration": error_of(lambda: overlapkit.overlap_ddp(  # a part of it
            registered, torch.optim.SGD, params=list(registered.parameters())[:1], lr=0.1)),
        "own comm hook": error_of(
            lambda: overlapkit.overlap_ddp(hooked, torch.optim.SGD, lr=0.1)),
        "unknown comm hook": error_of(lambda: overlapkit.overlap_ddp(
            fresh(), torch.optim.SGD, lr=0.1, comm_hook="allreduse")),
        "params not in model": error_of(lambda: overlapkit.overlap_ddp(
            fresh(), torch.optim.SGD, params=[stranger], lr=0.1)),
        "params not managed": error_of(lambda: overlapkit.overlap_ddp(
            _ddp(ignored), torch.optim.SGD, params=ignored.parameters(), lr=0.1)),
        "bad optimizer argument": error_of(
            lambda: overlapkit.overlap_ddp(fresh(), torch.optim.SGD, lr=-1.0)),
        "bad clip": error_of(lambda: overlapkit.overlap_ddp(
            fresh(), torch.optim.SGD, lr=0.1, clip_grad_norm=-1)),
        "closure": error_of(lambda: working.step(lambda: 0.0)),
        "bad step_thread": error_of(lambda: overlapkit.overlap_ddp(
            fresh(), torch.optim.SGD, lr=0.1, step_thread="gloo")),
        "muon on a bias": error_of(lambda: overlapkit.overlap_ddp(fresh(), torch.optim.Muon)),
        "clip norm with unused": error_of(lambda: overlapkit.overlap_ddp(
            _ddp(_model(), find_unused_parameters=True), torch.optim.SGD, lr=0.1,
            clip_grad_norm=1.0, clip_grad_norm_scope="bucket")),
        "clip norm with static graph": error_of(lambda: overlapkit.overlap_ddp(
            _ddp(_model(), static_graph=True), torch.optim.SGD, lr=0.1, clip_grad_norm=1.0,
            clip_grad_norm_scope="bucket")),
        "ZeroRedundancyOptimizer": error_of(lambda: overlapkit.overlap_ddp(
            fresh(), ZeroRedundancyOptimizer, optimizer_class=torch.optim.SGD, lr=0.1)),
    }


def scenarios_run(rank: int, world_size: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for part in (_bucket_views_and_unused, _no_sync, _subset_and_groups, _compress,
                 _clipping, _contract, _generator_groups, _join, _added_groups, _errors):
        results.update(part(rank))
    dist.barrier()
    return results
