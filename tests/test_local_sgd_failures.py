"""An averager raising on one rank, and ``learn_first_step`` through a
PostLocalSGDOptimizer, on 2 gloo ranks.

- f2b92e2: rank 1's averager raising at its first averaging, caught by the loop, left
  rank 0 waiting in the averaging collective; rank 1's next averaging paired with it
  and gloo aborted both processes ("Received data size doesn't match expected size"),
  or, with no later collective, rank 0 waited until the process group's timeout. Now
  rank 0 raises ExchangeFailedError naming rank 1 and the averager within a second,
  and the next step() refuses on both ranks, nothing stepped. Every rank raising alike
  leaves the group in step: the run goes on, bitwise as if the failing step had not
  averaged.
- f2b92e2: ``PostLocalSGDOptimizer.learn_first_step`` (the refusals' advice) raised
  AttributeError; now it is passed to the local optimizer.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import overlapkit
from overlapkit.distributed import run_distributed
from overlapkit.local_sgd.averagers import HierarchicalAverager, PeriodicAverager


class _RaisesOn(PeriodicAverager):
    """Raises in its first averaging on the ranks in ``ranks`` (its step not counted)."""

    def __init__(self, ranks: tuple[int, ...]) -> None:
        super().__init__(period=2)
        self.ranks, self.raised = ranks, False

    def average(self, params: list[torch.Tensor], group: Any) -> None:
        if not self.raised and dist.get_rank() in self.ranks:
            self.raised = True
            raise ValueError("the plugin's own bug")
        super().average(params, group)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _loop(rank: int, raising: tuple[int, ...]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = overlapkit.PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           _RaisesOn(raising))
    errors: list[tuple[int, str, str, float]] = []
    start = time.monotonic()
    for step in range(4):
        gen = torch.Generator().manual_seed(10 * rank + step)
        model(torch.randn(3, 4, generator=gen)).sum().backward()
        before = _flat(model)
        try:
            opt.step()
        except Exception as error:  # the user's loop goes on
            changed = not torch.equal(before, _flat(model))
            errors.append((step, type(error).__name__, str(error),
                           time.monotonic() - start, changed))
        opt.zero_grad()
    return {"errors": errors, "params": _flat(model)}


def _one_rank_raises(rank: int, world_size: int) -> dict[str, Any]:
    return _loop(rank, (1,))


def _every_rank_raises(rank: int, world_size: int) -> dict[str, Any]:
    return _loop(rank, (0, 1))


def test_the_waiting_rank_names_the_failing_averager_at_once() -> None:
    results = run_distributed(_one_rank_raises, 2, timeout=60)
    waiting, failing = results[0]["errors"], results[1]["errors"]
    step, kind, message, seconds, _ = waiting[0]
    assert (step, kind) == (0, "ExchangeFailedError"), waiting
    assert "rank 1's averager _RaisesOn raised ValueError: the plugin's own bug" in message
    assert seconds < 10, seconds  # not the process group's 60 s timeout
    assert failing[0][:2] == (0, "ValueError")
    # the next step() refuses on both ranks, before the local step changes anything
    for errors in (waiting, failing):
        assert [e[:2] for e in errors[1:]] == [(s, "ExchangeFailedError") for s in (1, 2, 3)]
        assert all("took no local step and averaged nothing" in e[2] and not e[4]
                   for e in errors[1:])


def _plain_without_first_averaging(rank: int) -> torch.Tensor:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = overlapkit.PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           PeriodicAverager(period=2))
    for step in range(4):
        gen = torch.Generator().manual_seed(10 * rank + step)
        model(torch.randn(3, 4, generator=gen)).sum().backward()
        if step == 0:
            opt.optim.step()  # the failed step: stepped locally, not averaged (the
            # averager's step not counted: it raised, so step 1 averages)
        else:
            opt.step()
        opt.zero_grad()
    return _flat(model)


def _alike_and_plain(rank: int, world_size: int) -> dict[str, Any]:
    return {**_every_rank_raises(rank, world_size),
            "plain": _plain_without_first_averaging(rank)}


def test_every_rank_raising_alike_goes_on_in_step() -> None:
    for rank, result in enumerate(run_distributed(_alike_and_plain, 2, timeout=60)):
        assert [e[:2] for e in result["errors"]] == [(0, "ValueError")], result["errors"]
        assert torch.equal(result["params"], result["plain"]), rank


def _train(ddp: DDP, opt: torch.optim.Optimizer, rank: int) -> torch.Tensor:
    for step in range(5):
        gen = torch.Generator().manual_seed(10 * rank + step)
        x, y = torch.randn(3, 4, generator=gen), torch.randn(3, 2, generator=gen)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return _flat(ddp)


def _model() -> DDP:
    torch.manual_seed(0)
    return DDP(torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(),
                                   torch.nn.Linear(6, 2)), bucket_cap_mb=0.0002)


def _learn_first_step(rank: int, world_size: int) -> dict[str, Any]:
    ddp = _model()
    plain = overlapkit.PostLocalSGDOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1),
                                             PeriodicAverager(period=2))
    plain.learn_first_step(ddp)  # nothing to learn: steps at step() anyway
    expected = _train(ddp, plain, rank)
    ddp = _model()
    local = overlapkit.overlap_ddp(ddp, torch.optim.SGD, lr=0.1)
    opt = overlapkit.PostLocalSGDOptimizer(local, PeriodicAverager(period=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.learn_first_step(ddp)
        overlapped = _train(ddp, opt, rank)
    # an averager without before_step_at: every step in the plain order, kept so
    class NoStepAt(PeriodicAverager):
        def before_step(self, params: Any) -> None:
            return None

    ddp = _model()
    local = overlapkit.overlap_ddp(ddp, torch.optim.SGD, lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        forced = overlapkit.PostLocalSGDOptimizer(local, NoStepAt(period=2))
    forced.learn_first_step(ddp)
    return {"expected": expected, "overlapped": overlapped,
            "warnings": [str(w.message) for w in caught],
            "plain order kept": local.steps_in_plain_order}


def test_learn_first_step_is_passed_to_the_overlapped_local_optimizer() -> None:
    for rank, result in enumerate(run_distributed(_learn_first_step, 2, timeout=60)):
        assert torch.equal(result["overlapped"], result["expected"]), rank
        assert result["warnings"] == []
        assert result["plain order kept"]


class _RaisesInSubgroup(HierarchicalAverager):
    """Rank 1 raises at step 2, an averaging of the subgroup {0, 1} only."""

    def average(self, params: list[torch.Tensor], group: Any) -> None:
        if self.step == 2 and dist.get_rank() == 1:
            raise ValueError("the plugin's own bug")
        super().average(params, group)


def _subgroup_raises(rank: int, world_size: int) -> list[tuple[int, str, str]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = overlapkit.PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           _RaisesInSubgroup({2: 2, 4: 4}))
    errors = []
    for step in range(6):
        model(torch.randn(3, 4)).sum().backward()
        try:
            opt.step()
        except Exception as error:
            errors.append((step, type(error).__name__, str(error)))
        opt.zero_grad()
    return errors


def test_hierarchical_the_other_subgroup_learns_at_the_next_global_averaging() -> None:
    results = run_distributed(_subgroup_raises, 4, timeout=60)
    assert [e[:2] for e in results[1]][:1] == [(2, "ValueError")]
    assert [e[:2] for e in results[0]][:1] == [(2, "ExchangeFailedError")]
    for rank in (2, 3):  # their subgroup averaged at step 2; the global level waits
        assert [e[:2] for e in results[rank]] == [(4, "ExchangeFailedError"),
                                                 (5, "ExchangeFailedError")], rank
        assert "rank 1's averager _RaisesInSubgroup raised ValueError" in results[rank][0][2]


class _OwnAllReduce(PeriodicAverager):
    """A plugin's averager averaging with its own blocking ``dist.all_reduce`` (not
    overlapkit's ``average_in_place``); raises in its first averaging on rank 1."""

    def __init__(self, raising: bool) -> None:
        super().__init__(period=1)
        self.raising = raising

    def average(self, params: list[torch.Tensor], group: Any) -> None:
        if self.raising and dist.get_rank() == 1:
            self.raising = False
            raise ValueError("the plugin's own bug")
        flat = torch.cat([p.detach().reshape(-1) for p in params]).div_(dist.get_world_size())
        dist.all_reduce(flat, group=group)  # the plugin's own collective, blocking
        torch.nn.utils.vector_to_parameters(flat, params)


