"""Rank code of tests/trainers/test_lightning_window.py: ``on_after_backward`` of the
module and of a callback, an ``optimizer_step`` handing ``optimizer.step()`` a closure
wrapping Lightning's, ``ModelCheckpoint(save_last=True)`` then
``fit(ckpt_path="last")``, ``LearningRateFinder`` as a callback inside the fit, SequentialLR
and ReduceLROnPlateau from ``configure_optimizers``, and ``validate`` / ``test`` /
``predict`` between two fits of one module: each compared bitwise with the plain
strategy's run (parameters, optimizer state and learning rates, logged metrics, what the
hooks read); and a gradient changed through ``.data`` under ``hooks_read_only_grads=True``
(no version counter bumped), refused before anything steps."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from helpers import compare, error_of
from lightning.pytorch.callbacks import Callback, LearningRateFinder, ModelCheckpoint
from lightning_models import Regression, data, quiet, trainer, values
from lightning_parity_ranks import strategy
from lightning_tuning_ranks import Tunable
from optimizer_overrides_ranks import Noisy

#: overlapkit's strategy -> the plain one it is compared with, by world size
PAIRS = {
    2: {"overlap_ddp": "ddp", "optimizer_in_backward": "ddp"},
    1: {"overlap_ddp": "ddp", "optimizer_in_backward": "ddp",
        "one device": "single device"},
}


class Logged(Regression):
    """Logs its training, validation and test losses (ReduceLROnPlateau monitors one)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", F.mse_loss(self.net(x), y), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0])


class HalvesGradsAfterBackward(Logged):
    """``on_after_backward`` halves every gradient (the plain step uses the halves)."""

    def on_after_backward(self) -> None:
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(0.5)


class ReadsAfterBackward(Callback):
    """A callback's ``on_after_backward`` records the parameters and Adam's first moments:
    the plain loop's are those before the step."""

    def __init__(self) -> None:
        self.read: list[torch.Tensor] = []

    def on_after_backward(self, trainer: Any, module: Any) -> None:
        state = trainer.optimizers[0].state
        self.read.append(torch.stack([p.detach().norm() for p in module.parameters()]))
        self.read.extend(state[p]["exp_avg"].clone() for p in module.parameters()
                         if p in state)


class ScalesThroughData(Callback):
    """Changes the gradients through ``.data``, which bumps no version counter."""

    def on_after_backward(self, trainer: Any, module: Any) -> None:
        for p in module.parameters():
            if p.grad is not None:
                p.grad.data.mul_(0.5)


class LogsWeightNorms(Callback):
    """Logs the parameters' norms before the step: a read of their values, not of
    ``.grad`` (the plain run's: before the step; stepped during backward: after it)."""

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        module.log("weight norm", torch.stack([p.norm() for p in module.parameters()]).sum())


class WrapsTheClosure(Logged):
    """An ``optimizer_step`` that hands ``optimizer.step()`` a closure of its own from the
    third step on: after Lightning's closure (its backward) it records the parameters'
    norms and clips the gradients itself, in the window before the step."""

    def __init__(self) -> None:
        super().__init__()
        self.read: list[torch.Tensor] = []

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any,
                       optimizer_closure: Any = None) -> None:
        def closure() -> Any:
            loss = optimizer_closure()
            self.read.append(torch.stack([p.detach().norm() for p in self.parameters()]))
            torch.nn.utils.clip_grad_norm_(self.parameters(), 0.05)
            return loss

        optimizer.step(closure=closure if self.trainer.global_step >= 2 else
                       optimizer_closure)


def _wrapped_closure(label: str, ws: int, root: Path) -> list[torch.Tensor]:
    module = WrapsTheClosure()
    run = trainer(strategy(label), ws, root, max_epochs=1)
    run.fit(module, data())
    return record(module, run, module.read)


