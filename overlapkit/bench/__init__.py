"""Benchmarks, one module per technique, each exposing ``run_benchmark(...) -> dict``.

Performance is measured here, never in timed tests: medians of interleaved rounds,
peak RSS per rank, and ratios against PyTorch's own implementation in the same run.
"""
