"""Rank code of tests/trainers/test_lightning_parity.py and test_lightning_refusals.py:
the same Lightning fits with the plain strategy and with overlapkit's, on gloo ranks that
overlapkit.distributed.run_distributed started (Lightning finds their process group and
``LOCAL_RANK``, so it launches nothing itself)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from helpers import Comparison, compare, error_of
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    Callback,
    GradientAccumulationScheduler,
    StochasticWeightAveraging,
)
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning_models import LogsGradNorms, Regression, data, quiet, trainer, values
from lightning_tuning_ranks import tuning

from overlapkit.integrations.lightning import OverlapDDPStrategy, OverlapSingleDeviceStrategy

#: what each parity case sets on the Trainer (callbacks built per fit: they keep state)
CASES: dict[str, dict[str, Any]] = {
    "LR scheduler": {},
    "clip norm, accumulate 2": {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2},
    "clip value, bf16-mixed": {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value",
                               "precision": "bf16-mixed"},
    "GradientAccumulationScheduler": {"gradient_clip_val": 0.05},
    "checkpoint, ckpt_path= resume": {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2},
    "self.optimizer kept, lr lowered by hand": {},
    "a callback reads .grad in on_train_batch_end": {},
    "a callback reads .grad in on_train_batch_end, clip norm, accumulate 2": {
        "gradient_clip_val": 0.05, "accumulate_grad_batches": 2},
    "a callback reads .grad in on_train_batch_start": {},
    "a module reads .grad in on_after_batch_transfer": {},
    "a module reads .grad in training_step": {},
    # the window between backward and step: stepped in the plain order (WARNED)
    "on_before_optimizer_step logs gradient norms": {},
    "on_before_optimizer_step reads the parameters and the optimizer state": {},
    "a callback scales .grad in on_before_optimizer_step, clip norm": {
        "gradient_clip_val": 0.05},
    "LightningModule.backward changes .grad": {},
    "optimizer_zero_grad every other batch": {},
    "optimizer_step runs the closure itself, skips a step, clip norm, accumulate 2": {
        "gradient_clip_val": 0.05, "accumulate_grad_batches": 2},
    "BackboneFinetuning unfreezes a layer": {},
    "a callback adds a step pre-hook to trainer.optimizers[0], clip norm": {
        "gradient_clip_val": 0.05},
    "configure_gradient_clipping from the second step, clip value, accumulate 2": {
        "gradient_clip_val": 0.01, "gradient_clip_algorithm": "value",
        "accumulate_grad_batches": 2},
    # already bitwise, with the overlap: pinned
    "LR warm-up set in optimizer_step": {},
    "StochasticWeightAveraging": {},
}
#: the cases whose fits record what a callback read between optimizer steps
READS_GRADS = [case for case in CASES if "reads .grad in on_" in case]
_ALL = ("overlap_ddp", "optimizer_in_backward", "one device")
_DDP = ("overlap_ddp", "optimizer_in_backward")
#: what the one warning of a case names, by strategy (the hook seen at set-up, the
#: gradients read after the first step, ...); a strategy not named keeps the overlap and
#: warns nothing
WARNED: dict[str, dict[str, str]] = {
    **{case: dict.fromkeys(("optimizer_in_backward", "one device"),
                           "ReadsGrads.on_train_batch_end" if "batch_end" in case
                           else "ReadsGradsAtStart.on_train_batch_start" if "start" in case
                           else "were read after the first optimizer step")
       for case in READS_GRADS},
    "a module reads .grad in training_step": dict.fromkeys(
        ("optimizer_in_backward", "one device"), "were read after the first optimizer step"),
    "self.optimizer kept, lr lowered by hand": dict.fromkeys(
        ("optimizer_in_backward", "one device"), "LowersItsLr.on_train_batch_start"),
    "on_before_optimizer_step logs gradient norms": dict.fromkeys(
        _ALL, "LogsGradNorms.on_before_optimizer_step"),
    "on_before_optimizer_step reads the parameters and the optimizer state": dict.fromkeys(
        _ALL, "ReadsBeforeTheStep.on_before_optimizer_step"),
    "a callback scales .grad in on_before_optimizer_step, clip norm": dict.fromkeys(
        _ALL, "ScalesGradients.on_before_optimizer_step"),
    "LightningModule.backward changes .grad": dict.fromkeys(
        _ALL, "AddsToGradients.backward (an override)"),
    "optimizer_zero_grad every other batch": dict.fromkeys(
        ("optimizer_in_backward", "one device"), "ZeroesEveryOther.optimizer_zero_grad"),
    "optimizer_step runs the closure itself, skips a step, clip norm, accumulate 2":
        dict.fromkeys(_ALL, "the optimizer_step override runs itself"),
    "configure_gradient_clipping from the second step, clip value, accumulate 2":
        dict.fromkeys(_ALL, "ClipsFromTheSecondStep.configure_gradient_clipping"),
    "BackboneFinetuning unfreezes a layer": dict.fromkeys(
        _DDP, "2 parameters the optimizer steps did not require grad"),
    "a callback adds a step pre-hook to trainer.optimizers[0], clip norm": dict.fromkeys(
        _ALL, "the optimizer has step hooks"),
}
#: overlapkit's strategy -> the plain one it is compared with, by world size
PAIRS = {
    2: {"overlap_ddp": "ddp", "optimizer_in_backward": "ddp"},
    1: {"overlap_ddp": "ddp", "optimizer_in_backward": "ddp",
        "one device": "single device"},
}


class LowersItsLr(Regression):
    """Keeps ``self.optimizer`` from ``configure_optimizers`` and halves its learning
    rates by hand every other step; records what ``self.optimizers()`` reports."""

    def __init__(self) -> None:
        super().__init__()
        self.lrs: list[float] = []

    def configure_optimizers(self) -> Any:
        config = super().configure_optimizers()
        self.optimizer = config["optimizer"]
        return config

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx % 2:
            for group in self.optimizer.param_groups:
                group["lr"] *= 0.5

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.lrs.extend(group["lr"] for group in self.optimizers().param_groups)
        return super().training_step(batch, batch_idx)


class ReadsGrads(Callback):
    """Reads every gradient after each optimizer step (and after accumulating
    micro-batches), as a callback logging gradient statistics does; -1 for None."""

    def __init__(self) -> None:
        self.read: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.read.extend(torch.tensor([-1.0]) if p.grad is None else p.grad.detach().clone()
                         for p in module.parameters())


class ReadsGradsAtStart(Callback):
    """The same, at the start of the next batch (the plain loop's gradients are still
    there: zero_grad runs in the closure)."""

    def __init__(self) -> None:
        self.read: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any,
                             batch_idx: int) -> None:
        ReadsGrads.on_train_batch_end(self, trainer, module, None, batch,  # type: ignore[arg-type]
                                      batch_idx)


class ReadsGradsAfterTransfer(Regression):
    """Reads every gradient when the next batch is on the device, a hook that is not
    seen at set-up: the read of the gradients the first step kept is."""

    def __init__(self) -> None:
        super().__init__()
        self.read: list[torch.Tensor] = []

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.trainer.training:
            ReadsGrads.on_train_batch_end(self, self.trainer, self, None,  # type: ignore[arg-type]
                                          batch, 0)
        return batch


class ReadsGradsInTrainingStep(Regression):
    """Reads every gradient in ``training_step``, before Lightning's ``zero_grad``: the
    last step's, in the plain loop (the sixth probe: optimizer_in_backward had freed
    them, None read from the third step on, silently)."""

    def __init__(self) -> None:
        super().__init__()
        self.read: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ReadsGrads.on_train_batch_end(self, self.trainer, self, None,  # type: ignore[arg-type]
                                      batch, batch_idx)
        return super().training_step(batch, batch_idx)


class LowersLrInAStepHook(Callback):
    """Keeps ``trainer.optimizers[0]`` and lowers its learning rates in a step pre-hook,
    recording them (the plain loop runs it once per step, before the step)."""

    def __init__(self) -> None:
        self.read: list[torch.Tensor] = []

    def on_train_start(self, trainer: Any, module: Any) -> None:
        def lower(optimizer: Any, args: Any, kwargs: Any) -> None:
            for group in optimizer.param_groups:
                group["lr"] *= 0.9
            self.read.append(torch.tensor([g["lr"] for g in optimizer.param_groups]))

        trainer.optimizers[0].register_step_pre_hook(lower)


class ReadsBeforeTheStep(Regression):
    """Records, before each step, the parameters' norms and Adam's first moments (an
    update-size logger): the plain loop's are those before the step."""

    def __init__(self) -> None:
        super().__init__()
        self.record: list[torch.Tensor] = []

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        state = optimizer.state
        self.record.append(torch.stack([p.detach().norm() for p in self.parameters()]))
        self.record.extend(state[p]["exp_avg"].clone() for p in self.parameters()
                           if p in state)


