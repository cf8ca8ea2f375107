"""Trainer runs that work in the window between backward and ``optimizer.step()`` (issue
30, cases 1 to 3): a callback changing or reading ``.grad`` in
``on_pre_optimizer_step``, a ``create_optimizer`` override, a ``training_step`` override
with two backwards (FGM); and (0.4's probe) a ``training_step`` editing ``.grad`` in a
Trainer subclass listed after ``OverlapTrainer``, a ``_clip_grad_norm`` override of one's
own, a callback changing ``.grad`` added for a second ``train()`` or while training;
(the sixth probe) an epoch shorter than the accumulation window (a dataset without a
length); (the seventh) an optimizer class overriding ``step()`` (before: bitwise here on
CPU, where every part is stepped in one call in the model's order, but no warning; a
hand-written loop or Lightning was off); (the eighth) a ``compute_loss`` override running
a backward of its own (an auxiliary loss) or returning a loss with a hook running the
backwards (a cached, GradCache-style loss): each backward stepped, and the first
``optimizer.step()`` refused a window of 2 stepping backwards after the parameters had
taken them (moved 0.0200). Each is run by the
plain ``Trainer`` and by ``OverlapTrainer`` with the same override, in the test process
or on gloo ranks (``run``)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from hf_models import Tokens, gpt2, parameters, quiet
from optimizer_overrides_ranks import Noisy
from trainer_runs import arguments, same_run

#: (the eleventh probe) a window method patched on the Trainer instance, which the
#: Trainer's loop calls as it would an override: not seen before (the training_step
#: silently 0.030 off under optimizer_in_backward, the clip refused after its step, the
#: compute_loss's auxiliary backward stepped, then refused as a second one)
PATCHED = ("training_step patched on the instance", "_clip_grad_norm patched on the instance",
           "compute_loss patched on the instance")
#: (the eleventh probe) a callback's on_train_begin wrapping the Trainer's optimizer.step
#: (Accelerate's AcceleratedOptimizer) to edit .grad first: not seen before (under
#: optimizer_in_backward the edit read freed gradients, 0.036 off the plain Trainer)
STEP_PATCHED = "optimizer.step patched by a callback"
CASES = ("callback zeroes rows", "callback logs norms", "create_optimizer", "two backwards",
         "base listed after", "own clip", "callback for a second train",
         "callback added while training", "max_grad_norm lowered while training",
         "max_grad_norm 0 for a second train", "a layer unfrozen while training",
         "optimizer over part of the model", "epoch shorter than the window",
         "callback added at a step's beginning", "an optimizer class overriding step()",
         "compute_loss running a backward", "compute_loss hooking the loss",
         *PATCHED, STEP_PATCHED)
STEPS = 3


class Unsized(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """A dataset without a length (a streamed one): 3 batches of 4 per rank and epoch,
    so the Trainer (gradient_accumulation_steps=2) runs each epoch's last micro-batch
    outside no_sync() without stepping, and adds the next epoch's to it (the sixth
    probe: OverlapTrainer stepped in that backward, then refused a later one as a
    second backward, 0.0252 off the plain run)."""

    def __iter__(self) -> Any:
        ranks = (torch.distributed.get_world_size()
                 if torch.distributed.is_initialized() else 1)
        tokens = Tokens("gpt2", 12 * ranks)
        return (tokens[index] for index in range(len(tokens)))


class MomentumSGD(torch.optim.SGD):
    """The user's own optimizer class (a torch.optim optimizer from outside torch)."""


def window_callback(case: str, logged: list[dict[str, float]]) -> Any:
    from transformers import TrainerCallback

    class ZeroOldRows(TrainerCallback):  # type: ignore[misc]
        """Keeps the first rows of the embedding (the "old tokens") frozen."""

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any,
                                  model: Any = None, **kw: Any) -> None:
            for name, param in model.named_parameters():
                if "wte" in name and param.grad is not None:
                    param.grad[:8] = 0

    class LogNorms(TrainerCallback):  # type: ignore[misc]
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any,
                                  model: Any = None, **kw: Any) -> None:
            logged.append({name: float(p.grad.norm()) for name, p in model.named_parameters()
                           if p.grad is not None})

    return ZeroOldRows() if case == "callback zeroes rows" else LogNorms()


