"""A torch.amp.GradScaler driving an optimizer that steps during backward is refused at
the first scaler.step() with a ConfigurationError — never a silent step on scaled
gradients, never torch's bare "No inf checks were recorded" (2 gloo ranks, and a plain
module here)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from grad_scaler_ranks import run
from helpers import compare
from torch import nn

import overlapkit
from overlapkit.distributed import run_distributed


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(run, 2, timeout=120)


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_a_grad_scaler_is_refused_on_ddp(results: list[dict[str, Any]], technique: str) -> None:
    for rank_results in results:
        error = rank_results[technique]
        assert error is not None and error["type"] == "ConfigurationError", error
        assert "GradScaler" in error["message"] and "scaled gradients" in error["message"]
        assert "grad_scaler=scaler" in error["message"]
        assert rank_results[f"{technique} plain step after"] is None
        error = rank_results[f"{technique} unscale_"]
        assert error is not None and error["type"] == "ConfigurationError", error
        assert "grad_scaler=scaler" in error["message"]
        assert rank_results[f"{technique} unscale_ left grads"]


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
@pytest.mark.parametrize("call", ["step", "unscale_"])
@pytest.mark.parametrize("given", ["with", "without"])
def test_a_grad_scaler_on_the_adopted_optimizer_is_refused_on_ddp(
        results: list[dict[str, Any]], technique: str, call: str, given: str) -> None:
    """scaler.step(inner) / scaler.unscale_(inner) on the optimizer handed to the
    technique: before, torch's bare AssertionError ("No inf checks were recorded")
    under optimizer_in_backward, and under overlap_ddp the kept gradients unscaled in
    place before the plain-step refusal."""
    for rank_results in results:
        key = f"{technique} adopted {call} {given} grad_scaler"
        error = rank_results[key]
        assert error is not None and error["type"] == "ConfigurationError", error
        assert f"scaler.{call}(optimizer)" in error["message"]
        assert "adopted" in error["message"] and "grad_scaler=scaler" in error["message"]
        assert rank_results[f"{key} unchanged"]
        assert rank_results[f"{key} attrs"] == []


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
@pytest.mark.parametrize("given", ["with", "without"])
def test_sharded_grad_scaler_unscale_is_refused_on_ddp(
        results: list[dict[str, Any]], technique: str, given: str) -> None:
    """FSDP's ShardedGradScaler has its own unscale_: before, not seen (the kept gradients
    unscaled in place under overlap_ddp, silently)."""
    for rank_results in results:
        key = f"{technique} ShardedGradScaler unscale_ {given}"
        error = rank_results[key]
        assert error is not None and error["type"] == "ConfigurationError", error
        assert ("grad_scaler=scaler" if given == "without" else "clip_grad_norm=") in (
            error["message"])
        assert rank_results[f"{key} unchanged"]


def test_a_grad_scaler_on_a_second_plain_optimizer_is_refused() -> None:
    """A plain optimizer over parameters optimizer_in_backward steps (freed gradients):
    before, torch's bare AssertionError from scaler.step."""
    model = nn.Linear(4, 2)
    opt = overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=0.1)
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.ones(3, 4)).sum()).backward()
    with pytest.raises(overlapkit.ConfigurationError, match="stepped twice"):
        scaler.step(other)
    opt.release()


@pytest.mark.parametrize("call", ["step", "unscale_"])
def test_a_scaler_other_than_the_one_set_up_is_refused_at_its_call(call: str) -> None:
    """Two scalers (one given as grad_scaler=, another driving the loop): before, the
    step taken and torch's bare AssertionError ("No inf checks were recorded prior to
    update.") at the loop scaler's update()."""
    model = nn.Linear(4, 2)
    set_up = torch.amp.GradScaler("cpu", init_scale=1024.0)
    loop = torch.amp.GradScaler("cpu", init_scale=1024.0)
    opt = overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=0.1,
                                           grad_scaler=set_up)
    loop.scale(model(torch.ones(3, 4)).sum()).backward()
    with pytest.raises(overlapkit.ConfigurationError,
                       match=r"other than the one optimizer_in_backward was set up with"):
        getattr(loop, call)(opt)
    opt.release()