class AddsToGradients(Regression):
    """A ``backward`` override that changes the gradients after ``loss.backward()``
    (gradient noise, deterministic here)."""

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        loss.backward()
        for p in self.parameters():
            p.grad.add_(1e-3)  # type: ignore[union-attr]


class ZeroesEveryOther(Regression):
    """Keeps the gradients of every other batch and adds the next ones to them."""

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        if batch_idx % 4 == 0:
            optimizer.zero_grad()


class RunsTheClosure(Regression):
    """An ``optimizer_step`` that runs the closure itself: then ``step()`` without it,
    skips the step (its gradients dropped at the next ``zero_grad``), or passes it again
    (a second forward and backward, SAM-like)."""

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any,
                       optimizer_closure: Any = None) -> None:
        optimizer_closure()
        if batch_idx % 6 == 3:
            return
        optimizer.step(closure=optimizer_closure if batch_idx % 6 == 5 else None)


class ClipsFromTheSecondStep(Regression):
    """Its own clipping: Lightning's, with the Trainer's values, from the second step."""

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        if self.trainer.global_step > 0:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)


class Finetuned(Regression):
    """The first layer is the backbone that ``BackboneFinetuning`` freezes before the
    fit and adds to the optimizer at epoch 1."""

    @property
    def backbone(self) -> torch.nn.Module:
        return self.net[0]

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


