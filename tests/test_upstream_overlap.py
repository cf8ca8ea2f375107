"""PyTorch's own upstream tests of ``DDP._register_fused_optim`` and
``_apply_optimizer_in_backward``, ported to overlapkit's API with their loops unchanged
(most are backward only: the loop 0.2 refused at the second iteration). See
tests/upstream_overlap_ranks.py for what was changed in the port and why.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

import pytest
import torch
from torch import nn
from upstream_overlap_ranks import apply_optim_in_backward_cases, parity_cases, run

import overlapkit
from overlapkit.distributed import run_distributed

PARITY = ["parity " + " ".join(map(str, case)) for case in parity_cases()]
APPLY = ["apply " + " ".join(map(str, case)) for case in apply_optim_in_backward_cases()]


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(run, 2, timeout=600)


@pytest.mark.parametrize("case", PARITY)
def test_ddp_hook_with_optimizer_parity(results: list[dict[str, Any]], case: str) -> None:
    """upstream test_ddp_hook_with_optimizer_parity_{adamw,adam,sgd}[grad_as_bucket_view,
    static_graph, optimize_subset]."""
    for rank_results in results:
        result = rank_results[case]
        assert result["initially"], result["initially"]
        assert result["equal"], result["equal"]
        assert result["first moved"]
        assert result["others untouched"], result["others untouched"]


@pytest.mark.parametrize("case", APPLY)
def test_ddp_apply_optim_in_backward(results: list[dict[str, Any]], case: str) -> None:
    """upstream test_ddp_apply_optim_in_backward and its
    _grad_as_bucket_view_false variant; init_before=True is refused clearly."""
    init_before = case.split()[2] == "True"
    for rank_results in results:
        for model, result in rank_results[case].items():
            if init_before:
                error = result["error"]
                assert error is not None and error["type"] == "ConfigurationError", error
                assert "before DistributedDataParallel wrapped it" in error["message"]
                assert result["unchanged"], (model, result["unchanged"])
                continue
            assert result["initially"], (model, result["initially"])
            assert len(result["equal"]) == 8
            for step, equal in enumerate(result["equal"]):
                assert equal, (model, step, equal)
            assert all(result["grads none"]), (model, result["grads none"])


# -- ApplyOverlappedOptimizerTest (test/distributed/optim/test_apply_optimizer_in_backward.py)


def _validate_params(params_list: list[Any]) -> None:
    ref_params = list(params_list[0])
    for param_list in params_list[1:]:
        for p1, p2 in zip(ref_params, list(param_list), strict=True):
            assert torch.equal(p1, p2)  # upstream: assert_close; here bitwise


def _run_training_loop_and_validate(inp: torch.Tensor, models: list[nn.Module],
                                    optimizers: list[torch.optim.Optimizer]) -> None:
    """upstream's loop, unchanged: the overlapped model's loop is backward only."""
    for _ in range(6):
        for model in models:
            model(inp).sum().backward()
        for opt in optimizers:
            opt.step()
        _validate_params([model.parameters() for model in models])
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)


def _unique(params: list[nn.Parameter]) -> list[nn.Parameter]:
    return list({id(p): p for p in params}.values())


@pytest.mark.parametrize("share_params", [False, True])
def test_apply_optimizer_in_backward(share_params: bool) -> None:
    """upstream _test_apply_optimizer_in_backward: SGD lr 1.0 on the weights and 0.5 on
    the biases, two calls on one model. With shared weights upstream lists the shared
    weight twice (torch's SGD then steps it twice per step, with a warning);
    overlapkit refuses a parameter listed twice with an error naming it, so the port
    lists it once, for both models."""
    weight_optimizer_kwargs = {"lr": 1.0}
    bias_optimizer_kwargs = {"lr": 0.5}
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))
    if share_params:
        model[0].weight = model[1].weight
    weights = _unique([m.weight for m in model])
    biases = [m.bias for m in model]
    optim_weight = torch.optim.SGD(weights, **weight_optimizer_kwargs)
    optim_bias = torch.optim.SGD(biases, **bias_optimizer_kwargs)
    model_with_opt_in_bwd = deepcopy(model)
    if share_params:
        with pytest.raises(overlapkit.ConfigurationError, match="listed more than once"):
            overlapkit.optimizer_in_backward(
                model_with_opt_in_bwd, torch.optim.SGD,
                params=[m.weight for m in model_with_opt_in_bwd], **weight_optimizer_kwargs)
    overlapkit.optimizer_in_backward(
        model_with_opt_in_bwd, torch.optim.SGD,
        params=_unique([m.weight for m in model_with_opt_in_bwd]), **weight_optimizer_kwargs)
    overlapkit.optimizer_in_backward(
        model_with_opt_in_bwd, torch.optim.SGD,
        params=[m.bias for m in model_with_opt_in_bwd], **bias_optimizer_kwargs)
    _validate_params([model.parameters(), model_with_opt_in_bwd.parameters()])
    _run_training_loop_and_validate(torch.randn(4, 10), [model, model_with_opt_in_bwd],
                                    [optim_weight, optim_bias])


def test_multiple_optim_for_params_steps_with_the_last_call_alone() -> None:
    """upstream test_multiple_optim_for_params steps every parameter with two SGDs in
    one backward; overlapkit steps a parameter in backward by one optimizer only: a
    second call over all of the first's parameters replaces it, as building a new
    optimizer does in plain PyTorch (tests/test_rebuild.py), and the model trains as
    with the second alone. A second call over part of them is refused
    (test_optimizer_in_backward.py)."""
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))
    plain = deepcopy(model)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.01)
    overlapkit.optimizer_in_backward(model, torch.optim.SGD, lr=0.03)
    overlapkit.optimizer_in_backward(model, torch.optim.SGD, lr=0.01)
    inp = torch.randn(4, 10)
    model(inp).sum().backward()
    plain(inp).sum().backward()
    plain_opt.step()
    _validate_params([plain.parameters(), model.parameters()])
