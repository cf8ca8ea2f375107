"""The optimizer's ``state`` lists its entries in the plain loop's order (plain module,
1 process; DDP, 2 gloo ranks; rank code: state_order_ranks.py).

Stepped during backward, the entries were made last layer first: ``list(opt.state)``
and ``list(opt.state_dict()["state"])`` were the reverse of the plain loop's, and a
loop resetting the state of the entry listed first (``opt.state.pop(next(iter(
opt.state)))``) reset another parameter's: 0.044 off the plain loop after 5 AdamW
steps, silently (0.4.0 before this test)."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import each_setting, ranks_fixture
from state_order_ranks import OPTIMIZERS, SETTINGS, run

CASES = [(setting, technique, optimizer) for setting, (_, techniques) in SETTINGS.items()
         for technique in techniques for optimizer in OPTIMIZERS]


ranks = ranks_fixture(run)


@pytest.mark.parametrize(("setting", "technique", "optimizer"), CASES)
def test_the_state_lists_its_entries_in_the_plain_loops_order(
        ranks: list[dict[Any, Any]], setting: str, technique: str, optimizer: str) -> None:
    for results in each_setting(ranks, setting):
        found = results[setting, technique, optimizer, False]
        ours, plain = found["order"]
        assert ours == plain, found
        assert found["saved order"][0] == found["saved order"][1], found
        assert found["bitwise"], found


@pytest.mark.parametrize(("setting", "technique", "optimizer"), CASES)
def test_a_loop_resetting_the_first_entry_resets_the_plain_loops_first_entry(
        ranks: list[dict[Any, Any]], setting: str, technique: str, optimizer: str) -> None:
    for results in each_setting(ranks, setting):
        found = results[setting, technique, optimizer, True]
        assert found["bitwise"], found
        assert found["order"][0] == found["order"][1], found


def test_entries_made_later_come_after_the_others(ranks: list[dict[Any, Any]]) -> None:
    """A branch first used at the third step: its entries follow the trunk's, in the
    optimizer's order, as the plain loop appends them."""
    ours, plain = ranks[0]["later branch"]
    assert plain == ["trunk.weight", "trunk.bias", "branch.weight", "branch.bias"]
    assert ours == plain
