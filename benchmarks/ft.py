"""Fault tolerance on torchft: the cost per step of the quorum, the seconds from a kill
to the survivor's next averaging, and a restarted replica group's rejoin.

    python benchmarks/ft.py [--runs 3] [--syncs 20] [--json]

Needs the ``ft`` extra (torchft 0.2.0). Each run is tests/ft/ft_scenarios.py's: a
Lighthouse in this process (heartbeat timeout 1 s), two replica groups of one process
(gloo, a small MLP, period 3), forked from a server that imported torch and torchft
once. Not an ``overlapkit bench`` entry: it needs torchft and tests/ft's runner. The
figures in docs/fault_tolerance.rst come from here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "ft"))

from ft_scenarios import KILLED_IN_ROUND, PERIOD, Scenario, next_averaging, run


def _step_times(result: dict[str, Any]) -> tuple[list[float], list[float]]:
    """(averaging steps, local steps) durations in seconds of one replica."""
    syncs = {began for _, began, _ in result["timings"]["syncs"]}
    averaging, local = [], []
    for began, ended in result["timings"]["steps"]:
        (averaging if began in syncs else local).append(ended - began)
    return averaging, local


def _ms(values: list[float]) -> float:
    return round(1000 * statistics.median(values), 2)


def measure(runs: int, syncs: int) -> dict[str, Any]:
    figures: dict[str, Any] = {"period": PERIOD, "syncs": syncs, "runs": runs,
                               "averaging_step_ms": {}, "local_step_ms": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for impl in ("plain", "overlapkit", "torchft"):
            averaging, local = [], []
            for i in range(runs):
                result = run(Scenario(impl=impl, syncs=syncs), Path(scratch, f"{impl}{i}"))
                for label in ("0", "1"):
                    a, loc = _step_times(result[label])
                    averaging += a[1:]  # the first includes both groups' start-up
                    local += loc
            figures["averaging_step_ms"][impl] = _ms(averaging)
            figures["local_step_ms"][impl] = _ms(local)
        kill_to_step, rejoin, recovery = [], [], []
        for i in range(runs):
            result = run(Scenario(impl="overlapkit", failure="kill", syncs=syncs),
                         Path(scratch, f"kill{i}"))
            killed_at = result["killed_at"]
            kill_to_step.append(next_averaging(result["0"], KILLED_IN_ROUND) - killed_at)
            back = result["1b"]["timings"]
            _, healed_began, healed_ended = back["syncs"][0]
            rejoin.append(healed_ended - back["started"])
            recovery.append(healed_ended - healed_began)
    figures["kill_to_next_averaging_s"] = [round(v, 2) for v in kill_to_step]
    figures["restart_to_first_commit_s"] = [round(v, 2) for v in rejoin]
    figures["recovering_averaging_step_ms"] = [round(1000 * v, 1) for v in recovery]
    overhead = figures["averaging_step_ms"]["overlapkit"] - figures["averaging_step_ms"]["plain"]
    figures["quorum_cost_per_step_ms"] = round(overhead / PERIOD, 2)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--syncs", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="print the raw figures")
    args = parser.parse_args()
    figures = measure(args.runs, args.syncs)
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    print(f"period {PERIOD}, {args.syncs} averagings per run, {args.runs} runs, medians:")
    for impl in ("plain", "overlapkit", "torchft"):
        print(f"  {impl:10s} averaging step {figures['averaging_step_ms'][impl]:7.2f} ms, "
              f"local step {figures['local_step_ms'][impl]:6.2f} ms")
    print(f"  quorum cost per step (overlapkit - plain, / period): "
          f"{figures['quorum_cost_per_step_ms']} ms")
    print(f"  kill -> survivor's next averaging: {figures['kill_to_next_averaging_s']} s")
    print(f"  restart -> first committed averaging: {figures['restart_to_first_commit_s']} s")
    print(f"  the recovering averaging step: {figures['recovering_averaging_step_ms']} ms")


if __name__ == "__main__":
    main()
