"""The demo's closing table and its JSON form (the plot: :mod:`overlapkit.cli.demo.figure`)."""

from __future__ import annotations

import statistics
from typing import Any

import attrs

from overlapkit.cli.textui import format_table as format_text_table

__all__ = ["TechniqueRow", "format_table", "identical_groups", "median_ms"]


@attrs.frozen(kw_only=True)
class TechniqueRow:
    """One technique's figures, as the demo reports them."""

    technique: str
    #: median step time over the run, in milliseconds (load time for ``checkpoint``)
    step_ms: float
    #: peak resident memory of each rank, in MiB (``VmHWM``)
    peak_rss_mib: list[float]
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
    header = ("technique", "step (ms)", "vs plain", "peak RSS/rank (MiB)", "final loss (mean)",
              "max |Δparam| vs plain")
    lines = [header]
    for r in rows:
        ratio = f"{r.step_ms / plain:.2f}x" if plain and r.technique != "checkpoint" else "-"
        diff = "-" if r.max_param_diff is None else f"{r.max_param_diff:.3g}"
        loss = "-" if r.final_loss is None else f"{r.final_loss:.5f}"
        rss = "/".join(f"{m:.0f}" for m in r.peak_rss_mib)
        lines.append((r.technique, f"{r.step_ms:.2f}", ratio, rss, loss, diff))
    notes = [f"  {r.technique}: {r.note}" for r in rows if r.note]
    notes += [f"  {' = '.join(group)}: bitwise-identical loss curves (one line in the plot)"
              for group in identical_groups(rows)]
    table = format_text_table(lines, rule=True)
    notes.append("  step times: on CPU, with every rank on its own core, communication cannot "
                 "overlap computation; docs/benchmarks.md has the comparisons with torch's own.")
    return "\n".join([table, "", "notes:", *notes]) if notes else table


def identical_groups(rows: list[TechniqueRow]) -> list[list[str]]:
    """Techniques whose loss curves are bitwise identical, in groups of two or more
    (in row order): drawn as one line, they need saying so."""
    groups: dict[tuple[float, ...], list[str]] = {}
    for r in rows:
        if r.losses:
            groups.setdefault(tuple(r.losses), []).append(r.technique)
    return [names for names in groups.values() if len(names) > 1]
