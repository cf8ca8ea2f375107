"""How often a finished torchrun job fails at exit: gloo's "terminate called without an
active exception" (overlapkit.nodes.exit_safe, docs/nodes.rst "Ending cleanly").

    python benchmarks/exit_aborts.py [--runs 25] [--at-once 2] [--nproc 4] [--script readme]

Runs a script ``--runs`` times under ``torchrun --nproc-per-node --nproc`` (``--at-once``
jobs side by side, which is what makes a gloo worker thread late on a small machine)
and counts the runs whose workers printed the abort, and the runs torchrun reported as
failed. ``--script readme`` is the README's training script (it ends on
``checkpoint.save``); ``--script zero`` ends as a ZeRO script does:
``consolidate_state_dict(0)`` of overlapkit's sharded optimizer, then rank 0 saves;
``--script barrier`` is plain PyTorch: DDP, then ``dist.barrier()`` and
``dist.destroy_process_group()``, no overlapkit. The abort depends
on a thread's timing, so compare figures taken on the same machine, at the same load.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ABORT = "terminate called without an active exception"

BARRIER_SCRIPT = """\
import datetime, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=3))
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 4))
for _ in range(20):
    model(torch.randn(8, 16)).sum().backward()
dist.barrier()
dist.destroy_process_group()
"""

ZERO_SCRIPT = """\
import datetime, os, torch, torch.distributed as dist
import overlapkit
dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=3))
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)))
optimizer = overlapkit.overlap_ddp(model, torch.optim.AdamW, lr=1e-3,
                                   shard_optimizer_state=True)
for _ in range(20):
    model(torch.randn(8, 16)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
optimizer.consolidate_state_dict(0)
if dist.get_rank() == 0:
    torch.save(optimizer.state_dict(), os.environ["CHECKPOINT"])
"""

SCRIPTS = {"barrier": BARRIER_SCRIPT, "zero": ZERO_SCRIPT}


def readme_script() -> str:
    section = (ROOT / "README.md").read_text(encoding="utf-8").split(
        "## Use it in your training loop", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block is not None, "the README's training-loop section has no python block"
    return block.group(1)


def one_run(script: Path, directory: Path, nproc: int) -> tuple[bool, bool]:
    """(aborted, failed) of one torchrun job in ``directory``."""
    directory.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CHECKPOINT": str(directory / "checkpoint")}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc-per-node", str(nproc), str(script)],
        cwd=directory, env=env, capture_output=True, text=True, timeout=600)
    return ABORT in proc.stderr, proc.returncode != 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=25)
    parser.add_argument("--at-once", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--script", choices=["readme", "zero", "barrier"], default="readme")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="exit-aborts-") as scratch:
        script = Path(scratch, "train.py")
        script.write_text(readme_script() if args.script == "readme" else
                          SCRIPTS[args.script], encoding="utf-8")
        with concurrent.futures.ThreadPoolExecutor(args.at_once) as pool:
            outcomes = list(pool.map(
                lambda run: one_run(script, Path(scratch, f"run{run}"), args.nproc),
                range(args.runs)))
    aborted = sum(abort for abort, _ in outcomes)
    failed = sum(fail for _, fail in outcomes)
    figures = {"script": args.script, "runs": args.runs, "at_once": args.at_once,
               "nproc": args.nproc, "aborted": aborted, "failed": failed}
    if args.json:
        print(json.dumps(figures))
    else:
        print(f"{args.script}: {aborted} of {args.runs} runs aborted at exit, {failed} "
              f"reported failed ({args.nproc} ranks, {args.at_once} runs at a time)")


if __name__ == "__main__":
    main()
