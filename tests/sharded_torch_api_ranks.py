"""The rank side of tests/test_sharded_torch_api.py: a sharded optimizer driven through
torch's own APIs rather than overlapkit's (``torch.distributed.checkpoint.state_dict``'s
``get_optimizer_state_dict`` / ``set_optimizer_state_dict``), ``load_state_dict`` in the
window, ``consolidate_state_dict`` called on only some ranks, and more ranks than
parameters, against plain DDP + the plain optimizer on 2 and 3 gloo ranks."""

from __future__ import annotations

import copy
import datetime
import time
from typing import Any

import torch
import torch.distributed as dist
from helpers import compare, error_of, values
from sharded_state_ranks import LR, _loss, batches, build
from sharded_views_ranks import _pair, _train
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit


def torch_state_dict_api(rank: int, world_size: int) -> dict[str, Any]:
    """``get_optimizer_state_dict`` of the sharded optimizer (refused: it would be this
    rank's share), then ``set_optimizer_state_dict`` of the plain optimizer's dict (keyed
    by parameter names), and two more steps; and ``load_state_dict`` between a stepping
    backward and ``step()`` (refused, loading nothing), against the plain run."""
    reference, plain, ddp, opt = _pair()
    data = batches(rank, 5)
    _train(reference, plain, data[:2])
    _train(ddp, opt, data[:2])
    got = error_of(lambda: get_optimizer_state_dict(ddp, opt))
    # a copy, as read from disk: the plain optimizer's own tensors would be shared
    named = copy.deepcopy(get_optimizer_state_dict(reference, plain))
    set_optimizer_state_dict(ddp, opt, named)
    entries = (len(opt.state), len(opt.owned_parameters()))
    _train(reference, plain, data[2:3])
    _train(ddp, opt, data[2:3])
    # load_state_dict in the window: the backward has stepped already
    saved = copy.deepcopy(plain.state_dict())
    _loss(ddp, data[3]).backward()
    before = [t.clone() for t in values(ddp)]
    loaded = error_of(lambda: opt.load_state_dict(saved))
    unchanged = compare(before, values(ddp))
    opt.step()
    opt.zero_grad()
    _train(reference, plain, data[3:])
    _train(ddp, opt, data[4:])
    return {"get": got, "entries": entries, "loaded in window": loaded,
            "window: nothing changed": unchanged,
            "values": compare(values(reference), values(ddp))}


