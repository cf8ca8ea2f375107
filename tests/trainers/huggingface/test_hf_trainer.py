"""``OverlapTrainer``: Hugging Face's ``Trainer`` with its defaults (``max_grad_norm=1.0``,
AdamW), ``gradient_accumulation_steps=2``, a cosine schedule with warm-up, bf16 autocast
on CPU and ``resume_from_checkpoint`` trains bitwise as the plain ``Trainer`` — the same
parameters, the same logged gradient norms and learning rates — on GPT-2 (tied weights)
and BERT, on one process and on 2 gloo ranks, with both techniques; the ``optimizer.pt``
it saves resumes bitwise. A plain ``optimizer_in_backward`` handed to the ``Trainer``
is refused at its first backward, before anything steps (0.2: silently unclipped, 0.0153
off; 0.3: raised after 1 or 2 steps). A second ``OverlapTrainer`` on the same model on 2
ranks trains bitwise as the plain one (0.4 before the third probe: refused)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_runs import SAVE_AT, arguments, cases, run, same_run, train

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
    """One process launched as torchrun launches it: on CPU Accelerate wraps the model
    in DDP (of one rank) then, so overlap_ddp runs too."""
    (result,) = run_distributed(run, 1, args=(str(tmp_path_factory.mktemp("launched")),
                                              ("overlap_ddp",)), timeout=300)
    return result


@pytest.mark.parametrize("case", CASES)
def test_one_launched_process_overlap_ddp_is_bitwise_the_plain_trainer(
        one_launched_process: dict[str, Any], case: str) -> None:
    assert one_launched_process["clipping active"]
    assert one_launched_process["overlap_ddp stepped with the facade"] == "DDPOverlapOptimizer"
    assert one_launched_process["overlap_ddp stepped in backward"]
    assert one_launched_process[f"overlap_ddp {case}"]


@pytest.mark.parametrize("case", CASES)
def test_one_process_optimizer_in_backward_is_bitwise_the_plain_trainer(
        one_process: dict[str, Any], case: str) -> None:
    assert one_process["clipping active"]
    assert one_process["optimizer_in_backward stepped with the facade"] == "OptimizerInBackward"
    assert one_process["optimizer_in_backward stepped in backward"]
    assert one_process[f"optimizer_in_backward {case}"]


@pytest.mark.parametrize("technique", TECHNIQUES)
@pytest.mark.parametrize("case", CASES)
def test_two_ranks_are_bitwise_the_plain_trainer(two_ranks: list[dict[str, Any]],
                                                  technique: str, case: str) -> None:
    for rank_results in two_ranks:
        assert rank_results["clipping active"]
        assert rank_results[f"{technique} {case}"]


def test_two_ranks_step_with_each_technique(two_ranks: list[dict[str, Any]]) -> None:
    assert two_ranks[0]["overlap_ddp stepped with the facade"] == "DDPOverlapOptimizer"
    assert two_ranks[0]["optimizer_in_backward stepped with the facade"] == \
        "OptimizerInBackward"
    for rank_results in two_ranks:
        for technique in TECHNIQUES:
            assert rank_results[f"{technique} stepped in backward"], technique


def test_the_saved_optimizer_state_is_the_plain_trainers(tmp_path: Path) -> None:
    for technique in (None, "optimizer_in_backward"):
        train(technique, "gpt2", str(tmp_path / str(technique)), save_strategy="steps",
              save_steps=SAVE_AT, max_steps=SAVE_AT)
    plain, ours = (torch.load(tmp_path / name / f"checkpoint-{SAVE_AT}" / "optimizer.pt",
                              weights_only=True) for name in ("None", "optimizer_in_backward"))
    assert plain["param_groups"] == ours["param_groups"]
    assert plain["state"].keys() == ours["state"].keys()
    for index, state in plain["state"].items():
        for key, value in state.items():
            assert torch.equal(value, ours["state"][index][key]), (index, key)


@pytest.mark.parametrize(("overrides", "named"), [
    ({}, r"max_grad_norm=1\b.*gradient_accumulation_steps=2"),
    ({"max_grad_norm": 0.0}, r"whose gradient_accumulation_steps=2"),
])
def test_an_overlapkit_optimizer_in_the_plain_trainer_is_refused_before_the_first_step(
        tmp_path: Path, overrides: dict[str, Any], named: str) -> None:
    # 0.3: raised at the first clip, or (max_grad_norm=0) at the first step() ending an
    # accumulation window, after the parameters had taken 1 or 2 steps
    from hf_models import Tokens, gpt2, quiet
    from transformers import Trainer, get_scheduler

    quiet()
    model = gpt2()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=1e-2)
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=2, num_training_steps=6)
    trainer = Trainer(model=model, args=arguments(str(tmp_path), **overrides),
                      train_dataset=Tokens("gpt2"), optimizers=(optimizer, scheduler))
    with pytest.raises(overlapkit.ConfigurationError, match=named) as info:
        trainer.train()
    assert "Nothing has stepped yet" in str(info.value)
    assert "OverlapTrainer" in str(info.value)
    assert trainer.state.global_step == 0
    assert all(p.detach().equal(b) for p, b in zip(model.parameters(), before, strict=True))


def test_overlap_ddp_on_one_process_without_torchrun_is_refused(tmp_path: Path) -> None:
    with pytest.raises(overlapkit.ConfigurationError, match=r"nothing to overlap.*torchrun"):
        train("overlap_ddp", "gpt2", str(tmp_path))


def test_with_max_grad_norm_0_the_plain_grad_norm_is_logged_and_training_is_the_plain_one(
        tmp_path: Path) -> None:
    # 0.3 logged no grad_norm (optimizer_in_backward had freed the gradients)
    plain = train(None, "gpt2", str(tmp_path / "plain"), max_grad_norm=0.0)
    ours = train("optimizer_in_backward", "gpt2", str(tmp_path / "ours"), max_grad_norm=0.0)
    assert None not in plain["grad_norms"]
    assert ours["grad_norms"] == plain["grad_norms"]
    assert same_run(plain, ours)


def _overlap_trainer(tmp_path: Path, *, optimizers: Any = (None, None), **options: Any) -> Any:
    from hf_models import Tokens, gpt2, quiet

    from overlapkit.integrations.transformers import OverlapTrainer

    quiet()
    arguments_overrides = options.pop("arguments", {})
    model = options.pop("model", None) or gpt2()
    return OverlapTrainer(model=model, args=arguments(str(tmp_path), **arguments_overrides),
                          train_dataset=Tokens("gpt2"), optimizers=optimizers, **options)


@pytest.mark.parametrize(("options", "named"), [
    ({"arguments": {"torch_compile": True, "torch_compile_backend": "eager"}},
     "torch_compile=True"),
    ({"arguments": {"fp16": True, "bf16": False}}, "fp16=True"),
    ({"overlap_options": {"clip_grad_norm": 2.0}}, "'clip_grad_norm'.*max_grad_norm"),
    ({"technique": "zero"}, "technique must be one of"),
])
def test_settings_it_cannot_honour_are_refused_when_it_is_built(
        tmp_path: Path, options: dict[str, Any], named: str) -> None:
    with pytest.raises(overlapkit.ConfigurationError, match=named):
        _overlap_trainer(tmp_path, **options)


def test_an_optimizer_overlapkit_already_set_up_is_refused(tmp_path: Path) -> None:
    from hf_models import gpt2

    model = gpt2()
    optimizer = overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=1e-2)
    with pytest.raises(overlapkit.UnsupportedOptimizerError, match="plain optimizer"):
        _overlap_trainer(tmp_path, model=model, optimizers=(optimizer, None))


class Unknown(torch.optim.SGD):
    """An optimizer class from outside torch and transformers."""


def test_an_optimizer_from_args_optim_outside_torch_and_transformers_is_refused(
        tmp_path: Path) -> None:
    trainer = _overlap_trainer(tmp_path)
    model = trainer.model
    with pytest.raises(overlapkit.ConfigurationError, match=r"optim='adamw_torch_fused'.*Unknown"):
        trainer.check_optimizer(Unknown(model.parameters(), lr=0.1))
    trainer.check_optimizer(torch.optim.AdamW(model.parameters()))  # torch's: accepted


def test_a_plain_optimizer_given_to_it_is_the_one_stepped(tmp_path: Path) -> None:
    from hf_models import gpt2

    model = gpt2()
    optimizer = Unknown(model.parameters(), lr=1e-2)  # the user's choice: accepted
    trainer = _overlap_trainer(tmp_path, model=model, optimizers=(optimizer, None),
                               arguments={"max_steps": 2})
    trainer.train()
    assert trainer.optimizer.optimizer.optimizer is optimizer


def test_two_ranks_a_second_trainer_on_the_same_model_is_bitwise_the_plain_trainer(
        tmp_path: Path) -> None:
    # 0.4 before the probe: refused at the second Trainer's train() ("already stepped
    # during backward"): the first Trainer's optimizer sat on its own DDP wrapper
    from trainer_runs import second_trainers

    for rank_results in run_distributed(second_trainers, 2, args=(str(tmp_path),),
                                        timeout=420):
        for technique, found in rank_results.items():
            assert found, (technique, str(found))


def test_sync_each_batch_is_refused_in_the_trainers_terms(tmp_path: Path) -> None:
    """Set through ``TrainingArguments(accelerator_config=...)``, the refusal names that
    setting (before the fifth probe: Accelerate's GradientAccumulationPlugin and
    ``accelerator.accumulate()``, which a Trainer user never writes)."""
    from hf_models import Tokens, gpt2, quiet

    from overlapkit.integrations.transformers import OverlapTrainer

    quiet()
    args = arguments(str(tmp_path), accelerator_config={
        "gradient_accumulation_kwargs": {"sync_each_batch": True}})
    with pytest.raises(overlapkit.ConfigurationError) as info:
        OverlapTrainer(model=gpt2(), args=args, train_dataset=Tokens("gpt2"))
    message = str(info.value)
    assert "accelerator_config" in message and "gradient_accumulation_kwargs" in message
    assert "GradientAccumulationPlugin" not in message
    assert "accelerator.accumulate" not in message
