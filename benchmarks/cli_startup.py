"""How long `overlapkit --help`, `--version` and each command's `--help` take to answer
(goal: under 0.5 s; they import no torch), with `python -c "import torch"` beside them.

    python benchmarks/cli_startup.py [--runs 11] [--json]

Each command runs `--runs` times in a fresh process, one after another; the figure is
the median wall time, with the fastest and slowest run. The numbers are in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

GOAL_S = 0.5
COMMANDS = (["--help"], ["--version"], ["demo", "--help"], ["bench", "--help"],
            ["plugins", "--help"])


def _overlapkit() -> list[str]:
    """The console script users run, beside this interpreter (else ``-m overlapkit``)."""
    script = Path(sys.executable).with_name("overlapkit")
    return [str(script)] if script.exists() else [sys.executable, "-m", "overlapkit"]


def _times(argv: list[str], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=11, help="runs per command")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    rows = {}
    for command in COMMANDS:
        times = _times([*_overlapkit(), *command], args.runs)
        rows["overlapkit " + " ".join(command)] = times
    rows["python -c 'import torch' (for scale)"] = _times(
        [sys.executable, "-c", "import torch"], max(3, args.runs // 3))
    figures = {name: {"median_s": round(statistics.median(t), 3), "min_s": round(min(t), 3),
                      "max_s": round(max(t), 3), "runs": len(t)} for name, t in rows.items()}
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    width = max(map(len, figures))
    print(f"{'command':<{width}}  median s  min s  max s  goal < {GOAL_S} s")
    for name, f in figures.items():
        met = "" if "torch" in name else ("met" if f["median_s"] < GOAL_S else "MISSED")
        print(f"{name:<{width}}  {f['median_s']:>8.3f}  {f['min_s']:>5.3f}  {f['max_s']:>5.3f}"
              f"  {met}")
    print(f"({shutil.which('overlapkit') or _overlapkit()[0]}, Python "
          f"{sys.version.split()[0]})")


if __name__ == "__main__":
    main()
