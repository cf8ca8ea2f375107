"""``overlapkit demo``: what a newcomer runs first.

Every argument is checked before a rank starts (techniques, sizes, ports, the
checkpoint directory, the plot's file and matplotlib), and torch is imported only
once they pass: a mistake costs a second, not a training run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from overlapkit.cli.demo.config import MODEL_SIZES, TECHNIQUES, DemoConfig, parse_techniques
from overlapkit.cli.textui import DefaultsHelpFormatter, check_plot_target
from overlapkit.launch import under_torchrun


def run(args: argparse.Namespace) -> int:
    """Run the demo and print its table (or JSON)."""
    cfg = DemoConfig(
        techniques=parse_techniques(args.technique), steps=args.steps,
        world_size=args.world_size, model_size=args.model_size, port=args.port,
        checkpoint_dir=args.checkpoint_dir,
        progress=not args.json,
    )
    plot_path = check_plot_target(args.plot) if args.plot else None
    reporting = not under_torchrun() or os.environ.get("RANK") == "0"
    if not args.json and reporting:
        print(f"overlapkit demo: {cfg.describe()}", file=sys.stderr, flush=True)

    from overlapkit.cli.demo.report import format_table
    from overlapkit.cli.demo.run import run_demo

    rows = run_demo(cfg)
    if rows is None:  # a torchrun rank other than 0: rank 0 reports
        return 0
    if args.json:
        json.dump([r.to_json() for r in rows], sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_table(rows))
        if under_torchrun():
            print("  under torchrun every technique runs in the same processes: peak RSS "
                  "is each rank's high-water mark so far.")
    if plot_path is not None:
        from overlapkit.cli.demo.figure import plot

        plot(rows, cfg, plot_path)
        print(f"plot: {plot_path}", file=sys.stderr if args.json else sys.stdout)
    return 0


def register(commands: Any) -> None:
    techniques = ", ".join(TECHNIQUES)
    parser = commands.add_parser(
        "demo", help="train a small model with every technique and compare them",
        description="Train a small MLP on synthetic data on CPU ranks with plain DDP and "
        "each overlapkit technique, then save a checkpoint and reload it at another world "
        "size. Under torchrun (`torchrun --nproc-per-node 2 -m overlapkit demo`) it uses "
        "torchrun's ranks (and reloads at the same world size, which torchrun fixes); "
        "otherwise it spawns its own.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=40, help="training steps per technique")
    parser.add_argument("--world-size", type=int, default=2,
                        help="local ranks to spawn (under torchrun: torchrun's)")
    parser.add_argument("--model-size", default="small", choices=list(MODEL_SIZES),
                        help="MLP size preset")
    parser.add_argument("--technique", default="all",
                        help=f"'all' or a comma-separated list of: {techniques}")
    parser.add_argument("--port", type=int, default=None,
                        help="rendezvous port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--checkpoint-dir", metavar="DIR", default=None,
                        help="where the checkpoint technique saves, created if missing "
                        "(default: a temporary directory; on several nodes, pass one they "
                        "all share)")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="draw loss curves and step times (needs matplotlib: "
                        "pip install 'overlapkit[plot]')")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.set_defaults(func=run)
