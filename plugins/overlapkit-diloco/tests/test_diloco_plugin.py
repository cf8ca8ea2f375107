"""The plugin as users meet it: installed, listed, blockable, validating its options."""

from __future__ import annotations

import pytest
import torch

import overlapkit
import overlapkit_diloco.plugin
from overlapkit.plugin import OverlapkitPluginManager
from overlapkit.testing import installed_plugins
from overlapkit_diloco import DiLoCoAverager


def test_installed_plugin_is_listed_with_its_version() -> None:
    listed = installed_plugins()["diloco"]
    assert (listed["distribution"], listed["version"]) == ("overlapkit-diloco", "0.3.0")
    assert listed["provides"] == {"averagers": ["diloco"]}


def test_blocking_the_plugin_by_name_removes_it() -> None:
    listed = installed_plugins(OVERLAPKIT_DISABLE_PLUGINS="diloco")
    assert listed["diloco"]["status"] == "blocked"
    assert listed["diloco"]["provides"] == {}


def test_registered_by_hand_in_a_test(overlapkit_plugin_manager: OverlapkitPluginManager) -> None:
    with pytest.raises(overlapkit.UnknownNameError):
        overlapkit.create_averager("diloco", period=4)  # autoload is off in the fixture
    overlapkit_plugin_manager.register(overlapkit_diloco.plugin, name="diloco")
    averager = overlapkit.create_averager("diloco", period=4, outer_lr=0.5)
    assert isinstance(averager, DiLoCoAverager) and averager.period == 4


@pytest.mark.parametrize(
    ("options", "message"),
    [({"outer_lr": 0.0}, "outer_lr must be > 0"),
     ({"outer_momentum": 1.0}, "outer_momentum must be in"),
     ({"period": 0}, "period must be an integer >= 1"),
     ({"fragments": 3}, "fragments must be an integer >= 1 dividing period 4"),
     ({"fragments": 0}, "fragments must be an integer >= 1"),
     ({"fragments": 2, "fragment_sync_delay": 2},
      r"fragment_sync_delay must be an integer in \[0, 2\)"),
     ({"fragment_sync_delay": -1}, r"fragment_sync_delay must be an integer in \[0, 4\)"),
     ({"fragment_sync_delay": 1.0}, "fragment_sync_delay must be an integer"),
     ({"fragment_update_alpha": 1.5}, r"fragment_update_alpha must be a number in \[0, 1\]"),
     ({"fragment_update_alpha": -0.1}, "fragment_update_alpha must be a number"),
     ({"fragment_update_alpha": float("nan")}, "fragment_update_alpha must be a number")],
)
def test_bad_options_are_clear_errors(
    overlapkit_plugin_manager: OverlapkitPluginManager, options: dict[str, float], message: str
) -> None:
    overlapkit_plugin_manager.register(overlapkit_diloco.plugin, name="diloco")
    with pytest.raises(overlapkit.ConfigurationError, match=message):
        overlapkit.create_averager("diloco", **{"period": 4, **options})


def test_outer_weight_decay_is_refused() -> None:
    averager = DiLoCoAverager(
        2, outer_optimizer=lambda ts: torch.optim.SGD(ts, lr=0.7, weight_decay=0.1))
    with pytest.raises(overlapkit.ConfigurationError, match="must not use weight_decay"):
        averager.load_state_dict({"step": 3, "round_start": [torch.zeros(2)],
                                  "outer_optimizer": {}})


def test_fragments_take_their_outer_steps_in_turn_every_period_over_fragments() -> None:
    averager = DiLoCoAverager(4, fragments=2)
    steps = [s for s in range(12) if (s + 1) % averager.sync_every == 0]
    assert averager.sync_every == 2 and steps == [1, 3, 5, 7, 9, 11]
    assert [averager.fragment_at(s) for s in steps] == [0, 1, 0, 1, 0, 1]


def test_with_a_sync_delay_each_fragments_allreduce_starts_delay_steps_before_its_outer_step(
) -> None:
    averager = DiLoCoAverager(6, fragments=2, fragment_sync_delay=2)
    starts = [s for s in range(12) if averager.sync_starts_at(s)]
    ends = [s for s in range(12) if averager.sync_ends_at(s)]
    assert starts == [0, 3, 6, 9] and ends == [2, 5, 8, 11]
    assert [averager.fragment_at(s) for s in starts] == [0, 1, 0, 1]
    assert [averager.fragment_at(s) for s in ends] == [0, 1, 0, 1]