def consolidated_on_some_ranks(rank: int, world_size: int) -> dict[str, Any]:
    """``consolidate_state_dict(to=0)`` on every rank but the last,
    on a DDP model whose process group has a 5 s timeout; then ``add_param_group`` on
    rank 0 only, on another model (a 6 s group): the errors and how long they took."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=5))
    dist.barrier()  # (the default group's timeout) the ranks start the 5 s group together
    ddp = build(process_group=group)
    opt = overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=LR, shard_optimizer_state=True)
    _train(ddp, opt, batches(rank, 1))
    dist.barrier()
    start = time.monotonic()
    error = None
    if rank != world_size - 1:
        error = error_of(lambda: opt.consolidate_state_dict(0))
    else:
        time.sleep(10)  # past the others' timeout and roll call
    seconds = time.monotonic() - start
    dist.barrier()
    group = dist.new_group(timeout=datetime.timedelta(seconds=6))
    dist.barrier()
    ddp = build(process_group=group)
    head = list(ddp.module.head.parameters())
    opt = overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=LR, shard_optimizer_state=True,
                                 params=[p for p in ddp.parameters()
                                         if all(p is not h for h in head)])
    _train(ddp, opt, batches(rank, 1))
    dist.barrier()
    start = time.monotonic()
    added = None
    if rank == 0:
        added = error_of(lambda: opt.add_param_group({"params": head}))
    else:
        time.sleep(11)
    return {
            "error": error, "seconds": seconds,
            "added": added, "added seconds": time.monotonic() - start}


class _Linear(nn.Module):
    """Two parameter tensors: at 3 ranks one owns nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def more_ranks_than_parameters(rank: int, world_size: int) -> dict[str, Any]:
    """A rank owning nothing: steps, the gathered state dict, ``load_state_dict`` of a
    plain dict and of the local one, torch's ``set_optimizer_state_dict`` /
    ``get_optimizer_state_dict`` (the rank owning nothing took torch's initialising step
    alone: ``ExchangeFailedError`` at the group's timeout), and a full step, against
    plain DDP + Adam; and ``load_state_dict`` in the first window (loaded, then
    refused at ``step()``), on a DDP model whose group has a 5 s timeout."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=5))
    models = []
    for options in ({}, {"process_group": group}):
        torch.manual_seed(0)
        models.append(DDP(_Linear(), **options))
    reference, ddp = models
    plain = torch.optim.Adam(reference.parameters(), lr=LR)
    opt = overlapkit.overlap_ddp(ddp, torch.optim.Adam, lr=LR, shard_optimizer_state=True)
    generator = torch.Generator().manual_seed(rank)
    inputs = [torch.randn(4, 6, generator=generator) for _ in range(5)]

    def train(model: DDP, optimizer: Any, xs: list[torch.Tensor]) -> None:
        for x in xs:
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()

    train(reference, plain, inputs[:2])
    # the first window: refused before anything loads (the lr and state are the dict's)
    other = copy.deepcopy(plain.state_dict())
    other["param_groups"][0]["lr"] = 5.0
    ddp(inputs[0]).square().mean().backward()
    before = ({p: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()},
              opt.param_groups[0]["lr"])
    first = error_of(lambda: opt.load_state_dict(other))
    after = ({p: dict(s) for p, s in opt.state.items()}, opt.param_groups[0]["lr"])
    unchanged = before[1] == after[1] and before[0].keys() == after[0].keys() and all(
        compare(list(before[0][p].values()), list(after[0][p].values())) for p in before[0])
    opt.step()
    opt.zero_grad()
    train(ddp, opt, inputs[1:2])
    opt.consolidate_state_dict(world_size - 1)
    gathered = opt.state_dict() if rank == world_size - 1 else None
    state = True if gathered is None else compare(
        [t for s in plain.state_dict()["state"].values() for t in s.values()],
        [t for s in gathered["state"].values() for t in s.values()])
    # torch's API, with the gathering on the last rank (at 3 ranks: the one owning
    # nothing), then loaded on every rank
    named = copy.deepcopy(get_optimizer_state_dict(reference, plain))
    got = error_of(lambda: get_optimizer_state_dict(ddp, opt)) if rank != world_size - 1 \
        else None
    torch_gathered = compare([], []) if rank != world_size - 1 else compare(
        [t for s in named["state"].values() for t in s.values()],
        [t for s in get_optimizer_state_dict(ddp, opt)["state"].values()
         for t in s.values()])
    set_optimizer_state_dict(ddp, opt, named)
    opt.load_state_dict(copy.deepcopy(plain.state_dict()))
    opt.load_state_dict(opt.local_state_dict())
    train(reference, plain, inputs[2:4])
    train(ddp, opt, inputs[2:4])
    for model in (reference, ddp):  # a full step: gradients reduced by hand
        with model.no_sync():
            model(inputs[4]).square().mean().backward()
        for param in model.parameters():
            assert param.grad is not None
            dist.all_reduce(param.grad)
            param.grad.div_(world_size)
    for optimizer in (plain, opt):
        optimizer.step()
        optimizer.zero_grad()
    return {"owned": len(opt.owned_parameters()), "state": state,
            "first window": first, "first window: nothing changed": unchanged,
            "torch get": got, "torch gathered": torch_gathered,
            "values": compare(values(reference), values(ddp))}


def born_with_state(rank: int, world_size: int) -> dict[str, Any]:
    """Adagrad (state from its constructor) at 3 ranks, the last owning nothing: torch's
    ``set_optimizer_state_dict`` before the first step on every rank, then
    ``get_optimizer_state_dict`` with the gathering on the rank owning nothing, then
    training, against plain DDP + Adagrad loading the same dict (a 5 s group: the rank
    owning nothing took torch's initialising step alone and waited for the others'
    exchange until the timeout)."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=5))
    dist.barrier()
    generator = torch.Generator().manual_seed(rank)
    inputs = [torch.randn(4, 6, generator=generator) for _ in range(4)]

    def train(model: DDP, optimizer: Any, xs: list[torch.Tensor]) -> None:
        for x in xs:
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()

    torch.manual_seed(0)
    first = DDP(_Linear())
    plain = torch.optim.Adagrad(first.parameters(), lr=LR)
    train(first, plain, inputs[:1])
    saved = copy.deepcopy(get_optimizer_state_dict(first, plain))
    models = []
    for options in ({}, {"process_group": group}):
        torch.manual_seed(0)
        models.append(DDP(_Linear(), **options))
        with torch.no_grad():
            for mine, theirs in zip(models[-1].parameters(), first.parameters(), strict=True):
                mine.copy_(theirs)
    reference, ddp = models
    plain = torch.optim.Adagrad(reference.parameters(), lr=LR)
    opt = overlapkit.overlap_ddp(ddp, torch.optim.Adagrad, lr=LR, shard_optimizer_state=True)
    set_optimizer_state_dict(reference, plain, copy.deepcopy(saved))
    start = time.monotonic()
    loaded = error_of(lambda: set_optimizer_state_dict(ddp, opt, copy.deepcopy(saved)))
    seconds = time.monotonic() - start
    got = None
    if loaded is None:
        opt.consolidate_state_dict(world_size - 1)
        if rank == world_size - 1:
            got = compare([t for s in saved["state"].values() for t in s.values()],
                          [t for s in get_optimizer_state_dict(ddp, opt)["state"].values()
                           for t in s.values()])
        train(reference, plain, inputs[1:])
        train(ddp, opt, inputs[1:])
    return {"owned": len(opt.owned_parameters()), "loaded": loaded, "seconds": seconds,
            "gathered": True if got is None else got,
            "values": compare(values(reference), values(ddp))}


