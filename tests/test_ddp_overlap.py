"""overlap_ddp: bitwise parity with plain DDP + step(), the Optimizer contract, errors.

Two spawned runs of 2 gloo ranks do all the distributed work (each rank loops over the
cases and returns a dict of results); the tests assert on those results one behaviour
at a time. Every model uses a tiny ``bucket_cap_mb`` so DDP makes several buckets.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import compare, failures
from overlap_ddp_ranks import OPTIMIZERS, STEPS, every_optimizer_run, scenarios_run
from torch import nn

import overlapkit
from overlapkit.distributed import run_distributed

# -- spawned run 1: every optimizer ------------------------------------------------------


@pytest.fixture(scope="module")
def every_optimizer() -> list[dict[str, Any]]:
    return run_distributed(every_optimizer_run, 2, timeout=240)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_bitwise_parity_with_plain_ddp_and_step(
    every_optimizer: list[dict[str, Any]], name: str
) -> None:
    for rank_results in every_optimizer:
        result = rank_results[name]
        assert result["moved"], f"{name} did not change the parameters"
        assert result["equal"], f"{name}: overlap_ddp differs from plain DDP + step()"


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_lr_scheduler_drives_the_returned_optimizer(
    every_optimizer: list[dict[str, Any]], name: str
) -> None:
    result = every_optimizer[0][name]
    initial_lr = OPTIMIZERS[name][1]["lr"]
    assert result["lr"] == result["plain_lr"] == initial_lr * 0.5 ** (STEPS // 2)


def test_the_model_has_several_buckets(every_optimizer: list[dict[str, Any]]) -> None:
    assert every_optimizer[0]["Adam"]["buckets"] >= 4


# -- spawned run 2: scenarios and errors -------------------------------------------------


@pytest.fixture(scope="module")
def scenarios() -> list[dict[str, Any]]:
    return run_distributed(scenarios_run, 2, timeout=240)


@pytest.mark.parametrize("as_view", [False, True])
def test_parity_with_gradient_as_bucket_view(scenarios: list[dict[str, Any]],
                                             as_view: bool) -> None:
    assert failures(scenarios, f"bucket_view={as_view}") == {}


@pytest.mark.parametrize("as_view", [False, True])
def test_find_unused_parameters_steps_like_plain(scenarios: list[dict[str, Any]],
                                                 as_view: bool) -> None:
    for rank_results in scenarios:
        result = rank_results[f"unused bucket_view={as_view}"]
        assert result["equal"]
        # used on rank 0 only: stepped on both ranks, as plain DDP does
        assert result["branch_moved"]


@pytest.mark.parametrize("as_view", [False, True])
def test_stepping_on_the_comm_thread_gives_the_same_result(
    scenarios: list[dict[str, Any]], as_view: bool
) -> None:
    assert failures(scenarios, f"comm thread bucket_view={as_view}") == {}


def test_static_graph_parity(scenarios: list[dict[str, Any]]) -> None:
    assert failures(scenarios, "static_graph") == {}


def test_no_sync_accumulation_parity(scenarios: list[dict[str, Any]]) -> None:
    assert failures(scenarios, "no_sync") == {}


def test_params_subset_with_groups_and_a_second_plain_optimizer(
    scenarios: list[dict[str, Any]],
) -> None:
    assert failures(scenarios, "subset") == {}


def test_compress_hook_matches_plain_ddp_with_the_same_hook(
    scenarios: list[dict[str, Any]],
) -> None:
    for rank_results in scenarios:
        assert rank_results["fp16_vs_plain_fp16"] == 0.0
        # and stays close to uncompressed training (fp16 rounding of the gradients)
        assert 0.0 < rank_results["fp16_vs_plain_fp32"] < 1e-3


def test_value_clipping_is_exact(scenarios: list[dict[str, Any]]) -> None:
    assert failures(scenarios, "clip_value") == {}


def test_bucket_scope_norm_clipping_is_per_bucket(scenarios: list[dict[str, Any]]) -> None:
    for rank_results in scenarios:
        assert rank_results["clip_norm_buckets"] >= 4
        assert rank_results["clip_norm_per_bucket"]
        assert rank_results["clip_norm_differs_from_global"]


@pytest.mark.parametrize("case", ["SGD", "AdamW", "unused"])
def test_default_norm_clipping_is_torchs_global_clip_grad_norm(
        scenarios: list[dict[str, Any]], case: str) -> None:
    assert failures(scenarios, f"clip_norm_global {case}") == {}
    if case != "unused":
        assert failures(scenarios, f"clip_norm_global {case} active") == {}


@pytest.mark.parametrize("behaviour", [
    "is_optimizer", "stepped_in_backward", "step_is_noop", "zero_grad_zeros",
    "zero_grad_none", "fallback_step_is_plain", "live_param_groups", "state_dict_format",
])
def test_optimizer_contract(scenarios: list[dict[str, Any]], behaviour: str) -> None:
    assert failures(scenarios, behaviour) == {}


def test_state_dict_loads_into_a_plain_optimizer_and_back(
    scenarios: list[dict[str, Any]],
) -> None:
    for rank_results in scenarios:
        # every resumed run continues exactly as the plain one resumed from plain
        assert compare(rank_results["overlap_to_plain"], rank_results["resumed_reference"])
        assert compare(rank_results["plain_to_overlap"], rank_results["resumed_reference"])


ERRORS = {
    "not an optimizer": ("UnsupportedOptimizerError", "optimizer class itself"),
    "LBFGS": ("UnsupportedOptimizerError", "closure"),
    "SparseAdam": ("UnsupportedOptimizerError", "sparse gradients"),
    "second registration": ("ConfigurationError", "covers only part of the parameters"),
    "own comm hook": ("ConfigurationError", "pass its name as overlap_ddp"),
    "unknown comm hook": ("UnknownNameError", "'allreduce', 'bf16_compress'"),
    "params not in model": ("ConfigurationError", "not a parameter of the DDP model"),
    "params not managed": ("ConfigurationError", "'head.bias' in params is trainable but not "
                           "reduced by DDP"),
    "bad optimizer argument": ("ConfigurationError", "Fix the optimizer arguments"),
    "bad clip": ("ConfigurationError", "clip_grad_norm must be a positive"),
    "closure": ("ConfigurationError", "takes no closure"),
    "bad step_thread": ("ConfigurationError", "step_thread must be one of"),
    "muon on a bias": ("ConfigurationError", "Muon only supports 2D"),
    "clip norm with unused": ("ConfigurationError", "find_unused_parameters=True: there"),
    "clip norm with static graph": ("ConfigurationError", "static_graph=True: there"),
    "ZeroRedundancyOptimizer": ("UnsupportedOptimizerError", "distributed wrapper"),
    "added claimed": ("ConfigurationError", "already stepped during backward by overlap_ddp"),
    "add claimed elsewhere": ("ConfigurationError",
                              "already stepped during backward by optimizer_in_backward"),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_bad_input_gets_an_overlapkit_error_saying_what_to_do(
    scenarios: list[dict[str, Any]], case: str
) -> None:
    expected_type, expected_text = ERRORS[case]
    for rank_results in scenarios:
        error = rank_results[case]
        assert error is not None, f"{case}: no error raised"
        assert error["overlapkit"], error
        assert error["type"] == expected_type, error
        assert expected_text in error["message"], error


def test_param_groups_given_as_generators_are_trained(
    scenarios: list[dict[str, Any]],
) -> None:
    for rank_results in scenarios:
        result = rank_results["generator groups"]
        assert result["equal"], result["equal"]
        assert result["head_moved"]


def test_join_with_uneven_inputs_matches_plain_ddp(scenarios: list[dict[str, Any]]) -> None:
    assert failures(scenarios, "join") == {}


def test_added_param_groups_are_tracked_like_the_first(
    scenarios: list[dict[str, Any]],
) -> None:
    # with find_unused_parameters, untracked parameters would be left to the end of
    # backward instead of being stepped with their bucket
    assert failures(scenarios, "added in buckets") == {}


def test_a_model_that_is_not_ddp_is_refused() -> None:
    with pytest.raises(overlapkit.UnsupportedModelError, match="wrap it first"):
        overlapkit.overlap_ddp(nn.Linear(2, 2), torch.optim.SGD, lr=0.1)


def test_the_generic_engine_serves_every_optimizer_and_plugins_can_override(
    overlapkit_plugin_manager: overlapkit.plugin.manager.OverlapkitPluginManager,
) -> None:
    from overlapkit.overlap.core.generic import GenericOverlapEngine

    registry = overlapkit_plugin_manager.registry
    assert registry.optimizer_spec(torch.optim.AdamW).overlapped_cls is (
        GenericOverlapEngine)
    assert registry.optimizer_provider(torch.optim.SGD).plugin == "overlapkit.overlap"


class _CountsInGroup(torch.optim.SGD):
    """Writes into its param group during step(), as D-Adaptation's ``d`` does."""

    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            group["steps_seen"] = group.get("steps_seen", 0) + 1
        return super().step(closure)


