"""The package layout stays what docs/design.rst describes: one concept per package,
a small top level, no module past ~400 lines."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "overlapkit"  # the source tree: tox runs the tests against an installed wheel
DESIGN = (ROOT / "docs" / "design.rst").read_text()
SUBPACKAGES = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))


def test_the_top_level_has_at_most_eight_modules() -> None:
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= 8, modules


def test_the_subpackages_are_the_concepts() -> None:
    assert SUBPACKAGES == ["checkpoint", "cli", "ft", "integrations", "local_sgd", "nodes",
                           "overlap", "plugin"]


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_design_page_names_every_module_of_each_package(package: str) -> None:
    assert f"``overlapkit.{package}``" in DESIGN
    modules = [p.stem for p in (PACKAGE / package).glob("*.py") if p.stem != "__init__"]
    missing = [m for m in modules if f"``{m}``" not in DESIGN]
    assert missing == [], f"docs/design.rst does not name overlapkit.{package}: {missing}"


def test_no_module_is_longer_than_400_lines() -> None:
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def test_each_technique_package_owns_its_builtin_plugin() -> None:
    from overlapkit.plugin.manager import BUILTIN_PLUGINS

    assert BUILTIN_PLUGINS == {
        "overlapkit.comm_hooks": "overlapkit.comm_hooks",
        "overlapkit.overlap": "overlapkit.overlap.plugin",
        "overlapkit.local_sgd": "overlapkit.local_sgd.plugin",
        "overlapkit.checkpoint": "overlapkit.checkpoint.plugin",
    }
