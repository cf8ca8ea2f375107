"""A LightningModule's ``lr_scheduler_step`` override that reads ``.grad`` (twelfth
round), at 1 process (both techniques, one device) and 2 gloo ranks: it runs after the
optimizer step, before the next ``zero_grad``, where the plain loop still holds the
gradients and ``optimizer_in_backward`` has freed them. At ``cdd1705`` a read from the
third step on read none, silently (0.016 off the plain fit, the scheduler not stepped);
it is now one of the hooks after the step: every step in the plain order, bitwise, one
warning naming it (``reads_grads_after_step=False`` keeps the overlap). ``overlap_ddp``
keeps the gradients: unaffected. Rank code: lightning_after_step_ranks.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning", reason="the `trainers` tox environment installs lightning")

from lightning_after_step_ranks import PAIRS, run

from overlapkit.distributed import run_distributed


@pytest.mark.parametrize("world_size", [1, 2], ids=["1 process", "2 ranks"])
def test_an_lr_scheduler_step_reading_grads_is_the_plain_fit_bitwise(
        world_size: int, tmp_path: Path) -> None:
    ranks: list[dict[str, Any]] = run_distributed(run, world_size, args=(str(tmp_path),),
                                                  timeout=400)
    for rank, results in enumerate(ranks):
        for label in PAIRS[world_size]:
            assert results[label], (rank, label)
            warned = results[f"{label} | warnings"]
            if label == "overlap_ddp":
                assert warned == [], (rank, warned)
            else:
                assert len(warned) == 1, (rank, label, warned)
                assert "SchedulesOnGradients.lr_scheduler_step" in warned[0], warned
