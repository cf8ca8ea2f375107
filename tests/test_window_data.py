"""Writes through ``.data`` between backward and ``step()``, and forwards there.

``p.grad.data.mul_(0.5)`` and ``p.data.clamp_(-c, c)`` change the tensor without bumping
its version counter (``.data`` has one of its own), which is what the window's checks
read (``overlapkit/overlap/core/data_writes.py``). 0.4.0 did not see them (measured
after 4 steps): under ``overlap_ddp``, ``p.grad.data.mul_(0.5)`` 0.030 off the plain
loop with SGD, 0.0093 with AdamW after ``learn_first_step`` (the integrations' path),
silently; a ``p.data.clamp_`` 0.015 off (AdamW) under both techniques with only the
parameter-read warning, which said such a change is refused. Now refused at that
``step()``, or, learnt, every step in the plain order, bitwise, one warning; a ``.data``
read, or set to the same values (``model.to(device)``), is no change.

A forward of the DDP model between the first backward and ``step()`` (a validation)
cleared the gradients under ``overlap_ddp`` (as a backward-only loop's next forward), and
that ``step()`` refused the loop as one that changed them; now bitwise the plain loop.
(DDP: 2 gloo ranks, ``tests/window_data_ranks.py``.)"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from helpers import compare, learned_loop, rank_batches, stepped_once, values
from torch import nn
from window_data_ranks import run

import overlapkit
from overlapkit.distributed import run_distributed


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_distributed(run, 2, timeout=300)


def _each(two_ranks: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    return [rank_results[key] for rank_results in two_ranks]


@pytest.mark.parametrize(("technique", "window", "words"), [
    ("overlap_ddp", "grads halved through data", "the gradients of module.0.weight"),
    ("overlap_ddp", "weights clamped through data", "the values of module.0.weight"),
    ("overlap_ddp", "weights set through data", "the values of module.0.weight"),
    ("optimizer_in_backward", "weights clamped through data", "the values of module.0.weight"),
    ("optimizer_in_backward", "weights set through data", "the values of module.0.weight")])
def test_a_write_through_data_after_a_stepping_backward_is_refused_at_step(
        two_ranks: list[dict[str, Any]], technique: str, window: str, words: str) -> None:
    # before: not seen (SGD 0.030 off after 4 steps of p.grad.data.mul_(0.5); a clamp
    # through .data AdamW 0.015 off, warned of only as a read)
    for found in _each(two_ranks, f"{technique} {window}"):
        error = found["error"]
        assert error is not None and error["type"] == "ConfigurationError", found
        assert words in error["message"], error["message"]
        assert "between backward() and optimizer.step()" in error["message"]
        assert found["at"] == 0, found


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
@pytest.mark.parametrize("window", ["grads halved through data",
                                    "weights clamped through data",
                                    "weights set through data"])
def test_a_write_through_data_in_a_learnt_first_window_keeps_the_plain_order_bitwise(
        two_ranks: list[dict[str, Any]], technique: str, window: str) -> None:
    # before (overlap_ddp, gradients halved through .data): AdamW 0.0093 off, no warning
    for found in _each(two_ranks, f"{technique} {window} learnt"):
        assert found["error"] is None, found
        assert found["bitwise plain"], found["bitwise plain"]
        plain_order = [w for w in found["warnings"] if "in the plain order" in w]
        assert len(plain_order) == 1, found["warnings"]


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
@pytest.mark.parametrize("learnt", [False, True])
@pytest.mark.parametrize("window", ["grad norms read through data", "moved to its device"])
def test_data_read_or_set_to_the_same_values_is_no_change(
        two_ranks: list[dict[str, Any]], technique: str, learnt: bool, window: str) -> None:
    for found in _each(two_ranks, f"{technique} {window}{' learnt' if learnt else ''}"):
        assert found["error"] is None, found
        assert found["bitwise plain"], found["bitwise plain"]


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
@pytest.mark.parametrize("window", ["validated under no_grad", "validated with autograd"])
def test_a_forward_between_the_first_backward_and_step_is_bitwise_the_plain_loop(
        two_ranks: list[dict[str, Any]], technique: str, window: str) -> None:
    # before (overlap_ddp): the forward cleared the gradients, and the first step()
    # refused the loop as one that changed them
    for found in _each(two_ranks, f"{technique} {window}"):
        assert found["error"] is None, found
        assert found["bitwise plain"], found["bitwise plain"]


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_a_backward_only_loop_validating_under_no_grad_is_bitwise_the_plain_loop(
        two_ranks: list[dict[str, Any]], technique: str) -> None:
    for found in _each(two_ranks, f"{technique} backward only, validated"):
        assert found, found


def _module_loop(technique: bool, window: Any) -> tuple[list[torch.Tensor], Any]:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt: Any = (overlapkit.optimizer_in_backward(module, torch.optim.SGD, lr=0.1, momentum=0.9)
                if technique else torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9))
    error = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            for batch in rank_batches(0, 3):
                module(batch).square().mean().backward()
                window(module)
                opt.step()
                opt.zero_grad()
        except overlapkit.ConfigurationError as refused:
            error = refused
    return values(module), error


def test_a_plain_module_refuses_a_clamp_through_data_at_step() -> None:
    # before: 0.015 off (AdamW, 4 steps), warned of only as a parameter read
    def clamp(module: nn.Module) -> None:
        module[0].weight.data.clamp_(-0.1, 0.1)

    _, error = _module_loop(True, clamp)
    assert error is not None and "the values of 0.weight were changed" in str(error)


def test_a_plain_module_learnt_keeps_a_clamp_through_data_bitwise() -> None:
    def iteration(module: nn.Module, opt: Any, i: int, batch: torch.Tensor) -> None:
        module(batch).square().mean().backward()
        module[2].weight.data.clamp_(-0.1, 0.1)
        opt.step()
        opt.zero_grad()

    expected, _ = learned_loop(False, iteration, 4)
    ours, said = learned_loop(True, iteration, 4)
    assert compare(expected, ours)
    assert len([s for s in said if "in the plain order" in s]) == 1, said


def test_data_writes_note_the_windows_tensors_while_open_and_keep_no_temporaries() -> None:
    from overlapkit.overlap.core.data_writes import DataWrites

    _, error = _module_loop(True, lambda module: None)
    assert error is None
    param, other = nn.Parameter(torch.zeros(3)), torch.zeros(3)
    param.grad = torch.zeros(3)
    writes = DataWrites([param])
    for _ in range(5):  # temporaries, read only: one kept at a time
        float(param.data.sum())
    assert len(writes.aliases[id(param)][1]) == 1
    held = param.data  # one the loop keeps is kept too
    float(param.data.sum())
    assert len(writes.aliases[id(param)][1]) == 2
    other.data.add_(1)  # not the window's
    assert writes.changed() == set()
    held.mul_(2)
    float(param.data.sum())  # drops the changed one, remembered
    param.grad.data.add_(1)
    writes.close()
    param.grad.data.add_(1)  # closed: not noted
    assert writes.changed() == {id(param), id(param.grad)}
    assert id(other) not in writes.aliases
    param.data = torch.full((3,), 2.0)  # torch's own .data behind it
    assert param.data.tolist() == [2.0, 2.0, 2.0] and param.requires_grad


def test_optimizer_state_written_through_data_is_refused_at_step() -> None:
    # before: warned of only as a state read (AdamW 0.0055 off after 4 steps)
    from overlapkit.overlap.core.state_marks import StateReadInWindowWarning

    module, opt = stepped_once()
    with pytest.warns(StateReadInWindowWarning):  # a read too
        opt.state[module[0].weight]["exp_avg"].data.mul_(0.5)
    with pytest.raises(overlapkit.ConfigurationError,
                       match=r"state of 0\.weight was written between backward"):
        opt.step()


@pytest.mark.parametrize("learnt", [False, True])
def test_a_tensor_lr_filled_through_data_is_refused_or_learnt(learnt: bool) -> None:
    # before: not seen (0.039 off after 4 steps, no warning)
    def train(overlapped: bool) -> tuple[list[torch.Tensor], Any]:
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        lr = torch.tensor(0.01)
        opt: Any = (overlapkit.optimizer_in_backward(module, torch.optim.AdamW, lr=lr)
                    if overlapped else torch.optim.AdamW(module.parameters(), lr=lr))
        if overlapped and learnt:
            opt.learn_first_step(module)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                for i, batch in enumerate(rank_batches(0, 4)):
                    module(batch).square().mean().backward()
                    opt.param_groups[0]["lr"].data.fill_(0.005 * (i + 1))  # a warm-up
                    opt.step()
                    opt.zero_grad()
            except overlapkit.ConfigurationError as error:
                return values(module), error
        return values(module), [str(w.message) for w in caught]

    expected, _ = train(False)
    ours, found = train(True)
    if learnt:
        assert compare(expected, ours)
        assert len([w for w in found if "in the plain order" in w]) == 1, found
    else:
        assert isinstance(found, overlapkit.ConfigurationError)
        assert "lr of param group 0" in str(found)
