"""A save is complete only once every rank sees every file of it.

The checkpoint directory must be on storage every node sees. Given the same path on
each node but separate disks, each rank writes its shards to its own node's disk, rank
0 writes DCP's ``.metadata`` to node 0's, and without a check every rank returns from
the save as if it were complete: node 0's copy lacks the other nodes' shards (measured
on torch 2.13 with two torchrun agents: "saved" on both, then node 0's ranks resumed
from it and node 1's found none, and the job hung for gloo's 30 minutes).

So after DCP's write, and before rank 0 writes the file list that marks the checkpoint
complete, every rank looks at the directory from where it runs: DCP's ``.metadata``
must be there with the bytes rank 0 wrote (they hold the save's own id, so another
save's left-over does not pass), and every file the metadata places data in must be
there, long enough for it. The ranks gather what they see (one small
``all_gather_object``); if any rank misses anything, every rank raises the same
:class:`~overlapkit.errors.CheckpointError`, naming the ranks, their nodes and the
files, and nothing is marked complete.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch.distributed as dist

from overlapkit.checkpoint.integrity import needed_extents
from overlapkit.checkpoint.metadata import METADATA_FILE
from overlapkit.errors import CheckpointError
from overlapkit.nodes.layout import this_node

__all__ = ["check_every_rank_sees"]


def _what_this_rank_sees(directory: Path, storage_data: Any) -> tuple[str | None, list[str]]:
    """The digest of ``.metadata`` here (``None`` when missing) and the files the
    metadata names that are missing or too short here."""
    metadata = directory / METADATA_FILE
    try:
        digest = hashlib.sha256(metadata.read_bytes()).hexdigest()
    except OSError:
        digest = None
    missing = []
    for name, end in sorted(needed_extents(storage_data).items()):
        file = directory / name
        try:
            if file.stat().st_size < end:
                missing.append(f"{name} (short)")
        except OSError:
            missing.append(name)
    return digest, missing


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _listed(names: list[str]) -> str:
    return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")


def check_every_rank_sees(directory: Path, storage_data: Any, path: Path) -> None:
    """Raise on every rank unless every rank sees ``.metadata`` as rank 0 wrote it and
    every file it names in ``directory`` (the save's ``.NAME.saving``).

    :param storage_data: the metadata's ``storage_data``, as ``dcp.save`` returns it
        on every rank.
    :param path: where the checkpoint is going, for the message.
    :raises CheckpointError: on every rank, when any rank misses a file.
    """
    digest, missing = _what_this_rank_sees(directory, storage_data)
    seen = [(digest, missing, this_node()[1])]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        seen = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(seen, (digest, missing, this_node()[1]))
    written = seen[0][0]
    problems: dict[tuple[str, str], list[int]] = {}
    for rank, (rank_digest, rank_missing, node) in enumerate(seen):
        names = list(rank_missing)
        if rank_digest is None:
            names.insert(0, METADATA_FILE)
        elif rank_digest != written:
            names.insert(0, f"{METADATA_FILE} (another save's)")
        if names:
            problems.setdefault((node, _listed(names)), []).append(rank)
    if not problems:
        return
    blind = "; ".join(f"{_ranks(ranks)} ({node}) {'does' if len(ranks) == 1 else 'do'} "
                      f"not see {names}"
                      for (node, names), ranks in problems.items())
    raise CheckpointError(
        f"saving the checkpoint to {path} failed: the ranks do not all see the files the "
        f"others wrote into {directory}: {blind}. The checkpoint directory must be on "
        "storage every node sees (a shared file system, mounted at the same path on "
        "every node), not each node's own disk. Nothing was marked complete: the "
        f"previous checkpoint at {path}, if any, is as it was."
    )
