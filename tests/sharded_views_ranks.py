"""The rank side of tests/test_sharded_views.py: what a loop does to a sharded
optimizer's ``param_groups``, step hooks and copies, and to the model around it
(wrapped again, dropped early, the process group made again), against plain DDP + the
plain optimizer and ``ZeroRedundancyOptimizer``, on 2 and 3 gloo ranks.

Each function returns what differed (a :class:`~helpers.Comparison`), the errors
raised (:func:`~helpers.error_of`) or the figures measured.
"""

from __future__ import annotations

import copy
import datetime
import gc
import io
import pickle
import time
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist
from helpers import compare, error_of, values
from sharded_lifecycle_ranks import _live_tensor_bytes, _resources
from sharded_state_ranks import (
    LR,
    Net,
    _loss,
    batches,
    build,
    build_reference,
    compare_state_dicts,
    param_groups,
)
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit
from overlapkit.distributed import free_port
from overlapkit.nodes.roll_call import HEARTBEAT_SECONDS
from overlapkit.overlap.sharded import exchange


def _train(ddp: Any, opt: Any, data: list[torch.Tensor], schedule: Any = None) -> None:
    for tokens in data:
        loss = _loss(ddp, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if isinstance(schedule, torch.optim.lr_scheduler.ReduceLROnPlateau):
            schedule.step(float(loss.detach()))
        elif schedule is not None:
            schedule.step()


def _pair(groups: bool = True) -> tuple[Any, Any, Any, Any]:
    """Plain DDP + AdamW, and DDP + the sharded AdamW, on the same parameters."""
    reference, ddp = build_reference(), build()
    plain = torch.optim.AdamW(param_groups(reference, groups), lr=LR)
    opt = overlapkit.overlap_ddp(ddp, torch.optim.AdamW, params=param_groups(ddp, groups),
                                 lr=LR, shard_optimizer_state=True)
    return reference, plain, ddp, opt


def _gathered(opt: Any, rank: int, to: int = 0) -> dict[str, Any] | None:
    opt.consolidate_state_dict(to)
    return copy.deepcopy(opt.state_dict()) if rank == to else None


# -- param_groups edited by hand ------------------------------------------------------

def groups_reordered(rank: int, world_size: int) -> dict[str, Any]:
    """``opt.param_groups = reversed(...)`` after a step, then one in place
    (``param_groups.reverse()``), each followed by a step: parameters, the gathered
    state dict and each rank's local one against the plain optimizer doing the same."""
    reference, plain, ddp, opt = _pair()
    data = batches(rank, 3)
    for index, edit in enumerate((lambda o: setattr(o, "param_groups",
                                                    list(reversed(o.param_groups))),
                                  lambda o: o.param_groups.reverse(), None)):
        _train(reference, plain, data[index:index + 1])
        _train(ddp, opt, data[index:index + 1])
        if edit is not None:
            edit(plain)
            edit(opt)
    whole = _gathered(opt, rank)
    local = opt.local_state_dict()
    return {"values": compare(values(reference), values(ddp)),
            "state": compare_state_dicts(plain.state_dict(), whole) if rank == 0 else True,
            "local entries": (len(local["sharded_state"]), len(opt.owned_parameters()))}


def groups_changed(rank: int, world_size: int) -> dict[str, Any]:
    """Parameters added or removed by editing ``param_groups``: assigned (refused, nothing
    changed), appended in place and removed in place (the next backward refused on every
    rank, nothing stepped); put back, training goes on bitwise the plain run."""
    reference, plain, ddp, opt = _pair(groups=False)
    head = list(ddp.module.head.parameters())
    data = batches(rank, 4)
    _train(reference, plain, data[:1])
    _train(ddp, opt, data[:1])
    groups = opt.param_groups
    extra = {**opt.param_groups[0], "params": head}
    assigned = error_of(lambda: setattr(opt, "param_groups", [*groups, extra]))
    unchanged = opt.param_groups is groups and len(groups) == 1
    out: dict[str, Any] = {"assigned": assigned, "assignment left groups": unchanged}
    kept = list(groups[0]["params"])
    for name, edit in (("appended", lambda: opt.param_groups.append(extra)),
                       ("removed", lambda: groups[0].__setitem__("params", kept[1:]))):
        edit()
        before = values(ddp)
        out[name] = error_of(lambda: _loss(ddp, data[1]).backward())
        out[f"{name}: nothing stepped"] = compare(before, values(ddp))
        del groups[1:]
        groups[0]["params"] = kept  # put back
        opt.zero_grad()
    _train(reference, plain, data[1:])
    _train(ddp, opt, data[1:])
    return {**out, "values": compare(values(reference), values(ddp))}


# -- schedulers and gathering, pinned ----------------------------------------------------

def schedulers(rank: int, world_size: int) -> dict[str, Any]:
    """OneCycleLR with ``cycle_momentum`` (betas / momentum changed every step) and
    ReduceLROnPlateau, over Adam and SGD with momentum: parameters and the gathered state
    dict bitwise the plain run's."""
    makers = {
        "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(
            o, max_lr=0.05, total_steps=10, cycle_momentum=True),
        "ReduceLROnPlateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(
            o, patience=0, factor=0.5, threshold=10.0),
    }
    optimizers = {"Adam": (torch.optim.Adam, {"lr": LR}),
                  "SGD momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})}
    out = {}
    for schedule_name, make in makers.items():
        for name, (cls, kwargs) in optimizers.items():
            reference, ddp = build_reference(), build()
            plain = cls(reference.parameters(), **kwargs)
            opt = overlapkit.overlap_ddp(ddp, cls, shard_optimizer_state=True, **kwargs)
            data = batches(rank, 4)
            _train(reference, plain, data, make(plain))
            _train(ddp, opt, data, make(opt))
            whole = _gathered(opt, rank)
            out[f"{schedule_name} | {name}"] = (
                compare(values(reference), values(ddp)),
                compare_state_dicts(plain.state_dict(), whole) if rank == 0 else True)
    return out


def gathered_like_zero(rank: int, world_size: int) -> dict[str, Any]:
    """``consolidate_state_dict(to=1)``: rank 1's state dict against
    ``ZeroRedundancyOptimizer``'s; ZeRO's, loaded into a fresh sharded optimizer, then
    two steps: bitwise the plain optimizer resumed the same way."""
    data = batches(rank, 5)
    zero_ddp = build_reference()
    zero = ZeroRedundancyOptimizer(zero_ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                   lr=LR)
    _train(zero_ddp, zero, data[:3])
    reference, plain, ddp, opt = _pair(groups=False)
    _train(reference, plain, data[:3])
    _train(ddp, opt, data[:3])
    zero.consolidate_state_dict(to=1)
    ours = _gathered(opt, rank, to=1)
    zero_dict = zero.state_dict() if rank == 1 else None
    box = [zero_dict]
    dist.broadcast_object_list(box, src=1)
    resumed = build(seed=3)
    with torch.no_grad():
        for param, value in zip(resumed.parameters(), values(reference), strict=True):
            param.copy_(value)
    again = overlapkit.overlap_ddp(resumed, torch.optim.AdamW, lr=LR,
                                   shard_optimizer_state=True)
    again.load_state_dict(copy.deepcopy(box[0]))  # the load aliases its tensors
    _train(resumed, again, data[3:])
    _train(reference, plain, data[3:])
    return {"as ZeRO's": compare_state_dicts(zero_dict, ours) if rank == 1 else True,
            "resumed": compare(values(reference), values(resumed))}


# -- step hooks and copies --------------------------------------------------------------

def hooks_and_copies(rank: int, world_size: int) -> dict[str, Any]:
    """Step hooks refused before anything is registered; pickling and deep-copying
    refused with an error naming what to save; training is then the plain run's."""
    reference, plain, ddp, opt = _pair(groups=False)
    calls: list[int] = []
    pre = error_of(lambda: opt.register_step_pre_hook(lambda *_: calls.append(1)))
    post = error_of(lambda: opt.register_step_post_hook(lambda *_: calls.append(1)))
    registered = len(opt.optimizer._optimizer_step_pre_hooks) + len(
        opt.optimizer._optimizer_step_post_hooks)
    copied = error_of(lambda: copy.deepcopy(opt))
    try:
        pickle.dumps(opt)
        pickled_type = None
    except TypeError as error:
        pickled_type = type(error).__name__
    data = batches(rank, 3)
    _train(reference, plain, data)
    _train(ddp, opt, data)
    # the wrapped module saved whole, and copied (an EMA), as plain DDP's
    buffer = io.BytesIO()
    saved = error_of(lambda: torch.save(ddp.module, buffer))
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False) if saved is None else ddp.module
    ema = copy.deepcopy(ddp.module)
    tokens = batches(rank, 1, seed=9)[0]
    with torch.no_grad():
        outputs = [model(tokens) for model in (reference.module, loaded, ema)]
    return {"pre": pre, "post": post, "registered": registered, "calls": len(calls),
            "deepcopy": copied, "pickle": pickled_type, "module saved": saved,
            "values": compare(values(reference), values(ddp)),
            "module outputs": compare(outputs[:1] * 2, outputs[1:])}


