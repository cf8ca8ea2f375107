"""Is there a checkpoint to resume from? One answer, the same on every rank.

A training script decides at start-up whether to resume. Asked on each rank of its
own — ``os.path.isdir(path)`` — the answer can differ: with the checkpoint directory on
each node's own disk, node 0's ranks resumed and node 1's trained from the start, and
the job hung (measured on torch 2.13, two torchrun agents: gloo's 30 minutes). And a
save killed between its two renames leaves nothing at ``path``: the script trained from
step 0 without a word, and its first save threw away the newer complete checkpoint
left at ``.NAME.saving``.

:func:`latest` answers both: each rank finds the newest complete checkpoint the saves
to ``path`` left (:func:`~overlapkit.checkpoint.directories.newest_complete`), the ranks
compare what they found (which directory, and a digest of its file list), and every rank
gets the same answer or the same error.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

from overlapkit.checkpoint.agreement import checks_on_every_rank
from overlapkit.checkpoint.arguments import check_path
from overlapkit.checkpoint.directories import (
    fingerprint,
    finish_interrupted_save,
    newest_complete,
    on_rank_zero,
)
from overlapkit.errors import CheckpointError
from overlapkit.nodes.layout import this_node
from overlapkit.nodes.lost_ranks import lost_ranks_named, note_complete_checkpoint

__all__ = ["latest"]


def _describe(found: tuple[str, str] | None, path: Path) -> str:
    if found is None:
        return f"no checkpoint at {path}"
    where, digest = found
    return f"the checkpoint at {path.parent / where} (file list {digest})"


def latest(path: str | os.PathLike[str]) -> Path | None:
    """The checkpoint to resume from — ``path`` — or ``None`` when the saves to
    ``path`` left no complete checkpoint: the same answer on every rank.

    Call it on every rank, after ``init_process_group``, where a script decides
    whether to resume::

        if overlapkit.checkpoint.latest(CHECKPOINT) is not None:
            progress = overlapkit.checkpoint.load(CHECKPOINT, model, optimizer)

    A save killed at any instant leaves a complete checkpoint behind (the previous
    one, or the new one once its file list was written; see
    :mod:`overlapkit.checkpoint.directories`). When the newest is not at ``path`` — a
    save was killed between its two renames — rank 0 moves it there first, as the next
    save would, so ``path`` is what every rank loads.

    :raises CheckpointError: on every rank, when the ranks do not find the same
        checkpoint (the directory is not on storage every node sees: the message names
        the ranks, their nodes and what each found), or when the newest checkpoint is
        damaged (a file its list names is missing, or the list itself): answering with an
        older one, or none, would resume from further back without a word.
    :raises RanksLostError: ranks were lost while asking; the message names them.
    """
    with lost_ranks_named(f"looking for the checkpoint at {path}"):
        return _latest(path)


def _latest(path: str | os.PathLike[str]) -> Path | None:
    with checks_on_every_rank("latest"):
        directory = check_path(path, "latest")
        newest = newest_complete(directory)
        found = None if newest is None else (newest.name, fingerprint(newest))
    answers = [(found, this_node()[1])]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        answers = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(answers, (found, this_node()[1]))
    if any(answer != answers[0][0] for answer, _ in answers):
        groups: dict[tuple[str, str], list[int]] = {}
        for rank, (answer, node) in enumerate(answers):
            groups.setdefault((_describe(answer, directory), node), []).append(rank)
        seen = "; ".join(
            f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))} "
            f"({node}) {'sees' if len(ranks) == 1 else 'see'} {what}"
            for (what, node), ranks in groups.items())
        raise CheckpointError(
            f"latest: the ranks do not find the same checkpoint at {directory}: {seen}. "
            "The checkpoint directory must be on storage every node sees (a shared file "
            "system, mounted at the same path on every node), not each node's own disk; "
            "no rank resumed."
        )
    if found is None:
        return None
    if found[0] != directory.name:
        on_rank_zero("moving the newest complete checkpoint into place", directory,
                     lambda: finish_interrupted_save(directory),
                     call="latest: finishing the interrupted save to")
    note_complete_checkpoint(directory)
    return directory