#: torch's StateDictOptions for a whole dict: given on every rank, or only on rank 0
FULL_OPTIONS = {"whole on every rank": {"full_state_dict": True},
                "broadcast from rank 0": {"full_state_dict": True,
                                          "broadcast_from_rank0": True}}


def full_state_dict_loads(rank: int, world_size: int, options: str) -> dict[str, Any]:
    """torch's ``set_optimizer_state_dict(..., options=StateDictOptions(
    full_state_dict=True, ...))`` (``FULL_OPTIONS``; with ``broadcast_from_rank0`` the
    other ranks are given ``{}``), before the first step and after two, on the tests'
    model and on one with fewer parameters than ranks (at 3 ranks one owns nothing),
    then training: against plain DDP + AdamW loading the same way. Before 0.4 every case
    was refused as a ``state_dict()`` without a gathering, after torch's initialising
    step had created state; answered, a rank given the whole dict raised torch's bare
    ``KeyError`` and a rank owning nothing its bare ``AssertionError``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    chosen = StateDictOptions(**FULL_OPTIONS[options])
    out: dict[str, Any] = {}
    for model_name, make in (("Net", lambda: build()), ("two parameters", _Linear)):
        for when in ("before the first step", "after two steps"):
            generator = torch.Generator().manual_seed(rank)
            inputs = ([torch.randint(0, 32, (8, 6), generator=generator) for _ in range(5)]
                      if model_name == "Net" else
                      [torch.randn(4, 6, generator=generator) for _ in range(5)])

            def train(model: Any, optimizer: Any, xs: list[torch.Tensor]) -> None:
                for x in xs:
                    output = model(x)
                    output.float().square().mean().backward()
                    optimizer.step()
                    optimizer.zero_grad()

            torch.manual_seed(0)
            first = DDP(make() if model_name != "Net" else make().module)
            plain = torch.optim.AdamW(first.parameters(), lr=LR)
            train(first, plain, inputs[:1])
            saved = copy.deepcopy(get_optimizer_state_dict(first, plain))
            given = saved if rank == 0 or "broadcast" not in options else {}
            models = []
            for _ in range(2):
                torch.manual_seed(1)
                models.append(DDP(make() if model_name != "Net" else make().module))
            reference, ddp = models
            plain = torch.optim.AdamW(reference.parameters(), lr=LR)
            opt = overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=LR,
                                         shard_optimizer_state=True)
            if when == "after two steps":
                train(reference, plain, inputs[1:3])
                train(ddp, opt, inputs[1:3])
            set_optimizer_state_dict(reference, plain, copy.deepcopy(given), options=chosen)
            error = error_of(lambda: set_optimizer_state_dict(
                ddp, opt, copy.deepcopy(given), options=chosen))  # noqa: B023
            case = f"{model_name}, {when}"
            out[case] = {"error": error}
            if error is not None:
                continue
            index = {id(p): i for i, p in enumerate(ddp.parameters())}
            reference_state = list(plain.state.values())
            out[case]["state"] = all(
                compare(list(reference_state[index[id(p)]].values()), list(s.values()))
                for p, s in opt.state.items())
            out[case]["held"] = (len(opt.state), len(opt.owned_parameters()))
            train(reference, plain, inputs[3:])
            train(ddp, opt, inputs[3:])
            out[case]["values"] = compare(values(reference), values(ddp))
    return out


def offloaded_whole_dict(rank: int, world_size: int) -> dict[str, Any]:
    """torch's ``get_optimizer_state_dict(..., options=StateDictOptions(
    full_state_dict=True, cpu_offload=True))`` on every rank (the whole state on rank 0,
    ``{}`` elsewhere): without a gathering, gathered on the last rank, and gathered on
    rank 0; then training goes on, against plain DDP + AdamW."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    reference, plain, ddp, opt = _pair()
    data = batches(rank, 4)
    _train(reference, plain, data[:2])
    _train(ddp, opt, data[:2])
    expected = get_optimizer_state_dict(reference, plain, options=options)
    unsharded = error_of(lambda: get_optimizer_state_dict(ddp, opt, options=options))
    opt.consolidate_state_dict(world_size - 1)
    elsewhere = error_of(lambda: get_optimizer_state_dict(ddp, opt, options=options))
    opt.consolidate_state_dict(0)
    got = get_optimizer_state_dict(ddp, opt, options=options)
    same = (compare([t for s in expected["state"].values() for t in s.values()],
                    [t for s in got["state"].values() for t in s.values()])
            if rank == 0 else got == expected == {})
    _train(reference, plain, data[2:])
    _train(ddp, opt, data[2:])
    return {"without a gathering": unsharded, "gathered elsewhere": elsewhere,
            "same": same, "groups": rank != 0 or got["param_groups"] == expected[
                "param_groups"], "values": compare(values(reference), values(ddp))}


