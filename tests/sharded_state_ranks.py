"""The rank side of tests/test_sharded_state.py: ``overlap_ddp(...,
shard_optimizer_state=True)`` against plain DDP + the same optimizer, on 2 and 3 gloo
ranks.

The reference is plain DDP, ``backward(); [clip]; step(); zero_grad()``, at 2 and at 3
ranks. (Up to 0.3 it was plain DDP with torch's ``default_hooks.allreduce_hook`` at 3
ranks, read then as another order of summation: it was the averaging, which torch's hook
does by dividing and plain DDP by multiplying with the inverse; overlapkit's
``allreduce`` now multiplies, as plain DDP does.)
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any

import attrs
import torch
import torch.distributed as dist
from helpers import compare, values
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit

STEPS = 3
LR = 0.01
#: the step at which rank 1's batch overflows under a GradScaler: every rank skips it
OVERFLOW_STEP = 1


class Net(nn.Module):
    """What users' models have: an embedding, a norm, biases, parameters of many sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.norm = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 48)
        self.mid = nn.Linear(48, 24)
        self.head = nn.Linear(24, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(self.embed(tokens).mean(dim=1))
        return self.head(torch.tanh(self.mid(torch.tanh(self.fc(hidden)))))


def batches(rank: int, count: int = STEPS, seed: int = 1000) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed + rank)
    return [torch.randint(0, 32, (8, 6), generator=generator) for _ in range(count)]


def build(seed: int = 0, **ddp_options: Any) -> DDP:
    torch.manual_seed(seed)
    ddp = DDP(Net(), bucket_cap_mb=0.001, **ddp_options)  # one or two tensors per bucket
    return ddp


def build_reference(seed: int = 0, **ddp_options: Any) -> DDP:
    """Plain DDP, without a comm hook (module docstring)."""
    return build(seed, **ddp_options)


def param_groups(ddp: DDP, grouped: bool) -> Any:
    """Every parameter, or the usual two groups: no decay for biases and norms."""
    if not grouped:
        return ddp.parameters()
    named = list(ddp.module.named_parameters())
    return [{"params": [p for n, p in named if p.ndim > 1], "weight_decay": 0.1},
            {"params": [p for n, p in named if p.ndim <= 1], "weight_decay": 0.0,
             "lr": LR / 2}]


class AllOnLastRank(overlapkit.ShardingPolicy):
    """Every parameter owned by the last rank: the others own nothing."""

    def assign(self, params: Any, world_size: int, *, loads: Any) -> list[int]:
        return [world_size - 1] * len(params)


OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "AdamW": (torch.optim.AdamW, {"lr": LR}),
    "Adam amsgrad": (torch.optim.Adam, {"lr": LR, "amsgrad": True}),
    "SGD nesterov": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    "NAdam": (torch.optim.NAdam, {"lr": LR}),
    "RAdam": (torch.optim.RAdam, {"lr": LR}),
    "Adagrad": (torch.optim.Adagrad, {"lr": LR}),
    "Adamax": (torch.optim.Adamax, {"lr": LR}),
    "RMSprop": (torch.optim.RMSprop, {"lr": LR, "momentum": 0.5}),
    "Rprop": (torch.optim.Rprop, {"lr": LR}),
    "Adadelta": (torch.optim.Adadelta, {"lr": 1.0}),
    "ASGD": (torch.optim.ASGD, {"lr": LR}),
    "Adafactor": (torch.optim.Adafactor, {"lr": LR}),
}


@attrs.frozen(kw_only=True)
class Case:
    """One training set-up, run sharded and plain."""

    optimizer: str = "AdamW"
    loop: str = "step"  # "step" | "backward only" | "scheduler"
    grouped: bool = False
    setup: dict[str, Any] = attrs.field(factory=dict)
    ddp: dict[str, Any] = attrs.field(factory=dict)
    micro: int = 1  # backwards per step; all but the last inside no_sync()
    #: every backward inside no_sync(), the gradients all-reduced by hand, then step()
    full_step: bool = False
    policy: Any = True


#: name -> case; the 3-rank run takes those in CASES_AT_3
CASES: dict[str, Case] = {
    "AdamW": Case(),
    "backward only": Case(loop="backward only"),
    "two groups + LR scheduler, backward then scheduler.step()": Case(
        loop="scheduler", grouped=True),
    "global clip_grad_norm": Case(setup={"clip_grad_norm": 0.05}),
    "clip_grad_norm, backward only": Case(loop="backward only",
                                          setup={"clip_grad_norm": 0.05}),
    "clip_grad_value": Case(setup={"clip_grad_value": 0.002}),
    "grad_scaler with a skipped step": Case(setup={"grad_scaler": True,
                                                   "clip_grad_norm": 0.05}),
    "no_sync accumulation": Case(micro=2, grouped=True),
    "full step after no_sync backwards, reduced by hand": Case(micro=2, full_step=True,
                                              setup={"clip_grad_norm": 0.05}),
    "static_graph": Case(ddp={"static_graph": True}),
    "gradient_as_bucket_view": Case(ddp={"gradient_as_bucket_view": True}),
    "a policy giving rank 0 nothing": Case(policy=AllOnLastRank()),
    **{name: Case(optimizer=name) for name in OPTIMIZERS if name != "AdamW"},
}
CASES_AT_3 = ("AdamW", "backward only", "two groups + LR scheduler, backward then "
              "scheduler.step()", "global clip_grad_norm", "grad_scaler with a skipped step",
              "no_sync accumulation", "static_graph", "SGD nesterov", "Adafactor")


