"""The rank side of tests/test_sharded_dcp.py: a sharded optimizer handed to
``torch.distributed.checkpoint`` itself (``dcp.save({"optim": optimizer})``, a
``Stateful``), after ``consolidate_state_dict(0)`` as a ZeRO loop has it, saved on 2 of 3
gloo ranks and loaded on all 3, against plain DDP + AdamW saved and loaded the same way;
and torch's ``get_state_dict`` + ``dcp.save`` after that gathering (the whole state on
rank 0 only), on groups timing out in :data:`TIMEOUT_SECONDS`.
"""

from __future__ import annotations

import copy
import datetime
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import compare, error_of, values
from sharded_state_ranks import LR, AllOnLastRank, _loss, batches, build, build_reference
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import overlapkit

#: the groups' timeout: what a rank left waiting in a collective save would take
TIMEOUT_SECONDS = 8


def _train(ddp: Any, opt: Any, data: list[torch.Tensor]) -> None:
    for tokens in data:
        _loss(ddp, tokens).backward()
        opt.step()
        opt.zero_grad()


def _pair(group: Any, policy: Any = True) -> tuple[Any, Any, Any, Any]:
    reference, ddp = build_reference(process_group=group), build(process_group=group)
    plain = torch.optim.AdamW(reference.parameters(), lr=LR)
    opt = overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=LR, shard_optimizer_state=policy)
    return reference, plain, ddp, opt


def _timed(call: Any) -> tuple[dict[str, Any] | None, float]:
    started = time.monotonic()
    error = error_of(call)
    return error, time.monotonic() - started


def _files_equal(sharded: str, plain: str) -> Any:
    """The two DCP checkpoints read back whole (on one process): the sharded one's
    optimizer state against the plain one's, bitwise."""
    dcp_to_torch_save(sharded, sharded + ".pt")
    dcp_to_torch_save(plain, plain + ".pt")
    mine = torch.load(sharded + ".pt", weights_only=False)["optim"]
    theirs = torch.load(plain + ".pt", weights_only=False)["optim"]
    if mine["param_groups"] != theirs["param_groups"]:
        return compare([torch.zeros(1)], [torch.ones(1)])
    return compare({f"{k}.{n}": v for k, s in theirs["state"].items() for n, v in s.items()},
                   {f"{k}.{n}": v for k, s in mine["state"].items() for n, v in s.items()})


def dcp_stateful(rank: int, world_size: int, path: str, owning_nothing: bool
                 ) -> dict[str, Any]:
    """``owning_nothing``: every parameter on the last rank (the others own nothing)."""
    policy = AllOnLastRank() if owning_nothing else True
    timeout = datetime.timedelta(seconds=TIMEOUT_SECONDS)
    everyone = dist.new_group(list(range(world_size)), timeout=timeout)
    pair = dist.new_group([0, 1], timeout=timeout)
    out: dict[str, Any] = {}
    data = batches(rank, 4)
    if rank < 2:  # saved at 2 ranks, after the gathering a ZeRO loop does
        reference, plain, ddp, opt = _pair(pair, policy)
        _train(reference, plain, data[:2])
        _train(ddp, opt, data[:2])
        opt.consolidate_state_dict(0)
        out["save"], out["seconds"] = _timed(lambda: dcp.save(
            {"optim": opt}, checkpoint_id=f"{path}/sharded", process_group=pair))
        dcp.save({"optim": plain}, checkpoint_id=f"{path}/plain", process_group=pair)
        saved = values(reference)
    dist.barrier()
    if rank == 0 and out["save"] is None:
        out["file"] = _files_equal(f"{path}/sharded", f"{path}/plain")
    shared = [saved if rank == 0 else None]
    dist.broadcast_object_list(shared, 0)
    if rank < 2 and out["save"] is not None:
        return out
    # loaded at 3 ranks, into optimizers holding state (as DCP loads into a template)
    reference, plain, ddp, opt = _pair(everyone, policy)
    other = batches(rank, 1, seed=7)
    _train(reference, plain, other)
    _train(ddp, opt, other)
    with torch.no_grad():
        for model in (reference, ddp):
            for param, value in zip(model.parameters(), shared[0], strict=True):
                param.copy_(value)
    out["load"] = error_of(lambda: dcp.load({"optim": opt}, checkpoint_id=f"{path}/sharded",
                                            process_group=everyone))
    dcp.load({"optim": plain}, checkpoint_id=f"{path}/plain", process_group=everyone)
    _train(reference, plain, data[2:])
    _train(ddp, opt, data[2:])
    # a save between a stepping backward and step() (as overlapkit.checkpoint's)
    _loss(ddp, data[0]).backward()
    out["in the window"] = error_of(lambda: dcp.save(
        {"optim": opt}, checkpoint_id=f"{path}/window", process_group=everyone))
    opt.step()
    opt.zero_grad()
    _loss(reference, data[0]).backward()
    plain.step()
    plain.zero_grad()
    out["values"] = compare(values(reference), values(ddp))
    opt.consolidate_state_dict(0)
    if rank == 0:
        expected, got = plain.state_dict(), opt.state_dict()
        out["state"] = compare(
            [t for s in expected["state"].values() for t in s.values()],
            [t for s in got["state"].values() for t in s.values()])
    return out


