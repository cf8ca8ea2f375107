"""Save and load across world sizes and layouts, on real gloo ranks and real DCP files.

One chain of four spawned runs shares its checkpoints (module-scoped): world size 2
saves FSDP2, DDP and FSDP1 checkpoints; world size 4 loads them and saves a 2-D
(dp 2 x tp 2) one; world size 2 loads that as 1-D, and DDP <-> FSDP2; world size 1
loads again. Every rank trains on the same batches. A separate run on 2 ranks checks
saves of an ``overlap_ddp`` optimizer and a swap that fails on rank 0.
"""

from __future__ import annotations

from typing import Any

import checkpoint_ranks as scenarios
import pytest
import torch
from helpers import failures

from overlapkit.distributed import run_distributed


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("reshard"))
    results: dict[str, Any] = {}
    results.update(run_distributed(scenarios.save_at_two, 2, args=(root,))[0])
    at_four = run_distributed(scenarios.load_at_four, 4, args=(root,), timeout=240)
    results.update(at_four[0])
    results["fsdp1_tp/ranks"] = [r["fsdp1_tp"] for r in at_four]
    at_two = run_distributed(scenarios.load_at_two, 2, args=(root,))
    results.update(at_two[0])
    results["error/ranks"] = [r["error"] for r in at_two]
    results.update(run_distributed(scenarios.load_at_one, 1, args=(root,))[0])
    return results


@pytest.fixture(scope="module")
def overlap_and_swap(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("overlap-swap"))
    return run_distributed(scenarios.overlap_and_failing_swap, 2, args=(root,), timeout=60)


def test_save_after_an_overlap_ddp_backward_keeps_step_a_no_op_and_is_refused_once_it_steps(
    overlap_and_swap: list[dict[str, Any]],
) -> None:
    assert failures(overlap_and_swap, "overlap_save_changes_nothing") == {}
    for r in overlap_and_swap:  # the second window's save: refused everywhere, unwritten
        assert r["window_saves_refused"] == [1]
        assert not r["second_save_written"]


def test_a_load_in_the_first_window_is_refused_on_every_rank_loading_nothing(
    overlap_and_swap: list[dict[str, Any]],
) -> None:
    """The first window's save is taken (it changes nothing); its load is not: the
    backward stepped the parameters, the plain loop's step() would start from what the
    load gives."""
    for r in overlap_and_swap:
        assert "between the first stepping backward() and optimizer.step()" in \
            r["first_window_load"], r["first_window_load"]
        assert "Nothing was written or changed" in r["first_window_load"]
        assert r["first_window_load_changed_nothing"]


def test_a_failed_swap_on_rank_zero_is_a_checkpoint_error_on_every_rank(
    overlap_and_swap: list[dict[str, Any]],
) -> None:
    for r in overlap_and_swap:
        assert r["swap_error"] is not None
        assert "failed on rank 0 while moving it into place" in r["swap_error"]
        assert "PermissionError: refused by the file system" in r["swap_error"]
        assert r["previous_intact"]


def _assert_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["tensors"].keys() == want["tensors"].keys()
    for key, value in want["tensors"].items():
        assert torch.equal(got["tensors"][key], value), key
    assert got["lr"] == want["lr"]


def _assert_close(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["tensors"].keys() == want["tensors"].keys()
    for key, value in want["tensors"].items():
        torch.testing.assert_close(got["tensors"][key], value, rtol=1e-5, atol=1e-6,
                                   msg=key)


# (loaded scenario, saved checkpoint): equal bitwise right after loading
CASES = [
    ("fsdp2->fsdp2@1", "fsdp2"),
    ("fsdp2->fsdp2@2", "fsdp2"),
    ("fsdp2->fsdp2", "fsdp2"),            # at world size 4
    ("fsdp1->fsdp1@1", "fsdp1"),
    ("fsdp1->fsdp1", "fsdp1"),            # at world size 4
    ("fsdp2_tp->fsdp2", "fsdp2_tp"),      # 2-D on 4 ranks -> 1-D FSDP2 on 2
    ("fsdp2_tp->plain", "fsdp2_tp"),      # 2-D on 4 ranks -> one process
    ("fsdp2->fsdp2_tp", "fsdp2"),         # 1-D on 2 ranks -> 2-D on 2 (dp 1 x tp 2)
    ("ddp->fsdp2", "ddp"),
    ("fsdp2->ddp", "fsdp2"),
]


@pytest.mark.parametrize(("scenario", "saved"), CASES, ids=[c[0] for c in CASES])
def test_params_and_every_optimizer_state_tensor_equal_after_loading(
    chain: dict[str, Any], scenario: str, saved: str
) -> None:
    _assert_equal(chain[scenario]["loaded"], chain[f"{saved}/saved"])


@pytest.mark.parametrize(("scenario", "saved"), CASES, ids=[c[0] for c in CASES])
def test_two_more_steps_match_the_uninterrupted_run(
    chain: dict[str, Any], scenario: str, saved: str
) -> None:
    # Layouts sum and multiply in different orders (tensor parallel splits the
    # matmuls), so the comparison allows float32 rounding.
    _assert_close(chain[scenario]["after2"], chain[f"{saved}/after2"])


def test_same_layout_same_world_size_continues_bitwise(chain: dict[str, Any]) -> None:
    _assert_equal(chain["fsdp2->fsdp2@2"]["after2"], chain["fsdp2/after2"])


def test_shape_mismatch_is_one_clear_error_on_every_rank(chain: dict[str, Any]) -> None:
    for message in chain["error/ranks"]:
        assert message is not None
        assert "'model.down.weight' has shape (8, 16) in the checkpoint" in message
        assert "but (8, 32) here" in message


class TestTorchIsWrongOn2DFsdp1TensorParallel:
    """torch 2.13's load_sharded_optimizer_state_dict on FSDP1 + TP (dp 2 x tp 2)."""

    def test_ours_returns_the_saved_values_in_the_parameters_layout(
        self, chain: dict[str, Any]
    ) -> None:
        for rank in chain["fsdp1_tp/ranks"]:
            assert rank["ours_match_saved"] and all(rank["ours_match_saved"])

    def test_ours_loads_into_the_optimizer_like_the_saved_state_dict(
        self, chain: dict[str, Any]
    ) -> None:
        for rank in chain["fsdp1_tp/ranks"]:
            assert all(rank["ours_roundtrip_equal"])

    def test_torch_silently_loads_wrong_values(self, chain: dict[str, Any]) -> None:
        # If this fails, torch fixed its 2-D path: keep ours, drop this regression.
        wrong = [not all(rank["torch_roundtrip_equal"]) for rank in chain["fsdp1_tp/ranks"]]
        assert all(wrong)

    def test_ours_warns_no_deprecations_where_torch_warns_several(
        self, chain: dict[str, Any]
    ) -> None:
        for rank in chain["fsdp1_tp/ranks"]:
            assert rank["our_warnings"] == []
            assert len(rank["torch_warnings"]) >= 3


def test_a_checkpoint_saved_before_the_first_step_resumes_exactly(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    # It held Adam's step 1 and zero moments (what get_state_dict creates): the resumed
    # run took its first step as a second one.
    root = str(tmp_path_factory.mktemp("fresh"))
    for rank_results in run_distributed(scenarios.resume_from_before_the_first_step, 2,
                                        args=(root,), timeout=240):
        for kind in ("ddp", "fsdp2", "fsdp1"):
            assert rank_results[f"{kind}/state after load"] == 0, kind
            assert rank_results[f"{kind}/resumed"], (kind, rank_results[f"{kind}/resumed"])