# -- the model around it: wrapped again, dropped early, the group made again ------------

def wrapped_again(rank: int, world_size: int) -> dict[str, Any]:
    """One module, wrapped in a new DDP model and sharded optimizer four times (the one
    before dropped each time, the first after 1 step, within DDP's first iteration):
    each set-up accepted, training bitwise the plain loop doing the same, nothing left
    behind (the dropped DDP models collected, no forward pre-hook left on the module,
    threads, file descriptors, process groups, live tensors)."""
    torch.manual_seed(0)
    module = Net()
    torch.manual_seed(0)
    plain_module = Net()
    errors, dropped, counts, sizes = [], [], [], []
    for round_, steps in enumerate((1, 2, 2, 2)):
        data = batches(rank, steps, seed=100 + round_)

        def plain_round(data: list[torch.Tensor] = data) -> None:
            plain_ddp = DDP(plain_module, bucket_cap_mb=0.001)
            _train(plain_ddp, torch.optim.AdamW(plain_ddp.parameters(), lr=LR), data)

        plain_round()

        def one_round(data: list[torch.Tensor] = data) -> Any:
            ddp = DDP(module, bucket_cap_mb=0.001)
            opt = overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=LR,
                                         shard_optimizer_state=True)
            _train(ddp, opt, data)
            return weakref.ref(ddp)

        try:
            dropped.append(one_round())
            errors.append(None)
        except Exception:
            errors.append(error_of(one_round))
            break
        gc.collect()
        dist.barrier()
        counts.append(_resources())
        sizes.append(_live_tensor_bytes())
    return {"errors": errors, "values": compare(values(plain_module), values(module)),
            "alive": sum(ref() is not None for ref in dropped),
            "module hooks": len(module._forward_pre_hooks),
            "counts": counts, "live tensor bytes": sizes}


