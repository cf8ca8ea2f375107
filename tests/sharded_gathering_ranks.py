"""The rank side of tests/test_sharded_gathering.py: the whole state gathered by a
sharded optimizer (``consolidate_state_dict``, torch's ``get_optimizer_state_dict``)
and the exchange's process group, against plain DDP + AdamW, at 3 gloo ranks.

Each part returns what differed (a :class:`~helpers.Comparison`) or what was raised
(:func:`~helpers.error_of`), with the seconds it took where a hang is the risk.
"""

from __future__ import annotations

import copy
import datetime
import time
from typing import Any

import torch
import torch.distributed as dist
from helpers import compare, error_of, values
from sharded_state_ranks import (
    LR,
    Net,
    _loss,
    batches,
    build,
    build_reference,
    compare_state_dicts,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
)
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit
from overlapkit.distributed import free_port

OFFLOADED = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _train(ddp: Any, opt: Any, data: list[torch.Tensor]) -> None:
    for tokens in data:
        _loss(ddp, tokens).backward()
        opt.step()
        opt.zero_grad()


def _pair() -> tuple[Any, Any, Any, Any]:
    reference, ddp = build_reference(), build()
    plain = torch.optim.AdamW(reference.parameters(), lr=LR)
    opt = overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=LR, shard_optimizer_state=True)
    return reference, plain, ddp, opt


def changed_after_gathering(rank: int) -> dict[str, Any]:
    """Adam's ``exp_avg`` zeroed on every rank between ``consolidate_state_dict()`` and
    ``state_dict()`` (0.4.0: the dict as gathered, 0.0169 off the plain one): refused on
    rank 0; gathered again, the plain optimizer's dict."""
    reference, plain, ddp, opt = _pair()
    data = batches(rank, 2)
    _train(reference, plain, data)
    _train(ddp, opt, data)
    opt.consolidate_state_dict(to=0)
    for optimizer in (plain, opt):
        for param in optimizer.param_groups[0]["params"]:
            if param in optimizer.state:
                optimizer.state[param]["exp_avg"].zero_()
    out: dict[str, Any] = {"changed": error_of(opt.state_dict) if rank == 0 else None}
    opt.consolidate_state_dict(to=0)
    whole = opt.state_dict() if rank == 0 else None
    out["gathered again"] = compare_state_dicts(plain.state_dict(), whole) if rank == 0 \
        else True
    return out


def different_destinations(rank: int) -> dict[str, Any]:
    """``consolidate_state_dict(to=rank)`` on every rank (0.4.0: ``ExchangeFailedError``
    at the group's timeout, 300 s here): a ``ConfigurationError`` on every rank at once;
    the next gathering, named alike, works."""
    _, _, ddp, opt = _pair()
    _train(ddp, opt, batches(rank, 1))
    started = time.monotonic()
    error = error_of(lambda: opt.consolidate_state_dict(to=rank))
    seconds = time.monotonic() - started
    opt.consolidate_state_dict(to=1)
    return {"different": error, "seconds": seconds,
            "then": len(opt.state_dict()["state"]) if rank == 1 else 9}


def empty_dict_then_torch_s_get(rank: int) -> dict[str, Any]:
    """A state dict without state loaded (a fresh optimizer's), then torch's
    ``get_optimizer_state_dict``: the plain optimizer takes torch's initialising step
    (Adam's ``step`` at 1); 0.4.0 skipped it (trained 0.0185 off the plain run after
    it). Every rank takes it: the gathered dict is refused as stale, gathered again it
    is the plain one's, and training goes on bitwise."""
    reference, plain, ddp, opt = _pair()
    data = batches(rank, 3)
    _train(reference, plain, data[:1])
    _train(ddp, opt, data[:1])
    fresh = torch.optim.AdamW(build_reference().parameters(), lr=LR).state_dict()
    plain.load_state_dict(copy.deepcopy(fresh))
    opt.load_state_dict(copy.deepcopy(fresh))
    opt.consolidate_state_dict(to=0)
    expected = get_optimizer_state_dict(reference, plain, options=OFFLOADED)
    stale = error_of(lambda: get_optimizer_state_dict(ddp, opt, options=OFFLOADED))
    opt.consolidate_state_dict(to=0)
    got = get_optimizer_state_dict(ddp, opt, options=OFFLOADED)
    out = {"stale": stale,
           "get": compare_state_dicts(expected, got) if rank == 0 else got == {}}
    _train(reference, plain, data[1:])
    _train(ddp, opt, data[1:])
    return {**out, "values": compare(values(reference), values(ddp))}


