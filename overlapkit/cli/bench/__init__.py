"""Benchmarks, one module per technique, each with ``run_benchmark(...) -> dict``.

``overlapkit bench`` (:mod:`overlapkit.cli.bench.runner`) runs them; the scripts in the
repository's ``benchmarks/`` folder run one each. Every result is a JSON-serialisable
dict: ``{"benchmark", "command", "variants": {variant: {metric: value}}, "ratios",
"goals", "notes"}``. One spelling throughout: times ``step_ms`` (``load_s`` for a
checkpoint load), memory in MiB (``peak_rss_mib``, ``..._mib``); each goal a record of
:func:`goal`, which ``overlapkit bench`` shows with a met/missed column.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["goal", "torchscript_warnings_silenced"]


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


@contextmanager
def torchscript_warnings_silenced() -> Iterator[None]:
    """Drop torch's TorchScript ``DeprecationWarning`` while a benchmark builds torch's
    own implementation (the functional optimizers behind ``_register_fused_optim`` and
    ``_apply_optimizer_in_backward``); every other warning is re-issued.

    ``warnings.simplefilter("ignore")`` is not enough: torch warns inside its own
    ``catch_warnings`` with ``simplefilter("always")``; recording catches it anyway.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        text = str(w.message)
        if issubclass(w.category, DeprecationWarning) and (
                "TorchScript" in text or "torch.jit" in text):
            continue
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
