"""torchrun's entry point in the node-loss tests: run a script, and lose this node once.

    torchrun ... lose_node.py train.py [args]

On the node whose ``GROUP_RANK`` is ``LOSE_GROUP``, local rank 0 kills its agent, every
other worker of its agent and itself with SIGKILL — as a machine that loses power
takes its processes with it, none of them running any clean-up — at ``LOSE_AT``:

- ``loss:K``: the K-th call of ``torch.nn.functional.mse_loss`` (mid-step: after a
  forward, before its backward);
- ``save:K``: once this rank has written its files of the K-th checkpoint save (DCP's
  ``FileSystemWriter.write_data``), before the save is complete;
- ``rename:K``: (rank 0, which moves checkpoints into place: ``LOSE_GROUP=0``) between
  the two renames of the K-th save, the previous checkpoint moved to ``.NAME.old`` and
  the new one still at ``.NAME.saving``.

It first writes the time (``time.time()``) to the file ``LOSE_MARK``, and does nothing
where that file exists: the node started again after the loss runs the script plainly.
Elsewhere the script runs unchanged. With ``LOSE_HOW=freeze`` the node's processes are
stopped (SIGSTOP) instead: a node that hangs, whose connections stay open (the caller
kills it afterwards).
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time
from typing import Any

from agents import children  # this script's folder is on sys.path (run as a script)


def lose_this_node() -> None:
    with open(os.environ["LOSE_MARK"], "w") as mark:
        mark.write(repr(time.time()))
    how = signal.SIGSTOP if os.environ.get("LOSE_HOW") == "freeze" else signal.SIGKILL
    agent = os.getppid()
    for worker in children(agent):
        if worker != os.getpid():
            os.kill(worker, how)
    os.kill(agent, how)
    os.kill(os.getpid(), how)


def _count_calls(owner: Any, name: str, at: int, after: bool = False) -> None:
    original = getattr(owner, name)
    calls = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == at and not after:
            lose_this_node()
        result = original(*args, **kwargs)
        if calls[0] == at and after:
            result.wait()  # the files are written
            lose_this_node()
        return result

    setattr(owner, name, counted)


def _lose_between_renames(at: int) -> None:
    """Lose this node when the K-th save moves its ``.NAME.saving`` to ``NAME`` (the
    first save has no previous checkpoint to move aside: its only rename counts)."""
    replace = os.replace
    calls = [0]

    def replacing(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if os.path.basename(os.fspath(src)).endswith(".saving"):
            calls[0] += 1
            if calls[0] == at:
                lose_this_node()
        replace(src, dst, *args, **kwargs)

    os.replace = replacing  # type: ignore[assignment]


def main() -> None:
    here = (os.environ.get("GROUP_RANK") == os.environ.get("LOSE_GROUP")
            and os.environ.get("LOCAL_RANK") == "0"
            and not os.path.exists(os.environ.get("LOSE_MARK", "")))
    if here:
        what, _, at = os.environ["LOSE_AT"].partition(":")
        if what == "loss":
            import torch.nn.functional as F

            _count_calls(F, "mse_loss", int(at))
        elif what == "save":
            from torch.distributed.checkpoint import FileSystemWriter

            _count_calls(FileSystemWriter, "write_data", int(at), after=True)
        elif what == "rename":
            _lose_between_renames(int(at))
        else:
            raise SystemExit(f"LOSE_AT={os.environ['LOSE_AT']!r}: use loss:K, save:K or "
                             "rename:K")
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
