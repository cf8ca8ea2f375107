"""``overlapkit checkpoint inspect PATH [--json]``: what a checkpoint holds.

Reads only the checkpoint's metadata (safely: no arbitrary unpickling), never its
tensor data, so it is instant on a checkpoint of any size.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from overlapkit.cli.textui import format_table


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


def _sharding(chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]) -> str:
    if len(chunks) <= 1:
        return "whole" if chunks else "-"
    offsets = ", ".join(
        "[" + ",".join(str(o) for o in off) + "]" for off, _ in chunks[:4]
    )
    more = ", ..." if len(chunks) > 4 else ""
    return f"{len(chunks)} chunks at {offsets}{more}"


def inspect_command(args: argparse.Namespace) -> int:
    """Print the checkpoint's entries (or JSON)."""
    from overlapkit.checkpoint import inspect

    info = inspect(args.path)
    status = 1 if info.integrity == "damaged" else 0
    if args.json:
        json.dump(info.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return status
    print(f"{info.path}: {len(info.tensors)} tensors, "
          f"{len(info.entries) - len(info.tensors)} values, "
          f"{_human(info.size_on_disk)} on disk in {info.files} files "
          f"(DCP {info.dcp_version or 'unknown'})")
    rows = [("key", "shape", "dtype", "stored", "sharding")]
    for e in info.entries:
        if e.kind == "tensor":
            shape = "(" + ", ".join(str(s) for s in e.shape) + ")"
            rows.append((e.key, shape, e.dtype.removeprefix("torch."), _human(e.stored_bytes),
                         _sharding(e.chunks)))
        else:
            rows.append((e.key, "-", "value", _human(e.stored_bytes), "-"))
    print(format_table(rows))
    if info.integrity == "damaged":
        print(f"DAMAGED: {info.problem}", file=sys.stderr)
    elif info.integrity == "unverified":
        print("files: no file list (an older or torch-written checkpoint): only their "
              "lengths were checked")
    else:
        print("files: verified (every size and CRC-32 as recorded at save)")
    return status


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "checkpoint", help="work with sharded checkpoints",
        description="Work with sharded (DCP) checkpoints written by "
        "overlapkit.checkpoint.save or torch.distributed.checkpoint.")
    sub = parser.add_subparsers(dest="checkpoint_command", metavar="SUBCOMMAND",
                                required=True)
    inspect = sub.add_parser(
        "inspect", help="tensors, shapes, dtypes, sharding and size of a DCP checkpoint",
        description="Print what a DCP checkpoint holds: tensors, shapes, dtypes, "
        "sharding and size, from its metadata alone (no tensor data is read).")
    inspect.add_argument("path", metavar="PATH", help="the checkpoint directory")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.set_defaults(func=inspect_command)