def _adds_after_the_first_step(trainer: Any, logged: list[dict[str, float]],
                               at_step_begin: bool = False) -> Any:
    """A callback adding the one zeroing rows once the first step has ended, or as the
    second begins (``at_step_begin``: added after the Trainer was built, it runs after
    OverlapTrainer's own ``on_step_begin``; the sixth probe: that step's edit was missed
    under optimizer_in_backward, silently 0.0180 off)."""
    from transformers import TrainerCallback

    class AddsZeroOldRows(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 1 and not at_step_begin:
                trainer.add_callback(window_callback("callback zeroes rows", logged))

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 1 and at_step_begin:
                trainer.add_callback(window_callback("callback zeroes rows", logged))

    return AddsZeroOldRows()


def _changes_while_training(case: str, trainer: Any) -> Any:
    """A callback that, before the second step, lowers ``args.max_grad_norm`` or unfreezes
    the position embedding (frozen when the optimizer was built, so outside it: the
    Trainer's clip over ``model.parameters()`` counts its gradient from then on)."""
    from transformers import TrainerCallback

    class ChangesTheClip(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step != 1:
                return
            if case == "max_grad_norm lowered while training":
                args.max_grad_norm = 0.3
            else:
                trainer.model.transformer.wpe.weight.requires_grad_(True)

    return ChangesTheClip()


def _trainer_class(case: str, base: type) -> type:
    class CustomOptimizer(base):  # type: ignore[valid-type,misc]
        def create_optimizer(self, model: Any = None) -> Any:
            self.optimizer = MomentumSGD(self.model.parameters(), lr=1e-2, momentum=0.9)
            return self.optimizer

    class FGM(base):  # type: ignore[valid-type,misc]
        def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None,
                          ) -> torch.Tensor:
            model.train()
            loss = self.compute_loss(model, inputs)
            self.accelerator.backward(loss, retain_graph=True)
            adversarial = self.compute_loss(model, inputs)
            self.accelerator.backward(adversarial)
            return loss.detach()

    class OwnClip(base):  # type: ignore[valid-type,misc]
        def _clip_grad_norm(self, model: Any) -> Any:  # a max_norm of its own
            return self.accelerator.clip_grad_norm_(model.parameters(), 0.5)

    class AuxiliaryLoss(base):  # type: ignore[valid-type,misc]
        """A penalty on the logits, backpropagated by itself before the main loss."""

        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            self.accelerator.backward(0.1 * model(**inputs).logits.pow(2).mean())
            outputs = model(**inputs)
            return (outputs.loss, outputs) if return_outputs else outputs.loss

    class CachedLoss(base):  # type: ignore[valid-type,misc]
        """GradCache (sentence-transformers' cached losses): the loss over logits taken
        without grad, and a hook on it that runs the forward and backward again in
        chunks of 2 during the Trainer's backward."""

        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            ids = inputs["input_ids"]
            with torch.no_grad():
                logits = model(input_ids=ids).logits
            leaf = logits.detach().requires_grad_()
            loss = torch.nn.functional.cross_entropy(leaf[:, :-1].flatten(0, 1),
                                                     ids[:, 1:].flatten())
            (cached,) = torch.autograd.grad(loss, leaf, retain_graph=True)

            def chunks(grad: torch.Tensor) -> None:
                with torch.enable_grad():
                    for start in range(0, len(ids), 2):
                        part = model(input_ids=ids[start:start + 2]).logits
                        (part * cached[start:start + 2] * grad).sum().backward()

            loss.register_hook(chunks)
            return (loss, None) if return_outputs else loss

    if case == "base listed after":
        from transformers import Trainer

        class EditingBase(Trainer):  # type: ignore[misc]
            """Another library's Trainer subclass, editing ``.grad`` after backward."""

            def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
                loss = super().training_step(*args, **kwargs)
                self.model.transformer.wte.weight.grad[:8] = 0
                return loss

        return EditingBase if base is Trainer else type("Mixed", (base, EditingBase), {})
    return {"create_optimizer": CustomOptimizer, "two backwards": FGM,
            "own clip": OwnClip, "compute_loss running a backward": AuxiliaryLoss,
            "compute_loss hooking the loss": CachedLoss}.get(case, base)


def _patches_the_step() -> Any:
    """A callback wrapping the optimizer the Trainer steps, at ``on_train_begin``: its
    ``step`` zeroes rows of the embedding's gradient, then steps."""
    from transformers import TrainerCallback

    class PatchesStep(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                           model: Any = None, **kw: Any) -> None:
            saved = optimizer.step

            def step(*a: Any, **k: Any) -> Any:
                model.transformer.wte.weight.grad[:8] = 0
                return saved(*a, **k)

            optimizer.step = step

    return PatchesStep()


def _patch(case: str, trainer: Any) -> None:
    """Set ``case``'s window method on the instance (``types.MethodType``), as a library
    patching a Trainer it is given would: an edit of ``.grad`` after the class's
    ``training_step``, a clip of its own, a ``compute_loss`` with an auxiliary backward."""
    import types

    cls = type(trainer)

    def training_step(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = cls.training_step(self, *args, **kwargs)
        self.model.transformer.wte.weight.grad[:8] = 0
        return loss

    def clip(self: Any, model: Any) -> Any:
        return self.accelerator.clip_grad_norm_(model.parameters(), 0.5)

    def compute_loss(self: Any, model: Any, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        self.accelerator.backward(0.1 * model(**inputs).logits.pow(2).mean())
        outputs = model(**inputs)
        return (outputs.loss, outputs) if return_outputs else outputs.loss

    name = case.split()[0]
    method = {"training_step": training_step, "_clip_grad_norm": clip,
              "compute_loss": compute_loss}[name]
    setattr(trainer, name, types.MethodType(method, trainer))


def train(case: str, technique: str | None, out_dir: str) -> dict[str, Any]:
    """One run of ``case`` by the plain Trainer (``technique`` None) or OverlapTrainer;
    its parameters, optimizer state, logs and the warnings it gave."""
    from transformers import Trainer

    from overlapkit.integrations.transformers import OverlapTrainer

    quiet()
    model = gpt2()
    base = Trainer if technique is None else OverlapTrainer
    extra: dict[str, Any] = {} if technique is None else {"technique": technique}
    if case == "a layer unfrozen while training":
        model.transformer.wpe.weight.requires_grad_(False)
    if case == "an optimizer class overriding step()":  # noise after the update
        extra["optimizers"] = (Noisy(model.parameters(), lr=1e-2), None)
    if case == "optimizer over part of the model":  # the rest requires grad, unstepped
        extra["optimizers"] = (torch.optim.AdamW(model.transformer.h.parameters(), lr=1e-2),
                               None)
    logged: list[dict[str, float]] = []
    data = Unsized() if case == "epoch shorter than the window" else Tokens("gpt2")
    trainer = _trainer_class(case, base)(
        model=model, args=arguments(out_dir, max_steps=STEPS), train_dataset=data, **extra)
    if case in ("callback added while training", "callback added at a step's beginning"):
        trainer.add_callback(_adds_after_the_first_step(
            trainer, logged, at_step_begin=case != "callback added while training"))
    elif case in ("max_grad_norm lowered while training", "a layer unfrozen while training"):
        trainer.add_callback(_changes_while_training(case, trainer))
    elif case == STEP_PATCHED:
        trainer.add_callback(_patches_the_step())
    elif case in PATCHED:
        _patch(case, trainer)
    elif case.startswith("callback") and case != "callback for a second train":
        trainer.add_callback(window_callback(case, logged))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
        if case == "callback for a second train":  # the first train() overlapped
            trainer.add_callback(window_callback("callback zeroes rows", logged))
            trainer.train()
        if case == "max_grad_norm 0 for a second train":  # the first clipped at 1.0
            trainer.args.max_grad_norm = 0.0
            trainer.train()
    entries = [entry for entry in trainer.state.log_history if "loss" in entry]
    inner = trainer.optimizer.optimizer
    return {"params": parameters(model),
            "state": [t for s in inner.state.values() for t in s.values()
                      if isinstance(t, torch.Tensor)],
            "grad_norms": [entry.get("grad_norm") for entry in entries],
            "lrs": [entry["learning_rate"] for entry in entries],
            "norms logged": logged,
            "warnings": [str(w.message) for w in caught if "plain order" in str(w.message)]}




def compare_case(case: str, out_dir: str, techniques: tuple[str, ...]) -> dict[str, Any]:
    """For each technique: what differs from the plain Trainer (a falsy Comparison when
    nothing), and the warnings given."""
    from helpers import Comparison, compare

    plain = train(case, None, f"{out_dir}/{case}-plain")
    out: dict[str, Any] = {}
    for technique in techniques:
        try:
            ours = train(case, technique, f"{out_dir}/{case}-{technique}")
        except Exception as error:  # what 0.3 raised, reported per case
            out[technique] = (False, f"{type(error).__name__}: {error}"[:300], [])
            continue
        found = same_run(plain, ours)
        if found:
            found = compare(plain["state"], ours["state"])
        if found and plain["norms logged"] != ours["norms logged"]:
            found = Comparison(("the callback logged other gradient norms",))
        out[technique] = (bool(found), str(found), ours["warnings"])
    return out


def unclipped(out_dir: str, techniques: tuple[str, ...]) -> dict[str, Any]:
    """``max_grad_norm=0`` (issue 30, case 4): per technique, what differs from the plain
    Trainer, logged ``grad_norm`` included (0.3 logged none under optimizer_in_backward)."""
    from trainer_runs import train as train_plain_case

    plain = train_plain_case(None, "gpt2", f"{out_dir}/unclipped-plain", max_grad_norm=0.0)
    out: dict[str, Any] = {"plain logged": None not in plain["grad_norms"]}
    for technique in techniques:
        ours = train_plain_case(technique, "gpt2", f"{out_dir}/unclipped-{technique}",
                                max_grad_norm=0.0)
        found = same_run(plain, ours)
        out[technique] = (bool(found), str(found))
    return out


def run(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    techniques = ("overlap_ddp", "optimizer_in_backward")
    out = {case: compare_case(case, out_dir, techniques) for case in CASES}
    out["max_grad_norm 0"] = unclipped(out_dir, techniques)
    return out


def model_init_run(technique: str | None, out_dir: str) -> dict[str, Any]:
    """``Trainer(model_init=...)`` (what ``hyperparameter_search`` runs once per trial)
    trained twice: each ``train()`` builds a new model and optimizer. The last model's
    parameters, the logs, the plain-order warnings and what the last ``train()`` stepped
    with (the sixth probe: its set-up took the new model's parameters for ones whose
    ``requires_grad`` had changed, and stepped in the plain order, with a warning)."""
    from transformers import Trainer

    from overlapkit.integrations.transformers import OverlapTrainer

    quiet()
    base = Trainer if technique is None else OverlapTrainer
    extra: dict[str, Any] = {} if technique is None else {"technique": technique}
    trainer = base(model_init=gpt2, args=arguments(out_dir, max_steps=2),
                   train_dataset=Tokens("gpt2"), **extra)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
        trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {"params": parameters(trainer.model),
            "grad_norms": [entry.get("grad_norm") for entry in logged],
            "lrs": [entry["learning_rate"] for entry in logged],
            "stepped by": type(trainer.optimizer.optimizer).__name__,
            "warnings": [str(w.message) for w in caught if "plain order" in str(w.message)]}


def model_init_runs(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    """Per technique: (bitwise the plain Trainer, what stepped, the warnings)."""
    plain = model_init_run(None, f"{out_dir}/init-plain")
    out: dict[str, Any] = {}
    for technique in ("overlap_ddp", "optimizer_in_backward"):
        ours = model_init_run(technique, f"{out_dir}/init-{technique}")
        found = same_run(plain, ours)
        out[technique] = (bool(found), str(found), ours["stepped by"], ours["warnings"])
    return out


def forward_past_ddp(technique: str, out_dir: str) -> dict[str, Any]:
    """A ``compute_loss`` calling ``self.model`` (the module, past the DDP model the
    Trainer hands it; the eighth probe: on 2 ranks ``overlap_ddp`` silently 1.2e-7 off
    the plain run, ``optimizer_in_backward`` refused naming ``find_unused_parameters``):
    the error, and whether the parameters are the ones it started from."""
    from helpers import compare, error_of

    from overlapkit.integrations.transformers import OverlapTrainer

    class SelfModel(OverlapTrainer):
        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            outputs = self.model(**inputs)
            return (outputs.loss, outputs) if return_outputs else outputs.loss

    quiet()
    model = gpt2()
    trainer = SelfModel(model=model, args=arguments(out_dir, max_steps=STEPS),
                        train_dataset=Tokens("gpt2"), technique=technique)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        error = error_of(trainer.train)
    return {"error": error, "unchanged": compare(parameters(gpt2()), parameters(model))}


def forward_past_ddp_runs(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    return {technique: forward_past_ddp(technique, f"{out_dir}/{technique}")
            for technique in ("overlap_ddp", "optimizer_in_backward")}
