"""Post-local SGD on 4 gloo ranks: parity with torch, resume, zero_grad, subgroups, errors.

One spawned run executes every scenario (tests/local_sgd_ranks.py); each test asserts
one behaviour on its results.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from local_sgd_ranks import PERIOD, SAVE_AT, STEPS, WARMUP, all_scenarios

from overlapkit.distributed import run_distributed

WORLD = 4


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("local_sgd_checkpoints")
    return run_distributed(all_scenarios, WORLD, args=(str(directory),), timeout=240)


def _scenario(results: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [results[rank][name] for rank in range(WORLD)]


def _equal_trajectories(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_periodic_matches_torch_post_local_sgd_bitwise(results: list[dict[str, Any]]) -> None:
    for rank, run in enumerate(_scenario(results, "periodic")):
        assert _equal_trajectories(run["ours"], run["torch"]), f"rank {rank} differs"


def test_hook_and_averager_built_from_the_registry_match_post_local_sgd(
    results: list[dict[str, Any]],
) -> None:
    for run in _scenario(results, "periodic"):
        assert _equal_trajectories(run["manual"], run["ours"])


def test_ranks_agree_on_averaging_steps_and_only_within_subgroups_between(
    results: list[dict[str, Any]],
) -> None:
    ours = [run["ours"] for run in _scenario(results, "periodic")]
    for step in range(STEPS):
        averaging = step >= WARMUP and (step - WARMUP) % PERIOD == 0
        assert torch.equal(ours[0][step], ours[1][step])  # same subgroup {0, 1}
        assert torch.equal(ours[2][step], ours[3][step])  # same subgroup {2, 3}
        across = torch.equal(ours[0][step], ours[2][step])
        assert across == (step < WARMUP or averaging), f"step {step}"


def test_counters_after_training(results: list[dict[str, Any]]) -> None:
    run = results[0]["periodic"]
    assert run["hook_iter"] == WARMUP  # counts up to the warm-up length, then stops
    assert run["averager_step"] == STEPS


@pytest.mark.parametrize("levels", ["hierarchical_2", "hierarchical_3"])
def test_hierarchical_matches_torch_hierarchical_model_averager(
    results: list[dict[str, Any]], levels: str
) -> None:
    runs = _scenario(results, levels)
    for rank, run in enumerate(runs):
        assert _equal_trajectories(run["ours"], run["torch"]), f"rank {rank} differs"
    # Local steps really happen: without gradient communication ranks 0 and 1 differ
    # after some step, so the averaging levels are what brings them together.
    assert not all(torch.equal(a, b) for a, b in zip(runs[0]["ours"], runs[1]["ours"],
                                                     strict=True))


def test_resumed_run_matches_uninterrupted_exactly(results: list[dict[str, Any]]) -> None:
    for rank, run in enumerate(_scenario(results, "resume")):
        assert _equal_trajectories(run["resumed"], run["uninterrupted"][SAVE_AT:]), rank
        assert run["load_warnings"] == []


def test_resumed_run_does_not_reenter_warmup(results: list[dict[str, Any]]) -> None:
    for run in _scenario(results, "resume"):
        assert run["after_load"] == {"hook_iter": WARMUP, "in_warmup": False,
                                     "averager_step": SAVE_AT}
        assert run["global_grad_allreduce_after_resume"] == [False] * (STEPS - SAVE_AT)


def test_reentering_warmup_would_change_the_result(results: list[dict[str, Any]]) -> None:
    # The control for the two tests above: a hook counter reset to 0 on resume (what
    # torch's hook state does, pytorch #74556) gives other parameters.
    run = results[0]["resume"]
    assert not _equal_trajectories(run["resumed_into_warmup_again"],
                                   run["uninterrupted"][SAVE_AT:])


def test_checkpoint_in_torch_format_resumes_exactly_with_a_warning(
    results: list[dict[str, Any]],
) -> None:
    for run in _scenario(results, "resume"):
        assert _equal_trajectories(run["resumed_from_torch_format"],
                                   run["uninterrupted"][SAVE_AT:])
        assert len(run["torch_format_warnings"]) == 1
        assert "no 'comm_hook' entry" in run["torch_format_warnings"][0]


def test_state_dict_keeps_the_optimizer_format_and_adds_entries(
    results: list[dict[str, Any]],
) -> None:
    keys = results[0]["resume"]["saved_optim_keys"]
    assert keys == ["averager", "comm_hook", "param_groups", "state", "step", "world_size"]


def test_averaging_after_zero_grad_set_to_none(results: list[dict[str, Any]]) -> None:
    for run in _scenario(results, "zero_grad_none"):
        assert run["all_none_averaged"] is True
        for tensor in run["all_none_values"]:
            assert torch.all(tensor == run["expected_all_none"])


def test_parameter_with_a_gradient_on_some_ranks_only_is_averaged(
    results: list[dict[str, Any]],
) -> None:
    for run in _scenario(results, "zero_grad_none"):
        used, frozen = run["partial"]
        expected_used, expected_frozen = run["expected_partial"]
        assert torch.all(used == expected_used)
        assert torch.all(frozen == expected_frozen)


def test_default_subgroup_is_one_per_node_from_local_world_size(
    results: list[dict[str, Any]],
) -> None:
    runs = _scenario(results, "default_subgroup")
    assert [run["local_world_4"] for run in runs] == [[0, 1, 2, 3]] * WORLD
    assert [run["local_world_2"] for run in runs] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    # it trains on CPU (torch's default subgroup needs CUDA): after warm-up the two
    # "nodes" drift apart between averagings (period 3, warm-up 1: steps 2 and 3)
    trajectories = [run["local_world_2_trajectory"] for run in runs]
    assert torch.equal(trajectories[0][3], trajectories[1][3])
    assert not torch.equal(trajectories[0][3], trajectories[2][3])


def test_default_subgroup_without_launcher_is_one_rank_with_a_warning(
    results: list[dict[str, Any]],
) -> None:
    runs = _scenario(results, "default_subgroup")
    for run in runs:
        assert run["unset"] is None
        assert any("LOCAL_WORLD_SIZE is not set" in w and "subgroup_size=N" in w
                   for w in run["unset_warnings"])
    trajectories = [run["unset_trajectory"] for run in runs]
    assert not torch.equal(trajectories[0][2], trajectories[1][2])  # local step 2
    assert torch.equal(trajectories[0][3], trajectories[1][3])  # averaged at step 3


@pytest.mark.parametrize(("case", "error", "says"), [
    ("subgroup_size_3", "ConfigurationError", "use one of [1, 2, 4]"),
    ("hier_size_not_dividing", "ConfigurationError", "does not divide the process group"),
    ("hier_last_not_world", "ConfigurationError", "must be the whole process group"),
    ("hier_period_mismatch", "ConfigurationError", "pass period=4"),
    ("unknown_averager", "UnknownNameError", "'hierarchical', 'periodic'"),
    ("averager_unknown_option", "ConfigurationError", "takes no options ['momentum']"),
    ("hook_missing_start", "ConfigurationError", "needs start_localSGD_iter=N"),
    ("hook_unknown_option", "ConfigurationError", "has no options ['warmup']"),
    ("local_world_size_3", "ConfigurationError", "pass subgroup_size=N"),
    ("second_comm_hook", "ConfigurationError", "build a fresh DistributedDataParallel"),
])
def test_bad_input_needing_a_process_group_is_a_clear_error(
    results: list[dict[str, Any]], case: str, error: str, says: str
) -> None:
    for run in _scenario(results, "errors"):
        raised = run[case]
        assert raised is not None, f"{case} did not raise"
        name, message, is_overlapkit_error = raised
        assert (name, is_overlapkit_error) == (error, True)
        assert says in message