def two_subgroups(rank: int) -> dict[str, Any]:
    """Two sharded optimizers on ``new_group([0, 1])`` and ``new_group([1, 2])``, trained
    in turn (0.4.0: the set-up of the second hung: torch names a group made by its
    members alone after the number of groups each holds, which rank 1 and 2 did not
    share): each bitwise plain DDP on its group."""
    groups = [(dist.new_group(members), members) for members in ([0, 1], [1, 2])]
    pairs = []
    for seed, (group, members) in enumerate(groups):
        if rank in members:
            torch.manual_seed(seed)
            reference = DDP(Net(), process_group=group, bucket_cap_mb=0.001)
            torch.manual_seed(seed)
            ddp = DDP(Net(), process_group=group, bucket_cap_mb=0.001)
            pairs.append((reference, torch.optim.AdamW(reference.parameters(), lr=LR), ddp,
                          overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=LR,
                                                 shard_optimizer_state=True)))
    for tokens in batches(rank, 2):
        for reference, plain, ddp, opt in pairs:
            _train(reference, plain, [tokens])
            _train(ddp, opt, [tokens])
    return {"subgroups": compare([v for r, _, _, _ in pairs for v in values(r)],
                                 [v for _, _, d, _ in pairs for v in values(d)])}


def _halving(seen: list[int]) -> Any:
    def hook(optimizer: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        seen.append(len(state_dict["state"]))
        return {**state_dict, "state": {key: {**entry, "exp_avg": entry["exp_avg"] / 2}
                                        for key, entry in state_dict["state"].items()}}
    return hook


def load_pre_hooks_see_the_whole(rank: int) -> dict[str, Any]:
    """A load pre-hook returning a changed dict (Adam's ``exp_avg`` halved) sees the whole
    dict once per load, as a plain optimizer's (0.4.0: this rank's share only, 3 of 9
    entries at 3 ranks), and training goes on bitwise the plain one's."""
    reference, plain, ddp, opt = _pair()
    data = batches(rank, 3)
    _train(reference, plain, data[:1])
    _train(ddp, opt, data[:1])
    whole = copy.deepcopy(plain.state_dict())
    plain_seen: list[int] = []
    seen: list[int] = []
    plain.register_load_state_dict_pre_hook(_halving(plain_seen))
    opt.register_load_state_dict_pre_hook(_halving(seen))
    plain.load_state_dict(copy.deepcopy(whole))
    opt.load_state_dict(copy.deepcopy(whole))
    _train(reference, plain, data[1:])
    _train(ddp, opt, data[1:])
    return {"seen": (plain_seen, seen), "hooked": compare(values(reference), values(ddp))}


def reordered_on_one_rank(rank: int) -> dict[str, Any]:
    """One group's parameters reversed on rank 0 only (``param_groups[0]["params"]
    .reverse()`` under ``if rank == 0:``): the steps follow it, bitwise plain DDP doing
    the same; ``consolidate_state_dict()`` is refused on every rank as param groups in
    another order, nothing gathered (with be7423f: "called for different optimizers",
    which it was not); reversed back, gathered, the plain optimizer's dict."""
    reference, plain, ddp, opt = _pair()
    data = batches(rank, 3)
    _train(reference, plain, data[:1])
    _train(ddp, opt, data[:1])
    for optimizer in (plain, opt):
        if rank == 0:
            optimizer.param_groups[0]["params"].reverse()
    _train(reference, plain, data[1:])
    _train(ddp, opt, data[1:])
    out: dict[str, Any] = {"reordered: values": compare(values(reference), values(ddp)),
                           "reordered: refused": error_of(lambda: opt.consolidate_state_dict(0))}
    for optimizer in (plain, opt):
        if rank == 0:
            optimizer.param_groups[0]["params"].reverse()
    opt.consolidate_state_dict(0)
    out["reordered: gathered"] = compare_state_dicts(plain.state_dict(), opt.state_dict()) \
        if rank == 0 else True
    return out


def used_after_destroy(rank: int, world_size: int) -> dict[str, Any]:
    """``destroy_process_group()`` and ``init_process_group`` again, then the old DDP
    model and optimizer used (0.4.0: torch's bare ``ValueError`` from inside the comm
    hook, each rank having stepped its share of the bucket): backward and
    ``consolidate_state_dict()`` refused with a ``ConfigurationError``, nothing
    stepped."""
    _, _, ddp, opt = _pair()
    data = batches(rank, 2)
    _train(ddp, opt, data[:1])
    port = [free_port() if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    store = dist.TCPStore("127.0.0.1", port[0], world_size, rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    before = values(ddp)
    backward = error_of(lambda: _loss(ddp, data[1]).backward())
    return {"destroyed: backward": backward, "destroyed: nothing stepped":
            compare(before, values(ddp)),
            "destroyed: consolidate": error_of(opt.consolidate_state_dict)}


def gathering(rank: int, world_size: int) -> dict[str, Any]:
    """Every part above, in one run of 3 ranks (the default group made again last)."""
    return {**changed_after_gathering(rank), **different_destinations(rank),
            **empty_dict_then_torch_s_get(rank), **load_pre_hooks_see_the_whole(rank),
            **two_subgroups(rank), **reordered_on_one_rank(rank),
            **used_after_destroy(rank, world_size)}