def dropped_within_first_step(rank: int, world_size: int, sharded: bool) -> dict[str, Any]:
    """DDP + ``overlap_ddp`` built, stepped once, dropped, 4 times: the DDP models
    collected, live tensor bytes flat."""
    refs, sizes = [], []
    for _ in range(4):
        def one() -> Any:
            ddp = build()
            opt = overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=LR,
                                         shard_optimizer_state=sharded)
            _train(ddp, opt, batches(rank, 1))
            return weakref.ref(ddp)

        refs.append(one())
        gc.collect()
        sizes.append(_live_tensor_bytes())
    return {"alive": sum(ref() is not None for ref in refs), "live tensor bytes": sizes}


def group_made_again(rank: int, world_size: int) -> dict[str, Any]:
    """Train, ``destroy_process_group()``, ``init_process_group`` again (a new store),
    build and train again, three times: bitwise the plain run each time, no destroyed group
    kept by the exchange, the same threads, file descriptors and process groups."""
    out: dict[str, Any] = {"values": [], "counts": [], "destroyed groups kept": []}
    for _ in range(4):
        reference, plain, ddp, opt = _pair(groups=False)
        data = batches(rank, 2)
        _train(reference, plain, data)
        _train(ddp, opt, data)
        out["values"].append(compare(values(reference), values(ddp)))
        live = dist.distributed_c10d._world.pg_map
        out["destroyed groups kept"].append(
            sum(group not in live for group in exchange._GROUPS.values()))
        del reference, plain, ddp, opt
        gc.collect()
        # a destroyed world's heartbeat thread ends at its next beat (nodes.roll_call)
        time.sleep(1.5 * HEARTBEAT_SECONDS)
        out["counts"].append(_resources())
        port = [free_port() if rank == 0 else None]
        dist.broadcast_object_list(port, src=0)
        dist.destroy_process_group()
        store = dist.TCPStore("127.0.0.1", port[0], world_size, rank == 0,
                              timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    return out


def on_a_subgroup(rank: int, world_size: int) -> dict[str, Any]:
    """DDP over ``new_group([1, 2], timeout=7 s)`` at 3 ranks (rank 0 outside): bitwise
    plain DDP on that group; the exchange's group has its ranks and timeout; the state
    gathered on its rank 1 (global 2) is the plain optimizer's."""
    members = [1, 2]
    group = dist.new_group(members, timeout=datetime.timedelta(seconds=7))
    if rank not in members:
        dist.barrier()
        return {"outside": True}
    torch.manual_seed(0)
    ddp = DDP(Net(), bucket_cap_mb=0.001, process_group=group)
    torch.manual_seed(0)
    reference = DDP(Net(), bucket_cap_mb=0.001, process_group=group)
    plain = torch.optim.AdamW(reference.parameters(), lr=LR)
    opt = overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=LR, shard_optimizer_state=True)
    data = batches(members.index(rank), 3)
    _train(reference, plain, data)
    _train(ddp, opt, data)
    exchanged = opt._stepper.exchange.group
    whole = _gathered(opt, members.index(rank), to=1)
    dist.barrier()
    return {"values": compare(values(reference), values(ddp)),
            "exchange": (dist.get_process_group_ranks(exchanged),
                         exchange.group_timeout(exchanged)),
            "state": compare_state_dicts(plain.state_dict(), whole) if rank == 2 else True}


