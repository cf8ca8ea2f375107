"""What each gloo rank runs for tests/test_optimizer_in_backward.py: DDP and FSDP2.

:func:`two_rank_scenarios` runs every scenario in one spawned run of 2 ranks and returns
a dict of plain results per rank; the tests assert on them one behaviour at a time.
Every comparison is with the plain run: the same optimizer, ``step()`` after backward.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from helpers import compare, error_of, rank_batches, values
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

STEPS = 5
BUCKET_CAP_MB = 0.001  # 250 floats: one to three parameters per bucket

#: name -> (optimizer class, kwargs)
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "SGD-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "AdamW": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.05}),
}


class Branchy(nn.Module):
    """A trunk, a head, and a branch used only when ``use_branch`` is true."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, 4)
        self.branch = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        hidden = self.trunk(x)
        out = self.head(hidden)
        return out + self.branch(hidden) if use_branch else out


def _model() -> Branchy:
    torch.manual_seed(0)
    return Branchy()


def _train(model: nn.Module, opt: Any, batches: list[torch.Tensor], *,
           scheduler: bool = False, before_step: Callable[[], None] | None = None,
           accumulate: int = 1, use_branch: bool = True) -> dict[str, Any]:
    """Train; report whether the optimized parameters' grads were None after each
    stepping backward, and the last lr."""
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if scheduler else None
    owned = [p for group in opt.param_groups for p in group["params"]]
    grads_none = []
    for i, x in enumerate(batches):
        boundary = (i + 1) % accumulate == 0
        quiet = contextlib.nullcontext() if boundary else _no_step(model, opt)
        with quiet:
            model(x, use_branch).square().mean().backward()
        if not boundary:
            continue
        grads_none.append(all(p.grad is None for p in owned))
        if before_step is not None:
            before_step()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    return {"grads_none": all(grads_none), "lr": opt.param_groups[0]["lr"]}


def _no_step(model: nn.Module, opt: Any) -> Any:
    if isinstance(opt, overlapkit.OptimizerInBackward):
        return opt.no_step()
    if isinstance(model, DDP):
        return model.no_sync()
    return contextlib.nullcontext()


# -- DDP -------------------------------------------------------------------------------


def _ddp(**options: Any) -> DDP:
    return DDP(_model(), bucket_cap_mb=BUCKET_CAP_MB, **options)


def _ddp_run(rank: int, in_backward: bool, optim_cls: type[torch.optim.Optimizer],
             kwargs: dict[str, Any], *, ddp_options: dict[str, Any] | None = None,
             oib_options: dict[str, Any] | None = None, plain_hook: Any = None,
             before_step: Callable[[DDP], None] | None = None, steps: int = STEPS,
             **train_options: Any) -> tuple[list[torch.Tensor], dict[str, Any], Any]:
    ddp = _ddp(**(ddp_options or {}))
    if in_backward:
        opt: Any = overlapkit.optimizer_in_backward(ddp, optim_cls, **kwargs,
                                                    **(oib_options or {}))
    else:
        opt = optim_cls(ddp.parameters(), **kwargs)
        if plain_hook is not None:
            ddp.register_comm_hook(None, plain_hook)
    hook = None if before_step is None else (lambda: before_step(ddp))
    info = _train(ddp, opt, rank_batches(rank, steps), before_step=hook, **train_options)
    return values(ddp.module), info, opt


def _ddp_parity(rank: int, optim_cls: type[torch.optim.Optimizer], kwargs: dict[str, Any],
                **options: Any) -> dict[str, Any]:
    plain_options = {k: v for k, v in options.items() if k != "oib_options"}
    ours, info, _ = _ddp_run(rank, True, optim_cls, kwargs, **options)
    plain, plain_info, _ = _ddp_run(rank, False, optim_cls, kwargs, **plain_options)
    return {"equal": compare(ours, plain), "moved": not compare(ours, values(_model())),
            "grads_none": info["grads_none"], "lr": info["lr"], "plain_lr": plain_info["lr"]}


