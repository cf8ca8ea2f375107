"""Complex parameters on a DDP model (twelfth round of the window in hand-written
loops): DDP's reducer holds a complex parameter's gradient in its bucket as the
parameter's real view (``torch.view_as_real``: twice ``numel`` real elements).
Before (``cdd1705``): both techniques read it as ``numel`` elements of the bucket and
the first stepping backward failed with torch's bare "attempting to assign a gradient
with dtype 'float' to a tensor with grad_dtype 'ComplexFloat'" from inside backward
(the plain DDP loop trains). Now bitwise the plain loop, parameters and state, 1
process and 2 gloo ranks, ``gradient_as_bucket_view`` off and on; the sharded
optimizer (``shard_optimizer_state=True``), which steps the same views, too.
"""

from __future__ import annotations

from typing import Any

import pytest
from complex_params_ranks import run

from overlapkit.distributed import run_distributed


@pytest.mark.parametrize("world_size", [1, 2])
def test_complex_parameters_train_as_the_plain_ddp_loop(world_size: int) -> None:
    ranks: list[dict[Any, dict[str, Any]]] = run_distributed(run, world_size, timeout=300)
    for rank, results in enumerate(ranks):
        for case, result in results.items():
            assert result["error"] is None, (rank, case, result["error"])
            assert result["values"], (rank, case, result["values"])
            assert result["state"], (rank, case, result["state"])
