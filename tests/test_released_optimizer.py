"""An optimizer after ``opt.release()``: a plain optimizer again, whatever it was set up
with (``overlapkit/overlap/rules/released.py``).

Before (968cf42): set up with ``clip_grad_norm=``, the loop's own ``clip_grad_norm_``
before ``step()`` was clipped again by ``step()`` (8.9e-8 off the plain AdamW loop after
4 steps, silently); a ``torch.amp.GradScaler`` driving it directly was refused as "built
without grad_scaler=: its steps during backward used the scaled gradients" (none are
taken once released), and ``scaler.unscale_`` on one set up with ``grad_scaler=`` as
unscaling what the end of backward had "already unscaled and stepped". Now each is the
plain loop, bitwise (parameters and the scaler's scale), 1 process and 2 gloo ranks
(``overlap_ddp`` on DDP)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from released_ranks import SET_UPS, run, run_loop

from overlapkit.distributed import run_distributed

CLIPS = ("none", "clip_grad_norm_", "halves", "clip_grad_value_")


@pytest.mark.parametrize("clip", CLIPS)
@pytest.mark.parametrize("set_up", ["clip_grad_norm", "clip_grad_value"])
def test_a_released_optimizer_set_up_to_clip_clips_once(set_up: str, clip: str) -> None:
    # before: the loop's clip, then step()'s set-up clip again (8.9e-8 off, AdamW)
    plain, _ = run_loop(None, set_up, clip, scaler=None)
    got, _ = run_loop("optimizer_in_backward", set_up, clip, scaler=None)
    assert all(torch.equal(a, b) for a, b in zip(plain, got, strict=True))


@pytest.mark.parametrize("unscale", [False, True])
@pytest.mark.parametrize("set_up", SET_UPS)
def test_a_scaler_driving_a_released_optimizer_is_the_plain_loop(set_up: str,
                                                                 unscale: bool) -> None:
    # before: refused, "built without grad_scaler=" / "already unscaled and stepped"
    plain, plain_scale = run_loop(None, set_up, "clip_grad_norm_" if unscale else "none",
                                  scaler="unscale" if unscale else "step")
    got, scale = run_loop("optimizer_in_backward", set_up,
                          "clip_grad_norm_" if unscale else "none",
                          scaler="unscale" if unscale else "step")
    assert all(torch.equal(a, b) for a, b in zip(plain, got, strict=True))
    assert scale == plain_scale == 512.0  # the overflowing step skipped, as torch's


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_distributed(run, 2, timeout=300)


def test_two_ranks_a_released_overlap_ddp_optimizer_is_the_plain_loop(
        two_ranks: list[dict[str, Any]]) -> None:
    for results in two_ranks:
        assert results and all(v == "bitwise" for v in results.values()), results
