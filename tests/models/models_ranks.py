"""The rank side of the ``models`` tox environment: real architectures from Hugging Face
``transformers`` configs with random weights (no download), trained on 2 gloo ranks by
each technique and by the plain PyTorch loop it stands in for.

- GPT-2: tied embedding and head, a frozen position embedding, an integer parameter;
- BERT (``BertModel``): the pooler is never used (``find_unused_parameters=True``);
- ResNet: BatchNorm running statistics (buffers DDP broadcasts from rank 0).

Every run returns, per case, a ``helpers.Comparison`` against the plain run.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from helpers import compare, named_values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

STEPS, RESUME_AT, LR, CLIP_VALUE, CLIP_NORM = 10, 5, 1e-3, 0.05, 0.5


class Refused:
    """A case the technique refused with an OverlapkitError: false, with its message."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"Refused({self.message!r})"


# -- models ---------------------------------------------------------------------------


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16,
                        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    model.transformer.wpe.weight.requires_grad_(False)  # frozen
    model.register_parameter(  # an integer parameter, as some users keep counters
        "seen_batches", nn.Parameter(torch.zeros(1, dtype=torch.int64), requires_grad=False))
    return model


def bert() -> nn.Module:
    from transformers import BertConfig, BertModel

    config = BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                        intermediate_size=64, vocab_size=64, max_position_embeddings=16,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertModel(config)  # its pooler is not used by the loss below


def resnet() -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                          num_labels=3, layer_type="basic")
    return ResNetForImageClassification(config)


MODELS: dict[str, tuple[Callable[[], nn.Module], dict[str, Any]]] = {
    "gpt2": (gpt2, {}),
    "bert": (bert, {"find_unused_parameters": True}),
    "resnet": (resnet, {"broadcast_buffers": True}),
}


def _build(name: str) -> DDP:
    make, ddp_options = MODELS[name]
    torch.manual_seed(0)
    return DDP(make(), bucket_cap_mb=0.01, **ddp_options)


def _batch(name: str, rank: int, step: int) -> Any:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    if name == "resnet":
        return torch.randn(4, 3, 16, 16, generator=generator)
    return torch.randint(0, 64, (2, 12), generator=generator)


def _loss(name: str, model: DDP, batch: Any) -> torch.Tensor:
    if name == "gpt2":
        return model(input_ids=batch, labels=batch).loss
    if name == "bert":
        return model(input_ids=batch).last_hidden_state.square().mean()
    return model(pixel_values=batch).logits.square().mean()


# -- training -------------------------------------------------------------------------


def _scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def _train(name: str, model: DDP, opt: Any, sched: Any, rank: int, steps: range, *,
           plain_clip: str | None, scaler: torch.amp.GradScaler | None = None) -> None:
    """The training loop; with ``scaler``, the PyTorch AMP loop under bf16 autocast."""
    for step in steps:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=scaler is not None):
            loss = _loss(name, model, _batch(name, rank, step)).float()
        if scaler is None:
            loss.backward()
        else:
            scaler.scale(loss).backward()
            if plain_clip is not None:
                scaler.unscale_(opt)
        if plain_clip == "value":
            torch.nn.utils.clip_grad_value_(model.parameters(), CLIP_VALUE)
        elif plain_clip == "norm":
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        sched.step()


