"""Sparse gradients on a DDP model (twelfth round of the window in hand-written loops):
an ``nn.Embedding(sparse=True)``, whose gradient DDP reduces as a bucket of its own.
Before (``cdd1705``): both techniques set up, and the first backward failed at its end
with torch's bare "Cannot access data pointer of Tensor that doesn't have storage", the
dense buckets stepped already. Now refused at set-up, naming the module, nothing
registered: the model trains as plain DDP afterwards (2 gloo ranks).
"""

from __future__ import annotations

from typing import Any

from sparse_gradients_ranks import run

from overlapkit.distributed import run_distributed


def test_sparse_embedding_on_ddp_is_refused_at_set_up() -> None:
    ranks: list[dict[str, Any]] = run_distributed(run, 2, timeout=300)
    for rank, results in enumerate(ranks):
        for technique, result in results.items():
            error = result["error"]
            assert error is not None and error["type"] == "ConfigurationError", (rank, error)
            assert "embedding (Embedding(sparse=True))" in error["message"], error
            assert result["plain after"], (rank, technique, result["plain after"])
