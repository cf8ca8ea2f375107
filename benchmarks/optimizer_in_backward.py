"""Run the optimizer-in-backward benchmark and print a table.

    python benchmarks/optimizer_in_backward.py [--quick] [--rounds N] [--json]
"""

from __future__ import annotations

import argparse
import json

from overlapkit.bench.optimizer_in_backward import run_benchmark


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, few steps")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the raw result")
    args = parser.parse_args()
    result = run_benchmark(rounds=args.rounds, quick=args.quick)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{'variant':<42} {'peak RSS MiB':>13} {'over base MiB':>14} {'step ms':>9}")
    for name, figures in result["variants"].items():
        print(f"{name:<42} {figures['peak_rss_mib']:>13.1f} "
              f"{figures['over_baseline_mib']:>14.1f} {figures['step_ms']:>9.1f}")
    for name, ratio in result["ratios"].items():
        print(f"{name}: {ratio:.3f}")
    print(result["notes"])


if __name__ == "__main__":
    main()
