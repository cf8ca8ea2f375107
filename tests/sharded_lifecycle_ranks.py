"""The rank side of tests/test_sharded_lifecycle.py: the views and the lifecycle of
``overlap_ddp(..., shard_optimizer_state=True)`` (issue 31, cases 1-7) against plain DDP
and the plain optimizer, on 2 and 3 gloo ranks.

Each function returns what differed (a :class:`~helpers.Comparison`) or the figures
measured, so that a failing test says what and by how much.
"""

from __future__ import annotations

import copy
import gc
import os
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
from helpers import compare, error_of, values
from sharded_state_ranks import LR, _loss, batches, build, build_reference, compare_state_dicts

import overlapkit

MAX_NORM = 0.05


def _sharded(ddp: Any, params: Any = None, **options: Any) -> Any:
    return overlapkit.overlap_ddp(ddp, torch.optim.AdamW, params=params, lr=LR,
                                  shard_optimizer_state=True, **options)


def _whole_on_every_rank(state_dict: dict[str, Any] | None) -> dict[str, Any]:
    """Rank 0's gathered state dict, on every rank (as a ``torch.save``/``torch.load``
    through a shared file would give it)."""
    box = [state_dict]
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None
    return box[0]


# -- case 1: reads of opt.state[p] on ranks not owning p ------------------------------

def reads_of_state(rank: int, world_size: int) -> dict[str, Any]:
    """A logging loop reads ``opt.state[p]`` for every parameter on every rank; the
    gathered state dict is the plain optimizer's, and resuming from it (a fresh model and
    sharded optimizer, 2 more steps) is bitwise the uninterrupted plain run."""
    data = batches(rank, 5)
    reference = build_reference()
    plain = torch.optim.AdamW(reference.parameters(), lr=LR)
    plain_after_3: dict[str, Any] = {}
    plain_model: list[torch.Tensor] = []
    for index, tokens in enumerate(data):
        _loss(reference, tokens).backward()
        plain.step()
        plain.zero_grad()
        if index == 2:
            plain_after_3 = copy.deepcopy(plain.state_dict())
            plain_model = [v.clone() for v in values(reference)]
    ddp = build()
    opt = _sharded(ddp)
    for tokens in data[:3]:
        _loss(ddp, tokens).backward()
        opt.step()
        opt.zero_grad()
        for param in ddp.parameters():  # what a logging loop does
            opt.state[param].get("step")
    opt.consolidate_state_dict(0)
    whole = opt.state_dict() if rank == 0 else None
    missing = [index for index in plain_after_3["state"]
               if not whole["state"].get(index)] if rank == 0 else []
    gathered = compare_state_dicts(plain_after_3, whole) if rank == 0 and not missing \
        else compare([], [])
    model = [v.clone() for v in values(ddp)]
    whole = _whole_on_every_rank(whole)
    resumed = build()
    with torch.no_grad():
        for param, value in zip(resumed.parameters(), model, strict=True):
            param.copy_(value)
    again = _sharded(resumed)
    again.load_state_dict(whole)
    for tokens in data[3:]:
        _loss(resumed, tokens).backward()
        again.step()
        again.zero_grad()
    # the reference resumes the same way: a fresh DDP model reduces its first backward
    # in other buckets, which at 3 gloo ranks sums in another order than the
    # uninterrupted model's (1.2e-07 off); at 2 ranks both are the uninterrupted run
    plain_resumed = build_reference()
    with torch.no_grad():
        for param, value in zip(plain_resumed.parameters(), plain_model, strict=True):
            param.copy_(value)
    plain_again = torch.optim.AdamW(plain_resumed.parameters(), lr=LR)
    plain_again.load_state_dict(plain_after_3)
    for tokens in data[3:]:
        _loss(plain_resumed, tokens).backward()
        plain_again.step()
        plain_again.zero_grad()
    return {"gathered": gathered, "missing entries": len(missing),
            "resumed": compare(values(plain_resumed), values(resumed)),
            "uninterrupted": compare(values(reference), values(resumed))}


# -- case 2: the param groups of state_dict() after a scheduler step ------------------