# -- optimizer.state read by the loop ---------------------------------------------------

def state_read_by_the_loop(rank: int, world_size: int) -> dict[str, Any]:
    """The loop reads ``opt.state[p]`` of every parameter between backward and ``step()``
    (a log of Adam's step count: each rank reads parameters other ranks own), and, before
    the first step, rank 0 reads one it does not own; then torch's
    ``set_optimizer_state_dict`` on every rank (a 5 s group: a rank skipping torch's
    initialising step alone made the others wait for its exchange), and training goes on
    reading: against plain DDP + AdamW doing the same."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    group = dist.new_group(timeout=datetime.timedelta(seconds=5))
    dist.barrier()
    data = batches(rank, 4)

    def train(model: Any, optimizer: Any, tokens: torch.Tensor) -> None:
        _loss(model, tokens).backward()
        logged = [optimizer.state[p].get("step") for group in optimizer.param_groups
                  for p in group["params"]]
        assert len(logged) == len(list(model.parameters()))
        optimizer.step()
        optimizer.zero_grad()

    # a first step elsewhere: the dict both runs load, before their first step
    first = build_reference()
    plain = torch.optim.AdamW(param_groups(first, True), lr=LR)
    train(first, plain, data[0])
    saved = copy.deepcopy(get_optimizer_state_dict(first, plain))
    reference, ddp = build_reference(), build(process_group=group)
    with torch.no_grad():
        for model in (reference, ddp):
            for mine, theirs in zip(model.parameters(), first.parameters(), strict=True):
                mine.copy_(theirs)
    plain = torch.optim.AdamW(param_groups(reference, True), lr=LR)
    opt = overlapkit.overlap_ddp(ddp, torch.optim.AdamW, params=param_groups(ddp, True),
                                 lr=LR, shard_optimizer_state=True)
    owned = set(map(id, opt.owned_parameters()))
    others = [i for i, p in enumerate(ddp.parameters()) if id(p) not in owned]
    if rank == 0 and others:  # a read: nothing stored for another rank's parameter
        opt.state[list(ddp.parameters())[others[0]]]
        plain.state[list(reference.parameters())[others[0]]]
    shown = (len(opt.state), sum(p in opt.state for i, p in enumerate(ddp.parameters())
                                 if i in others))
    set_optimizer_state_dict(reference, plain, copy.deepcopy(saved))
    errors = [error_of(lambda: set_optimizer_state_dict(ddp, opt, copy.deepcopy(saved)))]
    for tokens in data[1:]:
        train(reference, plain, tokens)
        errors.append(error_of(lambda tokens=tokens: train(ddp, opt, tokens)))
        if errors[-1] is not None:
            break
    return {"errors": errors, "shown before": shown,
            "held": (len(opt.state), len(opt.owned_parameters())),
            "values": compare(values(reference), values(ddp))}


def state_read_in_a_learnt_window(rank: int, world_size: int) -> dict[str, Any]:
    """As :func:`state_read_by_the_loop` after ``learn_first_step(model)`` (the state is
    watched while the first window is learnt: the reads are noted on every rank alike,
    and the steps then taken at ``step()``), against the plain loop."""
    reference, plain, ddp, opt = _pair()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the plain order's one warning
        opt.learn_first_step(ddp)
        for model, optimizer in ((reference, plain), (ddp, opt)):
            for tokens in batches(rank, 3):
                _loss(model, tokens).backward()
                for group in optimizer.param_groups:
                    for param in group["params"]:
                        optimizer.state[param].get("step")
                optimizer.step()
                optimizer.zero_grad()
    return {"held": (len(opt.optimizer.state), len(opt.owned_parameters())),
            "values": compare(values(reference), values(ddp))}


def layer_state_reset(rank: int, world_size: int) -> dict[str, Any]:
    """The head's optimizer state reset mid-training on every rank (a re-initialised
    layer): ``del opt.state[p]`` for each of its parameters, against the plain loop; and
    ``opt.state[p]["exp_avg"]`` of each, which only the owner holds."""
    reference, plain, ddp, opt = _pair()
    data = batches(rank, 3)
    _train(reference, plain, data[:1])
    _train(ddp, opt, data[:1])
    deleted = []  # first: a read on the ranks not owning p stored an entry (0.4.0)
    for model, optimizer in ((reference, plain), (ddp, opt)):
        for param in model.module.head.parameters():
            deleted.append(error_of(lambda o=optimizer, p=param: o.state.__delitem__(p)))
    _train(reference, plain, data[1:])
    _train(ddp, opt, data[1:])
    owned = set(map(id, opt.owned_parameters()))
    reads = []
    for param in ddp.module.head.parameters():
        error = error_of(lambda param=param: opt.state[param]["exp_avg"])
        caught = False
        try:
            opt.state[param]["exp_avg"]
        except KeyError:  # what a missing entry raises, as before
            caught = True
        reads.append((id(param) in owned, error, caught or id(param) in owned))
    return {"reads": reads, "deleted": deleted,
            "values": compare(values(reference), values(ddp))}