def _make(technique: str, model: DDP, clip: str = "value",
          scaler: torch.amp.GradScaler | None = None) -> tuple[Any, str | None]:
    """The optimizer of ``technique`` on ``model``, clipping by ``clip`` ("value" or
    "norm") and driven by ``scaler``; how the loop clips itself (None: the optimizer
    clips)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if technique == "plain":
        return torch.optim.AdamW(params, lr=LR), clip
    clipping: dict[str, Any] = ({"clip_grad_value": CLIP_VALUE} if clip == "value"
                                else {"clip_grad_norm": CLIP_NORM})
    if scaler is not None:
        clipping["grad_scaler"] = scaler
    if technique in ("overlap_ddp", "optimizer_in_backward"):
        return getattr(overlapkit, technique)(model, torch.optim.AdamW, lr=LR,
                                              **clipping), None
    raise ValueError(technique)


def _run(name: str, technique: str, rank: int, directory: str | None,
         clip: str = "value", amp: bool = False) -> dict[str, Any]:
    """Train STEPS steps; with ``directory``, save at RESUME_AT and go on from a fresh
    model and optimizer loaded from it; with ``amp``, the AMP loop with a GradScaler."""
    model = _build(name)
    scaler = _scaler() if amp else None
    opt, plain_clip = _make(technique, model, clip, scaler)
    sched = _scheduler(opt)
    if directory is None:
        _train(name, model, opt, sched, rank, range(STEPS), plain_clip=plain_clip,
               scaler=scaler)
        return named_values(model.module)
    _train(name, model, opt, sched, rank, range(RESUME_AT), plain_clip=plain_clip,
           scaler=scaler)
    path = os.path.join(directory, f"{name}-{technique}{'-amp' if amp else ''}")
    overlapkit.checkpoint.save(path, model, opt)
    sched_state = copy.deepcopy(sched.state_dict())
    scaler_state = None if scaler is None else copy.deepcopy(scaler.state_dict())
    torch.manual_seed(123)  # other initial values: everything must come from the file
    fresh = _build(name)
    fresh_scaler = _scaler() if amp else None
    if fresh_scaler is not None and scaler_state is not None:
        fresh_scaler.load_state_dict(scaler_state)
    fresh_opt, _ = _make(technique, fresh, clip, fresh_scaler)
    fresh_sched = _scheduler(fresh_opt)  # the usual resume: build all, then load
    overlapkit.checkpoint.load(path, fresh, fresh_opt)
    fresh_sched.load_state_dict(sched_state)
    _train(name, fresh, fresh_opt, fresh_sched, rank, range(RESUME_AT, STEPS),
           plain_clip=plain_clip, scaler=fresh_scaler)
    return named_values(fresh.module)


def _scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)


def _torch_post_local_sgd(name: str, rank: int) -> dict[str, Any]:
    """torch's post-local SGD (hook, PostLocalSGDOptimizer, PeriodicModelAverager) with
    the same scheduler and clipping, uninterrupted: the reference."""
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
        PostLocalSGDState,
        post_localSGD_hook,
    )
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    model = _build(name)
    subgroup, _ = dist.new_subgroups(group_size=1)
    model.register_comm_hook(
        PostLocalSGDState(process_group=None, subgroup=subgroup, start_localSGD_iter=2),
        post_localSGD_hook)
    opt = PostLocalSGDOptimizer(torch.optim.AdamW(model.parameters(), lr=LR),
                                PeriodicModelAverager(period=2, warmup_steps=2))
    _train(name, model, opt, _scheduler(opt), rank, range(STEPS), plain_clip="value")
    return named_values(model.module)


def _our_post_local_sgd(name: str) -> tuple[DDP, Any, Any]:
    model = _build(name)
    opt = overlapkit.post_local_sgd(model, torch.optim.AdamW(model.parameters(), lr=LR),
                                    period=2, warmup_steps=2, subgroup_size=1)
    return model, opt, _scheduler(opt)


def _post_local_sgd(name: str, rank: int, directory: str | None,
                    via: str = "torch.save") -> dict[str, Any]:
    """overlapkit's post-local SGD; with ``directory``, save the model, optimizer and
    scheduler at RESUME_AT and go on from fresh objects loaded from them: each rank its
    own file with ``torch.save`` (after warm-up the ranks differ: the documented way),
    or one ``overlapkit.checkpoint`` for all."""
    model, opt, sched = _our_post_local_sgd(name)
    if directory is None:
        _train(name, model, opt, sched, rank, range(STEPS), plain_clip="value")
        return named_values(model.module)
    _train(name, model, opt, sched, rank, range(RESUME_AT), plain_clip="value")
    sched_state = copy.deepcopy(sched.state_dict())
    if via == "torch.save":
        path = os.path.join(directory, f"{name}-post-local-sgd-rank{rank}.pt")
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    else:
        path = os.path.join(directory, f"{name}-post-local-sgd")
        overlapkit.checkpoint.save(path, model, opt)
    torch.manual_seed(123)  # other initial values: everything must come from the file
    model, opt, sched = _our_post_local_sgd(name)
    if via == "torch.save":
        saved = torch.load(path, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
    else:
        overlapkit.checkpoint.load(path, model, opt)
    sched.load_state_dict(sched_state)
    _train(name, model, opt, sched, rank, range(RESUME_AT, STEPS), plain_clip="value")
    return named_values(model.module)


def run(rank: int, world_size: int, name: str, directory: str) -> dict[str, Any]:
    """Every technique on model ``name``, against the plain run."""
    plain = _run(name, "plain", rank, None)
    out: dict[str, Any] = {}
    for technique in ("overlap_ddp", "optimizer_in_backward"):
        out[technique] = compare(plain, _run(name, technique, rank, None))
        out[f"{technique} resumed"] = compare(plain, _run(name, technique, rank, directory))
    out["plain resumed"] = compare(plain, _run(name, "plain", rank, directory))
    plain_norm = _run(name, "plain", rank, None, clip="norm")
    for technique in ("overlap_ddp", "optimizer_in_backward"):
        try:
            ours = _run(name, technique, rank, None, clip="norm")
        except overlapkit.OverlapkitError as error:  # refused up front: not the same
            out[f"{technique} clip_grad_norm"] = Refused(str(error))
        else:
            out[f"{technique} clip_grad_norm"] = compare(plain_norm, ours)
    plain_amp = _run(name, "plain", rank, directory, clip="norm", amp=True)
    for technique in ("overlap_ddp", "optimizer_in_backward"):
        try:
            ours = _run(name, technique, rank, directory, clip="norm", amp=True)
        except overlapkit.OverlapkitError as error:  # refused up front: not the same
            out[f"{technique} GradScaler resumed"] = Refused(str(error))
        else:
            out[f"{technique} GradScaler resumed"] = compare(plain_amp, ours)
    theirs = _torch_post_local_sgd(name, rank)
    out["post_local_sgd"] = compare(theirs, _post_local_sgd(name, rank, None))
    out["post_local_sgd resumed"] = compare(theirs, _post_local_sgd(name, rank, directory))
    # overlapkit.checkpoint holds one copy of a DDP model: exact, or refused up front
    try:
        ours = _post_local_sgd(name, rank, directory, via="overlapkit.checkpoint")
    except overlapkit.CheckpointError as error:
        refused = "cannot go into an overlapkit checkpoint" in str(error)
        out["post_local_sgd overlapkit.checkpoint"] = refused or Refused(str(error))
    else:
        out["post_local_sgd overlapkit.checkpoint"] = compare(theirs, ours)
    dist.barrier()
    return out