def groups_after_scheduler(rank: int, world_size: int) -> dict[str, Any]:
    """``consolidate_state_dict(0)`` after ``step()``, then ``scheduler.step()``, then
    ``state_dict()``: the plain optimizer's state dict at that point (its current lr)."""
    tokens = batches(rank, 1)[0]
    reference = build_reference()
    plain = torch.optim.AdamW(reference.parameters(), lr=LR)
    plain_schedule = torch.optim.lr_scheduler.LambdaLR(plain, lambda s: 1.0 / (1 + s))
    _loss(reference, tokens).backward()
    plain.step()
    plain_schedule.step()
    ddp = build()
    opt = _sharded(ddp)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    _loss(ddp, tokens).backward()
    opt.step()
    opt.consolidate_state_dict(0)
    schedule.step()
    if rank != 0:
        return {"state dict": compare([], []), "lr": None}
    whole = opt.state_dict()
    return {"state dict": compare_state_dicts(plain.state_dict(), whole),
            "lr": (whole["param_groups"][0]["lr"], opt.param_groups[0]["lr"])}


# -- case 3: add_param_group under the late-clipping guard ----------------------------

def _head_later(ddp: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The parameters given at set-up (all but the head) and the head's, added later."""
    head = list(ddp.module.head.parameters())
    ids = {id(p) for p in head}
    return [p for p in ddp.parameters() if id(p) not in ids], head


def clip_after_add_param_group(rank: int, world_size: int) -> dict[str, Any]:
    """(a) ``clip_grad_norm_(model.parameters(), MAX_NORM)`` after each stepping backward,
    with the head added by ``add_param_group``: answered, bitwise the plain loop (values
    and norms); (b) ``clip_grad_norm_(head, 0.01)`` after the step: refused, nothing
    changed."""
    data = batches(rank)
    reference = build_reference()
    first, head = _head_later(reference)
    plain = torch.optim.AdamW(first, lr=LR)
    plain.add_param_group({"params": head})
    plain_norms = []
    for tokens in data:
        _loss(reference, tokens).backward()
        plain_norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM))
        plain.step()
        plain.zero_grad()
    ddp = build()
    first, head = _head_later(ddp)
    opt = _sharded(ddp, params=first, clip_grad_norm=MAX_NORM)
    opt.add_param_group({"params": head})
    norms: list[torch.Tensor] = []
    answered = None
    for tokens in data:
        _loss(ddp, tokens).backward()
        error = error_of(lambda: norms.append(
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM)))
        answered = answered or error
        opt.step()
        opt.zero_grad()
    trained = values(ddp)
    _loss(ddp, batches(rank, 1, seed=7)[0]).backward()
    before = values(ddp) + [p.grad.clone() for p in head]
    refused = error_of(lambda: torch.nn.utils.clip_grad_norm_(head, 0.01))
    after = values(ddp) + [p.grad.clone() for p in head]
    return {"answered": answered, "norms": compare(plain_norms, norms),
            "values": compare(values(reference), trained),
            "refused": refused, "unchanged": compare(before, after)}


# -- case 5: nothing left behind -----------------------------------------------------

def _resources() -> dict[str, int]:
    return {"threads": len(os.listdir("/proc/self/task")),
            "fds": len(os.listdir("/proc/self/fd")),
            "groups": len(dist.distributed_c10d._world.pg_map)}


def build_and_drop(rank: int, world_size: int, how: str) -> dict[str, Any]:
    """Build DDP + the optimizer, train one step, drop both (``how``: ``"plain"`` or
    ``"dropped"``, sharded), 10 times; the
    threads, file descriptors and process groups of this rank after the first and the
    last."""
    tokens = batches(rank, 1)[0]
    counts = []
    for _ in range(10):
        ddp = build()
        opt = (torch.optim.AdamW(ddp.parameters(), lr=LR) if how == "plain"
               else _sharded(ddp))
        _loss(ddp, tokens).backward()
        opt.step()
        opt.zero_grad()
        del ddp, opt
        gc.collect()
        dist.barrier()
        counts.append(_resources())
    return {"first": counts[0], "last": counts[-1]}


# -- case 6: the gathered state released once stale ------------------------------------

