"""The rank side of tests/test_frozen_params.py: frozen parameters in ``params=`` (a
frozen embedding, param-group dicts built from ``named_parameters()``), accepted as
torch's optimizers accept them, against the plain optimizer over the same ``params``;
a parameter unfrozen after set-up. 2 gloo ranks."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from helpers import compare, error_of, values
from loop_shapes_ranks import Net  # the same small model: embedding, norm, biases
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

STEPS = 4
#: the step before which the frozen embedding is unfrozen, in the unfreezing cases
UNFREEZE_AT = 2


def _net() -> Net:
    torch.manual_seed(0)
    net = Net()
    net.embed.weight.requires_grad_(False)  # a frozen embedding (a frozen backbone)
    return net


def _fsdp2() -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _net()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model.embed, model.fc, model.head):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _inner(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DDP) else model


def _all(model: nn.Module) -> Any:
    return model.parameters()


def _groups(model: nn.Module) -> Any:
    """Decay and no-decay groups from named_parameters(), frozen ones included."""
    named = list(_inner(model).named_parameters())
    return [{"params": [p for n, p in named if n.endswith("bias") or "norm" in n],
             "weight_decay": 0.0},
            {"params": [p for n, p in named if not (n.endswith("bias") or "norm" in n)],
             "weight_decay": 0.1}]


MODELS: dict[str, Callable[[], nn.Module]] = {
    "module": _net,
    "ddp": lambda: DDP(_net(), bucket_cap_mb=0.001),
    "fsdp2": _fsdp2,
}
PARAMS: dict[str, Callable[[nn.Module], Any]] = {"parameters()": _all,
                                                 "named groups": _groups}


def _techniques(model: str) -> tuple[str, ...]:
    return ("overlap_ddp", "optimizer_in_backward") if model == "ddp" \
        else ("optimizer_in_backward",)


def cases() -> list[tuple[str, str, str]]:
    return [(model, technique, params) for model in MODELS for technique in _techniques(model)
            for params in PARAMS]


def _batches(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(50 + rank)
    return [torch.randint(0, 32, (8, 6), generator=generator) for _ in range(STEPS)]


def _embed(model: nn.Module) -> torch.Tensor:
    return _inner(model).embed.weight  # type: ignore[no-any-return]


def _state(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The state dict with full tensors, in a comparable form."""
    state_dict = opt.state_dict()
    tensors = {}
    for index, state in state_dict["state"].items():
        for key, value in state.items():
            full = getattr(value, "full_tensor", None)
            tensors[f"{index}.{key}"] = full() if callable(full) else value
    groups = [{k: v for k, v in group.items()} for group in state_dict["param_groups"]]
    return {"tensors": tensors, "groups": groups}


def _train(model: nn.Module, opt: Any, rank: int, unfreeze: bool) -> dict[str, Any]:
    for step, tokens in enumerate(_batches(rank)):
        if unfreeze and step == UNFREEZE_AT:
            _embed(model).requires_grad_(True)
        model(tokens).square().mean().backward()
        opt.step()
        opt.zero_grad()
    flat = [p for group in opt.param_groups for p in group["params"]]
    embed = next(i for i, p in enumerate(flat) if p is _embed(model))
    return {"values": values(model), "embed index": embed, **_state(opt)}


def run(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model_name, technique, params_name in cases():
        for unfreeze in (False, True):
            name = f"{model_name} | {technique} | {params_name}" + \
                (" | unfrozen later" if unfreeze else "")
            plain_model = MODELS[model_name]()
            plain_opt = torch.optim.AdamW(PARAMS[params_name](plain_model), lr=0.01)
            model = MODELS[model_name]()
            opt = getattr(overlapkit, technique)(model, torch.optim.AdamW,
                                                 params=PARAMS[params_name](model), lr=0.01)
            if unfreeze and model_name == "ddp":
                # DDP decided at construction not to reduce it: refused before the
                # forward, nothing changed
                before = values(model)
                _embed(model).requires_grad_(True)
                error = error_of(lambda m=model: m(_batches(rank)[0]).sum().backward())
                out[name] = {"error": error, "unchanged": compare(before, values(model))}
                continue
            expected = _train(plain_model, plain_opt, rank, unfreeze)
            got = _train(model, opt, rank, unfreeze)
            out[name] = {
                "values": compare(expected["values"], got["values"]),
                "state": compare(expected["tensors"], got["tensors"]),
                "groups": expected["groups"] == got["groups"],
                "embedding state": any(key.startswith(f"{got['embed index']}.")
                                       for key in got["tensors"]),
            }
    return out


def run_loads(rank: int, world_size: int) -> dict[str, Any]:
    """The plain loop's optimizer state dict (``AdamW(model.parameters())``, the frozen
    embedding included) loaded into each technique on DDP: without ``params=`` (the
    trainable parameters only) refused naming the embedding, nothing loaded; with
    ``params=model.parameters()`` loaded, then trained bitwise as the plain optimizer
    resumed from it."""
    out: dict[str, Any] = {}
    batches = _batches(rank)
    plain_model = DDP(_net())
    plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=0.01)
    for tokens in batches[:2]:
        plain_model(tokens).square().mean().backward()
        plain_opt.step()
        plain_opt.zero_grad()
    # torch's load keeps the dict's tensors: each load gets its own copy
    saved = copy.deepcopy(plain_opt.state_dict())
    for technique in ("overlap_ddp", "optimizer_in_backward"):
        model = DDP(_net())
        model.load_state_dict(plain_model.state_dict())
        opt = getattr(overlapkit, technique)(model, torch.optim.AdamW, lr=0.01)
        out[f"{technique} | trainable only"] = {
            "error": error_of(lambda o=opt: o.load_state_dict(saved)),
            "nothing loaded": not opt.state}
        opt.release()
        resumed = DDP(_net())
        resumed.load_state_dict(plain_model.state_dict())
        resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=0.01)
        resumed_opt.load_state_dict(copy.deepcopy(saved))
        model = DDP(_net())
        model.load_state_dict(plain_model.state_dict())
        opt = getattr(overlapkit, technique)(model, torch.optim.AdamW, lr=0.01,
                                             params=model.parameters())
        opt.load_state_dict(copy.deepcopy(saved))
        for tokens in batches[2:]:
            for each_model, each_opt in ((resumed, resumed_opt), (model, opt)):
                each_model(tokens).square().mean().backward()
                each_opt.step()
                each_opt.zero_grad()
        out[f"{technique} | params=model.parameters()"] = {
            "values": compare(values(resumed), values(model))}
        opt.release()
    return out
