"""The demo's plot: loss curves and step times, with the run's settings on it.

A PNG is read without the terminal beside it, so it carries what the table says too:
the settings (model, ranks, steps), the value on every bar, the checkpoint's save and
reload, and which loss curves are bitwise identical (they draw as one line).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from overlapkit.cli.demo.config import DemoConfig
from overlapkit.cli.demo.report import TechniqueRow, identical_groups
from overlapkit.cli.textui import pyplot

__all__ = ["draw", "plot"]

_STYLES = ["-", "--", ":", "-.", (0, (5, 1))]


def _loss_axes(ax: Any, rows: list[TechniqueRow]) -> None:
    from matplotlib.ticker import LogLocator, NullFormatter, StrMethodFormatter

    same = {name: group for group in identical_groups(rows) for name in group}
    drawn: set[str] = set()
    for index, r in enumerate(r for r in rows if r.losses):
        if r.technique in drawn:
            continue
        group = same.get(r.technique, [r.technique])
        drawn.update(group)
        label = " = ".join(group) + (" (bitwise identical)" if len(group) > 1 else "")
        ax.plot(range(1, len(r.losses) + 1), r.losses, label=label,
                linestyle=_STYLES[index % len(_STYLES)], linewidth=2.0)
    ax.set(title="training loss (mean over ranks)", xlabel="step", ylabel="MSE loss",
           yscale="log")
    # A loss that falls less than a decade gets one or two labels from the default
    # log locator: label 1, 2 and 5 of each decade, and any in between when fewer show.
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_minor_locator(LogLocator(base=10, subs=tuple(range(1, 10))))
    ax.yaxis.set_major_formatter(StrMethodFormatter("{x:.3g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    low, high = ax.get_ylim()
    if sum(low <= t <= high for t in ax.get_yticks()) < 3:
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=tuple(range(1, 10))))
    ax.legend(fontsize=8)


def _time_axes(ax: Any, rows: list[TechniqueRow]) -> None:
    trained = [r for r in rows if r.losses]
    bars = ax.bar([r.technique for r in trained], [r.step_ms for r in trained],
                  color="tab:blue")
    ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set(title="median step time", ylabel="ms")
    ax.tick_params(axis="x", rotation=20, labelsize=8)
    ax.margins(y=0.15)


def _footer(rows: list[TechniqueRow]) -> str:
    lines = []
    checkpoint = next((r for r in rows if r.technique == "checkpoint"), None)
    if checkpoint is not None:
        where = checkpoint.note.split(";")[0]
        diff = "-" if checkpoint.max_param_diff is None else f"{checkpoint.max_param_diff:.3g}"
        lines.append(f"checkpoint: {where}; load {checkpoint.step_ms:.2f} ms; "
                     f"max |saved - reloaded| = {diff}")
    for r in rows:
        if r.technique not in ("plain", "checkpoint") and r.max_param_diff is not None:
            lines.append(f"{r.technique}: max |Δparam| vs plain DDP = {r.max_param_diff:.3g}")
    return "\n".join(line for line in lines if line)


def draw(rows: list[TechniqueRow], cfg: DemoConfig) -> Any:
    """The demo's figure (a matplotlib ``Figure``), not yet saved."""
    plt = pyplot()
    footer = _footer(rows)
    lines = footer.count("\n") + 1 if footer else 0
    height = 4.4 + 0.18 * lines  # inches: the footer's lines below the axes
    figure, (losses_ax, times_ax) = plt.subplots(1, 2, figsize=(12, height))
    figure.suptitle(f"overlapkit demo: {cfg.describe()}", fontsize=10)
    _loss_axes(losses_ax, rows)
    _time_axes(times_ax, rows)
    figure.text(0.01, 0.01, footer, fontsize=8.5, va="bottom", family="monospace")
    figure.tight_layout(rect=(0, (0.18 * lines + 0.05) / height, 1, 0.96))
    return figure


def plot(rows: list[TechniqueRow], cfg: DemoConfig, path: Path) -> None:
    """Draw the demo's figure into ``path`` (any format matplotlib writes, e.g. PNG)."""
    figure = draw(rows, cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    pyplot().close(figure)
