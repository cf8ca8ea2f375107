"""The optimizer's state between a stepping backward and ``step()``, in a loop that
steps during backward (``optimizer_in_backward`` on a plain module; DDP, 2 gloo ranks,
in tests/test_window.py): a write to one parameter's entry or a reset is refused at
that ``step()``, naming the parameters (0.4.0: a write not detected, AdamW 0.0064 off
after 4 steps); a read is warned of once (it holds this step's update already) and is
not a write; the watched state reads, copies and pickles as the dict and is given back
at ``step()``."""

from __future__ import annotations

import collections
import copy
import pickle
import warnings
from typing import Any

import pytest
import torch
from helpers import compare, rank_batches, stepped_once, values
from torch import nn

import overlapkit
from overlapkit.overlap.core.state_marks import StateReadInWindowWarning


def test_an_optimizer_state_reset_between_backward_and_step_is_refused_at_step() -> None:
    # the plain step() starts from the empty state (0.4.0: silently kept this step's)
    _, opt = stepped_once()
    opt.state = collections.defaultdict(dict)
    with pytest.raises(overlapkit.ConfigurationError, match=r"optimizer\.state \(4 entries -> 0"):
        opt.step()


@pytest.mark.parametrize("write", ["scaled", "replaced", "cleared", "deleted"])
def test_one_parameters_state_written_between_backward_and_step_is_refused_at_step(
        write: str) -> None:
    # 0.4.0: not detected (the step had used the state before the write)
    module, opt = stepped_once()
    weight = module[0].weight
    if write == "scaled":
        opt.state[weight]["exp_avg"].mul_(0.5)
    elif write == "replaced":
        opt.state[weight]["exp_avg_sq"] = opt.state[weight]["exp_avg_sq"] * 2
    elif write == "cleared":
        opt.state[weight].clear()
    else:
        del opt.state[weight]
    with pytest.raises(overlapkit.ConfigurationError,
                       match=r"state of 0\.weight.* was written between backward"):
        opt.step()


def test_state_read_for_parameters_without_state_is_not_a_reset() -> None:
    # opt.state[p] creates an empty entry for a parameter the optimizer does not step
    # (0.4.0: refused at step() as "a reset")
    def train(technique: str | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        stepped = list(module[0].parameters())
        if technique is None:
            opt: Any = torch.optim.AdamW(stepped, lr=1e-2)
        else:
            opt = overlapkit.optimizer_in_backward(module, torch.optim.AdamW, lr=1e-2,
                                                   params=stepped)
        for batch in rank_batches(0, 3):
            module(batch).square().mean().backward()
            assert [len(opt.state[p]) > 0 for p in module.parameters()].count(True) in (0, 2)
            opt.step()
            opt.zero_grad()
        return values(module)

    assert compare(train(None), train("optimizer_in_backward"))


def test_the_state_watched_in_the_window_reads_as_the_dict_and_is_given_back() -> None:
    module, opt = stepped_once()
    state = opt.state
    assert state.default_factory is dict
    assert module[0].weight in state and len(state) == 4
    assert repr(state).startswith("defaultdict(")
    opt.step()  # reading is not a write: nothing refused
    assert type(opt.state) is collections.defaultdict
    assert type(opt.optimizer.state) is collections.defaultdict


def test_a_state_read_between_backward_and_step_is_warned_of_once() -> None:
    # it holds this step's update already (0.4.0: silently)
    module, opt = stepped_once()
    with pytest.warns(StateReadInWindowWarning,
                      match="holds this step's update already") as caught:
        dict(opt.state.items())  # through collections.abc's mixin
    assert caught[0].filename == __file__  # the loop's line
    opt.step()
    opt.zero_grad()
    module(rank_batches(0, 3)[2]).square().mean().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dict(opt.state_dict())  # warned once per optimizer
    opt.step()


def test_the_state_watched_in_the_window_copies_and_pickles_as_the_dict() -> None:
    _, opt = stepped_once()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StateReadInWindowWarning)
        for copied in (copy.copy(opt.state), copy.deepcopy(opt.state),
                       pickle.loads(pickle.dumps(opt.state))):
            assert type(copied) is collections.defaultdict and len(copied) == 4
    opt.step()