def ddp_scenarios(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (optim_cls, kwargs) in OPTIMIZERS.items():
        for as_view in (False, True):
            out[f"ddp {name} bucket_view={as_view}"] = _ddp_parity(
                rank, optim_cls, kwargs, scheduler=True,
                ddp_options={"gradient_as_bucket_view": as_view})
    out["ddp unused"] = _ddp_parity(
        rank, torch.optim.Adam, {"lr": 0.01},
        ddp_options={"find_unused_parameters": True}, use_branch=rank == 0)
    out["ddp static_graph"] = _ddp_parity(rank, torch.optim.Adam, {"lr": 0.01},
                                          ddp_options={"static_graph": True})
    out["ddp fp16_compress"] = _ddp_parity(
        rank, torch.optim.Adam, {"lr": 0.01}, oib_options={"comm_hook": "fp16_compress"},
        plain_hook=default_hooks.fp16_compress_hook)
    out["ddp no_step"] = _ddp_parity(rank, torch.optim.AdamW, {"lr": 0.01}, accumulate=3,
                                     steps=9)

    def clip(ddp: DDP) -> None:
        torch.nn.utils.clip_grad_value_(ddp.parameters(), 0.01)

    ours, _, _ = _ddp_run(rank, True, torch.optim.SGD, {"lr": 0.1},
                          oib_options={"clip_grad_value": 0.01})
    plain, _, _ = _ddp_run(rank, False, torch.optim.SGD, {"lr": 0.1}, before_step=clip)
    out["ddp clip_value"] = compare(ours, plain)

    # a second, plain optimizer for the biases: their gradients are left alone
    ddp = _ddp()
    weights = [p for n, p in ddp.module.named_parameters() if n.endswith("weight")]
    opt = overlapkit.optimizer_in_backward(ddp, torch.optim.AdamW, params=weights, lr=0.01)
    ddp(rank_batches(rank, 1)[0]).square().mean().backward()
    out["ddp others keep grads"] = all(
        (p.grad is None) == n.endswith("weight") for n, p in ddp.module.named_parameters())
    opt.step()

    # param groups given as generators are trained, not emptied by the checks
    ddp = _ddp()
    head = ddp.module.head
    before = head.weight.detach().clone()
    opt = overlapkit.optimizer_in_backward(
        ddp, torch.optim.SGD, params=[{"params": head.parameters(), "lr": 0.1}], lr=0.1)
    ddp(rank_batches(rank, 1)[0]).square().mean().backward()
    out["ddp generator group"] = (not torch.equal(before, head.weight)
                                  and head.weight.grad is None)

    # a refused comm hook leaves no parameter hook behind (they would free the grads)
    ddp = _ddp()
    ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    out["ddp refused hook"] = error_of(
        lambda: overlapkit.optimizer_in_backward(ddp, torch.optim.SGD, lr=0.1))
    ddp(rank_batches(rank, 1)[0]).square().mean().backward()
    out["ddp refused hook keeps grads"] = all(p.grad is not None for p in ddp.parameters())

    out["ddp state_dict"] = _ddp_state_dict_round_trip(rank)
    out.update(_ddp_errors())
    return out


def _ddp_state_dict_round_trip(rank: int) -> bool:
    """Train 3 steps in backward, load the state into a plain Adam, continue 3 more:
    the same as 6 plain steps."""
    ours, _, opt = _ddp_run(rank, True, torch.optim.Adam, {"lr": 0.01}, steps=3)
    ddp = _ddp()
    with torch.no_grad():
        for p, v in zip(ddp.module.parameters(), ours, strict=True):
            p.copy_(v)
    plain_opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    plain_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    _train(ddp, plain_opt, rank_batches(rank, 6)[3:])
    reference, _, _ = _ddp_run(rank, False, torch.optim.Adam, {"lr": 0.01}, steps=6)
    return compare(values(ddp.module), reference)


def _ddp_errors() -> dict[str, Any]:
    first_overlap = _ddp()
    overlapkit.overlap_ddp(first_overlap, torch.optim.SGD, lr=0.1)
    first_oib = _ddp()
    overlapkit.optimizer_in_backward(first_oib, torch.optim.SGD, lr=0.1)
    inner = _model()
    overlapkit.optimizer_in_backward(inner, torch.optim.SGD, lr=0.1)
    return {
        "ddp twice": error_of(lambda: overlapkit.optimizer_in_backward(  # a part of it
            first_oib, torch.optim.SGD, params=list(first_oib.parameters())[:1], lr=0.1)),
        "ddp after overlap_ddp": error_of(
            lambda: overlapkit.optimizer_in_backward(first_overlap, torch.optim.SGD, lr=0.1)),
        "overlap_ddp after ddp": error_of(
            lambda: overlapkit.overlap_ddp(first_oib, torch.optim.SGD, lr=0.1)),
        "overlap_ddp over a module in backward": error_of(
            lambda: overlapkit.overlap_ddp(DDP(inner), torch.optim.SGD, lr=0.1)),
        "ddp params not in model": error_of(lambda: overlapkit.optimizer_in_backward(
            _ddp(), torch.optim.SGD, params=[nn.Parameter(torch.zeros(2))], lr=0.1)),
        "ddp unknown comm hook": error_of(lambda: overlapkit.optimizer_in_backward(
            _ddp(), torch.optim.SGD, lr=0.1, comm_hook="allreduse")),
        "ddp clip norm with unused": error_of(lambda: overlapkit.optimizer_in_backward(
            _ddp(find_unused_parameters=True), torch.optim.SGD, lr=0.1, clip_grad_norm=1.0,
            clip_grad_norm_scope="bucket")),
    }


# -- FSDP2 ------------------------------------------------------------------------------


def _fsdp(seed_model: nn.Module | None = None) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = seed_model if seed_model is not None else _model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (*model.trunk, model.head, model.branch):
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdp_run(rank: int, in_backward: bool, optim_cls: type[torch.optim.Optimizer],
              kwargs: dict[str, Any], *, oib_options: dict[str, Any] | None = None,
              before_step: Callable[[nn.Module], None] | None = None, steps: int = STEPS,
              **train_options: Any) -> tuple[list[torch.Tensor], dict[str, Any], Any, Any]:
    model = _fsdp()
    if in_backward:
        opt: Any = overlapkit.optimizer_in_backward(model, optim_cls, **kwargs,
                                                    **(oib_options or {}))
    else:
        opt = optim_cls(model.parameters(), **kwargs)
    hook = None if before_step is None else (lambda: before_step(model))
    info = _train(model, opt, rank_batches(rank, steps), before_step=hook, **train_options)
    return values(model), info, opt, model


#: per-parameter norm clipping (the opt-in scope; the default is global)
BUCKET_CLIP = {"clip_grad_norm": 0.05, "clip_grad_norm_scope": "bucket"}


def _fsdp_parity(rank: int, optim_cls: type[torch.optim.Optimizer], kwargs: dict[str, Any],
                 *, plain_before_step: Callable[[nn.Module], None] | None = None,
                 **options: Any) -> dict[str, Any]:
    plain_options = {k: v for k, v in options.items() if k != "oib_options"}
    ours, info, opt, _ = _fsdp_run(rank, True, optim_cls, kwargs, **options)
    plain, plain_info, _, _ = _fsdp_run(rank, False, optim_cls, kwargs,
                                        before_step=plain_before_step, **plain_options)
    return {"equal": compare(ours, plain), "moved": not compare(ours, values(_model())),
            "grads_none": info["grads_none"], "lr": info["lr"], "plain_lr": plain_info["lr"],
            "kind": opt.kind}


def fsdp_scenarios(rank: int, checkpoint_dir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (optim_cls, kwargs) in OPTIMIZERS.items():
        out[f"fsdp2 {name}"] = _fsdp_parity(rank, optim_cls, kwargs, scheduler=True)
    out["fsdp2 no_step"] = _fsdp_parity(rank, torch.optim.AdamW, {"lr": 0.01}, accumulate=3,
                                        steps=9)

    def clip_value(model: nn.Module) -> None:
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)

    def clip_norm_per_param(model: nn.Module) -> None:
        for p in model.parameters():
            torch.nn.utils.clip_grad_norm_([p], 0.05)

    def clip_norm_global(model: nn.Module) -> None:
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.05)

    sgd = {"lr": 0.1, "momentum": 0.9}
    out["fsdp2 clip_value"] = _fsdp_parity(
        rank, torch.optim.SGD, sgd, oib_options={"clip_grad_value": 0.01},
        plain_before_step=clip_value)
    out["fsdp2 clip_norm per parameter"] = _fsdp_parity(
        rank, torch.optim.SGD, sgd, oib_options=BUCKET_CLIP,
        plain_before_step=clip_norm_per_param)
    out["fsdp2 clip_norm not global"] = _fsdp_parity(
        rank, torch.optim.SGD, sgd, oib_options=BUCKET_CLIP,
        plain_before_step=clip_norm_global)
    out["fsdp2 clip_norm global"] = _fsdp_parity(  # the default scope: torch's, exact
        rank, torch.optim.SGD, sgd, oib_options={"clip_grad_norm": 0.05},
        plain_before_step=clip_norm_global)
    out["fsdp2 state_dict"] = _fsdp_state_dict_round_trip(rank)
    out["fsdp2 checkpoint"] = _fsdp_checkpoint_round_trip(rank, checkpoint_dir)
    model = _fsdp()
    overlapkit.optimizer_in_backward(model, torch.optim.SGD, lr=0.1)
    out["fsdp2 twice"] = error_of(lambda: overlapkit.optimizer_in_backward(  # a part of it
        model, torch.optim.SGD, params=list(model.parameters())[:1], lr=0.1))
    out["fsdp2 comm_hook"] = error_of(lambda: overlapkit.optimizer_in_backward(
        _fsdp(), torch.optim.SGD, lr=0.1, comm_hook="allreduce"))
    return out


