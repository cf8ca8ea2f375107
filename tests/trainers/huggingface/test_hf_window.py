"""``OverlapTrainer`` in a run that works in the window between backward and
``optimizer.step()`` (issue 30, cases 1 to 3): a callback changing ``.grad`` in
``on_pre_optimizer_step`` (0.3: 0.020 off the plain run with ``overlap_ddp``, a raw
``TypeError`` after a step with ``optimizer_in_backward``), one logging per-parameter
gradient norms there (0.3: logged ``{}``), a ``create_optimizer`` override (0.3: refused,
blaming ``optim='adamw_torch_fused'``), a ``training_step`` override running two
backwards (FGM; 0.3: a raw ``TypeError`` or a refusal after a step). Each now takes its
steps in the plain order: bitwise the plain ``Trainer`` (parameters, optimizer state,
logged ``grad_norm`` and learning rates, the callback's logs), with one warning naming
what turned the overlap off; on one process and on 2 gloo ranks, with both techniques.
Found by 0.4's probe, each silent or refused after a step before: a ``training_step``
editing ``.grad`` in a Trainer subclass listed after ``OverlapTrainer`` (0.0148 off), a
``_clip_grad_norm`` override (refused after the first step), a callback changing
``.grad`` added for a second ``train()`` (ignored) or by another callback while training
(0.0193 off), one set on a callback instance (0.0149 off). Found by the fifth probe,
what makes the Trainer's clip differ from the one set up (each seen before the backward
that would step, then the plain order): ``max_grad_norm`` lowered by a callback (was
refused at the Trainer's clip, after the step it was for) or set to 0 for a second ``train()``
(silently 0.0152 off, other logged ``grad_norm``), a frozen layer unfrozen while
training (refused after its step), an optimizer given through
``optimizers=`` over part of the trainable parameters (refused at the first clip, after
the first backward stepped). Found by the sixth probe: an epoch shorter than the
accumulation window (stepped in its unsynced last micro-batch, then refused as a second
backward, 0.0252 off), a window callback added in another callback's ``on_step_begin``
(that step's edit missed, 0.0180 off), ``model_init`` (the overlap off from the second
``train()``, with a false warning). Found by the eighth: a ``compute_loss`` running a
backward of its own, or hooking backwards onto its loss (GradCache): refused at the
first ``optimizer.step()`` after 2 steps were taken (the parameters moved 0.0200); a
``compute_loss`` calling ``self.model`` past the DDP model on 2 ranks (``overlap_ddp``
silently 1.2e-7 off, ``optimizer_in_backward`` refused naming
``find_unused_parameters``), now refused before the Trainer's backward. Found by the
eleventh: ``training_step``, ``_clip_grad_norm`` or ``compute_loss`` set on the Trainer
instance (a patch, which the loop calls as an override) was not seen: the
``training_step`` editing ``.grad`` silently 0.030 off (``optimizer_in_backward``), the
clip refused after its step, the ``compute_loss``'s auxiliary backward stepped and was
refused as a second backward; a callback wrapping the Trainer's ``optimizer.step`` at
``on_train_begin`` to edit ``.grad`` first (0.036 off under ``optimizer_in_backward``,
with only a warning about reading freed gradients)."""

from __future__ import annotations

from typing import Any

import pytest
from trainer_helpers import check_plain_order
from window_runs import CASES, compare_case, forward_past_ddp_runs, run

from overlapkit.distributed import run_distributed

pytestmark = pytest.mark.trainers


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = str(tmp_path_factory.mktemp("window-one"))
    return {case: compare_case(case, out, ("optimizer_in_backward",)) for case in CASES}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(run, 2, args=(str(tmp_path_factory.mktemp("window-two")),),
                           timeout=600)


