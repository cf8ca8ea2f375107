"""Small pieces the command-line jobs share: text tables, name lists, plotting."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from overlapkit.errors import ConfigurationError

__all__ = ["DefaultsHelpFormatter", "check_plot_target", "format_table", "parse_names",
           "pyplot"]


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """``--help`` shows each option's default, except where there is none (``None``,
    a flag's ``False``) or the help already says it (``default:``)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (action.default in (None, False, argparse.SUPPRESS) or "default" in text
                or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"


def format_table(rows: Sequence[Sequence[str]], *, rule: bool = False) -> str:
    """Left-aligned columns two spaces apart; the last column is not padded.

    :param rows: the header first, then one row per line.
    :param rule: draw a line of dashes under the header.
    """
    columns = len(rows[0])
    widths = [max(len(row[c]) for row in rows) for c in range(columns - 1)]
    lines = []
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    if rule:
        last = max(len(row[-1]) for row in rows)
        lines.insert(1, "  ".join("-" * w for w in [*widths, last]))
    return "\n".join(lines)


def parse_names(text: str, valid: Sequence[str], kind: str) -> list[str]:
    """``"all"`` or a comma-separated list of ``valid`` names (``-`` read as ``_``).

    :raises ConfigurationError: a name is not valid, or the list is empty.
    """
    if text.strip() == "all":
        return list(valid)
    names = [part.strip().replace("-", "_") for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in valid]
    if unknown or not names:
        raise ConfigurationError(
            f"unknown {kind} {', '.join(map(repr, unknown)) or repr(text)}; choose 'all' "
            f"or a comma-separated list of: {', '.join(valid)}."
        )
    return names


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend, or a ConfigurationError
    saying how to install it (it is the optional ``plot`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigurationError(
            "--plot needs matplotlib, which is not installed; run "
            "`pip install 'overlapkit[plot]'` or leave out --plot."
        ) from None
    return plt


def check_plot_target(path: str) -> Path:
    """Check, before any work, that ``--plot PATH`` can be drawn and written: matplotlib
    is installed, the format is one it writes, and the file can be created. Raises a
    ConfigurationError naming what to fix; leaves no file behind.

    A long demo or benchmark run that only finds out at the end would lose its table.
    """
    plt = pyplot()
    target = Path(path)
    if target.is_dir():
        raise ConfigurationError(f"--plot {path} is a directory; pass a file name.")
    formats = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    suffix = target.suffix.lstrip(".").lower()
    if suffix not in formats:
        raise ConfigurationError(
            f"--plot {path}: {'no' if not suffix else repr(suffix)} file format; end the "
            f"name with one of: {', '.join('.' + f for f in sorted(formats))} (e.g. .png)."
        )
    existed = target.exists()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("ab"):
            pass
    except OSError as exc:
        raise ConfigurationError(
            f"--plot {path} cannot be written ({exc.strerror}); pass a file in a "
            "directory you can write to."
        ) from None
    if not existed:
        target.unlink()
    return target