class OverridesStep(Logged):
    """``configure_optimizers`` returns a subclass of AdamW overriding ``step()`` (noise
    after the update); before, it ran per part stepped during backward: 0.016 (1
    process) and 0.010 (2 ranks) off the plain fit after 8 steps, silently."""

    def configure_optimizers(self) -> Any:
        self.noisy = Noisy(self.parameters(), lr=1e-2)  # its calls are compared too
        return self.noisy


def _overrides_step(label: str, ws: int, root: Path) -> list[torch.Tensor]:
    module = OverridesStep()
    run = trainer(strategy(label), ws, root, max_epochs=1)
    run.fit(module, data())
    return record(module, run, [torch.tensor(module.noisy.calls)])


def _schedules(kind: str) -> type[Logged]:
    class Scheduled(Logged):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
            if kind == "plateau":
                plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5,
                                                                     patience=0)
                return {"optimizer": optimizer, "lr_scheduler": {
                    "scheduler": plateau, "monitor": "train_loss", "interval": "step"}}
            sequential = torch.optim.lr_scheduler.SequentialLR(optimizer, [
                torch.optim.lr_scheduler.LinearLR(optimizer, 0.25, total_iters=3),
                torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.9)], milestones=[3])
            return {"optimizer": optimizer,
                    "lr_scheduler": {"scheduler": sequential, "interval": "step"}}
    return Scheduled


