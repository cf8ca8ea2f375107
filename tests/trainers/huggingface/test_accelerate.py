"""``overlapkit.integrations.accelerate.prepare``: the ordinary Accelerate loop —
``accumulate()``, ``backward``, ``clip_grad_norm_``, ``step()``, a prepared cosine
schedule, ``zero_grad()``, ``save_state``/``load_state`` — with bf16 autocast trains
bitwise as the same loop with the plain optimizer (parameters and the norms
``clip_grad_norm_`` returns), on GPT-2 (tied weights) and BERT, on one process and 2
gloo ranks, with both techniques. A clip it was not set up for raises at the first call;
settings it cannot honour raise before anything is prepared. A new optimizer after
``accelerator.free_memory()`` (same Accelerator, or a new one over the unwrapped model)
trains bitwise as the plain loop (0.4 before the third probe: refused)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from accelerate_runs import MAX_NORM, cases, run

import overlapkit
from overlapkit.distributed import run_distributed

pytestmark = pytest.mark.trainers

TECHNIQUES = ("overlap_ddp", "optimizer_in_backward")
CASES = ("gpt2", "gpt2 resumed", "bert")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return cases(str(tmp_path_factory.mktemp("one")), ("optimizer_in_backward",))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(run, 2, args=(str(tmp_path_factory.mktemp("two")),), timeout=420)


@pytest.fixture(scope="module")
def one_launched_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process launched as torchrun launches it: Accelerate wraps the model in DDP
    (on CPU) but does not enter its no_sync() with one process; prepare() does."""
    (result,) = run_distributed(run, 1, args=(str(tmp_path_factory.mktemp("launched")),
                                              ("overlap_ddp",)), timeout=300)
    return result


@pytest.mark.parametrize("case", CASES)
def test_one_launched_process_overlap_ddp_is_bitwise_the_plain_loop(
        one_launched_process: dict[str, Any], case: str) -> None:
    assert one_launched_process["clipping active"]
    assert one_launched_process["overlap_ddp stepped in backward"]
    assert one_launched_process[f"overlap_ddp {case}"]


@pytest.mark.parametrize("case", CASES)
def test_one_process_optimizer_in_backward_is_bitwise_the_plain_loop(
        one_process: dict[str, Any], case: str) -> None:
    assert one_process["clipping active"]
    assert one_process["optimizer_in_backward stepped with the facade"] == "OptimizerInBackward"
    assert one_process["optimizer_in_backward stepped in backward"]
    assert one_process[f"optimizer_in_backward {case}"]


@pytest.mark.parametrize("technique", TECHNIQUES)
@pytest.mark.parametrize("case", CASES)
def test_two_ranks_are_bitwise_the_plain_loop(two_ranks: list[dict[str, Any]],
                                               technique: str, case: str) -> None:
    for rank_results in two_ranks:
        assert rank_results["clipping active"]
        assert rank_results[f"{technique} stepped in backward"]
        assert rank_results[f"{technique} {case}"]
    assert two_ranks[0][f"{technique} stepped with the facade"] == {
        "overlap_ddp": "DDPOverlapOptimizer", "optimizer_in_backward": "OptimizerInBackward",
    }[technique]


