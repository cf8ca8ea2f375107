"""Packaging metadata that setuptools accepts without a deprecation warning: an SPDX
``license`` string with its ``license-files`` (a ``{ text = ... }`` table warns on
every build and stops building after 2027-02-18), in the package, both plugins and
the plugin scaffold."""

from __future__ import annotations

from pathlib import Path

import pytest

from overlapkit.plugin.scaffold import _pyproject

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
PYPROJECTS = [ROOT / "pyproject.toml", *sorted((ROOT / "plugins").glob("*/pyproject.toml"))]


@pytest.mark.parametrize("path", PYPROJECTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_license_is_an_spdx_expression_with_its_file(path: Path) -> None:
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    project = data["project"]
    assert project["license"] == "BSD-3-Clause"
    assert project["license-files"] == ["LICENSE"]
    assert (path.parent / "LICENSE").read_text(encoding="utf-8").startswith("BSD 3-Clause")
    assert data["build-system"]["requires"] == ["setuptools>=77"]  # PEP 639 support


def test_torch_is_pinned_exactly_everywhere() -> None:
    for path in PYPROJECTS:
        deps = tomllib.loads(path.read_text(encoding="utf-8"))["project"]["dependencies"]
        assert [d for d in deps if d.startswith("torch")] == ["torch==2.13.0"], path
    tox = (ROOT / "tox.ini").read_text(encoding="utf-8")
    torch_lines = [line.strip() for line in tox.splitlines() if line.strip().startswith(
        ("torch", "deps = torch"))]
    assert torch_lines and all(line.endswith("torch==2.13.0") for line in torch_lines)


def test_the_scaffold_writes_an_spdx_license() -> None:
    data = tomllib.loads(_pyproject("my_sgd", "overlapkit_my_sgd", "optimizer"))
    assert data["project"]["license"] == "BSD-3-Clause"
    assert data["build-system"]["requires"] == ["setuptools>=77"]