class OneGroup(Regression):
    """AdamW over every parameter, frozen or not, no schedule."""

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class WarmsUp(OneGroup):
    """Lightning's documented LR warm-up: ``optimizer_step`` sets the LR, then steps."""

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any,
                       optimizer_closure: Any = None) -> None:
        for group in optimizer.param_groups:
            group["lr"] = 1e-2 * min(1.0, (self.trainer.global_step + 1) / 5)
        optimizer.step(closure=optimizer_closure)


#: the parity cases whose module is not Regression
MODULES: dict[str, type[Regression]] = {
    "self.optimizer kept, lr lowered by hand": LowersItsLr,
    "on_before_optimizer_step logs gradient norms": LogsGradNorms,
    "on_before_optimizer_step reads the parameters and the optimizer state":
        ReadsBeforeTheStep,
    "LightningModule.backward changes .grad": AddsToGradients,
    "optimizer_zero_grad every other batch": ZeroesEveryOther,
    "optimizer_step runs the closure itself, skips a step, clip norm, accumulate 2":
        RunsTheClosure,
    "BackboneFinetuning unfreezes a layer": Finetuned,
    "configure_gradient_clipping from the second step, clip value, accumulate 2":
        ClipsFromTheSecondStep,
    "LR warm-up set in optimizer_step": WarmsUp,
    "a module reads .grad in on_after_batch_transfer": ReadsGradsAfterTransfer,
    "a module reads .grad in training_step": ReadsGradsInTrainingStep,
}


def strategy(label: str, accelerator: str = "cpu") -> Any:
    device = "cuda:0" if accelerator == "gpu" else "cpu"
    return {
        "ddp": lambda: DDPStrategy(),
        "single device": lambda: SingleDeviceStrategy(device),
        "overlap_ddp": lambda: OverlapDDPStrategy("overlap_ddp"),
        "optimizer_in_backward": lambda: OverlapDDPStrategy("optimizer_in_backward"),
        "one device": lambda: OverlapSingleDeviceStrategy(device),
        "one device, reads no grads after the step": lambda: OverlapSingleDeviceStrategy(
            device, reads_grads_after_step=False),
        "overlap_ddp, hooks read only grads": lambda: OverlapDDPStrategy(
            "overlap_ddp", hooks_read_only_grads=True),
    }[label]()


def _options(case: str) -> dict[str, Any]:
    options = dict(CASES[case])
    if case == "GradientAccumulationScheduler":
        options["callbacks"] = [GradientAccumulationScheduler({0: 1, 1: 2})]
    if case in READS_GRADS and "callback" in case:
        options["callbacks"] = [ReadsGradsAtStart() if "batch_start" in case
                                else ReadsGrads()]
    if case == "a callback scales .grad in on_before_optimizer_step, clip norm":
        options["callbacks"] = [ScalesGradients()]
    if case == "BackboneFinetuning unfreezes a layer":
        options["callbacks"] = [BackboneFinetuning(unfreeze_backbone_at_epoch=1)]
    if case == "a callback adds a step pre-hook to trainer.optimizers[0], clip norm":
        options["callbacks"] = [LowersLrInAStepHook()]
    if case == "StochasticWeightAveraging":
        options["callbacks"] = [StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1)]
    return options