@pytest.fixture
def fresh_state() -> Iterator[None]:
    """Accelerate keeps its settings in process-wide singletons: each refusal test
    builds its own Accelerator from a clean state."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def _prepare(accelerator: Any, technique: str = "optimizer_in_backward",
             **options: Any) -> Any:
    from hf_models import gpt2

    from overlapkit.integrations.accelerate import prepare

    model = gpt2()
    return prepare(accelerator, model, torch.optim.AdamW(model.parameters()),
                   technique=technique, **options)


def test_a_clip_it_was_not_set_up_for_raises_at_the_first_clip(fresh_state: None) -> None:
    from accelerate import Accelerator
    from hf_models import Tokens

    accelerator = Accelerator(cpu=True)
    model, _ = _prepare(accelerator, clip_grad_norm=None)
    batch = torch.utils.data.default_collate([Tokens("gpt2")[i] for i in range(4)])
    before = [p.detach().clone() for p in model.parameters()]
    accelerator.backward(model(**batch).loss)
    with pytest.raises(overlapkit.ConfigurationError,
                       match=r"max_norm=1\b.*Nothing has stepped yet.*"
                             r"accelerate\.prepare\(\.\.\., clip_grad_norm="):
        accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
    assert all(p.detach().equal(b) for p, b in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize(("settings", "named"), [
    ({"dynamo_backend": "eager"}, "torch.compile"),
    ({"kwargs_handlers": "fp16 comm hook"}, "comm hook 'fp16'"),
    ({"gradient_accumulation_plugin": "sync_each_batch"}, "sync_each_batch=True"),
])
def test_settings_it_cannot_honour_are_refused_before_anything_is_prepared(
        fresh_state: None, settings: dict[str, Any], named: str) -> None:
    from accelerate import Accelerator
    from accelerate.utils import (
        DDPCommunicationHookType,
        DistributedDataParallelKwargs,
        GradientAccumulationPlugin,
    )

    real = {"fp16 comm hook": [DistributedDataParallelKwargs(
                comm_hook=DDPCommunicationHookType.FP16)],
            "sync_each_batch": GradientAccumulationPlugin(num_steps=2, sync_each_batch=True)}
    accelerator = Accelerator(cpu=True, **{k: real.get(v, v) for k, v in settings.items()})
    with pytest.raises(overlapkit.ConfigurationError, match=named):
        _prepare(accelerator, clip_grad_norm=MAX_NORM)
    assert accelerator._models == []  # nothing was prepared


def test_fp16_loss_scaling_is_refused(fresh_state: None) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    accelerator.scaler = torch.amp.GradScaler("cpu")  # what fp16 on a GPU sets up
    with pytest.raises(overlapkit.ConfigurationError, match="GradScaler"):
        _prepare(accelerator, clip_grad_norm=MAX_NORM)


def test_overlap_ddp_on_one_process_is_refused_naming_torchrun(fresh_state: None) -> None:
    from accelerate import Accelerator

    with pytest.raises(overlapkit.ConfigurationError, match="torchrun"):
        _prepare(Accelerator(cpu=True), technique="overlap_ddp", clip_grad_norm=MAX_NORM)


def test_clip_grad_norm_must_be_stated(fresh_state: None) -> None:
    from accelerate import Accelerator

    with pytest.raises(TypeError, match="clip_grad_norm"):
        _prepare(Accelerator(cpu=True))


def test_an_unknown_technique_is_refused(fresh_state: None) -> None:
    from accelerate import Accelerator

    with pytest.raises(overlapkit.ConfigurationError, match="technique must be one of"):
        _prepare(Accelerator(cpu=True), technique="zero", clip_grad_norm=None)


def test_on_one_process_accelerator_no_sync_pauses_the_steps(fresh_state: None) -> None:
    # no DDP, so accelerator.no_sync(model) would do nothing: prepare() makes it
    # optimizer.no_step() for this model (accumulate() and the Trainer enter it)
    from accelerate import Accelerator
    from hf_models import Tokens

    accelerator = Accelerator(cpu=True)
    model, optimizer = _prepare(accelerator, clip_grad_norm=None)
    batch = torch.utils.data.default_collate([Tokens("gpt2")[i] for i in range(4)])
    # the first step is taken at step(), which learns the loop (overlapkit.overlap.core.window)
    accelerator.backward(model(**batch).loss)
    optimizer.step()
    optimizer.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    with accelerator.no_sync(model):
        accelerator.backward(model(**batch).loss)
    assert all(p.grad is not None for p in model.parameters())
    assert all(p.detach().equal(b) for p, b in zip(model.parameters(), before, strict=True))
    accelerator.backward(model(**batch).loss)  # steps the sum, frees the gradients
    assert all(p.grad is None for p in model.parameters())


def test_a_new_optimizer_after_free_memory_is_bitwise_the_plain_loop(
        fresh_state: None) -> None:
    # 0.4 before the probe: the second prepare() was refused (model already prepared),
    # where the plain accelerator.prepare(model, new_optimizer) returns the model as is
    from accelerate_runs import rebuilds

    found = rebuilds(0, 1, ("optimizer_in_backward",))["optimizer_in_backward", False]
    assert found, found


def test_two_ranks_a_new_optimizer_after_free_memory_is_bitwise_the_plain_loop() -> None:
    # with a new Accelerator, which wraps the module in a DDP model of its own, 0.4
    # before the probe refused it too ("already stepped during backward")
    from accelerate_runs import rebuilds

    for rank_results in run_distributed(rebuilds, 2, args=(TECHNIQUES, (False, True)),
                                        timeout=420):
        for key, found in rank_results.items():
            assert found, (key, str(found))
        assert len(rank_results) == 4
