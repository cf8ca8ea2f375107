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

from overlapkit.cli.bench.goals import goal

__all__ = ["goal", "torchscript_warnings_silenced"]


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
