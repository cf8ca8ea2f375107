"""Benchmarks, one module per technique, each exposing ``run_benchmark(...) -> dict``."""
