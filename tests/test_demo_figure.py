"""The demo's plot says what the table says: values, settings, the checkpoint, and
which curves coincide."""

from __future__ import annotations

import math
from typing import Any

import pytest

from overlapkit.cli.demo.config import DemoConfig
from overlapkit.cli.demo.report import TechniqueRow, format_table

pytest.importorskip("matplotlib")

LOSSES = [0.3 * math.exp(-i / 40) + 0.2 for i in range(40)]  # falls less than a decade


def _rows() -> list[TechniqueRow]:
    rows = [TechniqueRow(technique=name, step_ms=ms, peak_rss_mib=[300.0, 301.0],
                         final_loss=losses[-1], max_param_diff=diff, losses=losses)
            for name, ms, diff, losses in [
                ("plain", 10.0, 0.0, LOSSES), ("overlap_ddp", 11.0, 0.0, LOSSES),
                ("optimizer_in_backward", 12.5, 0.0, list(LOSSES)),
                ("post_local_sgd", 9.0, 0.03, [x * 1.01 for x in LOSSES])]]
    rows.append(TechniqueRow(technique="checkpoint", step_ms=55.0, peak_rss_mib=[300.0],
                             final_loss=0.2, max_param_diff=0.0,
                             note="saved at world size 2, reloaded at 1; the time is ..."))
    return rows


@pytest.fixture
def figure() -> Any:
    from overlapkit.cli.demo.figure import draw
    from overlapkit.cli.textui import pyplot

    fig = draw(_rows(), DemoConfig(steps=40, world_size=2, model_size="small"))
    fig.canvas.draw()
    yield fig
    pyplot().close(fig)


def test_the_log_loss_axis_has_at_least_three_labels(figure: Any) -> None:
    losses_ax = figure.axes[0]
    low, high = losses_ax.get_ylim()
    labels = [t.get_text() for t in losses_ax.get_yticklabels()
              if t.get_text() and low <= t.get_position()[1] <= high]
    assert len(labels) >= 3, labels


def test_identical_curves_are_one_line_that_says_so(figure: Any) -> None:
    legend = [t.get_text() for t in figure.axes[0].get_legend().get_texts()]
    assert legend == ["plain = overlap_ddp = optimizer_in_backward (bitwise identical)",
                      "post_local_sgd"]


def test_every_bar_carries_its_value(figure: Any) -> None:
    values = sorted(t.get_text() for t in figure.axes[1].texts)
    assert values == ["10.00", "11.00", "12.50", "9.00"]


def test_the_settings_and_the_checkpoint_are_on_the_figure(figure: Any) -> None:
    text = figure._suptitle.get_text() + " ".join(t.get_text() for t in figure.texts)
    assert "0.92M-parameter MLP (small), 2 CPU ranks" in text and "40 steps" in text
    assert "checkpoint: saved at world size 2, reloaded at 1; load 55.00 ms" in text
    assert "post_local_sgd: max |Δparam| vs plain DDP = 0.03" in text


def test_the_table_names_the_identical_curves() -> None:
    assert ("plain = overlap_ddp = optimizer_in_backward: bitwise-identical loss curves"
            in format_table(_rows()))