@pytest.fixture(scope="module")
def one_launched_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process launched as torchrun launches it: Accelerate wraps the model in DDP
    (of one rank), so overlap_ddp runs too."""
    (result,) = run_distributed(run, 1, args=(str(tmp_path_factory.mktemp("window-l")),),
                                timeout=600)
    return result


NAMED = {"callback zeroes rows": "ZeroOldRows.on_pre_optimizer_step",
         "callback logs norms": "LogNorms.on_pre_optimizer_step",
         "create_optimizer": "CustomOptimizer.create_optimizer",
         "two backwards": "FGM.training_step",
         "base listed after": "EditingBase.training_step",
         "own clip": "OwnClip._clip_grad_norm",
         "callback for a second train": "ZeroOldRows.on_pre_optimizer_step",
         "callback added while training": "ZeroOldRows.on_pre_optimizer_step",
         "max_grad_norm lowered while training": "max_grad_norm=0.3, changed since",
         "max_grad_norm 0 for a second train": "max_grad_norm=0.0, changed since",
         "a layer unfrozen while training": "requires_grad changed on 1 parameter since",
         "optimizer over part of the model": "requiring grad outside the optimizer",
         "epoch shorter than the window": "a micro-batch run outside no_sync() that ends "
                                          "no optimizer step",
         "callback added at a step's beginning": "ZeroOldRows.on_pre_optimizer_step",
         "an optimizer class overriding step()": "Noisy.step() overrides Adam.step()",
         "compute_loss running a backward": "AuxiliaryLoss.compute_loss (it ran a backward",
         "compute_loss hooking the loss": "CachedLoss.compute_loss (it returned a loss with "
                                          "a hook",
         "training_step patched on the instance": "training_step set on the ",
         "_clip_grad_norm patched on the instance": "_clip_grad_norm set on the ",
         "compute_loss patched on the instance": "compute_loss set on the ",
         "optimizer.step patched by a callback": "a step() set on this AcceleratedOptimizer"}


@pytest.mark.parametrize("case", CASES)
def test_one_process_a_run_using_the_window_is_bitwise_the_plain_trainer_with_one_warning(
        one_process: dict[str, Any], case: str) -> None:
    check_plain_order(one_process[case]["optimizer_in_backward"], NAMED[case])


@pytest.mark.parametrize("case", CASES)
def test_one_launched_process_overlap_ddp_using_the_window_is_bitwise_the_plain_trainer(
        one_launched_process: dict[str, Any], case: str) -> None:
    check_plain_order(one_launched_process[case]["overlap_ddp"], NAMED[case])
    same, differences = one_launched_process["max_grad_norm 0"]["overlap_ddp"]
    assert same, differences


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
@pytest.mark.parametrize("case", CASES)
def test_two_ranks_a_run_using_the_window_is_bitwise_the_plain_trainer_with_one_warning(
        two_ranks: list[dict[str, Any]], case: str, technique: str) -> None:
    for rank_results in two_ranks:
        check_plain_order(rank_results[case][technique], NAMED[case])


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_two_ranks_with_max_grad_norm_0_the_plain_grad_norm_is_logged(
        two_ranks: list[dict[str, Any]], technique: str) -> None:
    for rank_results in two_ranks:
        assert rank_results["max_grad_norm 0"]["plain logged"]
        same, differences = rank_results["max_grad_norm 0"][technique]
        assert same, differences


def test_jit_checkpointing_turns_the_overlap_off_with_a_warning_naming_its_flag(
        tmp_path: Any) -> None:
    # transformers' JITCheckpointCallback saves in on_pre_optimizer_step (on SIGTERM): the
    # plain order is right; the warning pointed at overlapkit_reads_no_gradients instead
    import warnings

    from hf_models import Tokens, gpt2, quiet
    from trainer_runs import arguments

    from overlapkit.integrations.transformers import OverlapTrainer

    quiet()
    trainer = OverlapTrainer(model=gpt2(), args=arguments(
        str(tmp_path), max_steps=2, enable_jit_checkpoint=True), train_dataset=Tokens("gpt2"))
    assert trainer.window_users() == ["the callback JITCheckpointCallback.on_pre_optimizer_step"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    said = [str(w.message) for w in caught if "without overlap" in str(w.message)]
    assert len(said) == 1 and "leave enable_jit_checkpoint off" in said[0], said


def test_a_subclass_declaring_it_reads_no_gradients_keeps_the_overlap(tmp_path: Any) -> None:
    from hf_models import Tokens, gpt2, quiet
    from trainer_runs import arguments

    from overlapkit.integrations.transformers import OverlapTrainer

    class Logged(OverlapTrainer):
        overlapkit_reads_no_gradients = True

        def training_step(self, *args: Any, **kwargs: Any) -> Any:
            return super().training_step(*args, **kwargs)

    quiet()
    trainer = Logged(model=gpt2(), args=arguments(str(tmp_path), max_steps=2),
                     train_dataset=Tokens("gpt2"))
    assert trainer.window_users() == []
    trainer.train()
    assert type(trainer.optimizer.optimizer).__name__ == "OptimizerInBackward"
    assert trainer.overlap_off_by == []


def test_a_compute_loss_override_keeps_the_overlap_and_is_bitwise_the_plain_trainer(
        tmp_path: Any) -> None:
    """``compute_loss`` runs before backward: no use of the window. It runs with the steps
    deferred (to see a backward of its own, the eighth probe): the Trainer's backward
    still steps."""
    from helpers import compare
    from hf_models import Tokens, gpt2, parameters, quiet
    from trainer_runs import StepsInBackward, arguments
    from transformers import Trainer

    from overlapkit.integrations.transformers import OverlapTrainer

    def scaled(base: type) -> type:
        class Scaled(base):  # type: ignore[valid-type,misc]
            def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False,
                             num_items_in_batch: Any = None) -> Any:
                outputs = model(**inputs)
                return (outputs.loss * 0.5, outputs) if return_outputs else outputs.loss * 0.5
        return Scaled

    quiet()
    runs = []
    for base, extra in ((Trainer, {}), (OverlapTrainer, {"technique": "optimizer_in_backward"})):
        model = gpt2()
        trainer = scaled(base)(model=model, args=arguments(str(tmp_path / base.__name__),
                                                           max_steps=3),
                               train_dataset=Tokens("gpt2"), **extra)
        watcher = StepsInBackward(model)
        trainer.add_callback(watcher.callback())
        trainer.train()
        runs.append((parameters(model), trainer, watcher.found))
    (plain, _, _), (ours, trainer, stepped_in_backward) = runs
    assert type(trainer.optimizer.optimizer).__name__ == "OptimizerInBackward"
    assert trainer.overlap_off_by == []
    assert stepped_in_backward == [True, True], stepped_in_backward
    assert compare(plain, ours)


def test_an_overlapkit_optimizer_in_the_plain_trainer_with_a_window_callback_is_refused(
        tmp_path: Any) -> None:
    """Without clipping or accumulation (0.3 and 0.4 before the probe: the callback's
    edit silently ignored, 0.015 off after 3 steps), refused at the first backward."""
    import torch
    from hf_models import Tokens, gpt2, quiet
    from trainer_runs import arguments
    from transformers import Trainer
    from window_runs import window_callback

    import overlapkit

    quiet()
    model = gpt2()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=1e-2)
    trainer = Trainer(model=model, args=arguments(str(tmp_path), max_grad_norm=0.0,
                                                  gradient_accumulation_steps=1),
                      train_dataset=Tokens("gpt2"), optimizers=(optimizer, None))
    trainer.add_callback(window_callback("callback zeroes rows", []))
    with pytest.raises(overlapkit.ConfigurationError,
                       match=r"ZeroOldRows\.on_pre_optimizer_step.*Nothing has stepped yet"
                             r".*OverlapTrainer"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert all(p.detach().equal(b) for p, b in zip(model.parameters(), before, strict=True))


def test_a_window_event_set_on_a_callback_instance_is_seen(tmp_path: Any) -> None:
    from hf_models import Tokens, gpt2, quiet
    from trainer_runs import arguments
    from transformers import TrainerCallback

    from overlapkit.integrations.transformers import OverlapTrainer

    quiet()
    callback = TrainerCallback()
    callback.on_pre_optimizer_step = lambda *args, **kwargs: None
    trainer = OverlapTrainer(model=gpt2(), args=arguments(str(tmp_path)),
                             train_dataset=Tokens("gpt2"), callbacks=[callback])
    assert trainer.window_users() == ["the callback TrainerCallback.on_pre_optimizer_step"]


def _model_init_checked(result: tuple[bool, str, str, list[str]], stepped_by: str) -> None:
    same, differences, stepped, warned = result
    assert same, differences
    assert warned == [], warned
    assert stepped == stepped_by


def test_model_init_each_train_builds_a_model_whose_run_keeps_the_overlap(
        tmp_path: Any) -> None:
    """``model_init`` (hyperparameter search: one model per trial). Before the sixth
    probe the second ``train()`` took the new model's 56 parameters for ones whose
    ``requires_grad`` had changed since the set-up, and stepped in the plain order, with
    a warning saying so."""
    from trainer_runs import same_run
    from window_runs import model_init_run

    plain = model_init_run(None, str(tmp_path / "plain"))
    ours = model_init_run("optimizer_in_backward", str(tmp_path / "ours"))
    found = same_run(plain, ours)
    _model_init_checked((bool(found), str(found), ours["stepped by"], ours["warnings"]),
                        "OptimizerInBackward")


def test_two_ranks_model_init_each_train_keeps_the_overlap(tmp_path: Any) -> None:
    from window_runs import model_init_runs

    for rank_results in run_distributed(model_init_runs, 2, args=(str(tmp_path),),
                                        timeout=600):
        _model_init_checked(rank_results["overlap_ddp"], "DDPOverlapOptimizer")
        _model_init_checked(rank_results["optimizer_in_backward"], "OptimizerInBackward")


def test_two_ranks_a_compute_loss_calling_self_model_past_ddp_is_refused_stepping_nothing(
        tmp_path: Any) -> None:
    """``self.model(**inputs)`` in ``compute_loss`` runs past the DDP model: its backward
    reduces nothing (the plain Trainer's ranks drift apart). Refused as ``compute_loss``
    returns, before the Trainer's backward."""
    for rank_results in run_distributed(forward_past_ddp_runs, 2, args=(str(tmp_path),),
                                        timeout=600):
        for key, result in rank_results.items():
            error = result["error"]
            assert error is not None and error["overlapkit"], (key, error)
            assert "SelfModel.compute_loss, calling self.model" in error["message"], key
            assert "Nothing was stepped" in error["message"], key
            assert result["unchanged"], (key, result["unchanged"])