def fit(label: str, case: str, world_size: int, root: Path,
        accelerator: str = "cpu") -> dict[str, Any]:
    """One case with one strategy: the parameters after it (and, for the resume case,
    the optimizer state saved halfway)."""
    root.mkdir(parents=True, exist_ok=True)
    options = {**_options(case), "accelerator": accelerator}
    if case != "checkpoint, ckpt_path= resume":
        module = MODULES.get(case, Regression)()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer(strategy(label, accelerator), world_size, root, **options).fit(
                module, data())
        out: dict[str, Any] = {"values": values(module), "warnings": [
            str(w.message) for w in caught if "overlap" in str(w.message)]}
        if (case in READS_GRADS and "callback" in case) or "step pre-hook" in case:
            out["state"] = options["callbacks"][0].read
        if isinstance(module, (ReadsGradsAfterTransfer, ReadsGradsInTrainingStep)):
            out["state"] = module.read
        if isinstance(module, ReadsBeforeTheStep):
            out["state"] = module.record
        if isinstance(module, LogsGradNorms):
            out["state"] = [v for step in module.norms for v in step.values()]
        if isinstance(module, (Finetuned, WarmsUp)):  # the groups and state at the end
            saved = module.optimizers().state_dict()  # type: ignore[union-attr]
            out["state"] = [torch.tensor([g["lr"] for g in saved["param_groups"]],
                                         dtype=torch.float64),
                            *[v for i in sorted(saved["state"])
                              for v in saved["state"][i].values()]]
        if isinstance(module, LowersItsLr):  # the learning rates seen, and the last ones
            out["state"] = [torch.tensor(module.lrs + [
                g["lr"] for g in module.optimizer.param_groups], dtype=torch.float64)]
        return out
    first = trainer(strategy(label, accelerator), world_size, root, max_epochs=1, **options)
    first.fit(Regression(), data())
    path = root / "halfway.ckpt"
    first.save_checkpoint(path)
    module = Regression()  # a new process would build a new module too
    trainer(strategy(label, accelerator), world_size, root, **options).fit(
        module, data(), ckpt_path=path)
    saved = torch.load(path, weights_only=False, map_location="cpu")
    state = saved["optimizer_states"][0]["state"]
    return {"values": values(module),
            "state": [t for i in sorted(state) for t in state[i].values()]}


def parity(rank: int, world_size: int, root: str,
           accelerator: str = "cpu") -> dict[str, Comparison]:
    quiet()
    base = Path(root)
    plain: dict[tuple[str, str], dict[str, Any]] = {}
    out: dict[str, Comparison] = {}
    for label, plain_label in PAIRS[world_size].items():
        for case in CASES:
            if (plain_label, case) not in plain:
                plain[plain_label, case] = fit(plain_label, case, world_size,
                                               base / plain_label / case, accelerator)
            expected = plain[plain_label, case]
            got = fit(label, case, world_size, base / label / case, accelerator)
            result = compare(expected["values"], got["values"])
            if "state" in expected:
                result = Comparison(result.differences + compare(
                    expected["state"], got["state"]).differences)
            out[f"{label} | {case}"] = result
            out[f"{label} | {case} | warnings"] = got.get("warnings", [])
    if accelerator == "cpu":
        out.update(_lrs_logged(rank, world_size, base / "lr_monitor"))
    if world_size == 1 and accelerator == "cpu":
        out["one device | a callback unfreezes a layer of the optimizer"] = _unfrozen(base)
    if world_size > 1 and accelerator == "cpu":
        out["overlap_ddp | gradient norms logged"] = _grad_norms(world_size, base)
        out["optimizer_in_backward | then strategy='ddp' on the same module"] = (
            _plain_fit_after(world_size, base / "after"))
    return out


def _plain_fit_after(world_size: int, root: Path) -> Comparison:
    """A plain fit of a module an OverlapDDPStrategy("optimizer_in_backward") fit has
    trained, against the same plain fit of a new module with its weights: the early
    freeing of gradients ends with the overlapkit fit (0.013 off before it did)."""
    trained = Regression()
    trainer(strategy("optimizer_in_backward"), world_size, root, max_steps=2).fit(
        trained, data())
    fresh = Regression()
    fresh.load_state_dict(trained.state_dict())
    for module in (trained, fresh):
        trainer(strategy("ddp"), world_size, root, max_steps=3).fit(module, data())
    return compare(values(fresh), values(trained))


