"""Benchmarks, one module per technique, each with ``run_benchmark(...) -> dict``, and the
harness they share.

``overlapkit bench`` (:mod:`overlapkit.cli.bench.runner`) runs them; the scripts in the
repository's ``benchmarks/`` folder run one each. Every result is a JSON-serialisable
dict: ``{"benchmark", "command", "variants": {variant: {metric: value}}, "ratios",
"goals", "notes"}``. One spelling throughout: times ``step_ms`` (``load_s`` for a
checkpoint load), memory in MiB (``peak_rss_mib``, ``..._mib``); each goal a record of
:func:`goal`, which ``overlapkit bench`` shows with a met/missed column.

The harness (a benchmark module fills in its variants, sizes and goals, and uses these):

- :mod:`~overlapkit.cli.bench.timing`: the seeded MLP, interleaved timed rounds in a
  rotating order (``timed_rounds``), and ``paired_ratio`` (ours / a peer, per round);
- :mod:`~overlapkit.cli.bench.goals`: ``goal(...)`` and its verdict; a goal a
  ``--quick`` run cannot measure is built with ``judged=not quick``;
- :mod:`~overlapkit.cli.bench.tables`: ``format_result``, the table of a result;
- :mod:`overlapkit.cli.memory`: peak RSS per rank, ``fix_mmap_threshold``;
- :mod:`~overlapkit.cli.bench.link`: a simulated network link, as a DDP comm hook
  (``network_bound``'s: every variant's buckets complete as over a slower link);
- :mod:`~overlapkit.cli.bench.runner`: the registry (``BENCHMARKS``), running them in
  turn, the plot.

A benchmark imports the harness and never another benchmark
(``tests/test_bench_imports.py`` checks the import graph).

Adding a benchmark (``network_bound`` was added so):

1. write ``overlapkit/cli/bench/network_bound.py`` with
   ``run_benchmark(*, rounds, world_size=2, quick=False, **options) -> dict`` returning
   the dict above (``quick``: small sizes; its goals built with ``judged=not quick``
   unless a quick run measures them exactly; an optional ``"plot"`` entry, ``{"x",
   "y", "xs", "series"}``, is drawn as lines by ``--plot``);
2. register it in one place: a line ``"network_bound": "overlapkit.cli.bench.network_bound"``
   in :data:`~overlapkit.cli.bench.runner.BENCHMARKS` (and its name in ``GPU_BENCHMARKS``
   if it runs with ``--device cuda``); ``--only``, ``--help``, ``--json`` and the tables
   follow;
3. add its expected variants to ``tests/test_bench_cli.py`` and a section to
   ``docs/benchmarks.md``.
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
