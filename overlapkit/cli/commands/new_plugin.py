"""``overlapkit new-plugin NAME [--kind optimizer|averager|comm-hook] [--dir DIR]``:
write a complete, installable plugin package that passes its own tests."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from overlapkit.cli.textui import DefaultsHelpFormatter
from overlapkit.plugin.scaffold import KINDS, write_plugin


def run(args: argparse.Namespace) -> int:
    directory = Path(args.dir or f"overlapkit-{args.name.replace('_', '-')}")
    written = write_plugin(directory, args.name, args.kind)
    for path in written:
        print(path)
    print(f"\nNext: cd {directory} && python -m pip install -e '.[test]' && python -m pytest "
          "(or: tox). 'overlapkit plugins' lists it once installed.")
    return 0


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "new-plugin", help="write a new plugin package that passes its own tests",
        description="Write a complete, installable overlapkit plugin package: pyproject "
        "with the entry point, a minimal working implementation, a test that calls the "
        "conformance checks of overlapkit.testing, and a tox.ini.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("name", help="the plugin's name, e.g. my_sgd")
    parser.add_argument("--kind", choices=KINDS, default="optimizer",
                        help="what the plugin provides (default: %(default)s)")
    parser.add_argument("--dir", default=None,
                        help="where to write it (default: ./overlapkit-NAME)")
    parser.set_defaults(func=run)