def another_model_s_dict(rank: int, world_size: int) -> dict[str, Any]:
    """``load_state_dict`` of another model's dict (its head has 5 outputs, not 4: the
    same parameters and groups, state of other shapes), directly and through torch's
    ``set_optimizer_state_dict``: a plain optimizer loads it and raises at its first
    step on every rank; sharded, only the ranks owning the head raised (at the end of
    backward) and the others trained on. Refused on every rank before anything loads;
    training then goes on bitwise the plain run, which never loaded it."""
    from sharded_state_ranks import Net

    reference, plain, ddp, opt = _pair()
    data = batches(rank, 3)
    _train(reference, plain, data[:1])
    _train(ddp, opt, data[:1])
    torch.manual_seed(1)
    other = Net()
    other.head = nn.Linear(24, 5)
    named = list(other.named_parameters())
    other_opt = torch.optim.AdamW(
        [{"params": [p for _, p in named if p.ndim > 1], "weight_decay": 0.1},
         {"params": [p for _, p in named if p.ndim <= 1], "weight_decay": 0.0,
          "lr": LR / 2}], lr=LR)
    other(data[0]).sum().backward()
    other_opt.step()
    saved = other_opt.state_dict()
    before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    errors = [error_of(lambda: opt.load_state_dict(copy.deepcopy(saved)))]
    by_name = dict(zip([n for n, _ in named], range(len(named)), strict=True))
    keyed = {"state": {n: saved["state"][i] for n, i in by_name.items()
                       if i in saved["state"]},
             "param_groups": [{**g, "params": [named[i][0] for i in g["params"]]}
                              for g in saved["param_groups"]]}
    errors.append(error_of(lambda: set_optimizer_state_dict(ddp, opt, copy.deepcopy(keyed))))
    unchanged = all(compare(list(before[id(p)].values()), list(s.values()))
                    for p, s in opt.state.items()) and len(before) == len(opt.state)
    _train(reference, plain, data[1:])
    errors.append(error_of(lambda: _train(ddp, opt, data[1:])))
    return {"errors": errors, "unchanged": unchanged,
            "values": compare(values(reference), values(ddp))}