def test_learn_first_step_with_grad_scaler_keeps_the_overlap_bitwise() -> None:
    """learn_first_step (what the integrations call) with grad_scaler=: before, the
    scaler's own inf check in scaler.step(opt) (GradScaler._check_inf_per_device) was
    taken for the loop reading the gradients: the plain order, with a warning saying so."""
    import warnings

    def loop(overlapped: bool) -> tuple[list[torch.Tensor], list[str], bool]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        opt: Any = torch.optim.AdamW(model.parameters(), lr=0.1)
        if overlapped:
            opt = overlapkit.optimizer_in_backward(model, opt, grad_scaler=scaler)
            opt.learn_first_step(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(3):
                batch = torch.Generator().manual_seed(step)
                scaler.scale(model(torch.randn(3, 4, generator=batch)).square().sum()).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
        learned = overlapped and opt._steps.learned
        if overlapped:
            opt.release()
        return ([p.detach().clone() for p in model.parameters()],
                [str(w.message) for w in caught if "takes every step" in str(w.message)],
                learned)

    plain, _, _ = loop(False)
    got, warned, learned = loop(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, got, strict=True))
    assert warned == [] and learned


def test_a_grad_scaler_is_refused_on_a_plain_module() -> None:
    model = nn.Linear(4, 2)
    opt = overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.ones(3, 4)).sum()).backward()
    with pytest.raises(overlapkit.ConfigurationError, match="GradScaler"):
        scaler.step(opt)


def test_unscale_is_refused_on_a_plain_module_without_grad_scaler() -> None:
    model = nn.Linear(4, 2)
    opt = overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.ones(3, 4)).sum()).backward()
    with pytest.raises(overlapkit.ConfigurationError, match=r"grad_scaler=scaler"):
        scaler.unscale_(opt)


def test_unscale_with_grad_scaler_points_to_clip_grad_norm() -> None:
    """With grad_scaler= the step was taken at the end of backward: clipping between
    unscale_ and step would change nothing, so unscale_ says to use clip_grad_norm=."""
    model = nn.Linear(4, 2)
    scaler = torch.amp.GradScaler("cpu")
    opt = overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=0.1,
                                           grad_scaler=scaler)
    scaler.scale(model(torch.ones(3, 4)).sum()).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(overlapkit.ConfigurationError, match="clip_grad_norm=max_norm"):
        scaler.unscale_(opt)
    assert compare(before, [p.detach() for p in model.parameters()])  # untouched
    scaler.step(opt)  # the loop without unscale_ goes on
    scaler.update()
    assert scaler.get_scale() == 65536.0


@pytest.mark.parametrize("call", ["step", "unscale_"])
def test_a_scaler_driving_a_replaced_optimizer_names_the_replacement(call: str) -> None:
    """An optimizer replaced by a later call on its parameters: before,
    scaler.unscale_(old) was refused as built without grad_scaler= (not the reason)."""
    model = nn.Linear(4, 2)
    old = overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=0.1)
    new = overlapkit.optimizer_in_backward(model, torch.optim.SGD, lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.ones(3, 4)).sum()).backward()
    with pytest.raises(overlapkit.ConfigurationError,
                       match=rf"was replaced by a later .* so scaler\.{call}\(optimizer\)"):
        getattr(scaler, call)(old)
    new.release()


@pytest.mark.parametrize("imported", ["before overlapkit", "after the set-up"])
def test_fsdps_sharded_grad_scaler_is_guarded_whenever_its_module_is_imported(
        imported: str) -> None:
    """overlapkit no longer imports FSDP to know its scaler (1.5 s of CPU with DTensor):
    ShardedGradScaler's own unscale_ is wrapped as its module is imported, before or
    after the set-up, and its unscale_ on a plain module's optimizer is refused,
    nothing unscaled."""
    first = "from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler\n"
    code = (
        "import sys, torch, overlapkit\n"
        + (first if imported == "before overlapkit" else "")
        + "model = torch.nn.Linear(4, 2)\n"
        "opt = overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=0.1)\n"
        + (first if imported == "after the set-up" else "")
        + "from overlapkit.overlap.rules.amp_scaler import SCALERS\n"
        "assert ShardedGradScaler in SCALERS, SCALERS\n"
        "assert hasattr(ShardedGradScaler.unscale_, '__wrapped__')\n"
        "assert hasattr(torch.amp.GradScaler.unscale_, '__wrapped__')\n"
        "scaler = ShardedGradScaler('cpu', init_scale=1024.0)\n"
        "scaler.scale(model(torch.ones(3, 4)).sum()).backward()\n"
        "before = [p.detach().clone() for p in model.parameters()]\n"
        "try:\n"
        "    scaler.unscale_(opt)\n"
        "except overlapkit.ConfigurationError as error:\n"
        "    print('refused:', error)\n"
        "assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("refused: ") and "grad_scaler=" in proc.stdout, proc.stdout
