"""What having overlapkit installed costs every pytest session: start-up time.

    python benchmarks/pytest_startup.py [--rounds N]

overlapkit registers ``overlapkit.testing`` as a pytest plugin (the ``pytest11`` entry
point), so pytest imports it at start-up in any environment where overlapkit is
installed, whatever is being tested. This times ``python -m pytest`` on a folder with
one trivial test, with the plugin loaded and with it blocked (``-p no:overlapkit``,
which is pytest without overlapkit's plugin), interleaved, and prints the medians, the
difference and whether torch was imported. The figures are in docs/benchmarks.md; the
goal is a difference under 50 ms.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEST = '''\
import sys


def test_nothing():
    print("torch imported at start-up:", "torch" in sys.modules)
'''
GOAL_MS = 50.0


def _run(folder: Path, blocked: bool) -> tuple[float, str]:
    command = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider"]
    if blocked:
        command += ["-p", "no:overlapkit"]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=folder, capture_output=True, text=True, check=True)
    return (time.perf_counter() - started) * 1000, done.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="runs of each (default 15)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        (folder / "test_nothing.py").write_text(TEST)
        times: dict[bool, list[float]] = {False: [], True: []}
        torch_seen: dict[bool, bool] = {}
        _run(folder, False)  # warm the file cache once
        for index in range(args.rounds):
            for blocked in ((False, True) if index % 2 == 0 else (True, False)):
                elapsed, output = _run(folder, blocked)
                times[blocked].append(elapsed)
                torch_seen[blocked] = "start-up: True" in output
    loaded, without = statistics.median(times[False]), statistics.median(times[True])
    difference = loaded - without
    print(f"pytest start-up, {args.rounds} interleaved runs each, medians:")
    print(f"  with overlapkit's plugin:    {loaded:7.1f} ms (torch imported: "
          f"{torch_seen[False]})")
    print(f"  without (-p no:overlapkit):  {without:7.1f} ms (torch imported: "
          f"{torch_seen[True]})")
    met = "met" if difference < GOAL_MS else "missed"
    print(f"  difference: {difference:+.1f} ms (goal < {GOAL_MS:.0f} ms: {met})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