def test_values_the_optimizer_writes_into_its_group_are_kept() -> None:
    from overlapkit.overlap.core.generic import GenericOverlapEngine

    params = [nn.Parameter(torch.ones(2)) for _ in range(2)]
    engine = GenericOverlapEngine(_CountsInGroup(params, lr=0.1))
    for p in params:
        p.grad = torch.ones(2)
    engine.step_params([params[0]])
    engine.step_params([params[1]])
    assert engine.param_groups[0]["steps_seen"] == 2
    assert engine.param_groups[0]["params"] == params


def test_engine_steps_exactly_the_given_parameters() -> None:
    from overlapkit.overlap.core.generic import GenericOverlapEngine

    params = [nn.Parameter(torch.ones(2)) for _ in range(3)]
    reference = [nn.Parameter(torch.ones(2)) for _ in range(3)]
    engine = GenericOverlapEngine(torch.optim.Adam(params, lr=0.1))
    plain = torch.optim.Adam(reference, lr=0.1)
    for p in params + reference:
        p.grad = torch.full((2,), 0.5)
    engine.step_params([params[2], params[0], nn.Parameter(torch.ones(1))])
    plain.step()
    assert torch.equal(params[0], reference[0]) and torch.equal(params[2], reference[2])
    assert torch.equal(params[1], torch.ones(2))
    assert params[1] not in engine.state
    assert engine.param_groups[0]["params"] == params  # the live groups are untouched
