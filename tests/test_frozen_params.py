"""Frozen parameters in ``params=`` are accepted as torch's optimizers accept them
(``optimizer_in_backward(model, AdamW, params=model.parameters())`` with a frozen
embedding, param-group dicts from ``named_parameters()``): never stepped, no state,
``state_dict()`` equal to the plain optimizer's. 0.2 refused them. A parameter unfrozen
after set-up is stepped from the next backward on, bitwise the plain optimizer (a plain
module, FSDP2), or — on DDP, which decides at construction which parameters it reduces —
refused with a clear error at the next forward, before anything changes."""

from __future__ import annotations

from typing import Any

import pytest
from frozen_params_ranks import cases, run, run_loads

from overlapkit.distributed import run_distributed

CASES = [" | ".join(case) for case in cases()]


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(run, 2, timeout=300)


@pytest.mark.parametrize("case", CASES)
def test_frozen_parameters_in_params_train_as_the_plain_optimizer(
        results: list[dict[str, Any]], case: str) -> None:
    for rank_results in results:
        result = rank_results[case]
        assert result["values"], result["values"]
        assert result["state"], result["state"]  # no state for the frozen embedding
        assert result["groups"]
        assert not result["embedding state"]


@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith("ddp")])
def test_a_parameter_unfrozen_later_is_stepped_as_the_plain_optimizer_steps_it(
        results: list[dict[str, Any]], case: str) -> None:
    for rank_results in results:
        result = rank_results[f"{case} | unfrozen later"]
        assert result["values"], result["values"]
        assert result["state"], result["state"]
        assert result["embedding state"]  # it was stepped


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("ddp")])
def test_a_parameter_unfrozen_later_under_ddp_is_refused_before_anything_changes(
        results: list[dict[str, Any]], case: str) -> None:
    for rank_results in results:
        result = rank_results[f"{case} | unfrozen later"]
        error = result["error"]
        assert error is not None and error["type"] == "ConfigurationError", error
        assert "'embed.weight' was frozen" in error["message"]
        assert "build a new DistributedDataParallel" in error["message"]
        assert result["unchanged"]


@pytest.fixture(scope="module")
def loads() -> list[dict[str, Any]]:
    return run_distributed(run_loads, 2, timeout=300)


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_the_plain_loops_state_dict_with_frozen_parameters_is_refused_naming_them(
        loads: list[dict[str, Any]], technique: str) -> None:
    """0.4 before this: torch's bare ``ValueError`` ("... doesn't match the size of
    optimizer's group") on every rank, nothing saying why."""
    for rank_results in loads:
        result = rank_results[f"{technique} | trainable only"]
        error = result["error"]
        assert error is not None and error["type"] == "ConfigurationError", error
        assert "'embed.weight'" in error["message"], error["message"]
        assert "params=model.parameters()" in error["message"]
        assert result["nothing loaded"]


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_the_plain_loops_state_dict_loads_with_params_and_trains_as_resumed(
        loads: list[dict[str, Any]], technique: str) -> None:
    for rank_results in loads:
        result = rank_results[f"{technique} | params=model.parameters()"]
        assert result["values"], result["values"]
