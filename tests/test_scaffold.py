"""``overlapkit new-plugin``: each kind writes a package that pip installs (a real build)
and whose own tests — the conformance checks — pass right away; installed, it is listed
by ``overlapkit plugins`` under its entry point."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from plugin_dists import plugins_json

from overlapkit.cli import main
from overlapkit.plugin.scaffold import KINDS


@pytest.mark.parametrize("kind", KINDS)
def test_the_generated_package_installs_and_passes_its_tests(tmp_path: Path, kind: str) -> None:
    name = f"demo_{kind.replace('-', '_')}"
    package = tmp_path / "pkg"
    assert main(["new-plugin", name, "--kind", kind, "--dir", str(package)]) == 0
    for needed in ("pyproject.toml", "tox.ini", f"src/overlapkit_{name}/plugin.py",
                   f"tests/test_{name}.py"):
        assert (package / needed).is_file(), needed
    site = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(site), str(package)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=package,
        env={**_env(), "PYTHONPATH": str(site)}, capture_output=True, text=True, timeout=300)
    assert tests.returncode == 0, tests.stdout + tests.stderr
    assert "1 passed" in tests.stdout
    listed = {p["name"]: p for p in plugins_json(site)}
    assert listed[name]["distribution"] == f"overlapkit-{name.replace('_', '-')}"


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("OVERLAPKIT_")}


def test_a_bad_name_is_one_clear_line(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["new-plugin", "9lives", "--dir", str(tmp_path / "x")]) == 2
    assert "must be a word of lower-case letters" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_an_existing_folder_is_not_overwritten(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["new-plugin", "mine", "--dir", str(tmp_path)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert (tmp_path / "keep.txt").read_text() == "mine"
