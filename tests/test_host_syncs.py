"""The GPU path checked on CPU: the steps overlapkit takes inside backward read no more
values back to the host than the plain loop's ``step()`` does, and use the same
multi-tensor (``foreach``) kernels.

A ``TorchDispatchMode`` sees every aten op of forward, backward (where ``overlap_ddp``
and ``optimizer_in_backward`` step) and ``step()``; on a GPU each host sync it counts
(``_local_scalar_dense`` behind ``.item()``, ``is_nonzero``, ``nonzero``...) would stall
the CPU until the stream caught up, in the middle of backward. One gloo rank, on CPU,
``foreach=True``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from host_syncs_ranks import HOST_SYNCS, SINGLE_TENSOR_ADAM, STEPS, count_ops

from overlapkit.distributed import run_distributed

#: ours -> the plain loop it replaces
PLAIN = {"overlap_ddp": "plain_ddp", "optimizer_in_backward_ddp": "plain_ddp",
         "optimizer_in_backward_module": "plain_module"}


@pytest.fixture(scope="module")
def ops() -> dict[tuple[str, str], dict[str, Counter[str]]]:
    return run_distributed(count_ops, 1, timeout=240)[0]


def _syncs(counts: Counter[str]) -> int:
    return sum(n for name, n in counts.items() if name in HOST_SYNCS)


def _foreach(counts: Counter[str]) -> set[str]:
    return {name for name in counts if name.startswith("_foreach_")}


def test_the_counter_sees_the_host_syncs_of_adams_step(ops: Any) -> None:
    # torch 2.13's foreach Adam reads each parameter's step count twice per step on
    # CPU (bias corrections): 6 parameters x 2 x 3 steps
    assert _syncs(ops["plain_ddp", "adam_foreach"]["all"]) == 6 * 2 * STEPS
    assert _syncs(ops["plain_ddp", "sgd_foreach"]["all"]) == 0


@pytest.mark.parametrize("optimizer", ["adam_foreach", "sgd_foreach"])
@pytest.mark.parametrize("ours", sorted(PLAIN))
def test_overlapkit_makes_no_more_host_syncs_per_step_than_the_plain_loop(
        ops: Any, ours: str, optimizer: str) -> None:
    plain = ops[PLAIN[ours], optimizer]
    mine = ops[ours, optimizer]
    assert _syncs(mine["all"]) / STEPS <= _syncs(plain["all"]) / STEPS, (
        {k: v for k, v in mine["all"].items() if k in HOST_SYNCS},
        {k: v for k, v in plain["all"].items() if k in HOST_SYNCS})
    # and the plain loop has none inside backward: ours are the steps it moved there
    assert _syncs(plain["backward"]) == 0
    assert _syncs(mine["backward"]) == _syncs(mine["all"])


@pytest.mark.parametrize("optimizer", ["adam_foreach", "sgd_foreach"])
@pytest.mark.parametrize("ours", sorted(PLAIN))
def test_each_step_inside_backward_runs_the_plain_steps_foreach_kernels(
        ops: Any, ours: str, optimizer: str) -> None:
    plain_step = ops[PLAIN[ours], optimizer]["all"] - ops[PLAIN[ours], optimizer]["backward"]
    in_backward = ops[ours, optimizer]["backward"]
    assert _foreach(plain_step), "the plain foreach step runs _foreach_ kernels"
    assert _foreach(in_backward) == _foreach(plain_step)
    if optimizer == "adam_foreach":  # no per-parameter fallback
        assert set(in_backward) & SINGLE_TENSOR_ADAM == set()


@pytest.mark.parametrize("ours", sorted(PLAIN))
def test_a_for_loop_optimizer_steps_per_parameter_in_backward_as_its_plain_step_does(
        ops: Any, ours: str) -> None:
    # the observation above can fail: foreach=False runs no _foreach_ kernel, plain or ours
    plain = ops[PLAIN[ours], "adam_for_loop"]["all"]
    in_backward = ops[ours, "adam_for_loop"]["backward"]
    assert _foreach(plain) == _foreach(in_backward) == set()
    assert set(plain) >= SINGLE_TENSOR_ADAM and set(in_backward) >= SINGLE_TENSOR_ADAM


@pytest.mark.parametrize("ours", sorted(PLAIN))
def test_clip_grad_norm_reads_the_total_norm_back_once_per_step_where_plain_reads_none(
        ops: Any, ours: str) -> None:
    # The one exception, a chosen price: with clip_grad_norm= (no scaler) the step that
    # clips by the total norm checks it is finite at the end of backward, so that a loop
    # raising (error_if_nonfinite) or skipping on a non-finite norm finds nothing stepped
    # (tests/test_nonfinite_norm.py). Without the read it would step NaN into the
    # parameters during backward. The first step does not read it (the loop is not known
    # to call step() yet).
    plain = ops[PLAIN[ours], "sgd_foreach_clipped"]
    mine = ops[ours, "sgd_foreach_clipped"]
    assert _syncs(plain["all"]) == 0
    assert mine["backward"]["_local_scalar_dense"] == _syncs(mine["all"]) == STEPS - 1