def _own_collective(rank: int, world_size: int,
                    averager: type[_OwnAllReduce] = _OwnAllReduce,
                    raisings: tuple[bool, ...] = (False, True)) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for raising in raisings:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = overlapkit.PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                               averager(raising))
        start, errors = time.monotonic(), []
        for step in range(3):
            gen = torch.Generator().manual_seed(10 * rank + step)
            model(torch.randn(3, 4, generator=gen)).sum().backward()
            try:
                opt.step()
            except Exception as error:  # the user's loop goes on
                errors.append((step, type(error).__name__, str(error),
                               time.monotonic() - start))
            opt.zero_grad()
        out[raising] = {"errors": errors, "params": _flat(model)}
    return out


def test_a_plugin_averagers_own_collective_is_told_of_the_failing_rank() -> None:
    # 968cf42: rank 0 waited in the averager's own dist.all_reduce until the process
    # group's timeout (here the run's 60 s); now it raises ExchangeFailedError naming
    # rank 1 at once, and without a failure the averaging is unchanged
    results = run_distributed(_own_collective, 2, timeout=60)
    assert results[0][False]["errors"] == results[1][False]["errors"] == []
    assert torch.equal(results[0][False]["params"], results[1][False]["params"])
    step, kind, message, seconds = results[0][True]["errors"][0]
    assert (step, kind) == (0, "ExchangeFailedError"), results[0][True]["errors"]
    assert "rank 1's averager _OwnAllReduce raised ValueError: the plugin's own bug" in message
    assert seconds < 10, seconds
    assert [e[:2] for e in results[1][True]["errors"]] == [
        (0, "ValueError"), (1, "ExchangeFailedError"), (2, "ExchangeFailedError")]


