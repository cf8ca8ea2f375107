"""Where a CPU rank steps buckets while later ones are still being reduced, it also fills
the parameters' own ``.grad`` then, and DDP's finalize has nothing left to copy after the
last reduction (:mod:`overlapkit.overlap.ddp.filled_grads`). What the loop sees stays
plain DDP's: the same gradients, bitwise, each a tensor of its own."""

from __future__ import annotations

import pytest
import torch
from filled_grads_ranks import (
    LAYERS,
    STEPS,
    filled_over_the_link,
    users_model_over_the_link,
)

from overlapkit.distributed import run_distributed
from overlapkit.overlap.ddp.filled_grads import FilledGradients
from overlapkit.overlap.ddp.inline_schedule import AFTER, FILL


def _param_with_grad() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    param = torch.nn.Parameter(torch.zeros(4))
    param.grad = torch.full((4,), 7.0)
    bucket = torch.arange(8.0)
    return param, param.grad, bucket[4:]


# -- the bookkeeping, on one tensor ---------------------------------------------------

def test_fill_copies_the_reduced_view_into_the_own_gradient_and_lend_swaps_them() -> None:
    param, local, view = _param_with_grad()
    filled = FilledGradients()
    filled.fill([(param, local)], [view])
    assert torch.equal(local, view) and param.grad is local
    filled.lend()
    assert param.grad is view
    filled.give_back()
    assert param.grad is local and torch.equal(local, torch.arange(4.0, 8.0))


def test_a_parameter_without_a_gradient_of_its_own_is_left_to_ddp() -> None:
    param = torch.nn.Parameter(torch.zeros(4))
    filled = FilledGradients()
    filled.fill([(param, None)], [torch.ones(4)])
    filled.lend()
    assert param.grad is None


def test_a_gradient_replaced_before_the_lend_is_not_swapped() -> None:
    param, local, view = _param_with_grad()
    filled = FilledGradients()
    filled.fill([(param, local)], [view])
    replaced = torch.zeros(4)
    param.grad = replaced
    filled.lend()
    filled.give_back()
    assert param.grad is replaced


def test_give_back_leaves_a_gradient_set_after_the_lend() -> None:
    # a backward that raised after the lend, then the loop's zero_grad(): the next
    # backward's give_back must not bring the old gradient back
    param, local, view = _param_with_grad()
    filled = FilledGradients()
    filled.fill([(param, local)], [view])
    filled.lend()
    param.grad = None
    filled.give_back()
    assert param.grad is None


def test_recovering_gives_back_what_the_loop_wrote_into_the_lent_view() -> None:
    # a final callback after the lend raised, so the give-back after DDP's finalize
    # never ran; the loop's zero_grad(set_to_none=False) then zeroed the lent view
    param, local, view = _param_with_grad()
    filled = FilledGradients()
    filled.fill([(param, local)], [view])
    filled.lend()
    param.grad.zero_()
    filled.give_back(recovering=True)  # the next backward's first hook
    assert param.grad is local and torch.equal(local, torch.zeros(4))


def test_give_back_forgets_what_was_filled_and_never_lent() -> None:
    param, local, view = _param_with_grad()
    filled = FilledGradients()
    filled.fill([(param, local)], [view])
    filled.give_back()  # a backward that raised before its end
    filled.lend()
    assert param.grad is local


# -- over the simulated link, 2 gloo ranks --------------------------------------------

@pytest.mark.parametrize("clip_value", [None, 1e-4], ids=["no clipping", "clip_grad_value"])
def test_over_a_slow_link_gradients_and_parameters_are_plain_ddps_bitwise(
        clip_value: float | None) -> None:
    for rank, out in enumerate(run_distributed(filled_over_the_link,
                                               args=(FILL, clip_value, False), timeout=180)):
        assert all(out["grads"]), (rank, out["grads"])
        assert all(out["grads_own"]), rank  # never a view of DDP's bucket
        assert out["params"], (rank, out["params"])
        # each backward stepped its first buckets while the last was on the wire; the
        # first backward runs in DDP's buckets from before it rebuilds them (one here)
        assert out["lent"][0] == 0 and len(out["lent"]) == STEPS, out
        assert all(0 < n < LAYERS for n in out["lent"][1:]), out


def test_clipped_gradients_reach_grad_where_the_hooks_future_holds_its_own_tensor() -> None:
    # DDP's finalize copies the future's tensor into .grad, not the bucket the step
    # clipped: the stepper gives it the clipped values, as the plain loop's clip leaves
    for rank, out in enumerate(run_distributed(
            filled_over_the_link, args=(FILL, 1e-4, False, True), timeout=180)):
        assert all(out["grads"]), (rank, out["grads"])
        assert out["params"], (rank, out["params"])


def test_ddps_finalize_writes_nothing_into_a_filled_gradient() -> None:
    # the filled parameters' own gradients are overwritten with NaN before the lend: DDP's
    # finalize copied the bucket onto the lent view, not into them
    for out in run_distributed(filled_over_the_link, args=(FILL, None, True), timeout=180):
        assert all(n > 0 for n in out["lent"][1:]), out
        for lent, poisoned in zip(out["lent"], out["poisoned"], strict=True):
            assert sum(poisoned) == lent, out
            assert not poisoned[0], out  # the first layer's bucket is reduced last


def test_in_the_plain_order_nothing_is_filled() -> None:
    # every reduction is waited for first, then one run: no wait left to fill
    for out in run_distributed(filled_over_the_link, args=(AFTER, None, False),
                               timeout=180):
        assert out["lent"] == [0] * STEPS, out
        assert all(out["grads"]) and out["params"], out


@pytest.mark.parametrize("loop", ["step", "backward"])
def test_a_users_model_over_a_slow_link_is_plain_ddps_bitwise(loop: str) -> None:
    # tied, unused, frozen and integer parameters, buffers, several buckets; the loop
    # with step() and zero_grad(), and the backward-only one
    for rank, out in enumerate(run_distributed(users_model_over_the_link, args=(loop,),
                                               timeout=240)):
        assert all(all(step) for step in out["grads"]), (rank, out["grads"])
        assert out["params"] and out["buffers"], (rank, out)
        assert any(n > 0 for n in out["lent"]), out  # filled while later buckets reduced
