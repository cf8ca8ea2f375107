"""The ordinary Accelerate loop — ``accelerator.accumulate``, ``accelerator.backward``,
``accelerator.clip_grad_norm_``, ``optimizer.step()``, the prepared scheduler,
``optimizer.zero_grad()``, ``save_state`` / ``load_state`` — with the model and
optimizer from ``accelerator.prepare`` (plain) or from
``overlapkit.integrations.accelerate.prepare``; in the test process (one process) or on
gloo ranks (``run``)."""

from __future__ import annotations

from typing import Any

from helpers import Comparison, compare
from hf_models import MODELS, Tokens, parameters, quiet
from trainer_helpers import prepared

STEPS, SAVE_AT, ACCUMULATE, MAX_NORM, LR = 6, 3, 2, 1.0, 1e-2
#: Accelerator(cpu=...): the CUDA test sets it to False
CPU = True


def loop(technique: str | None, kind: str, *, save: str | None = None,
         resume: str | None = None, stop_at: int = STEPS) -> dict[str, Any]:
    """Train ``kind`` for STEPS optimizer steps of ACCUMULATE micro-batches (or until
    ``stop_at``), saving the state after SAVE_AT steps to ``save``, or resuming from
    ``resume``. Returns the parameters and the norms the clip returned."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from transformers import get_scheduler

    quiet()
    # the settings of an Accelerator an earlier test file left (one pytest worker runs
    # several files: after test_accelerate_window.py this one raised "AcceleratorState
    # has already been initialized")
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=CPU, mixed_precision="bf16",
                              gradient_accumulation_steps=ACCUMULATE)
    model = MODELS[kind]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    model, optimizer = prepared(accelerator, model, optimizer, technique, MAX_NORM)
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=2,
                              num_training_steps=STEPS)
    data = torch.utils.data.DataLoader(Tokens(kind), batch_size=4)
    data, scheduler = accelerator.prepare(data, scheduler)
    start = 0
    if resume is not None:
        accelerator.load_state(resume)
        start = SAVE_AT
        data = accelerator.skip_first_batches(data, SAVE_AT * ACCUMULATE)
    norms: list[Any] = []
    #: per optimizer step after the first (LR 0 in warm-up): whether the parameters
    #: had changed before optimizer.step(), as they do when backward steps them
    changed: list[bool] = []
    steps = start
    for batch in data:
        with accelerator.accumulate(model):
            before = [p.detach().clone() for p in model.parameters()]
            accelerator.backward(model(**batch).loss)
            if accelerator.sync_gradients:
                if steps > 0:
                    changed.append(any(not p.detach().equal(b) for p, b in
                                       zip(model.parameters(), before, strict=True)))
                norms.append(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            steps += 1
            if save is not None and steps == SAVE_AT:
                accelerator.save_state(save)
            if steps == stop_at:
                break
    accelerator.wait_for_everyone()
    return {"params": parameters(accelerator.unwrap_model(model)), "norms": norms,
            "optimizer": type(optimizer.optimizer).__name__, "stepped in backward": changed}


def same_run(plain: dict[str, Any], ours: dict[str, Any]) -> Any:
    """Bitwise the same parameters and clip norms."""
    return compare(plain["params"], ours["params"]) and compare(plain["norms"], ours["norms"])


def cases(out_dir: str, techniques: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    plain = loop(None, "gpt2")
    out["clipping active"] = any(float(n) > MAX_NORM for n in plain["norms"])
    plain_bert = loop(None, "bert")
    for technique in techniques:
        saved = f"{out_dir}/{technique}-state"
        ours = loop(technique, "gpt2", save=saved)
        out[f"{technique} stepped with the facade"] = ours["optimizer"]
        out[f"{technique} stepped in backward"] = (
            ours["stepped in backward"] and all(ours["stepped in backward"])
            and not any(plain["stepped in backward"]))
        out[f"{technique} gpt2"] = same_run(plain, ours)
        resumed = loop(technique, "gpt2", resume=saved)
        resumed["norms"] = plain["norms"][:SAVE_AT] + resumed["norms"]
        out[f"{technique} gpt2 resumed"] = same_run(plain, resumed)
        out[f"{technique} bert"] = same_run(plain_bert, loop(technique, "bert"))
    return out


def run(rank: int, world_size: int, out_dir: str,
        techniques: tuple[str, ...] = ("overlap_ddp", "optimizer_in_backward")
        ) -> dict[str, Any]:
    return cases(out_dir, techniques)


def rebuilt(technique: str | None, new_accelerator: bool, steps: int = 2) -> dict[str, Any]:
    """AdamW for ``steps`` steps of 2 accumulated micro-batches, then
    ``accelerator.free_memory()`` and a new SGD prepared on the same (prepared) model
    with the same accelerator, or on the unwrapped model with a ``new_accelerator``, for
    ``steps`` more: parameters, clip norms, SGD's state."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    quiet()
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=CPU, gradient_accumulation_steps=ACCUMULATE)
    model: Any = MODELS["gpt2"]()
    data = accelerator.prepare(torch.utils.data.DataLoader(Tokens("gpt2"), batch_size=2))
    norms: list[Any] = []
    optimizer: Any = torch.optim.AdamW(model.parameters(), lr=LR)
    for phase in range(2):
        model, optimizer = prepared(accelerator, model, optimizer, technique, MAX_NORM)
        for index, batch in enumerate(data):
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                if accelerator.sync_gradients:
                    norms.append(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM))
                optimizer.step()
                optimizer.zero_grad()
            if index + 1 == steps * ACCUMULATE:
                break
        if phase == 0:  # a second phase, with a new optimizer
            accelerator.free_memory()
            if new_accelerator:
                from accelerate.state import AcceleratorState

                model = accelerator.unwrap_model(model)
                AcceleratorState._reset_state(True)
                accelerator = Accelerator(cpu=CPU, gradient_accumulation_steps=ACCUMULATE)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = optimizer.optimizer.state_dict()["state"]
    return {"params": parameters(accelerator.unwrap_model(model)), "norms": norms,
            "state": [s["momentum_buffer"] for s in state.values()]}


def rebuilds(rank: int, world_size: int, techniques: tuple[str, ...],
             new_accelerator: tuple[bool, ...] = (False,)) -> dict[str, Any]:
    """Per technique (and new accelerator or not): the rebuilt run bitwise the plain one
    (a falsy Comparison if not)."""
    out: dict[str, Any] = {}
    for new in new_accelerator:
        plain = rebuilt(None, new)
        for technique in techniques:
            try:
                ours = rebuilt(technique, new)
            except Exception as error:  # 0.4 before the probe: refused
                out[technique, new] = Comparison((f"{type(error).__name__}: {error}"[:300],))
                continue
            out[technique, new] = (same_run(plain, ours)
                                   and compare(plain["state"], ours["state"]))
    return out
