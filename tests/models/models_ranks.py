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

STEPS, RESUME_AT, LR, CLIP_VALUE = 8, 4, 1e-3, 0.05


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
           plain_clip: bool) -> None:
    for step in steps:
        _loss(name, model, _batch(name, rank, step)).backward()
        if plain_clip:
            torch.nn.utils.clip_grad_value_(model.parameters(), CLIP_VALUE)
        opt.step()
        opt.zero_grad()
        sched.step()


def _make(technique: str, model: DDP) -> tuple[Any, bool]:
    """The optimizer of ``technique`` on ``model``; whether the loop clips itself."""
    params = [p for p in model.parameters() if p.requires_grad]
    if technique == "plain":
        return torch.optim.AdamW(params, lr=LR), True
    if technique == "overlap_ddp":
        return overlapkit.overlap_ddp(model, torch.optim.AdamW, lr=LR,
                                      clip_grad_value=CLIP_VALUE), False
    if technique == "optimizer_in_backward":
        return overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=LR,
                                                clip_grad_value=CLIP_VALUE), False
    raise ValueError(technique)


def _run(name: str, technique: str, rank: int, directory: str | None) -> dict[str, Any]:
    """Train STEPS steps; with ``directory``, save at RESUME_AT and go on from a fresh
    model and optimizer loaded from it."""
    model = _build(name)
    opt, plain_clip = _make(technique, model)
    sched = _scheduler(opt)
    if directory is None:
        _train(name, model, opt, sched, rank, range(STEPS), plain_clip=plain_clip)
        return named_values(model.module)
    _train(name, model, opt, sched, rank, range(RESUME_AT), plain_clip=plain_clip)
    path = os.path.join(directory, f"{name}-{technique}")
    overlapkit.checkpoint.save(path, model, opt)
    sched_state = copy.deepcopy(sched.state_dict())
    torch.manual_seed(123)  # other initial values: everything must come from the file
    fresh = _build(name)
    fresh_opt, _ = _make(technique, fresh)
    fresh_sched = _scheduler(fresh_opt)  # the usual resume: build all, then load
    overlapkit.checkpoint.load(path, fresh, fresh_opt)
    fresh_sched.load_state_dict(sched_state)
    _train(name, fresh, fresh_opt, fresh_sched, rank, range(RESUME_AT, STEPS),
           plain_clip=plain_clip)
    return named_values(fresh.module)


def _post_local_sgd(name: str, rank: int) -> dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
        PostLocalSGDState,
        post_localSGD_hook,
    )
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    theirs = _build(name)
    subgroup, _ = dist.new_subgroups(group_size=1)
    theirs.register_comm_hook(
        PostLocalSGDState(process_group=None, subgroup=subgroup, start_localSGD_iter=2),
        post_localSGD_hook)
    their_opt = PostLocalSGDOptimizer(torch.optim.AdamW(theirs.parameters(), lr=LR),
                                      PeriodicModelAverager(period=2, warmup_steps=2))
    ours = _build(name)
    our_opt = overlapkit.post_local_sgd(ours, torch.optim.AdamW(ours.parameters(), lr=LR),
                                        period=2, warmup_steps=2, subgroup_size=1)
    for step in range(STEPS):
        for model, opt in ((theirs, their_opt), (ours, our_opt)):
            _loss(name, model, _batch(name, rank, step)).backward()
            opt.step()
            opt.zero_grad()
    return {"torch": named_values(theirs.module), "ours": named_values(ours.module)}


def run(rank: int, world_size: int, name: str, directory: str) -> dict[str, Any]:
    """Every technique on model ``name``, against the plain run."""
    plain = _run(name, "plain", rank, None)
    out: dict[str, Any] = {}
    for technique in ("overlap_ddp", "optimizer_in_backward"):
        out[technique] = compare(plain, _run(name, technique, rank, None))
        out[f"{technique} resumed"] = compare(plain, _run(name, technique, rank, directory))
    out["plain resumed"] = compare(plain, _run(name, "plain", rank, directory))
    local = _post_local_sgd(name, rank)
    out["post_local_sgd"] = compare(local["torch"], local["ours"])
    dist.barrier()
    return out
