"""Hugging Face ``Trainer`` runs, plain and through ``OverlapTrainer``, with the Trainer's
defaults (``max_grad_norm=1.0``, AdamW) plus gradient accumulation, an LR schedule
from ``lr_scheduler_type``, bf16 autocast on CPU and checkpoints; in the test process
(one process) or on gloo ranks (``run``, launched by ``run_distributed``, which sets the
``torchrun`` environment Accelerate reads)."""

from __future__ import annotations

from typing import Any

from helpers import Comparison, compare
from hf_models import MODELS, Tokens, parameters, quiet

STEPS, SAVE_AT = 6, 3


def arguments(out_dir: str, **overrides: Any) -> Any:
    from transformers import TrainingArguments

    options: dict[str, Any] = dict(
        output_dir=out_dir, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_steps=STEPS, learning_rate=1e-2, lr_scheduler_type="cosine", warmup_steps=2,
        bf16=True, use_cpu=True, seed=0, logging_steps=1, save_strategy="no",
        report_to=[], disable_tqdm=True, dataloader_num_workers=0,
    )
    options.update(overrides)
    return TrainingArguments(**options)


class StepsInBackward:
    """A Trainer callback: per optimizer step after the first (whose LR is 0 in
    warm-up), whether the parameters had changed already when the Trainer was about to
    call ``optimizer.step()``: they had iff the steps were taken during backward."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.before: list[Any] = []
        self.found: list[bool] = []

    def callback(self) -> Any:
        from transformers import TrainerCallback

        watcher = self

        class Watch(TrainerCallback):  # type: ignore[misc]
            overlapkit_reads_no_gradients = True  # it compares parameters only

            def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                watcher.before = [p.detach().clone() for p in watcher.model.parameters()]

            def on_pre_optimizer_step(self, args: Any, state: Any, control: Any,
                                      **kw: Any) -> None:
                if state.global_step > 0:
                    watcher.found.append(any(
                        not p.detach().equal(b)
                        for p, b in zip(watcher.model.parameters(), watcher.before,
                                        strict=True)))

        return Watch()


def train(technique: str | None, kind: str, out_dir: str, *, resume: str | None = None,
          **overrides: Any) -> dict[str, Any]:
    """One ``trainer.train()``: the plain ``Trainer`` (``technique`` None) or
    ``OverlapTrainer(technique=...)``. Returns the parameters and what was logged."""
    from transformers import Trainer

    from overlapkit.integrations.transformers import OverlapTrainer

    quiet()
    model = MODELS[kind]()
    common = dict(model=model, args=arguments(out_dir, **overrides),
                  train_dataset=Tokens(kind))
    trainer = (Trainer(**common) if technique is None
               else OverlapTrainer(technique=technique, **common))
    watcher = StepsInBackward(model)
    trainer.add_callback(watcher.callback())
    trainer.train(resume_from_checkpoint=resume)
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {"params": parameters(model),
            "grad_norms": [entry.get("grad_norm") for entry in logged],
            "lrs": [entry["learning_rate"] for entry in logged],
            "optimizer": type(trainer.optimizer.optimizer).__name__,
            "stepped in backward": watcher.found}


def same_run(plain: dict[str, Any], ours: dict[str, Any]) -> Any:
    """Bitwise the same parameters, and the same logged gradient norms and LRs."""
    found = compare(plain["params"], ours["params"])
    if found and plain["grad_norms"] != ours["grad_norms"]:
        return Comparison((f"grad norms differ: {plain['grad_norms']} vs "
                           f"{ours['grad_norms']}",))
    if found and plain["lrs"] != ours["lrs"]:
        return Comparison((f"learning rates differ: {plain['lrs']} vs {ours['lrs']}",))
    return found


def cases(out_dir: str, techniques: tuple[str, ...]) -> dict[str, Any]:
    """Every case, each compared with the plain Trainer: GPT-2 trained STEPS steps
    (saving at SAVE_AT), the same resumed from the overlapped run's SAVE_AT checkpoint,
    and BERT."""
    out: dict[str, Any] = {}
    plain = train(None, "gpt2", f"{out_dir}/plain-gpt2")
    out["clipping active"] = any(n > 1.0 for n in plain["grad_norms"])
    plain_bert = train(None, "bert", f"{out_dir}/plain-bert")
    for technique in techniques:
        saved = f"{out_dir}/{technique}-gpt2"
        ours = train(technique, "gpt2", saved, save_strategy="steps", save_steps=SAVE_AT)
        out[f"{technique} gpt2"] = same_run(plain, ours)
        out[f"{technique} stepped with the facade"] = ours["optimizer"]
        out[f"{technique} stepped in backward"] = (
            ours["stepped in backward"] and all(ours["stepped in backward"])
            and not any(plain["stepped in backward"]))
        resumed = train(technique, "gpt2", f"{out_dir}/{technique}-resumed",
                        resume=f"{saved}/checkpoint-{SAVE_AT}")
        # logged before the resume point (the checkpoint's log history holds the saved
        # run's): only the steps after it are compared
        for key in ("grad_norms", "lrs"):
            resumed[key] = plain[key][:SAVE_AT] + resumed[key][SAVE_AT - STEPS:]
        out[f"{technique} gpt2 resumed"] = same_run(plain, resumed)
        out[f"{technique} bert"] = same_run(plain_bert,
                                            train(technique, "bert", f"{out_dir}/{technique}-bert"))
    return out


def run(rank: int, world_size: int, out_dir: str,
        techniques: tuple[str, ...] = ("overlap_ddp", "optimizer_in_backward")
        ) -> dict[str, Any]:
    return cases(out_dir, techniques)


def two_trainers(technique: str | None, out_dir: str) -> dict[str, Any]:
    """A second phase with its own Trainer on the same model (2 steps of AdamW, then 2
    of SGD at another learning rate): parameters and the second Trainer's logs."""
    from transformers import Trainer

    from overlapkit.integrations.transformers import OverlapTrainer

    quiet()
    model = MODELS["gpt2"]()
    extra = {} if technique is None else {"technique": technique}
    base = Trainer if technique is None else OverlapTrainer
    for phase, overrides in enumerate(({}, {"optim": "sgd", "learning_rate": 5e-3})):
        trainer = base(model=model, args=arguments(f"{out_dir}/{phase}", max_steps=2,
                                                   **overrides),
                       train_dataset=Tokens("gpt2"), **extra)
        trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {"params": parameters(model), "grad_norms": [e["grad_norm"] for e in logged],
            "lrs": [entry["learning_rate"] for entry in logged]}


def second_trainers(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    """Per technique: :func:`two_trainers` against the plain Trainer's (a falsy
    Comparison where they differ)."""
    plain = two_trainers(None, f"{out_dir}/plain")
    out: dict[str, Any] = {}
    for technique in ("overlap_ddp", "optimizer_in_backward"):
        try:
            out[technique] = same_run(plain, two_trainers(technique, f"{out_dir}/{technique}"))
        except Exception as error:  # 0.4 before the probe: refused at the second train()
            out[technique] = Comparison((f"{type(error).__name__}: {error}"[:300],))
    return out
