"""A comm hook registered on a DDP model overlapkit set up — ``register_comm_hook``,
``_register_builtin_comm_hook``, torch's own ``_register_fused_optim`` — is refused with
a ``ConfigurationError`` that names ``comm_hook=``, before anything changes (training
goes on bitwise the plain DDP loop), also after ``release()`` (DDP keeps a model's one
comm hook for good); a deep copy of that model and any other DDP model take them as
torch does. Before: torch's bare ``RuntimeError`` ("register_comm_hook or
register_builtin_comm_hook can only be called once"). One gloo rank."""

from __future__ import annotations

from typing import Any

import pytest
from comm_hook_guard_ranks import CALLS, run

from overlapkit.distributed import run_distributed


@pytest.fixture(scope="module")
def found() -> dict[Any, Any]:
    return run_distributed(run, 1, timeout=240)[0]


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_a_comm_hook_on_a_model_overlapkit_set_up_is_refused_by_name(
        found: dict[Any, Any], technique: str, name: str) -> None:
    case = found[technique, name]
    for refusal in (case["refused"], case["after release"]):
        assert refusal is not None and refusal["type"] == "ConfigurationError", case
        assert "comm_hook=" in refusal["message"] and "Nothing was registered" in \
            refusal["message"], refusal
    assert case["then bitwise plain"], case


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_a_copy_or_another_ddp_model_takes_a_comm_hook_as_torch_does(
        found: dict[Any, Any], technique: str, name: str) -> None:
    case = found[technique, name]
    assert case["on a copy"] is None, case
    assert case["on another model"] is None, case
