"""The availability check every integration module runs when it is imported."""

from __future__ import annotations

import importlib.util
import warnings
from importlib.metadata import PackageNotFoundError, version

from overlapkit.errors import MissingDependencyError

__all__ = ["UntestedVersionWarning", "require"]


class UntestedVersionWarning(UserWarning):
    """The framework installed is not the version the integration was tested with."""


def require(package: str, extra: str, tested: str) -> None:
    """Check that ``package`` is installed, for the integration of the ``extra`` extra.

    :param tested: the version the extra pins: another one gets an
        :class:`UntestedVersionWarning` (the integration follows what that version's
        trainer loop does; parity with the plain run is tested on it only).
    :raises MissingDependencyError: ``package`` is not installed.
    """
    if importlib.util.find_spec(package) is None:
        raise MissingDependencyError(
            f"overlapkit.integrations.{extra} needs {package}, which is not installed; "
            f"install it with overlapkit's extra: pip install 'overlapkit[{extra}]' "
            f"({package}=={tested}, the version it is tested with)."
        )
    try:
        installed = version(package)
    except PackageNotFoundError:  # importable, but without metadata (a source tree)
        return
    if installed != tested:
        warnings.warn(
            f"overlapkit.integrations.{extra} is tested with {package}=={tested}, and "
            f"{package} {installed} is installed: parity with the plain run is tested "
            f"on {tested} only (pip install 'overlapkit[{extra}]' installs it).",
            UntestedVersionWarning, stacklevel=3)
