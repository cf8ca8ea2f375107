"""Parameter lists and optimizer arguments as users write them: a parameter listed
twice, a malformed group, a single tensor, arguments the optimizer rejects. Each is a
ConfigurationError that names what is wrong, before anything is registered — on a
plain module in this process, and on DDP in 2 gloo ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from parameter_lists_ranks import TiedHead, run

import overlapkit
from overlapkit.distributed import run_distributed

#: case -> the text the ConfigurationError must contain
EXPECTED = {
    "twice in one group": "parameter 'body.weight' is listed more than once",
    "twice across groups": "parameter 'body.weight' is listed more than once",
    "betas too short": "the argument betas=(0.9,)",
    "negative lr": "the argument lr=-1.0",
    "group without params": "param group 0 has no 'params' entry",
    "params is an int": "got int",
    "params is one tensor": "got a single tensor of shape (8, 8)",
}


@pytest.fixture(scope="module")
def ddp_results() -> list[dict[str, Any]]:
    return run_distributed(run, 2, timeout=120)


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_ddp_bad_input_is_a_configuration_error(ddp_results: list[dict[str, Any]],
                                                technique: str, case: str) -> None:
    for rank_results in ddp_results:
        error = rank_results[f"{technique}: {case}"]
        assert error is not None, f"{case}: accepted"
        assert error["type"] == "ConfigurationError", error
        assert EXPECTED[case] in error["message"], error


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_ddp_refusals_leave_the_model_usable(ddp_results: list[dict[str, Any]],
                                            technique: str) -> None:
    assert all(r[f"{technique}: valid call after refusals trains"] for r in ddp_results)


def _plain_cases(model: TiedHead) -> dict[str, dict[str, Any]]:
    w = model.body.weight
    return {
        "twice in one group": {"params": [w, w]},
        "twice across groups": {"params": [{"params": [w]}, {"params": [w], "lr": 0.5}]},
        "betas too short": {"betas": (0.9,)},
        "negative lr": {"lr": -1.0},
        "group without params": {"params": [{"lr": 0.1}]},
        "params is an int": {"params": 5},
        "params is one tensor": {"params": w},
    }


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_plain_module_bad_input_is_a_configuration_error(case: str) -> None:
    model = TiedHead()
    kwargs = {"lr": 0.1, **_plain_cases(model)[case]}
    with pytest.raises(overlapkit.ConfigurationError) as caught:
        overlapkit.optimizer_in_backward(model, torch.optim.AdamW, **kwargs)
    assert EXPECTED[case] in str(caught.value)
    # nothing was registered: a plain training step leaves gradients in place
    model(torch.tensor([[1, 2]])).square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())


#: case the optimizer's own constructor rejects -> the error it raises for it
OPTIMIZER_REJECTS = {
    "betas too short": IndexError,
    "negative lr": ValueError,
    "group without params": KeyError,
    "params is an int": TypeError,
    "params is one tensor": TypeError,
}


def test_the_optimizers_own_error_is_chained() -> None:
    with pytest.raises(overlapkit.ConfigurationError) as caught:
        overlapkit.optimizer_in_backward(TiedHead(), torch.optim.AdamW, lr=0.1, betas=(0.9,))
    assert isinstance(caught.value.__cause__, IndexError)


@pytest.mark.parametrize("case", sorted(OPTIMIZER_REJECTS))
def test_every_rejection_by_the_optimizer_is_chained_to_its_error(case: str) -> None:
    model = TiedHead()
    kwargs = {"lr": 0.1, **_plain_cases(model)[case]}
    with pytest.raises(overlapkit.ConfigurationError) as caught:
        overlapkit.optimizer_in_backward(model, torch.optim.AdamW, **kwargs)
    assert isinstance(caught.value.__cause__, OPTIMIZER_REJECTS[case]), caught.value.__cause__


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
@pytest.mark.parametrize("case", sorted(OPTIMIZER_REJECTS))
def test_ddp_rejections_by_the_optimizer_are_chained_to_its_error(
        ddp_results: list[dict[str, Any]], technique: str, case: str) -> None:
    for rank_results in ddp_results:
        cause = rank_results[f"{technique}: {case}"]["cause"]
        assert cause == OPTIMIZER_REJECTS[case].__name__, rank_results[f"{technique}: {case}"]


def test_a_tied_weight_is_one_parameter_and_is_accepted() -> None:
    model = TiedHead()
    opt = overlapkit.optimizer_in_backward(model, torch.optim.SGD, lr=0.1)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
