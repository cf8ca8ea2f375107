"""``overlapkit bench``: the technique benchmarks behind one command."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from overlapkit.cli.bench.runner import (
    available_benchmarks,
    format_result,
    parse_benchmarks,
    plot_results,
    run_benchmarks,
)


def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmarks and print tables (or JSON)."""
    names = parse_benchmarks(args.only)
    results = run_benchmarks(names, rounds=args.rounds, world_size=args.world_size,
                             quick=args.quick)
    if args.plot:
        plot_results(results, Path(args.plot))
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print("\n\n".join(format_result(r) for r in results))
    return 1 if any("error" in r for r in results) else 0


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "bench", help="benchmark each technique against torch's own and plain training",
        description="Run the technique benchmarks: variants interleaved in one run, "
        "medians of several rounds, ratios ours / torch's own / plain.",
    )
    parser.add_argument("--only", default="all",
                        help="'all' or a comma-separated list of: "
                        + (", ".join(available_benchmarks()) or "(none installed)"))
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per variant")
    parser.add_argument("--world-size", type=int, default=None,
                        help="local ranks to spawn (default: each benchmark's own: 2, and "
                        "2 -> 4 for the checkpoint reshard)")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the figures")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=run)
