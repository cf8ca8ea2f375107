"""The package layout stays what docs/design.rst describes: one concept per package,
a small top level, no module past ~400 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers import in_a_circle

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


# -- overlapkit.overlap by sub-concept (issue 32) ----------------------------------

OVERLAP = PACKAGE / "overlap"
OVERLAP_SUBPACKAGES = sorted(p.parent.name for p in OVERLAP.glob("*/__init__.py"))


def test_overlap_is_split_into_the_sub_concepts() -> None:
    assert OVERLAP_SUBPACKAGES == ["core", "ddp", "in_backward", "rules", "sharded"]


@pytest.mark.parametrize("package", OVERLAP_SUBPACKAGES)
def test_each_overlap_subpackage_says_what_it_owns(package: str) -> None:
    tree = ast.parse((OVERLAP / package / "__init__.py").read_text())
    doc = ast.get_docstring(tree) or ""
    modules = [p.stem for p in (OVERLAP / package).glob("*.py") if p.stem != "__init__"]
    unnamed = [m for m in modules if m not in doc]
    assert len(doc.split()) >= 20 and unnamed == [], (doc, unnamed)


@pytest.mark.parametrize("package", OVERLAP_SUBPACKAGES)
def test_design_page_names_every_module_of_each_overlap_subpackage(package: str) -> None:
    assert f"``overlapkit.overlap.{package}``" in DESIGN
    modules = [p.stem for p in (OVERLAP / package).glob("*.py") if p.stem != "__init__"]
    missing = [m for m in modules if f"``{m}``" not in DESIGN]
    assert missing == [], f"docs/design.rst does not name overlapkit.overlap.{package}: {missing}"


def _unit(module: str) -> str:
    """The sub-package (``core``, ...) or top-level module of overlapkit.overlap that
    ``module`` (``overlapkit.overlap.X...``) belongs to."""
    return module.split(".")[2]


def _overlap_imports() -> dict[str, set[str]]:
    """Sub-package or top-level module of overlapkit.overlap -> those it imports, at the
    top or inside a function (a lazy import closes a circle too); the package's own
    ``__init__`` (the public re-exports) left out."""
    graph: dict[str, set[str]] = {}
    for path in OVERLAP.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts == ("overlapkit", "overlap", "__init__"):
            continue
        here = _unit(".".join(parts))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if not name.startswith("overlapkit.overlap."):
                    continue
                there = _unit(name)
                if there != here and ((OVERLAP / there).is_dir()
                                      or (OVERLAP / f"{there}.py").exists()):
                    graph.setdefault(here, set()).add(there)
    return graph


def test_the_overlap_subpackages_import_no_circle() -> None:
    graph = _overlap_imports()
    assert in_a_circle(graph) == [], graph
    assert graph.get("core", set()) == set(), "the engine core imports no other part"
    assert graph.get("rules", set()) <= {"core"}