def _lrs_logged(rank: int, world_size: int, root: Path) -> dict[str, Comparison]:
    """What ``LearningRateMonitor`` writes to a ``CSVLogger`` (momentum and weight decay
    too; two param groups and a per-step schedule): the plain run's file, byte for byte
    (before, the groups were logged twice, once under the overlapped optimizer's name).
    Rank 0 writes the files, and compares them once every rank's fits are over."""
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger

    logged = {}
    for label in {label for pair in PAIRS[world_size].items() for label in pair}:
        directory = root / label
        trainer(strategy(label), world_size, directory, log_every_n_steps=1,
                logger=CSVLogger(str(directory), name="lrs", version=0),
                callbacks=[LearningRateMonitor(log_momentum=True, log_weight_decay=True)]
                ).fit(Regression(), data())
        if rank == 0:
            logged[label] = (directory / "lrs" / "version_0" / "metrics.csv").read_text()
    if rank != 0:
        return {}
    return {f"{label} | LearningRateMonitor logs": Comparison(
        () if logged[label] == logged[plain] else (
            f"{label}: {logged[label].splitlines()[0]} vs {logged[plain].splitlines()[0]}",))
        for label, plain in PAIRS[world_size].items()}


class Unfreezes(Callback):
    """Freezes the first layer before the fit, unfreezes it at epoch 1 in place (it is in
    the optimizer all along)."""

    def setup(self, trainer: Any, module: Any, stage: str) -> None:
        module.net[0].requires_grad_(False)

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        if trainer.current_epoch == 1:
            module.net[0].requires_grad_(True)


def _unfrozen(root: Path) -> dict[str, Any]:
    """One device: a parameter of the optimizer unfrozen during the fit has no step hook
    (0.067 off, never stepped, before); it turns the fit to the plain order."""
    runs = []
    for label in ("single device", "one device, reads no grads after the step"):
        module = OneGroup()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer(strategy(label), 1, root / "unfrozen" / label,
                    callbacks=[Unfreezes()]).fit(module, data())
        saved = module.optimizers().state_dict()  # type: ignore[union-attr]
        runs.append([*values(module), *[v for i in sorted(saved["state"])
                                        for v in saved["state"][i].values()]])
    return {"bitwise": compare(runs[0], runs[1]),
            "warnings": [str(w.message) for w in caught if "overlap" in str(w.message)]}


def _grad_norms(world_size: int, root: Path) -> Comparison:
    runs = []
    for label in ("ddp", "overlap_ddp, hooks read only grads"):
        module = LogsGradNorms()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer(strategy(label), world_size, root / "norms" / label).fit(module, data())
        assert not [w for w in caught if "overlap" in str(w.message)], "the overlap is kept"
        runs.append((module.norms, values(module)))
    (plain_norms, plain_values), (norms, got_values) = runs
    logged = [v for step in plain_norms for v in step.values()]
    assert logged and [list(s) for s in plain_norms] == [list(s) for s in norms]
    return Comparison(compare(plain_values, got_values).differences
                      + compare(logged, [v for step in norms for v in step.values()])
                      .differences)


# -- what is refused ---------------------------------------------------------------


class BackwardInTrainingStep(Regression):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        (0.5 * loss).backward(retain_graph=True)  # an auxiliary loss, done by hand
        return loss


class TwoBackwards(Regression):
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        loss.backward(retain_graph=True)
        loss.backward()


class Manual(Regression):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        optimizer.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(loss)
        optimizer.step()  # type: ignore[union-attr]
        return loss


class ReturnsOverlapkitOptimizer(Regression):
    def configure_optimizers(self) -> Any:
        import overlapkit

        return overlapkit.optimizer_in_backward(self, torch.optim.AdamW, lr=1e-2)


class PatchesStep(Regression):
    """Wraps the optimizer Lightning steps at ``on_train_start``: the wrapper runs the
    closure it is handed, halves the gradients, then steps (the eleventh probe: silently
    0.028 off the plain fit on one device, the wrapper called after the backward had
    stepped)."""

    def on_train_start(self) -> None:
        optimizer = self.trainer.optimizers[0]
        saved = optimizer.step

        def step(closure: Any = None, **kwargs: Any) -> Any:
            if closure is not None:
                closure()
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(0.5)
            return saved(**kwargs)

        optimizer.step = step  # type: ignore[method-assign]


