"""Checkpoint load time and peak RSS: overlapkit.checkpoint.load vs torch's DCP path.

    python benchmarks/checkpoint.py [--rounds 5] [--world-size 4] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json

from overlapkit.cli.bench.checkpoint import run_benchmark


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="a small checkpoint")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    result = run_benchmark(rounds=args.rounds, world_size=args.world_size, quick=args.quick)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['checkpoint_mb']} MB checkpoint, {result['resharding']}, "
          f"{args.rounds} rounds")
    print(f"{'variant':<12}{'load s':>10}{'peak RSS MB':>14}{'local shard MB':>16}"
          f"{'peak/shard':>12}")
    for name, m in result["variants"].items():
        print(f"{name:<12}{m['load_s']:>10.3f}{m['peak_rss_above_baseline_mb']:>14.1f}"
              f"{m['local_shard_mb']:>16.1f}{m['peak_over_local_shard']:>12.3f}")
    for name, value in result["ratios"].items():
        print(f"{name}: {value}")


if __name__ == "__main__":
    main()