def _optimizer(ddp: DDP, case: Case, sharded: bool, scaler: Any) -> Any:
    cls, kwargs = OPTIMIZERS[case.optimizer]
    if not sharded:
        return cls(param_groups(ddp, case.grouped), **kwargs)
    setup = dict(case.setup)
    if setup.pop("grad_scaler", False):
        setup["grad_scaler"] = scaler
    return overlapkit.overlap_ddp(ddp, cls, params=param_groups(ddp, case.grouped),
                                  shard_optimizer_state=case.policy, **setup, **kwargs)


def _loss(ddp: DDP, tokens: torch.Tensor) -> torch.Tensor:
    return ddp(tokens).square().mean()


def _grads(ddp: DDP) -> list[torch.Tensor]:
    """Every parameter's ``.grad`` as the loop reads it after its step (an empty
    tensor for None)."""
    return [torch.empty(0) if p.grad is None else p.grad.detach().clone()
            for p in ddp.parameters()]


def train(case: Case, rank: int, sharded: bool) -> dict[str, Any]:
    """``STEPS`` iterations of ``case``; the plain loop when not ``sharded``."""
    ddp = build(**case.ddp) if sharded else build_reference(**case.ddp)
    use_scaler = bool(case.setup.get("grad_scaler"))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if use_scaler else None
    opt = _optimizer(ddp, case, sharded, scaler)
    scheduler = (torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
                 if case.loop == "scheduler" else None)
    clip_norm, clip_value = case.setup.get("clip_grad_norm"), case.setup.get("clip_grad_value")
    losses: list[torch.Tensor] = []
    first: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    data = batches(rank, STEPS * case.micro)
    for step in range(STEPS):
        micro = data[step * case.micro:(step + 1) * case.micro]
        for index, tokens in enumerate(micro):
            synced = index == len(micro) - 1 and not case.full_step
            with nullcontext() if synced else ddp.no_sync():
                loss = _loss(ddp, tokens)
                if scaler is not None and step == OVERFLOW_STEP and rank == 1:
                    loss = loss * 3e38  # overflows: every rank skips this step
                losses.append(loss.detach().clone())
                (scaler.scale(loss) if scaler is not None else loss).backward()
        if case.full_step:  # a loop reducing the gradients itself
            for param in ddp.parameters():
                dist.all_reduce(param.grad)
                param.grad /= dist.get_world_size()
        last = step == STEPS - 1
        if scaler is not None:
            if not sharded:  # the PyTorch AMP loop with clipping
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip_norm)
            scaler.step(opt)
            scaler.update()
            grads = _grads(ddp) if last else grads
            opt.zero_grad()
        elif not sharded:
            if clip_value is not None:
                torch.nn.utils.clip_grad_value_(ddp.parameters(), clip_value)
            if clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip_norm)
            opt.step()
            grads = _grads(ddp) if last else grads
            opt.zero_grad()
        elif case.loop == "step" or case.full_step or case.micro > 1:
            opt.step()
            grads = _grads(ddp) if last else grads
            opt.zero_grad()
        else:  # a backward-only loop: the gradients stay until the next forward
            grads = _grads(ddp) if last else grads
        if scheduler is not None:
            scheduler.step()
        if step == 0:
            first = values(ddp)  # read right after backward: every update has landed
    out = {"losses": losses, "first": first, "values": values(ddp), "grads": grads}
    if sharded:
        opt.consolidate_state_dict(to=0)
        out["state"] = opt.state_dict() if rank == 0 else None
        out["state_bytes"] = _state_bytes(opt.optimizer.state)
        out["owned"] = len(opt.owned_parameters())
        out["state_outside_share"] = [id(p) for p in opt.optimizer.state
                                      if id(p) not in opt.local_state_params()]
    else:
        out["state"] = opt.state_dict()
        out["state_bytes"] = _state_bytes(opt.state)
        out["largest_state_bytes"] = max(_state_bytes({p: s}) for p, s in opt.state.items())
    return out


def _state_bytes(state: Any) -> int:
    return sum(v.numel() * v.element_size() for values_ in state.values()
               for v in values_.values() if isinstance(v, torch.Tensor))


