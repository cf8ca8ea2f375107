"""Every rank learns whether any rank refused a save or load, before the first
collective that would otherwise wait for the rank that stopped.

``save`` and ``load`` check their arguments, the checkpoint's files and metadata, and the
model and optimizer against it, on each rank. Every rank usually reaches the same
verdict, but not always: a checkpoint on a node-local disk is missing on one node, one
rank built another optimizer, one rank's model has other shapes. A rank that raised
alone would leave the others waiting in DCP's next collective until the process
group's timeout (measured on torch 2.13 with gloo: the default 30 minutes). So the
checks run inside :func:`checks_on_every_rank`, which gathers every rank's outcome
(one small ``all_gather_object``) and raises on each rank: the rank's own error where it
had one, a :class:`~overlapkit.errors.CheckpointError` naming the first rank that
refused, and why, elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from overlapkit.errors import CheckpointError, OverlapkitError

__all__ = ["checks_on_every_rank"]


def _as_overlapkit_error(error: Exception, call: str) -> OverlapkitError:
    if isinstance(error, OverlapkitError):
        return error
    converted = CheckpointError(
        f"{call}: {type(error).__name__}: {error}. Check that the path is readable and "
        "writable by this process on every rank."
    )
    converted.__cause__ = error
    return converted


@contextmanager
def checks_on_every_rank(call: str) -> Iterator[None]:
    """Run the body's checks, then agree across ranks: raise on every rank if any
    rank's body raised (nothing after the body runs anywhere).

    Use it only around work that changes nothing and runs no collective (the point is
    that the ranks meet here first). A non-overlapkit error of the body (an
    ``OSError`` reading a file) becomes a :class:`~overlapkit.errors.CheckpointError`.

    :param call: ``"save"`` or ``"load"``, for messages.
    """
    error: OverlapkitError | None = None
    try:
        yield
    except Exception as exc:
        error = _as_overlapkit_error(exc, call)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        outcomes: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, None if error is None else str(error))
        if error is None:
            refused = [(rank, text) for rank, text in enumerate(outcomes) if text is not None]
            if refused:
                rank, text = refused[0]
                others = f" (and {len(refused) - 1} other ranks)" if len(refused) > 1 else ""
                raise CheckpointError(
                    f"{call} was refused on rank {rank}{others}, so no rank went on; nothing "
                    f"was written or changed. Rank {rank} said: {text}"
                )
    if error is not None:
        raise error
