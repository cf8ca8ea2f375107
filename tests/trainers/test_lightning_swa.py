"""``StochasticWeightAveraging`` on a module with BatchNorm (thirteenth round), at 1
process (both techniques, one device) and 2 gloo ranks: the callback adds an epoch at the
end of the fit that runs the forwards only (no backward, no ``zero_grad``) and ends with
one optimizer step, which in the plain loop steps the last training step's gradients
again. At ``be7423f`` ``optimizer_in_backward`` (which freed them) refused that step after
the whole fit had run, saying ``step()`` was called twice (one device) or that
``training_step`` returned None (DDP), and ``overlap_ddp``'s warning said the latter. In
the thirteenth round ``optimizer_in_backward`` saw the callback at set-up and took every
step in the plain order; since the fourteenth (at ``4b7a286`` that was still so) it
overlaps every training step but the last one before that epoch, which keeps its
gradients; ``overlap_ddp`` takes that epoch's step so: bitwise, one warning naming the
callback when the order changes. Rank code: lightning_swa_ranks.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning", reason="the `trainers` tox environment installs lightning")

from lightning_swa_ranks import PAIRS, resume, run

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
            assert ("from its last training step on" in warned[0]) == (
                label != "overlap_ddp"), warned
            if label != "overlap_ddp":  # the steps before overlapped: their gradients freed
                assert (1, 1) in results[f"{label} | freed"], results[f"{label} | freed"]


def test_swa_with_accumulation_and_clipping_overlaps_until_the_last_window(
        tmp_path: Path) -> None:
    """``accumulate_grad_batches=3`` over 8 batches (the epoch's last window has 2) and
    clipping: the last window's micro-batches before its last run under ``no_step()``,
    that last one in the plain order; bitwise, one warning."""
    options = {"accumulate_grad_batches": 3, "gradient_clip_val": 0.5}
    results: dict[str, Any] = run_distributed(run, 1, args=(str(tmp_path), options),
                                              timeout=400)[0]
    for label in PAIRS[1]:
        assert results[label] is True, (label, results[label])
        assert len(results[f"{label} | warnings"]) == 1, results[f"{label} | warnings"]
    for label in ("optimizer_in_backward", "one device"):
        assert results[f"{label} | freed"] == [(0, 0), (0, 6), (1, 0), (1, 3), (1, 6)], (
            label, results[f"{label} | freed"])


def test_a_fit_resumed_into_the_batch_norm_epoch_is_the_plain_one(tmp_path: Path) -> None:
    """Resumed from the checkpoint of the last training epoch, the fit is SWA's BatchNorm
    epoch alone, whose step is the fit's first: nothing was freed. At ``4b7a286``
    ``optimizer_in_backward`` took the whole fit in the plain order; keeping the overlap
    until the last training step first refused this one on DDP, saying it had freed the
    gradients (the refusal now needs a step before it)."""
    results: dict[str, Any] = run_distributed(resume, 1, args=(str(tmp_path),),
                                              timeout=400)[0]
    assert results == dict.fromkeys(PAIRS[1], True), results
