"""The benchmarks share one harness and never import each other: no import circle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import in_a_circle

import overlapkit.cli.bench
from overlapkit.cli.bench.runner import BENCHMARKS

PACKAGE = "overlapkit.cli.bench"
FOLDER = Path(overlapkit.cli.bench.__file__).parent


def _imports(path: Path) -> set[str]:
    """The ``overlapkit.cli.bench`` modules ``path`` imports, at the top or inside a
    function (a lazy import closes a circle too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n for n in names if n.startswith(PACKAGE + ".")
                  and (FOLDER / f"{n.rsplit('.', 1)[1]}.py").exists()}
    return found


def _graph() -> dict[str, set[str]]:
    return {f"{PACKAGE}.{p.stem}": _imports(p) for p in FOLDER.glob("*.py")
            if p.stem != "__init__"}


def test_no_benchmark_imports_another_benchmark() -> None:
    graph = _graph()
    crossing = {(m, i) for m in BENCHMARKS.values() for i in graph[m]
                if i in BENCHMARKS.values()}
    assert crossing == set()


def test_the_bench_modules_import_no_circle() -> None:
    assert in_a_circle(_graph()) == []


@pytest.mark.parametrize("module", sorted(BENCHMARKS.values()))
def test_each_benchmark_imports_alone_in_a_fresh_interpreter(module: str) -> None:
    proc = subprocess.run([sys.executable, "-c", f"import {module}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
