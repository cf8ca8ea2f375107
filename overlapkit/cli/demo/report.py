"""The demo's closing table, its JSON form, and its plot."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import attrs

from overlapkit.cli.textui import format_table as format_text_table
from overlapkit.cli.textui import pyplot

__all__ = ["TechniqueRow", "format_table", "plot"]


@attrs.frozen(kw_only=True)
class TechniqueRow:
    """One technique's figures, as the demo reports them."""

    technique: str
    #: median step time over the run, in milliseconds (load time for ``checkpoint``)
    step_ms: float
    #: peak resident memory of each rank, in MiB
    peak_rss_mb: list[float]
    final_loss: float | None
    #: largest absolute parameter difference from plain DDP (``None``: not comparable)
    max_param_diff: float | None
    losses: list[float] = attrs.field(factory=list)
    step_times_ms: list[float] = attrs.field(factory=list)
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        """A plain dict for ``--json``."""
        return attrs.asdict(self)


def median_ms(seconds: list[float]) -> float:
    """The median of ``seconds``, in milliseconds, leaving out the first step (warm-up)."""
    kept = seconds[1:] or seconds
    return 1000.0 * statistics.median(kept)


def format_table(rows: list[TechniqueRow]) -> str:
    """The closing table as text."""
    plain = next((r.step_ms for r in rows if r.technique == "plain"), None)
    header = ("technique", "step (ms)", "vs plain", "peak RSS/rank (MiB)", "final loss",
              "max |Δparam| vs plain")
    lines = [header]
    for r in rows:
        ratio = f"{r.step_ms / plain:.2f}x" if plain and r.technique != "checkpoint" else "-"
        diff = "-" if r.max_param_diff is None else f"{r.max_param_diff:.3g}"
        loss = "-" if r.final_loss is None else f"{r.final_loss:.5f}"
        rss = "/".join(f"{m:.0f}" for m in r.peak_rss_mb)
        lines.append((r.technique, f"{r.step_ms:.2f}", ratio, rss, loss, diff))
    notes = [f"  {r.technique}: {r.note}" for r in rows if r.note]
    table = format_text_table(lines, rule=True)
    notes.append("  step times: on CPU, with every rank on its own core, communication cannot "
                 "overlap computation; docs/benchmarks.md has the comparisons with torch's own.")
    return "\n".join([table, "", "notes:", *notes]) if notes else table


def plot(rows: list[TechniqueRow], path: Path) -> None:
    """Draw loss curves and step times of every technique into a PNG at ``path``."""
    plt = pyplot()
    trained = [r for r in rows if r.losses]
    figure, (losses_ax, times_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    # Bitwise-identical curves lie on top of each other: vary the dashes so each shows.
    styles = ["-", "--", ":", "-.", (0, (5, 1))]
    for index, r in enumerate(trained):
        losses_ax.plot(range(1, len(r.losses) + 1), r.losses, label=r.technique,
                       linestyle=styles[index % len(styles)], linewidth=2.2 - 0.3 * index)
    losses_ax.set(title="training loss (mean over ranks)", xlabel="step", ylabel="MSE loss",
                  yscale="log")
    losses_ax.legend()
    names = [r.technique for r in trained]
    times_ax.bar(names, [r.step_ms for r in trained], color="tab:blue")
    times_ax.set(title="median step time", ylabel="ms")
    times_ax.tick_params(axis="x", rotation=20)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
