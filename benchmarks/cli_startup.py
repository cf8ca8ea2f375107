"""How long `overlapkit --help`, `--version` and each command's `--help` take to answer
(goal: under 0.5 s; they import no torch), with `python -c "import torch"` beside them,
and `overlapkit plugins` (the listing: it imports torch, not torch's checkpointing,
FSDP or DTensor; no goal), each with the CPU seconds it used (less sensitive than the
wall time to other work on the machine).

    python benchmarks/cli_startup.py [--runs 11] [--json]

Each command runs `--runs` times in a fresh process, one after another; the figure is
the median wall time, with the fastest and slowest run. The numbers are in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

GOAL_S = 0.5
COMMANDS = (["--help"], ["--version"], ["demo", "--help"], ["bench", "--help"],
            ["plugins", "--help"])
#: commands that import torch: timed, not judged
UNJUDGED = (["plugins"],)


def _overlapkit() -> list[str]:
    """The console script users run, beside this interpreter (else ``-m overlapkit``)."""
    script = Path(sys.executable).with_name("overlapkit")
    return [str(script)] if script.exists() else [sys.executable, "-m", "overlapkit"]


def _cpu_s() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _times(argv: list[str], runs: int) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds of each of ``runs`` runs of ``argv``."""
    times, cpu = [], []
    for _ in range(runs):
        started, cpu_started = time.perf_counter(), _cpu_s()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - started)
        cpu.append(_cpu_s() - cpu_started)
    return times, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=11, help="runs per command")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    rows = {}
    for command in (*COMMANDS, *UNJUDGED):
        rows["overlapkit " + " ".join(command)] = _times([*_overlapkit(), *command],
                                                         args.runs)
    rows["python -c 'import torch' (for scale)"] = _times(
        [sys.executable, "-c", "import torch"], max(3, args.runs // 3))
    figures = {name: {"median_s": round(statistics.median(t), 3), "min_s": round(min(t), 3),
                      "max_s": round(max(t), 3), "runs": len(t),
                      "median_cpu_s": round(statistics.median(cpu), 3)}
               for name, (t, cpu) in rows.items()}
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    width = max(map(len, figures))
    judged = {"overlapkit " + " ".join(command) for command in COMMANDS}
    print(f"{'command':<{width}}  median s  min s  max s  CPU s  goal < {GOAL_S} s")
    for name, f in figures.items():
        met = "" if name not in judged else ("met" if f["median_s"] < GOAL_S else "MISSED")
        print(f"{name:<{width}}  {f['median_s']:>8.3f}  {f['min_s']:>5.3f}  {f['max_s']:>5.3f}"
              f"  {f['median_cpu_s']:>5.2f}  {met}")
    print(f"({shutil.which('overlapkit') or _overlapkit()[0]}, Python "
          f"{sys.version.split()[0]})")


if __name__ == "__main__":
    main()