def get_state_dict_after_gathering(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """torch's recipe (``get_state_dict`` on every rank, then ``dcp.save``) after
    ``consolidate_state_dict(0)``: rank 0 gets the whole state, the others are refused;
    what each is told and how long rank 0 waits in the save."""
    group = dist.new_group(list(range(world_size)),
                           timeout=datetime.timedelta(seconds=TIMEOUT_SECONDS))
    _, _, ddp, opt = _pair(group)
    _train(ddp, opt, batches(rank, 2))
    opt.consolidate_state_dict(0)

    def save() -> None:
        model_sd, optim_sd = get_state_dict(ddp, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path,
                 process_group=group)

    error, seconds = _timed(save)
    return {"error": error, "seconds": seconds}


def ported_from_zero(rank: int, world_size: int) -> dict[str, Any]:
    """A loop ported from ``ZeroRedundancyOptimizer``: its arguments passed on to
    ``overlap_ddp``, and its consolidated state dict loaded, then trained, against
    ZeRO going on from the same point."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    group = dist.new_group(list(range(world_size)),
                           timeout=datetime.timedelta(seconds=TIMEOUT_SECONDS))
    out: dict[str, Any] = {}
    for name, value in (("process_group", group), ("overlap_with_ddp", False)):
        ported = build(process_group=group)
        out[name] = error_of(lambda: overlapkit.overlap_ddp(
            ported, torch.optim.AdamW, lr=LR, shard_optimizer_state=True,  # noqa: B023
            **{name: value}))  # noqa: B023
    reference = build_reference(process_group=group)
    zero = ZeroRedundancyOptimizer(reference.parameters(), torch.optim.AdamW, lr=LR,
                                   process_group=group)
    data = batches(rank, 4)
    _train(reference, zero, data[:2])
    zero.consolidate_state_dict(0)
    saved = [zero.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(saved, 0)
    ddp = build(process_group=group)
    opt = overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=LR, shard_optimizer_state=True)
    with torch.no_grad():
        for mine, theirs in zip(ddp.parameters(), reference.parameters(), strict=True):
            mine.copy_(theirs)
    # (ZeRO's dict holds rank 0's live state: a copy, as torch's load keeps what it gets)
    out["load"] = error_of(lambda: opt.load_state_dict(copy.deepcopy(saved[0])))
    _train(reference, zero, data[2:])
    _train(ddp, opt, data[2:])
    out["values"] = compare(values(reference), values(ddp))
    return out


def two_optimizers_gathered_crosswise(rank: int, world_size: int, kind: str
                                      ) -> dict[str, Any]:
    """Two sharded optimizers on one process group (a GAN's), each gathered on the
    ranks in another order (rank 0 the first one first, rank 1 the second): what each
    ``consolidate_state_dict`` raises, then both gathered in order on every rank, the
    first one's dict against plain DDP + AdamW's. The second (``kind``): AdamW over a
    small ``Linear`` ("other model"), SGD over the same model ("same model"), or AdamW
    over the same model ("twin": the same class, shapes, owners and settings; only
    the identity agreed at set-up tells them apart)."""
    group = dist.new_group(list(range(world_size)),
                           timeout=datetime.timedelta(seconds=TIMEOUT_SECONDS))
    reference, plain, first, opt = _pair(group)
    torch.manual_seed(3)
    same_model = kind != "other model"
    small = build(process_group=group) if same_model else \
        torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(6, 6), process_group=group)
    other = overlapkit.overlap_ddp(small, torch.optim.SGD, lr=LR, momentum=0.9,
                                   shard_optimizer_state=True) if kind == "same model" else \
        overlapkit.overlap_ddp(small, torch.optim.AdamW, lr=LR, shard_optimizer_state=True)
    for index, tokens in enumerate(batches(rank, 2)):
        for model, optimizer in ((reference, plain), (first, opt)):
            _loss(model, tokens).backward()
            optimizer.step()
            optimizer.zero_grad()
        if kind == "twin" and index:  # one step behind: its Adam 'step' counts differ
            continue
        loss = _loss(small, tokens) if same_model else \
            small(tokens[:, :6].float()).square().mean()
        loss.backward()
        other.step()
        other.zero_grad()
    order = (opt, other) if rank == 0 else (other, opt)
    out = {"crosswise": [error_of(lambda: each.consolidate_state_dict(0))  # noqa: B023
                         for each in order]}
    opt.consolidate_state_dict(0)
    other.consolidate_state_dict(0)
    if rank == 0:
        expected, got = plain.state_dict(), opt.state_dict()
        out["state"] = compare(
            {f"{k}.{n}": v for k, s in expected["state"].items() for n, v in s.items()},
            {f"{k}.{n}": v for k, s in got["state"].items() for n, v in s.items()})
    return out


class AppState:
    """torch's DCP recipe: a ``Stateful`` handing DCP ``get_state_dict`` of the model and
    the optimizer, and loading through ``set_state_dict``."""

    def __init__(self, model: Any, optimizer: Any) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def app_state_recipe(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """torch's ``AppState`` recipe around the sharded optimizer (after
    ``consolidate_state_dict(0)``), saved and loaded at 2 ranks into a fresh model and
    optimizer, against plain DDP + AdamW the same way."""
    group = dist.new_group(list(range(world_size)),
                           timeout=datetime.timedelta(seconds=TIMEOUT_SECONDS))
    reference, plain, ddp, opt = _pair(group)
    data = batches(rank, 4)
    _train(reference, plain, data[:2])
    _train(ddp, opt, data[:2])
    opt.consolidate_state_dict(0)
    out: dict[str, Any] = {}
    out["save"], out["seconds"] = _timed(lambda: dcp.save(
        {"app": AppState(ddp, opt)}, checkpoint_id=f"{path}/sharded", process_group=group))
    dcp.save({"app": AppState(reference, plain)}, checkpoint_id=f"{path}/plain",
             process_group=group)
    if out["save"] is not None:
        return out
    dist.barrier()
    if rank == 0:
        for name in ("sharded", "plain"):
            dcp_to_torch_save(f"{path}/{name}", f"{path}/{name}.pt")
        mine, theirs = (torch.load(f"{path}/{name}.pt", weights_only=False)["app"]["optim"]
                        for name in ("sharded", "plain"))
        out["file"] = compare(
            {f"{k}.{n}": v for k, s in theirs["state"].items() for n, v in s.items()},
            {f"{k}.{n}": v for k, s in mine["state"].items() for n, v in s.items()})
    reference, plain, ddp, opt = _pair(group)
    out["load"] = error_of(lambda: dcp.load({"app": AppState(ddp, opt)},
                                            checkpoint_id=f"{path}/sharded",
                                            process_group=group))
    dcp.load({"app": AppState(reference, plain)}, checkpoint_id=f"{path}/plain",
             process_group=group)
    _train(reference, plain, data[2:])
    _train(ddp, opt, data[2:])
    out["values"] = compare(values(reference), values(ddp))
    return out
