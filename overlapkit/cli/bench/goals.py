"""The goals of a benchmark: what a figure should reach, and whether this run reached it.

A ``--quick`` run trains tiny models for one round: a peak-memory saving, a load-time
ratio or a step-time ratio measured there says nothing about the full sizes the goal
is about. Such a goal is built with ``judged=False`` in quick mode: its figure is shown
and no verdict is given (:data:`NOT_JUDGED_QUICK`). A goal on an exact count (bytes
handed to collectives) holds at any size and is judged in quick mode too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["NOT_JUDGED_QUICK", "goal", "goal_counts"]

#: what a goal a ``--quick`` run cannot measure says instead of met/MISSED
NOT_JUDGED_QUICK = "not judged in --quick: needs the full sizes"


def goal(name: str, value: float | None, *, at_most: float | None = None,
         at_least: float | None = None, judged: bool = True) -> dict[str, Any]:
    """One goal of a benchmark and whether this run met it (``None``: not measured).

    :param name: what is compared, e.g. ``"mlp: overlapkit / torch_fused step time"``.
    :param at_most: the goal is ``value <= at_most``; ``at_least``: ``value >= at_least``.
    :param judged: ``False`` where this run cannot measure what the goal is about (a
        ``--quick`` run's sizes): ``met`` is ``None`` and ``not_judged`` says why.
    """
    if at_most is not None and at_least is None:
        target, met = f"<= {at_most:g}", None if value is None else value <= at_most
    elif at_least is not None and at_most is None:
        target, met = f">= {at_least:g}", None if value is None else value >= at_least
    else:
        raise ValueError("give exactly one of at_most and at_least")
    if not judged:
        return {"goal": name, "value": value, "target": target, "met": None,
                "not_judged": NOT_JUDGED_QUICK}
    return {"goal": name, "value": value, "target": target, "met": met}


def verdict(record: dict[str, Any]) -> str:
    """The met column of a goal: met, MISSED, not measured, or why it is not judged."""
    if record.get("not_judged"):
        return str(record["not_judged"])
    met = record["met"]
    return "not measured" if met is None else "met" if met else "MISSED"


def goal_counts(results: Sequence[dict[str, Any]]) -> dict[str, int]:
    """How many goals of ``results`` were met, missed, not judged (``--quick``) and not
    measured."""
    goals = [g for r in results for g in r.get("goals", [])]
    not_judged = sum(bool(g.get("not_judged")) for g in goals)
    met = sum(g["met"] is True for g in goals)
    missed = sum(g["met"] is False for g in goals)
    return {"met": met, "missed": missed, "not_judged": not_judged,
            "not_measured": len(goals) - met - missed - not_judged}
