"""``StochasticWeightAveraging`` on a module with BatchNorm (thirteenth round), at 1
process (both techniques, one device) and 2 gloo ranks: the callback adds an epoch at the
end of the fit that runs the forwards only (no backward, no ``zero_grad``) and ends with
one optimizer step, which in the plain loop steps the last training step's gradients
again. At ``be7423f`` ``optimizer_in_backward`` (which freed them) refused that step after
the whole fit had run, saying ``step()`` was called twice (one device) or that
``training_step`` returned None (DDP), and ``overlap_ddp``'s warning said the latter. Now
``optimizer_in_backward`` sees the callback at set-up and takes every step in the plain
order; ``overlap_ddp`` takes that last step so: bitwise, one warning naming the callback.
Rank code: lightning_swa_ranks.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning", reason="the `trainers` tox environment installs lightning")

from lightning_swa_ranks import PAIRS, run

from overlapkit.distributed import run_distributed


@pytest.mark.parametrize("world_size", [1, 2], ids=["1 process", "2 ranks"])
def test_swa_with_batch_norm_is_the_plain_fit_bitwise_with_one_warning(
        world_size: int, tmp_path: Path) -> None:
    ranks: list[dict[str, Any]] = run_distributed(run, world_size, args=(str(tmp_path),),
                                                  timeout=400)
    for rank, results in enumerate(ranks):
        for label in PAIRS[world_size]:
            assert results[label] is True, (rank, label, results[label])
            warned = results[f"{label} | warnings"]
            assert len(warned) == 1, (rank, label, warned)
            assert "StochasticWeightAveraging" in warned[0], warned
            assert ("its BatchNorm epoch" in warned[0]) == (label != "overlap_ddp"), warned