class ScalesGradients(Callback):
    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        for p in module.parameters():
            if p.grad is not None:
                p.grad.mul_(0.5)


class ChangesClipping(Callback):
    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any,
                             batch_idx: int) -> None:
        if batch_idx == 1:
            trainer.gradient_clip_val = 0.5


#: what the refusal of :class:`PatchesStep` says, before its closure runs
PATCHED_STEP = "Lightning's plain loop calls it with its closure"
#: case -> (module class, strategy label, Trainer options)
REFUSALS: dict[str, tuple[type[Regression], str, dict[str, Any]]] = {
    "overlap_ddp, hooks_read_only_grads, a callback changing gradients": (
        Regression, "overlap_ddp, hooks read only grads", {}),
    "optimizer_in_backward, gradient_clip_val changed during the fit": (
        Regression, "optimizer_in_backward", {"gradient_clip_val": 0.05}),
    "optimizer_in_backward, backward in training_step": (BackwardInTrainingStep,
                                                          "optimizer_in_backward", {}),
    "optimizer_in_backward, two backwards in LightningModule.backward": (
        TwoBackwards, "optimizer_in_backward", {}),
    "optimizer_in_backward, manual optimization": (Manual, "optimizer_in_backward", {}),
    "overlap_ddp, an overlapkit optimizer returned": (ReturnsOverlapkitOptimizer,
                                                      "overlap_ddp", {}),
    "overlap_ddp, precision 64-true": (Regression, "overlap_ddp", {"precision": "64-true"}),
    "overlap_ddp, a step patched on the optimizer": (PatchesStep, "overlap_ddp", {}),
    "optimizer_in_backward, a step patched on the optimizer": (PatchesStep,
                                                               "optimizer_in_backward", {}),
}


#: the same, on one process
ONE_PROCESS_REFUSALS: dict[str, tuple[type[Regression], str, dict[str, Any]]] = {
    "one device, backward in training_step": (BackwardInTrainingStep, "one device", {}),
    "one device, manual optimization": (Manual, "one device", {}),
    "the default strategy, an overlapkit optimizer returned": (
        ReturnsOverlapkitOptimizer, "single device", {}),
    "one device, a step patched on the optimizer": (PatchesStep, "one device", {}),
}


def refusals(rank: int, world_size: int, root: str) -> dict[str, dict[str, Any]]:
    """Each case's error, and whether the parameters are still the initial ones."""
    quiet()
    initial = values(Regression())
    out = {}
    cases = REFUSALS if world_size > 1 else ONE_PROCESS_REFUSALS
    for case, (module_cls, label, options) in cases.items():
        module = module_cls()
        if case.endswith("a callback changing gradients"):
            options = {**options, "callbacks": [ScalesGradients()]}
        if case.endswith("changed during the fit"):
            options = {**options, "callbacks": [ChangesClipping()]}
        run = trainer(strategy(label), world_size, Path(root) / "refusals", max_steps=4,
                      **options)
        error = error_of(lambda: run.fit(module, data()))  # noqa: B023
        out[case] = {"error": error, "unchanged": compare(initial, values(module))}
    return out


def run(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Everything the 2-rank tests read, in one start of the ranks (Lightning's import
    is the slow part)."""
    return {"parity": parity(rank, world_size, root),
            "refusals": refusals(rank, world_size, root),
            "tuning": tuning(rank, world_size, root)}


def gpu_run(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """On one CUDA GPU (NCCL): the one-process parity cases, and Lightning's
    FSDPStrategy (FSDP1, GPU only) with an overlapkit optimizer returned from
    configure_optimizers, which must be refused before anything changes."""
    from lightning.pytorch.strategies import FSDPStrategy

    out: dict[str, Any] = {"parity": parity(rank, world_size, root, accelerator="gpu")}
    quiet()
    initial = values(Regression())
    module = ReturnsOverlapkitOptimizer()
    run = trainer(FSDPStrategy(), 1, Path(root) / "fsdp", accelerator="gpu", max_steps=2)
    out["FSDPStrategy, an overlapkit optimizer returned"] = {
        "error": error_of(lambda: run.fit(module, data())),
        "unchanged": compare(initial, values(module))}
    return out