def compare_state_dicts(expected: dict[str, Any], actual: dict[str, Any]) -> Any:
    """Every state tensor by parameter index and name, bitwise; and the param groups."""
    if expected["param_groups"] != actual["param_groups"]:
        return compare([], [torch.zeros(1)], names=["param_groups differ"])
    names, a, b = [], [], []
    if expected["state"].keys() != actual["state"].keys():
        return compare([], [torch.zeros(1)], names=[
            f"state of parameters {sorted(expected['state'])} vs {sorted(actual['state'])}"])
    for index, state in expected["state"].items():
        for key, value in state.items():
            other = actual["state"][index][key]
            names.append(f"state[{index}][{key!r}]")
            a.append(torch.as_tensor(value).cpu())
            b.append(torch.as_tensor(other).cpu())
    return compare(a, b, names=names)


def run_cases(rank: int, world_size: int) -> dict[str, Any]:
    names = CASES if world_size == 2 else CASES_AT_3
    out: dict[str, Any] = {}
    for name in names:
        case = CASES[name]
        plain = train(case, rank, sharded=False)
        ours = train(case, rank, sharded=True)
        total = plain["state_bytes"]
        out[name] = {
            "losses": compare(plain["losses"], ours["losses"]),
            "first iteration": compare(plain["first"], ours["first"]),
            "values": compare(plain["values"], ours["values"]),
            "grads": compare(plain["grads"], ours["grads"]),
            "state": (compare_state_dicts(plain["state"], ours["state"])
                      if rank == 0 else compare([], [])),
            "state bytes": ours["state_bytes"],
            # the size-balanced policy's bound, for optimizers whose state is a multiple
            # of the parameters' (Adafactor's factored state is not: no bound)
            "bound": (total / world_size + plain["largest_state_bytes"]
                      if case.policy is True and case.optimizer != "Adafactor" else None),
            "no state outside the share": not ours["state_outside_share"],
            "owned": ours["owned"],
            "trained": not compare(values(build()), ours["values"]),
        }
    return out


# -- item 2: a delayed exchange is waited for ---------------------------------------

DELAY_S = 0.15
#: what reads the parameters after the exchange was launched
READERS = ("end of backward", "next forward", "wrapped module's forward", "zero_grad()")


def _delay_sends_of_rank_0(opt: Any, rank: int, delaying: dict[str, bool]) -> Any:
    """Make rank 0 sleep before each broadcast it sends while ``delaying["on"]``."""
    exchange = opt._stepper.exchange
    if rank == 0:
        issue = exchange._broadcast

        def slow_broadcast(buffer: torch.Tensor, source: int) -> Any:
            if source == 0 and delaying["on"]:
                time.sleep(DELAY_S)
            return issue(buffer, source)

        exchange._broadcast = slow_broadcast
    return exchange


def delayed_exchanges(rank: int, world_size: int) -> dict[str, Any]:
    """:func:`delayed_exchange` for every reader of :data:`READERS`."""
    return {reader: delayed_exchange(rank, world_size, reader) for reader in READERS}


def delayed_exchange(rank: int, world_size: int, reader: str) -> dict[str, Any]:
    """Rank 0 sleeps before each broadcast it sends, so the others reach the point
    where they read the parameters with rank 0's updates still on the way.

    ``"end of backward"``: training steps; each backward must wait for the last buckets'
    updates before it returns. The others: after the steps, rank 1 overwrites every
    parameter it does not own with NaN and all ranks exchange again (a backward that
    raised leaves the exchange pending like this); the reader — the next forward
    (DDP's forward pre-hook), a forward of the wrapped module itself (its own pre-hook),
    ``zero_grad()`` — must wait for the owners' values.
    """
    reference = build_reference()
    plain_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    ddp = build()
    opt = overlapkit.overlap_ddp(ddp, torch.optim.AdamW, lr=LR, shard_optimizer_state=True)
    delaying = {"on": reader == "end of backward"}
    exchange = _delay_sends_of_rank_0(opt, rank, delaying)
    plain_losses, losses, waited = [], [], []
    for tokens in batches(rank):
        loss = _loss(reference, tokens)
        plain_losses.append(loss.detach().clone())
        loss.backward()
        plain_opt.step()
        plain_opt.zero_grad()
        loss = _loss(ddp, tokens)
        losses.append(loss.detach().clone())
        exchange.still_pending_at_last_wait = 0
        loss.backward()
        waited.append(exchange.still_pending_at_last_wait)
        opt.step()
        opt.zero_grad()
    if reader != "end of backward":
        if rank == 1:
            with torch.no_grad():
                for param in ddp.parameters():
                    if exchange.ownership.owner_of(param) != rank:
                        param.fill_(float("nan"))
        delaying["on"] = True
        exchange.launch_all()
        exchange.still_pending_at_last_wait = 0
        probe = batches(rank, 1, seed=7)[0]
        with torch.no_grad():
            if reader == "next forward":
                losses.append(_loss(ddp, probe))
            elif reader == "wrapped module's forward":
                losses.append(ddp.module(probe).square().mean())
            else:
                opt.zero_grad()
                losses.append(_loss(ddp, probe))
            plain_losses.append(_loss(reference, probe))
        waited = [exchange.still_pending_at_last_wait]
    return {"losses": compare(plain_losses, losses),
            "values": compare(values(reference), values(ddp)), "waited": waited}