class _OwnAsyncAllReduce(_OwnAllReduce):
    """As :class:`_OwnAllReduce`, with one ``dist.all_reduce(..., async_op=True)`` per
    parameter (``async_op`` by keyword, then positionally), waited for by the averager
    itself."""

    def average(self, params: list[torch.Tensor], group: Any) -> None:
        if self.raising and dist.get_rank() == 1:
            self.raising = False
            raise ValueError("the plugin's own bug")
        works = []
        for i, p in enumerate(params):
            p.detach().div_(dist.get_world_size())
            if i % 2:
                works.append(dist.all_reduce(p.detach(), dist.ReduceOp.SUM, group, True))
            else:
                works.append(dist.all_reduce(p.detach(), group=group, async_op=True))
        assert all(isinstance(w, dist.Work) for w in works)
        for w in works:
            assert w.wait() is True


def _own_async_collective(rank: int, world_size: int) -> dict[str, Any]:
    # the blocking one first: after a failure the group is out of step
    blocking = _own_collective(rank, world_size, raisings=(False,))
    return {"blocking": blocking, "async": _own_collective(rank, world_size, _OwnAsyncAllReduce)}


def test_a_plugin_averagers_own_async_collective_is_told_of_the_failing_rank() -> None:
    # be7423f: a collective the averager started with async_op=True and waited for
    # itself was left unwatched: rank 0 waited in its wait() until the process group's
    # timeout (here the run's 60 s, the test's run failing). Now its Work's wait() is
    # watched as the blocking collectives are; without a failure the averaging is the
    # blocking one's, bitwise
    results = run_distributed(_own_async_collective, 2, timeout=60)
    for rank in (0, 1):
        assert results[rank]["async"][False]["errors"] == [], results[rank]["async"]
        assert torch.equal(results[rank]["async"][False]["params"],
                           results[rank]["blocking"][False]["params"])
    step, kind, message, seconds = results[0]["async"][True]["errors"][0]
    assert (step, kind) == (0, "ExchangeFailedError"), results[0]["async"][True]["errors"]
    assert "rank 1's averager _OwnAsyncAllReduce raised ValueError" in message
    assert seconds < 10, seconds
    assert [e[:2] for e in results[1]["async"][True]["errors"]] == [
        (0, "ValueError"), (1, "ExchangeFailedError"), (2, "ExchangeFailedError")]
