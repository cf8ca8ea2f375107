"""The ``overlapkit`` command line.

Subcommands live in :mod:`overlapkit.cli.commands`, one module each. Errors overlapkit
raises on purpose are printed as one line (``overlapkit: error: ...``) with exit
status 2, never as a traceback; Ctrl-C exits with 130.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from overlapkit.cli.commands import COMMAND_MODULES
from overlapkit.errors import OverlapkitError
from overlapkit.launch import exit_torchrun_rank

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="overlapkit",
        description="Overlapped optimizers, optimizer in backward, post-local SGD and "
        "sharded optimizer-state checkpoints for PyTorch distributed training.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(f"overlapkit.cli.commands.{name}").register(commands)
    return parser


def _version() -> str:
    from overlapkit import __version__

    return str(__version__)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status = int(args.func(args))
    except OverlapkitError as exc:
        print(f"overlapkit: error: {exc}", file=sys.stderr)
        status = 2
    except KeyboardInterrupt:
        print("overlapkit: interrupted", file=sys.stderr)
        return 130
    exit_torchrun_rank(status)  # under torchrun, after a command that used the group
    return status
