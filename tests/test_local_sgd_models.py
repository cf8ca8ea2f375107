"""post_local_sgd on a model with an integer parameter and a frozen layer inside the
optimizer: bitwise torch's PostLocalSGDOptimizer (periodic, and hierarchical), 4 gloo
ranks. torch averages only parameters that have gradients; overlapkit leaves out
exactly the integer and frozen ones, so the flat buffers — and the results — match."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import failures
from local_sgd_models_ranks import checkpoint_refused, run

from overlapkit.distributed import run_distributed

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(run, 4, timeout=240)


@pytest.mark.parametrize("averager", ["periodic", "hierarchical"])
def test_bitwise_torch_with_integer_and_frozen_parameters(results: list[dict[str, Any]],
                                                          averager: str) -> None:
    assert failures(results, averager) == {}


def test_the_integer_parameter_is_left_alone(results: list[dict[str, Any]]) -> None:
    assert failures(results, "integer parameter unchanged") == {}


def test_a_trainable_parameter_no_rank_uses_is_not_averaged_as_in_torch(
        results: list[dict[str, Any]]) -> None:
    assert failures(results, "unused trainable parameter") == {}



def test_an_overlapkit_checkpoint_of_post_local_sgd_is_refused_on_every_rank(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    directory = str(tmp_path_factory.mktemp("post-local-sgd"))
    for rank_results in run_distributed(checkpoint_refused, 2, args=(directory,),
                                        timeout=120):
        for call in ("save", "load"):
            error = rank_results[call]
            assert error is not None and error["type"] == "CheckpointError", error
            assert "cannot go into an overlapkit checkpoint" in error["message"]
            assert "torch.save" in error["message"]
        assert not rank_results["written"]
        assert rank_results["unchanged"], rank_results["unchanged"]
        assert rank_results["averager step kept"]
