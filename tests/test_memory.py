"""Peak RSS as overlapkit measures it: the process's own, not its parent's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from overlapkit.cli.memory import peak_rss_mib

GROW_THEN_SPAWN = """
import multiprocessing as mp
import sys
from overlapkit.cli.memory import peak_rss_mib

def report(queue):
    import resource
    queue.put((peak_rss_mib(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))

if __name__ == "__main__":
    ballast = bytearray(1024 * 2**20)  # the parent holds 1 GiB when it spawns
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1
    queue = mp.get_context("spawn").Queue()
    child = mp.get_context("spawn").Process(target=report, args=(queue,))
    child.start()
    ours, rusage = queue.get(timeout=60)
    child.join()
    print(ours, rusage)
"""


def test_peak_rss_grows_with_what_this_process_touches() -> None:
    before = peak_rss_mib()
    ballast = bytearray(64 * 2**20)
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1
    assert peak_rss_mib() >= before + 60 or peak_rss_mib() >= 64


def test_a_spawned_rank_is_not_credited_with_its_parents_memory(tmp_path: Path) -> None:
    script = tmp_path / "grow_then_spawn.py"  # spawn imports the child's code by file
    script.write_text(GROW_THEN_SPAWN)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    ours, rusage = map(float, proc.stdout.split())
    assert ours < 500  # an interpreter with torch imported, not the parent's 1 GiB
    assert rusage > 1024  # what ru_maxrss reports in the same child: the parent's peak


PEAK_RESET = """
from overlapkit.cli.memory import peak_rss_mib, reset_peak_rss, rss_mib
ballast = bytearray(64 * 2**20)  # mapped on its own: freed back to the OS by del
for i in range(0, len(ballast), 4096):
    ballast[i] = 1
with_ballast = rss_mib()
del ballast
print(with_ballast, reset_peak_rss(), peak_rss_mib())
"""


def test_the_peak_restarts_from_the_rss_of_now() -> None:
    """After :func:`reset_peak_rss` the peak forgets what was freed before. Run in a
    fresh interpreter: in a long test process the allocator's state (an mmap threshold
    pinned by an in-process benchmark, many live mappings) decides whether freed memory
    leaves the RSS at once — it did not, once, in a full test run."""
    proc = subprocess.run([sys.executable, "-c", PEAK_RESET], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    with_ballast, reset, peak = proc.stdout.split()
    if with_ballast == "None":
        pytest.skip("no /proc here")
    if reset != "True":
        pytest.skip("this kernel has no /proc/self/clear_refs")
    assert float(peak) < float(with_ballast) - 32