def _fsdp_state_dict_round_trip(rank: int) -> bool:
    """3 steps in backward, state into a plain AdamW on an FSDP2 model with the same
    values, 3 more plain steps: the same as 6 plain steps."""
    _, _, opt, trained = _fsdp_run(rank, True, torch.optim.AdamW, {"lr": 0.01}, steps=3)
    model = _fsdp()
    with torch.no_grad():
        for p, q in zip(model.parameters(), trained.parameters(), strict=True):
            p.to_local().copy_(q.to_local())
    plain_opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = copy.deepcopy(opt.state_dict())
    plain_opt.load_state_dict(state)
    _train(model, plain_opt, rank_batches(rank, 6)[3:])
    reference, _, _, _ = _fsdp_run(rank, False, torch.optim.AdamW, {"lr": 0.01}, steps=6)
    return compare(values(model), reference)


def _fsdp_checkpoint_round_trip(rank: int, directory: str) -> dict[str, Any]:
    """overlapkit.checkpoint.save after 3 steps in backward; load into a fresh FSDP2
    model and optimizer_in_backward (different initial values); continue 3 steps:
    the same as 6 plain steps, and the loaded state equals the saved one."""
    from pathlib import Path

    from overlapkit import checkpoint

    path = Path(directory) / "fsdp2-in-backward"
    _, _, opt, model = _fsdp_run(rank, True, torch.optim.AdamW, {"lr": 0.01}, steps=3)
    checkpoint.save(path, model, opt)
    saved = copy.deepcopy(opt.state_dict())
    torch.manual_seed(7)
    fresh = _fsdp(Branchy())
    fresh_opt = overlapkit.optimizer_in_backward(fresh, torch.optim.AdamW, lr=0.01)
    checkpoint.load(path, fresh, fresh_opt)
    loaded = fresh_opt.state_dict()
    state_equal = saved["state"].keys() == loaded["state"].keys() and all(
        torch.equal(_local(saved["state"][k][s]), _local(loaded["state"][k][s]))
        for k in saved["state"] for s in saved["state"][k])
    _train(fresh, fresh_opt, rank_batches(rank, 6)[3:])
    reference, _, _, _ = _fsdp_run(rank, False, torch.optim.AdamW, {"lr": 0.01}, steps=6)
    return {"state_equal": state_equal, "continues": compare(values(fresh), reference)}


def _local(value: Any) -> Any:
    return value.to_local() if hasattr(value, "to_local") else value


def two_rank_scenarios(rank: int, world_size: int, checkpoint_dir: str) -> dict[str, Any]:
    results = ddp_scenarios(rank)
    results.update(fsdp_scenarios(rank, checkpoint_dir))
    dist.barrier()
    return results
