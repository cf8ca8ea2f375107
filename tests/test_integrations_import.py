"""``overlapkit.integrations`` imports no framework until one of its modules is imported,
and an integration whose framework is missing raises ``MissingDependencyError`` naming the
extra to install (the frameworks themselves are tested in the ``trainers`` tox
environment, ``tests/trainers``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import overlapkit
from overlapkit.integrations.requirements import UntestedVersionWarning, require


def test_importing_overlapkit_and_its_integrations_imports_no_framework() -> None:
    code = ("import sys, overlapkit, overlapkit.integrations\n"
            "found = [m for m in ('transformers', 'accelerate', 'torch') if m in sys.modules]\n"
            "assert not found, found\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_missing_framework_names_the_extra_to_install() -> None:
    with pytest.raises(overlapkit.MissingDependencyError,
                       match=r"pip install 'overlapkit\[transformers\]'") as info:
        require("no_such_framework_installed", "transformers", "5.24.0")
    assert isinstance(info.value, ImportError)


def test_another_version_than_the_tested_one_warns() -> None:
    with pytest.warns(UntestedVersionWarning, match="tested with pluggy==0.0.1"):
        require("pluggy", "pluggy-extra", "0.0.1")
