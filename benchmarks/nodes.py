"""Past one machine: how long a lost node takes to be named, and a restart to resume.

    python benchmarks/nodes.py [--rounds 3] [--timeout 10] [--json]

Runs the README's training script on two torchrun agents on loopback, each its own node
of two ranks (gloo; ``tests/agents.py``), and loses node 1 (``tests/lose_node.py``) in
three ways:

- **killed** (SIGKILL to its agent and workers) in the forward of step 12: from the
  loss to the survivors' ``RanksLostError`` naming ranks 2 and 3 (when it shows in the
  surviving agent's output), and to the surviving agent's exit;
- **frozen** (SIGSTOP: its connections stay open) at the same point, the script's
  process group created with ``timeout=--timeout`` seconds: the same two figures
  (gloo notices a node that hangs only when that timeout expires);
- **killed while step 10's checkpoint is written**, under ``--max-restarts 1``, its
  torchrun started again as soon as the survivors have named it: from that start to
  the ``resumed from ... at step 5`` line, and to the end of training (step 20).

Medians of ``--rounds`` rounds, with the fastest and slowest. The figures are in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the harness the tests use

from agents import Job, kill_node  # noqa: E402


def _script(directory: Path, timeout: float | None) -> Path:
    """The README's training script, with the process group's timeout set when given."""
    section = (ROOT / "README.md").read_text(encoding="utf-8").split(
        "## Use it in your training loop", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None
    text = match.group(1)
    if timeout is not None:
        init = 'dist.init_process_group("gloo")'
        assert init in text
        text = text.replace(init, 'dist.init_process_group("gloo", timeout=__import__('
                            f'"datetime").timedelta(seconds={timeout}))')
    path = directory / ("train.py" if timeout is None else f"train-timeout-{timeout}.py")
    path.write_text(text, encoding="utf-8")
    return path


def _seen(read: Callable[[], str], text: str, seconds: float = 180) -> float:
    """When ``text`` first shows in ``read()`` (polled every 20 ms)."""
    deadline = time.monotonic() + seconds
    while text not in read():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{text!r} not seen within {seconds:.0f} s")
        time.sleep(0.02)
    return time.time()


def _job(directory: Path, script: Path, name: str, lose_at: str, **env: str) -> Job:
    return Job([str(ROOT / "tests" / "lose_node.py"), str(script)], [2, 2], directory,
               name=name, max_restarts=int(env.pop("max_restarts", "0")),
               env={"CHECKPOINT": str(directory / name), "STOP_AT": "20", "LOSE_GROUP": "1",
                    "LOSE_AT": lose_at, "LOSE_MARK": str(directory / f"{name}.mark"),
                    **env}).start()


def lost(directory: Path, script: Path, name: str, how: str) -> dict[str, float]:
    """Seconds from the loss to the survivors' error, and to the surviving agent's end."""
    job = _job(directory, script, name, "loss:13", LOSE_HOW=how)
    survivor, node = job.agents
    try:
        named = _seen(lambda: survivor.stderr, "RanksLostError")
        job.agents[0].wait(time.monotonic() + 120)
    finally:
        if how == "freeze":
            kill_node(node.proc.pid)
        job.wait(120)
    assert re.search(r"RanksLostError: ranks 2, 3 \(torchrun node 1", survivor.stderr)
    lost_at = float((directory / f"{name}.mark").read_text())
    assert survivor.ended is not None
    return {"named": named - lost_at, "survivors_ended": survivor.ended - lost_at}


def restarted(directory: Path, script: Path, name: str) -> dict[str, float]:
    """Seconds from the lost node's new start to the resumed step, and to the end."""
    job = _job(directory, script, name, "save:2", max_restarts="1",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    survivor, node = job.agents
    try:
        node.wait(time.monotonic() + 120)
        named = _seen(lambda: survivor.stderr, "RanksLostError")
        started = time.time()
        job.start_agent(2)
        resumed = _seen(lambda: survivor.stdout, "at step 5")
        codes = job.wait(240)
    finally:
        job.stop()
    assert "step 20: loss" in survivor.stdout, codes
    lost_at = float((directory / f"{name}.mark").read_text())
    assert survivor.ended is not None
    return {"named": named - lost_at, "resumed": resumed - started,
            "ended": survivor.ended - started}


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each case")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="the process-group timeout of the frozen case, seconds")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    figures: dict[str, list[dict[str, float]]] = {"killed": [], "frozen": [], "restarted": []}
    with tempfile.TemporaryDirectory(prefix="overlapkit-nodes-") as tmp:
        directory = Path(tmp)
        plain, with_timeout = _script(directory, None), _script(directory, args.timeout)
        for round_ in range(args.rounds):
            figures["killed"].append(lost(directory, plain, f"killed-{round_}", "kill"))
            figures["frozen"].append(
                lost(directory, with_timeout, f"frozen-{round_}", "freeze"))
            figures["restarted"].append(restarted(directory, plain, f"restarted-{round_}"))
            print(f"round {round_ + 1}: {figures['killed'][-1]} {figures['frozen'][-1]} "
                  f"{figures['restarted'][-1]}", file=sys.stderr, flush=True)
    if args.json:
        json.dump({"timeout": args.timeout, **figures}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    print(f"2 torchrun agents of 2 ranks on loopback, gloo; medians of {args.rounds} "
          "rounds (min-max), seconds")
    for case, what in (("killed", "node killed mid-step"),
                       ("frozen", f"node frozen mid-step, timeout {args.timeout:.0f} s")):
        rows = figures[case]
        print(f"{what}: named after {_summary([r['named'] for r in rows])}, survivors "
              f"ended after {_summary([r['survivors_ended'] for r in rows])}")
    rows = figures["restarted"]
    print(f"node killed while saving, then started again: named after "
          f"{_summary([r['named'] for r in rows])}; from its new start, resumed after "
          f"{_summary([r['resumed'] for r in rows])}, training ended after "
          f"{_summary([r['ended'] for r in rows])}")


if __name__ == "__main__":
    main()