def _live_tensor_bytes() -> int:
    gc.collect()
    seen: dict[int, int] = {}
    with warnings.catch_warnings():  # a deprecated torch alias among the objects
        warnings.simplefilter("ignore")
        objects = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in objects:
        if obj.device.type == "cpu":
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def stale_gathering_released(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 0's live tensor bytes before ``consolidate_state_dict(0)`` and after
    ``state_dict()`` (dropped) and two more steps, against the gathered state's size."""
    data = batches(rank, 3)
    ddp = build()
    opt = _sharded(ddp)
    _loss(ddp, data[0]).backward()
    opt.step()
    opt.zero_grad()
    before = _live_tensor_bytes()
    opt.consolidate_state_dict(0)
    whole = opt.state_dict() if rank == 0 else None
    size = 0 if whole is None else sum(
        v.numel() * v.element_size() for s in whole["state"].values() for v in s.values()
        if isinstance(v, torch.Tensor))
    del whole
    for tokens in data[1:]:
        _loss(ddp, tokens).backward()
        opt.step()
        opt.zero_grad()
    after = _live_tensor_bytes()
    stale = error_of(opt.state_dict)
    return {"held": after - before, "gathered": size, "stale": stale}


# -- case 7: state-dict hooks ------------------------------------------------------------

def _hooked(opt: Any, seen: list[list[str]]) -> None:
    def post(optimizer: Any, state_dict: dict[str, Any]) -> None:
        state_dict["hooked"] = {"entries": len(state_dict["state"])}

    def load_pre(optimizer: Any, state_dict: dict[str, Any]) -> None:
        seen.append(sorted(state_dict))

    opt.register_state_dict_post_hook(post)
    opt.register_load_state_dict_pre_hook(load_pre)


def state_dict_hooks(rank: int, world_size: int) -> dict[str, Any]:
    """A post-hook's entry in the gathered and the local state dict (the gathered one
    seen whole by the hook), and the keys the load pre-hooks see, against a plain
    optimizer's round trip."""
    tokens = batches(rank, 1)[0]
    reference = build_reference()
    plain = torch.optim.AdamW(reference.parameters(), lr=LR)
    plain_seen: list[list[str]] = []
    _hooked(plain, plain_seen)
    _loss(reference, tokens).backward()
    plain.step()
    plain_dict = plain.state_dict()
    plain.load_state_dict(plain_dict)
    ddp = build()
    opt = _sharded(ddp)
    seen: list[list[str]] = []
    _hooked(opt, seen)
    _loss(ddp, tokens).backward()
    opt.step()
    opt.consolidate_state_dict(0)
    whole = _whole_on_every_rank(opt.state_dict() if rank == 0 else None)
    local = opt.local_state_dict()
    opt.load_state_dict(whole)
    opt.load_state_dict(local)
    return {"plain": plain_dict.get("hooked"), "whole": whole.get("hooked"),
            "local": local.get("hooked"), "plain seen": plain_seen, "seen": seen,
            "state": compare_state_dicts({**plain_dict}, {**whole})}


# -- fourteenth round: DDP(static_graph=True), whose first backward steps at its end ----

def static_graph_reads(rank: int, world_size: int, read: bool) -> dict[str, Any]:
    """Three steps on ``DDP(..., static_graph=True)`` (its first backward reduces, and so
    steps, everything at its end), against plain DDP + AdamW on the same model; with
    ``read``, an EMA of the weights updated between the first backward and ``step()``
    (warned of once, at that line). The warnings of parameters read in the window come
    back as their lines."""
    from overlapkit.overlap.core.watched_params import ParameterReadInWindowWarning

    data = batches(rank, 3)
    reference = build_reference(static_graph=True)
    plain = torch.optim.AdamW(reference.parameters(), lr=LR)
    for tokens in data:
        _loss(reference, tokens).backward()
        plain.step()
        plain.zero_grad()
    ddp = build(static_graph=True)
    opt = _sharded(ddp)
    ema = torch.optim.swa_utils.AveragedModel(ddp.module)
    read_line = -1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for index, tokens in enumerate(data):
            _loss(ddp, tokens).backward()
            if read and index == 0:
                read_line = sys._getframe().f_lineno + 1
                ema.update_parameters(ddp.module)
            opt.step()
            opt.zero_grad()
    lines = [(os.path.basename(w.filename), w.lineno) for w in caught
             if issubclass(w.category, ParameterReadInWindowWarning)]
    return {"warned at": lines, "read at": (os.path.basename(__file__), read_line),
            "params": compare(values(ddp), values(reference))}
