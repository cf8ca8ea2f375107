"""Benchmarks, one module per technique, each with ``run_benchmark(...) -> dict``.

``overlapkit bench`` (:mod:`overlapkit.cli.bench.runner`) runs them; the scripts in the
repository's ``benchmarks/`` folder run one each. Every result is a JSON-serialisable
dict: ``{"benchmark", "command", "variants": {variant: {metric: value}}, "ratios",
"notes"}``.
"""