def record(module: L.LightningModule, run: L.Trainer,
           extra: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Parameters, the optimizer's learning rates and state, what was logged last, the
    step and epoch reached, and ``extra``."""
    saved = run.optimizers[0].state_dict()
    return [*values(module),
            torch.tensor([g["lr"] for g in saved["param_groups"]], dtype=torch.float64),
            *[v for i in sorted(saved["state"]) for v in saved["state"][i].values()],
            *[torch.as_tensor(v).detach().reshape(-1).clone()
              for _, v in sorted(run.callback_metrics.items())],
            torch.tensor([run.global_step, run.current_epoch]), *(extra or [])]


def _after_backward(label: str, ws: int, root: Path) -> list[torch.Tensor]:
    module, callback = HalvesGradsAfterBackward(), ReadsAfterBackward()
    run = trainer(strategy(label), ws, root, max_epochs=1, callbacks=[callback])
    run.fit(module, data())
    return record(module, run, callback.read)


def _resumed_from_last(label: str, ws: int, root: Path) -> list[torch.Tensor]:
    """One epoch, then ``fit(ckpt_path="last")`` of a new module to the second: compared
    with the plain strategy's two epochs in one fit (``uninterrupted``)."""
    def run_to(epochs: int) -> L.Trainer:
        return trainer(strategy(label), ws, root, max_epochs=epochs,
                       enable_checkpointing=True,
                       callbacks=[ModelCheckpoint(dirpath=str(root / "ck"), save_last=True)])

    run_to(1).fit(Logged(), data())
    module, run = Logged(), run_to(2)
    run.fit(module, data(), ckpt_path="last")
    return record(module, run)


def _uninterrupted(label: str, ws: int, root: Path) -> list[torch.Tensor]:
    module = Logged()
    run = trainer(strategy(label), ws, root, max_epochs=2)
    run.fit(module, data())
    return record(module, run)


def _lr_finder_callback(label: str, ws: int, root: Path) -> list[torch.Tensor]:
    """Lightning's LearningRateFinder inside the fit: its trial steps, the restore of the
    weights and optimizer, then the fit at the suggested learning rate."""
    module = Tunable()
    run = trainer(strategy(label), ws, root, max_epochs=1, callbacks=[LearningRateFinder(
        min_lr=1e-4, max_lr=1e-1, num_training_steps=4, early_stop_threshold=None)])
    run.fit(module)
    return record(module, run, [torch.tensor([module.lr], dtype=torch.float64)])


def _scheduled(kind: str) -> Callable[[str, int, Path], list[torch.Tensor]]:
    def fit(label: str, ws: int, root: Path) -> list[torch.Tensor]:
        module = _schedules(kind)()
        run = trainer(strategy(label), ws, root, max_epochs=2)
        run.fit(module, data())
        return record(module, run)
    return fit


def _between_fits(label: str, ws: int, root: Path) -> list[torch.Tensor]:
    """fit, then validate, test and predict with that Trainer, then a second Trainer
    fitting the same module."""
    module = Logged()
    run = trainer(strategy(label), ws, root, max_epochs=1)
    run.fit(module, data(), data())
    validated, tested = run.validate(module, data()), run.test(module, data())
    predicted = run.predict(module, data()) or []
    second = trainer(strategy(label), ws, root, max_epochs=1)
    second.fit(module, data(), data())
    return record(module, second, [torch.tensor([validated[0]["val_loss"],
                                                 tested[0]["test_loss"]]), *predicted])


#: case -> one fit (or fits) with a strategy, returning what is compared
CASES: dict[str, Callable[[str, int, Path], list[torch.Tensor]]] = {
    "on_after_backward halves .grad, a callback's reads the parameters and Adam's moments":
        _after_backward,
    "optimizer_step wraps the closure from the third step: reads, clips": _wrapped_closure,
    "ModelCheckpoint(save_last=True), fit(ckpt_path='last')": _resumed_from_last,
    "LearningRateFinder callback": _lr_finder_callback,
    "SequentialLR per step": _scheduled("sequential"),
    "ReduceLROnPlateau monitoring train_loss": _scheduled("plateau"),
    "validate, test, predict, then a second Trainer's fit": _between_fits,
    "an AdamW subclass overriding step()": _overrides_step,
}
#: the cases stepped in the plain order (one warning), the others keep the overlap
WARNED = {"on_after_backward halves .grad, a callback's reads the parameters and Adam's "
          "moments": "HalvesGradsAfterBackward.on_after_backward",
          "optimizer_step wraps the closure from the third step: reads, clips":
          "passed optimizer.step() a closure of its own",
          "an AdamW subclass overriding step()": "Noisy.step() overrides Adam.step()"}
#: the plain run each case's overlapkit run is compared with, when not the same case
PLAIN_CASE = {"ModelCheckpoint(save_last=True), fit(ckpt_path='last')": _uninterrupted}


def _refused_through_data(ws: int, root: Path,
                          callback: Callback | None = None) -> dict[str, Any]:
    module = Regression()
    run = trainer(strategy("overlap_ddp, hooks read only grads"), ws, root, max_steps=3,
                  callbacks=[callback or ScalesThroughData()])
    error = error_of(lambda: run.fit(module, data()))
    return {"error": error, "unchanged": compare(values(Regression()), values(module))}


class SkipsTheLastMicroBatch(Regression):
    """``training_step`` returns None (Lightning skips the batch) for the micro-batch
    that ends the second accumulation window (Lightning refuses None on several ranks)."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return None if batch_idx == 3 else super().training_step(batch, batch_idx)


def _fit_noting(module: L.LightningModule, run: L.Trainer,
                ) -> tuple[list[torch.Tensor], list[str], Any]:
    """``run.fit(module)``: the values after it, the plain-order warnings it gave, and
    the error it raised (or None)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        error = error_of(lambda: run.fit(module, data()))
    return (values(module), [str(w.message) for w in caught
                             if "in the plain order" in str(w.message)], error)


def _skipped(root: Path) -> dict[str, Any]:
    """One process, accumulate 2: DDP's reducer, prepared by the skipped batch's forward,
    reduces the next no_sync() backward. overlap_ddp: the plain order from there (before:
    that backward stepped, then a refusal at the next); optimizer_in_backward, whose
    early freeing would lose gradients: refused at the skip, before its step."""
    def fit(label: str) -> tuple[list[torch.Tensor], list[str], Any]:
        return _fit_noting(SkipsTheLastMicroBatch(), trainer(
            strategy(label), 1, root / label, max_epochs=1, accumulate_grad_batches=2))

    plain, _, _ = fit("ddp")
    single, _, _ = fit("single device")
    overlapped, warned, error = fit("overlap_ddp")
    one_device, one_device_warned, one_device_error = fit("one device")
    _, _, refusal = fit("optimizer_in_backward")
    return {"overlap_ddp": compare(plain, overlapped), "overlap_ddp warnings": warned,
            "errors": [error, one_device_error], "one device": compare(single, one_device),
            "one device warnings": one_device_warned, "refusal": refusal}


class CachedLoss(Regression):
    """A cached, GradCache-style loss (sentence-transformers' cached losses): the loss
    over outputs taken without grad, with a hook on it that runs the forward and backward
    again in chunks of 2 during Lightning's backward. The eighth probe: overlapkit took
    the chunks' nested backwards for one (2 ranks: ``overlap_ddp`` refused at the second
    step's ``step()``, the chunks stepped, the parameters 0.0070 from the start;
    ``optimizer_in_backward`` refused naming ``find_unused_parameters``)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        with torch.no_grad():
            out = self.net(x)
        leaf = out.detach().requires_grad_()
        loss = F.mse_loss(leaf, y)
        (cached,) = torch.autograd.grad(loss, leaf, retain_graph=True)

        def chunks(grad: torch.Tensor) -> None:
            with torch.enable_grad():
                for start in range(0, len(x), 2):
                    part = self.net(x[start:start + 2])
                    (part * cached[start:start + 2] * grad).sum().backward()

        loss.register_hook(chunks)
        return loss


def _cached_loss(ws: int, root: Path) -> dict[str, Any]:
    """Per strategy against its plain one: (bitwise, the plain-order warnings, the error);
    ``optimizer_in_backward`` on DDP (whose early freeing loses the chunks' sum): the
    refusal, and whether nothing had changed."""
    def fit(label: str) -> tuple[list[torch.Tensor], list[str], Any]:
        return _fit_noting(CachedLoss(), trainer(strategy(label), ws, root / label,
                                                 max_steps=3, gradient_clip_val=0.05))

    out: dict[str, Any] = {}
    pairs = {"overlap_ddp": "ddp", **({"one device": "single device"} if ws == 1 else {})}
    for label, plain_label in pairs.items():
        plain, _, _ = fit(plain_label)
        ours, warned, error = fit(label)
        out[label] = (compare(plain, ours), warned, error)
    params, _, refusal = fit("optimizer_in_backward")
    out["refusal"] = (refusal, compare(values(CachedLoss()), params))
    return out


def run(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Each case with each overlapkit strategy against the plain one: the comparison and
    the warnings about the overlap; and the refusal."""
    quiet()
    base = Path(root)
    plain: dict[tuple[str, str], list[torch.Tensor]] = {}
    out: dict[str, Any] = {}
    for label, plain_label in PAIRS[world_size].items():
        for case, fit in CASES.items():
            if (plain_label, case) not in plain:
                plain[plain_label, case] = PLAIN_CASE.get(case, fit)(
                    plain_label, world_size, base / plain_label / case)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = fit(label, world_size, base / label / case)
            out[f"{label} | {case}"] = compare(plain[plain_label, case], got)
            out[f"{label} | {case} | warnings"] = [
                str(w.message) for w in caught if "in the plain order" in str(w.message)]
    out["refused through .data"] = _refused_through_data(world_size, base / "data")
    # 0.4.0: from the second step on the norms were the stepped parameters', silently
    out["refused reading the parameters"] = _refused_through_data(
        world_size, base / "norms", LogsWeightNorms())
    out["a cached loss"] = _cached_loss(world_size, base / "cached")
    if world_size == 1:
        out["a skipped batch ends a window"] = _skipped(base / "skipped")
    return out
