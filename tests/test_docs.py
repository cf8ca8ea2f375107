"""Every hook specification is documented, in its docstring and in the docs."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from overlapkit.plugin import hookspecs

DOCS = Path(__file__).parent.parent / "docs"
HOOKS = sorted(name for name in dir(hookspecs) if name.startswith("overlapkit_"))


def test_there_are_four_hooks() -> None:
    assert HOOKS == [
        "overlapkit_register_averagers",
        "overlapkit_register_comm_hooks",
        "overlapkit_register_load_planners",
        "overlapkit_register_optimizers",
    ]


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_docstring_says_when_and_what_it_returns(hook: str) -> None:
    doc = inspect.getdoc(getattr(hookspecs, hook)) or ""
    assert "Called" in doc, f"{hook}'s docstring does not say when it is called"
    assert ":return:" in doc, f"{hook}'s docstring does not say what it returns"


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_in_the_hook_reference(hook: str) -> None:
    reference = (DOCS / "hooks.rst").read_text()
    assert f".. autofunction:: overlapkit.plugin.hookspecs.{hook}" in reference
