"""The goals of a benchmark: what a figure should reach, and whether this run reached it."""

from __future__ import annotations

from typing import Any

__all__ = ["goal"]


def goal(name: str, value: float | None, *, at_most: float | None = None,
         at_least: float | None = None) -> dict[str, Any]:
    """One goal of a benchmark and whether this run met it (``None``: not measured).

    :param name: what is compared, e.g. ``"mlp: overlapkit / torch_fused step time"``.
    :param at_most: the goal is ``value <= at_most``; ``at_least``: ``value >= at_least``.
    """
    if at_most is not None and at_least is None:
        target, met = f"<= {at_most:g}", None if value is None else value <= at_most
    elif at_least is not None and at_most is None:
        target, met = f">= {at_least:g}", None if value is None else value >= at_least
    else:
        raise ValueError("give exactly one of at_most and at_least")
    return {"goal": name, "value": value, "target": target, "met": met}
