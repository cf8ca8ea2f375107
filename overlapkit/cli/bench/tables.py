"""The tables ``overlapkit bench`` prints: one per benchmark, from the result dict every
benchmark returns (a row per variant, its ratios, then its goals with their verdicts)."""

from __future__ import annotations

from typing import Any

from overlapkit.cli.bench.goals import verdict
from overlapkit.cli.textui import format_table

__all__ = ["format_result"]


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "/".join(_cell(v) for v in value)
    return str(value)


def format_result(result: dict[str, Any]) -> str:
    """One benchmark's result as text: a row per variant, the ratios, then a table of
    its goals with value, target and met/MISSED (or why a goal is not judged)."""
    if "error" in result:
        return f"== {result['benchmark']}: FAILED: {result['error']}"
    if "skipped" in result:  # a package the benchmark needs is missing
        return f"== {result['benchmark']}: skipped: {result['skipped']}"
    variants: dict[str, dict[str, Any]] = result.get("variants", {})
    metrics: list[str] = []
    for figures in variants.values():
        metrics += [m for m in figures if m not in metrics and not isinstance(figures[m], dict)]
    lines = [["variant", *metrics]]
    lines += [[name, *(_cell(figures.get(m, "-")) for m in metrics)]
              for name, figures in variants.items()]
    text = [f"== {result.get('benchmark')} ({result.get('machine', '')})",
            format_table(lines)]
    for name, value in result.get("ratios", {}).items():
        text.append(f"  {name}: {_cell(value)}")
    goals = result.get("goals", [])
    if goals:
        rows = [["goal", "value", "target", "met"]]
        rows += [[g["goal"], "-" if g["value"] is None else _cell(float(g["value"])),
                  g["target"], verdict(g)] for g in goals]
        text.append(format_table(rows))
    if result.get("notes"):
        text.append(f"  notes: {result['notes']}")
    return "\n".join(text)
