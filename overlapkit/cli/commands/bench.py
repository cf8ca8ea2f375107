"""``overlapkit bench``: the technique benchmarks behind one command.

Arguments (names, rounds, world size, the plot's file and matplotlib) are checked
before any benchmark starts; torch is imported only then.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from overlapkit.cli.bench.goals import goal_counts
from overlapkit.cli.bench.runner import (
    ALIASES,
    GPU_BENCHMARKS,
    QUICK_ROUNDS,
    available_benchmarks,
    benchmarks_for_device,
    format_result,
    parse_benchmarks,
    plot_results,
    run_benchmarks,
)
from overlapkit.cli.textui import DefaultsHelpFormatter, check_plot_target


def _summary(results: list[dict[str, Any]], seconds: float, quick: bool) -> str:
    """The closing line. With ``--quick`` it counts the goals a quick run can judge and
    says that the others wait for a full run, so that a first run reads as what it is:
    a check that every variant runs."""
    counts = goal_counts(results)
    failed = sum("error" in r for r in results)
    failures = f"; {failed} FAILED" if failed else ""
    if not quick:
        # a full run also has goals it does not judge (GPT-2 on CPU: CUDA only) or
        # could not measure: counted, so that the line adds up to the table
        others = [f"{counts[key]} {label}" for key, label in
                  (("not_judged", "not judged"), ("not_measured", "not measured"))
                  if counts[key]]
        return (f"overlapkit bench: {len(results)} benchmarks in {seconds:.0f} s; goals: "
                + ", ".join([f"{counts['met']} met", f"{counts['missed']} missed", *others])
                + failures)
    judged = [f"{counts['met']} met"] + ([f"{counts['missed']} missed"]
                                          if counts["missed"] else [])
    return (f"overlapkit bench --quick: {len(results)} benchmarks ran every variant in "
            f"{seconds:.0f} s{failures}; goals: {', '.join(judged)}, "
            f"{counts['not_judged']} not judged (small sizes, one round: run without "
            "--quick to judge them)")


def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmarks and print tables (or JSON)."""
    names = benchmarks_for_device(parse_benchmarks(args.only), args.device,
                                  chosen=args.only != "all")
    plot_path = check_plot_target(args.plot) if args.plot else None
    started = time.monotonic()
    results = run_benchmarks(names, rounds=args.rounds, world_size=args.world_size,
                             quick=args.quick, device=args.device)
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print("\n\n".join(format_result(r) for r in results))
    if plot_path is not None:
        plot_results(results, plot_path)
        print(f"plot: {plot_path}", file=sys.stderr)
    print(_summary(results, time.monotonic() - started, args.quick), file=sys.stderr)
    return 1 if any("error" in r for r in results) else 0


def register(commands: Any) -> None:
    old = ", ".join(f"{old} for {new}" for old, new in ALIASES.items())
    parser = commands.add_parser(
        "bench", help="benchmark each technique against torch's own and plain training",
        description="Run the technique benchmarks: variants interleaved in one run, "
        "medians of several rounds, ratios ours / torch's own / plain, and each goal "
        "with whether this run met it. Memory is in MiB, times in ms (a checkpoint "
        "load in s).",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--only", default="all",
                        help="'all' or a comma-separated list of: "
                        + (", ".join(available_benchmarks()) or "(none installed)")
                        + f" (the names before 0.2 still work: {old})")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per variant")
    parser.add_argument("--world-size", type=int, default=None,
                        help="local ranks to spawn (default: each benchmark's own: 2, and "
                        "2 -> 4 for the checkpoint reshard)")
    parser.add_argument("--quick", action="store_true",
                        help=f"small sizes and {QUICK_ROUNDS} round: a smoke test of every "
                        "variant, not figures to quote; goals it cannot measure are shown, "
                        "not judged")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the ranks train: cpu (gloo) or cuda (NCCL, one GPU "
                        "per rank; the benchmarks with a GPU variant: "
                        + ", ".join(GPU_BENCHMARKS) + ")")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the figures (needs "
                        "matplotlib: pip install 'overlapkit[plot]')")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=run)
