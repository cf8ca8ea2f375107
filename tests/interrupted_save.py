"""A run that saves, and is killed (SIGKILL: no clean-up runs) at one instant of its
last save. For tests/test_checkpoint_interrupted.py.

    python interrupted_save.py PATH INSTANT STEP[,STEP...]

Trains a small model with Adam, one step per listed step, and saves to ``PATH`` after
each with ``extra={"step": STEP}``; before each save it writes the parameters to
``PATH.params-STEP.pt`` (what a load of that checkpoint must give back). The last save
is killed at ``INSTANT`` (one of :data:`INSTANTS`); ``none`` lets it finish.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter

import overlapkit.checkpoint.saving as saving
from overlapkit import checkpoint
from overlapkit.checkpoint.integrity import MANIFEST_FILE

#: every instant of a save a kill can come at, in the order a save reaches them
INSTANTS = (
    "writing the shards",  # the ranks' files written, DCP's .metadata not yet
    "before the check",  # DCP is done: every rank is about to look at the files
    "before the file list",  # extra written, DDP's layout and the file list not yet
    "writing the file list",  # the list written beside, not yet renamed into place
    "before the first rename",  # the checkpoint is complete in .NAME.saving
    "between the renames",  # the previous one at .NAME.old, nothing at NAME
    "removing the old one",  # the new one at NAME, the previous one half deleted
)


def die(*_: Any, **__: Any) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(instant: str, path: Path) -> None:
    """Kill this process when the save reaches ``instant``."""
    saving_dir, old = path.parent / f".{path.name}.saving", path.parent / f".{path.name}.old"
    if instant == "writing the shards":
        write_data = FileSystemWriter.write_data

        def written(self: FileSystemWriter, *args: Any, **kwargs: Any) -> Any:
            write_data(self, *args, **kwargs).wait()
            die()

        FileSystemWriter.write_data = written  # type: ignore[method-assign]
    elif instant == "before the check":
        saving.check_every_rank_sees = die  # type: ignore[assignment]
    elif instant == "before the file list":
        saving.write_layout = die  # type: ignore[assignment]
    elif instant in ("writing the file list", "before the first rename",
                     "between the renames"):
        replace = os.replace

        def replacing(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            src, dst = Path(src), Path(dst)
            if (instant == "writing the file list" and dst.name == MANIFEST_FILE) or \
                    (instant == "before the first rename" and (src, dst) == (path, old)) or \
                    (instant == "between the renames" and (src, dst) == (saving_dir, path)):
                die()
            replace(src, dst, *args, **kwargs)

        os.replace = replacing  # type: ignore[assignment]
    elif instant == "removing the old one":
        rmtree = shutil.rmtree

        def removing(target: Any, *args: Any, **kwargs: Any) -> None:
            if Path(target) == old:
                next(p for p in sorted(old.iterdir()) if p.suffix == ".distcp").unlink()
                die()
            rmtree(target, *args, **kwargs)

        shutil.rmtree = removing  # type: ignore[assignment]
    elif instant != "none":
        raise SystemExit(f"unknown instant {instant!r}: one of {INSTANTS}")


def main() -> None:
    path, instant = Path(sys.argv[1]), sys.argv[2]
    steps = [int(step) for step in sys.argv[3].split(",")]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for index, step in enumerate(steps):
        model(torch.randn(3, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        torch.save([p.detach() for p in model.parameters()],
                   path.parent / f"{path.name}.params-{step}.pt")
        if index == len(steps) - 1:
            arm(instant, path)
        checkpoint.save(path, model, opt, extra={"step": step})
    print("not killed", flush=True)


if __name__ == "__main__":
    main()
