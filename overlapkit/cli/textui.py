"""Small pieces the command-line jobs share: text tables, name lists, plotting."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from overlapkit.errors import ConfigurationError

__all__ = ["format_table", "parse_names", "pyplot"]


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
