"""Benchmarks, one module per technique, each exposing ``run_benchmark(*, rounds,
world_size, quick, **options) -> dict`` (see docs/benchmarks.md)."""
