"""``overlapkit demo``: what a newcomer runs first."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from overlapkit.cli.demo import (
    TECHNIQUES,
    DemoConfig,
    format_table,
    parse_techniques,
    plot,
    run_demo,
)
from overlapkit.cli.demo.model import MODEL_SIZES
from overlapkit.launch import under_torchrun


def run(args: argparse.Namespace) -> int:
    """Run the demo and print its table (or JSON)."""
    cfg = DemoConfig(
        techniques=parse_techniques(args.technique), steps=args.steps,
        world_size=args.world_size, model_size=args.model_size, port=args.port,
        checkpoint_dir=args.checkpoint_dir,
        progress=not args.json,
    )
    if not args.json and not under_torchrun():
        size = cfg.size
        print(f"overlapkit demo: {size.parameters / 1e6:.2f}M-parameter MLP, "
              f"{cfg.world_size} CPU ranks (gloo), {cfg.steps} steps per technique",
              file=sys.stderr)
    rows = run_demo(cfg)
    if rows is None:  # a torchrun rank other than 0: rank 0 reports
        return 0
    if args.plot:
        plot(rows, Path(args.plot))
    if args.json:
        json.dump([r.to_json() for r in rows], sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_table(rows))
        if under_torchrun():
            print("  under torchrun every technique runs in the same processes: peak RSS "
                  "is each rank's high-water mark so far.")
        if args.plot:
            print(f"\nplot: {args.plot}")
    return 0


def register(commands: Any) -> None:
    techniques = ", ".join(TECHNIQUES)
    parser = commands.add_parser(
        "demo", help="train a small model with every technique and compare them",
        description="Train a small MLP on synthetic data on CPU ranks with plain DDP and "
        "each overlapkit technique, then save and reload a checkpoint at another world "
        "size. Under torchrun (`torchrun --nproc-per-node 2 -m overlapkit demo`) it uses "
        "torchrun's ranks; otherwise it spawns its own.",
    )
    parser.add_argument("--steps", type=int, default=40, help="training steps per technique")
    parser.add_argument("--world-size", type=int, default=2, help="local ranks to spawn")
    parser.add_argument("--model-size", default="small", choices=list(MODEL_SIZES),
                        help="MLP size preset")
    parser.add_argument("--technique", default="all",
                        help=f"'all' or a comma-separated list of: {techniques}")
    parser.add_argument("--port", type=int, default=None,
                        help="rendezvous port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--checkpoint-dir", metavar="DIR", default=None,
                        help="where the checkpoint technique saves (default: a temporary "
                        "directory; on several nodes, pass one they all share)")
    parser.add_argument("--plot", metavar="FILE.png", help="draw loss curves and step times")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.set_defaults(func=run)
