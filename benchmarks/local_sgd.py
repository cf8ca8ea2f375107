"""Post-local SGD against plain DDP and torch's: bytes per step and step time
(`overlapkit bench --only post_local_sgd` with the period and subgroup size as options).

    python benchmarks/local_sgd.py [--rounds 5] [--world-size 2] [--period 4]
                                   [--subgroup-size 1] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json

from overlapkit.cli.bench.local_sgd import run_benchmark
from overlapkit.cli.bench.runner import format_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--period", type=int, default=4)
    parser.add_argument("--subgroup-size", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true", help="print the raw result")
    args = parser.parse_args()
    result = run_benchmark(rounds=args.rounds, world_size=args.world_size, quick=args.quick,
                           period=args.period, subgroup_size=args.subgroup_size)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(format_result(result))
    print("peak RSS MiB per rank:", [round(v) for v in result["peak_rss_mib_per_rank"]])

if __name__ == "__main__":
    main()
