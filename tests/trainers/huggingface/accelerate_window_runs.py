"""Accelerate loops that work in the window between backward and ``optimizer.step()``
(issue 30, cases 5 and 6): the manual accumulation of Accelerate's guide (``loss / 2``,
backward every micro-batch, step every second, no ``accelerator.accumulate``), gradient
noise and gradient masking between backward and step, and per-parameter gradient norms
read there (before the clip); and (0.4's probe) a warm-up written by hand (the learning
rate set between backward and step), the optimizer state read there for logging, and
the clipped gradients' norm asked after the clip.
Each run with the plain ``accelerator.prepare`` and with
``overlapkit.integrations.accelerate.prepare``, in the test process or on gloo ranks
(``run``)."""

from __future__ import annotations

import warnings
from typing import Any

from hf_models import Tokens, gpt2, parameters, quiet
from trainer_helpers import prepared

CASES = ("manual accumulation", "gradient noise", "gradient masking",
         "gradient norms logged", "warm-up by hand", "optimizer state logged",
         "norm logged after the clip", "clip of part of the model")
STEPS, MAX_NORM, LR = 4, 1.0, 1e-2
#: a loop zeroing with zero_grad(set_to_none=False) (the sixth probe: under
#: optimizer_in_backward refused at the third step's zero_grad, two steps taken; now the
#: plain order from the first, bitwise, one warning; overlap_ddp keeps the overlap)
ZEROS = "zero_grad(set_to_none=False)"


def loop(case: str, technique: str | None) -> dict[str, Any]:
    """STEPS optimizer steps of ``case``: parameters, optimizer state, clip norms and
    the warnings given."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    quiet()
    AcceleratorState._reset_state(True)  # the settings of an earlier Accelerator
    accelerator = Accelerator(cpu=True)
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    model, optimizer = prepared(accelerator, model, optimizer, technique, MAX_NORM)
    data = accelerator.prepare(torch.utils.data.DataLoader(Tokens("gpt2"), batch_size=2))
    every = 2 if case == "manual accumulation" else 1
    norms: list[Any] = []
    logged: list[Any] = []
    steps = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for index, batch in enumerate(data):
            loss = model(**batch).loss / every
            accelerator.backward(loss)
            if (index + 1) % every:
                continue
            noise = torch.Generator().manual_seed(steps)
            if case == "warm-up by hand":  # the plain step() takes this learning rate
                for group in optimizer.param_groups:
                    group["lr"] = LR * (steps + 1) / STEPS
            elif case == "optimizer state logged":  # Adam's first moments, before the step
                logged.extend(state["exp_avg"].norm() for state in optimizer.state.values())
            for param in model.parameters():
                if case == "gradient noise":
                    param.grad.add_(torch.randn(param.grad.shape, generator=noise), alpha=1e-3)
                elif case == "gradient masking" and param.grad.dim() == 2:
                    param.grad[:4] = 0
                elif case == "gradient norms logged":  # read only, before the clip
                    logged.append(torch.linalg.vector_norm(param.grad))
            clipped = (accelerator.unwrap_model(model).transformer.h.parameters()
                       if case == "clip of part of the model"  # the blocks only (sixth
                       else model.parameters())  # probe: refused after step 2, stepped)
            norms.append(accelerator.clip_grad_norm_(clipped, MAX_NORM))
            if case == "norm logged after the clip":  # the clipped gradients' norm
                norms.append(accelerator.clip_grad_norm_(model.parameters(), float("inf")))
            optimizer.step()
            optimizer.zero_grad(set_to_none=case != ZEROS)
            steps += 1
            if steps == STEPS:
                break
    inner = optimizer.optimizer
    return {"params": parameters(accelerator.unwrap_model(model)), "norms": norms + logged,
            "state": [t for s in inner.state.values() for t in s.values()
                      if isinstance(t, torch.Tensor)],
            "warnings": [str(w.message) for w in caught if "plain order" in str(w.message)]}


def compare_case(case: str, techniques: tuple[str, ...]) -> dict[str, Any]:
    """For each technique: (bitwise the plain run, what differs, the warnings)."""
    from helpers import compare

    plain = loop(case, None)
    out: dict[str, Any] = {}
    for technique in techniques:
        try:
            ours = loop(case, technique)
        except Exception as error:  # what 0.3 raised, reported per case
            out[technique] = (False, f"{type(error).__name__}: {error}"[:300], [])
            continue
        found = (compare(plain["params"], ours["params"])
                 and compare(plain["state"], ours["state"])
                 and compare(plain["norms"], ours["norms"]))
        out[technique] = (bool(found), str(found), ours["warnings"])
    return out


def second_backward(technique: str) -> dict[str, Any]:
    """A loop whose third step runs a second backward (an auxiliary loss through the
    kept graph) before ``optimizer.step()``, after the first step has shown it calls
    step(): the error, and whether that backward left the parameters unchanged."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from helpers import compare, error_of

    quiet()
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True)
    model = gpt2()
    model, optimizer = prepared(accelerator, model,
                                torch.optim.AdamW(model.parameters(), lr=LR), technique,
                                MAX_NORM)
    data = accelerator.prepare(torch.utils.data.DataLoader(Tokens("gpt2"), batch_size=2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step, batch in enumerate(data):
            loss = model(**batch).loss
            accelerator.backward(loss, retain_graph=step == 2)
            if step == 2:
                before = [p.detach().clone() for p in model.parameters()]
                error = error_of(lambda: accelerator.backward(0.5 * loss))  # noqa: B023
                return {"error": error, "unchanged": compare(
                    before, [p.detach().clone() for p in model.parameters()])}
            accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
            optimizer.step()
            optimizer.zero_grad()
    raise AssertionError("the loop ended before its third step")


def run(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {case: compare_case(case, ("overlap_ddp", "optimizer_in_backward"))
                           for case in CASES}
    out["second backward"] = {t: second_backward(t)
                              for t in ("overlap_ddp", "optimizer_in_backward")}
    out["gan"] = gans(("overlap_ddp", "optimizer_in_backward"))
    out[ZEROS] = compare_case(ZEROS, ("overlap_ddp", "optimizer_in_backward"))
    out["forward past DDP"] = {t: refused_in_the_window("forward past DDP", t)
                               for t in ("overlap_ddp", "optimizer_in_backward")}
    return out


def gans(techniques: tuple[str, ...]) -> dict[str, Any]:
    """Per technique and order (generator first, discriminator first): whether the GAN
    is bitwise the plain one with no error, its warnings, its error."""
    from helpers import compare

    out: dict[str, Any] = {}
    for generator_first, order in ((True, "generator first"),
                                   (False, "discriminator first")):
        plain = gan(None, generator_first=generator_first)
        for technique in techniques:
            ours = gan(technique, generator_first=generator_first)
            out.setdefault(technique, {})[order] = (
                bool(compare(plain["params"], ours["params"])) and ours["error"] is None,
                ours["warnings"], ours["error"])
    return out


def refused_in_the_window(case: str, technique: str) -> dict[str, Any]:
    """A loop that, from its third step on, does ``case`` between backward and
    ``optimizer.step()``: a learning rate changed by hand after the overlap began
    ("late learning rate"), or that clips in a way the optimizer was not set up for from
    the first step ("clip by value": ``clip_grad_value_``; "clip over two optimizers":
    ``clip_grad_norm_`` over the parameters of an overlapped and a plain optimizer); or
    that runs every forward past the DDP wrapper ("forward past DDP":
    ``accelerator.unwrap_model(model)(**batch)``; the eighth probe: ``overlap_ddp``
    silently 0.00038 off the plain run after 4 steps on 2 ranks, other clip norms;
    ``optimizer_in_backward`` refused naming ``find_unused_parameters``).
    The error, and the step it came at (1: the first, before anything stepped)."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from helpers import error_of

    quiet()
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True)
    model = gpt2()
    blocks = [p for name, p in model.named_parameters() if ".h." in name]
    rest = [p for name, p in model.named_parameters() if ".h." not in name]
    two = case == "clip over two optimizers"
    optimizer = torch.optim.AdamW(blocks if two else model.parameters(), lr=LR)
    model, optimizer = prepared(accelerator, model, optimizer, technique,
                                None if case == "clip by value" else MAX_NORM)
    other = accelerator.prepare(torch.optim.SGD(rest, lr=LR)) if two else None
    data = accelerator.prepare(torch.utils.data.DataLoader(Tokens("gpt2"), batch_size=2))
    before = [p.detach().clone() for p in model.parameters()]

    forward = accelerator.unwrap_model(model) if case == "forward past DDP" else model

    def one_step(step: int, batch: Any) -> None:
        accelerator.backward(forward(**batch).loss)
        if case == "late learning rate" and step >= 3:
            for group in optimizer.param_groups:
                group["lr"] = LR / 2
        if case == "clip by value":
            accelerator.clip_grad_value_(model.parameters(), 0.05)
        elif case not in ("no clip", "clip after the step"):
            accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
        for each in (optimizer, other):  # one step() each (a second is refused)
            if each is not None:
                each.step()
                if case == "clip after the step":  # a mis-ordered loop: no clip before
                    accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                each.zero_grad()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step, batch in enumerate(data, start=1):
            error = error_of(lambda: one_step(step, batch))  # noqa: B023
            if error is not None:
                unchanged = all(p.detach().equal(b) for p, b in
                                zip(model.parameters(), before, strict=True))
                return {"error": error, "step": step, "unchanged": unchanged}
            if step == STEPS:
                break
    return {"error": None}


def gan(technique: str | None, generator_first: bool, steps: int = 4) -> dict[str, Any]:
    """A GAN with two optimizers, both set up by ``prepare`` (``technique``): the
    generator's loss reaches the discriminator's parameters (no ``requires_grad_(False)``
    on them), whose gradients the plain loop then discards with ``zero_grad()``. The
    discriminator steps first (PyTorch's DCGAN tutorial) or after the generator. Both
    models' parameters, the warnings, the error."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from helpers import error_of

    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    generator = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 8))
    critic = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                 torch.nn.Linear(16, 1))
    models, optimizers = [], []
    for model in (generator, critic):
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        model, optimizer = prepared(accelerator, model, optimizer, technique, None) \
            if technique is not None else accelerator.prepare(model, optimizer)
        models.append(model)
        optimizers.append(optimizer)
    (generator, critic), (g_optimizer, c_optimizer) = models, optimizers
    loss = torch.nn.BCEWithLogitsLoss()
    data = torch.Generator().manual_seed(1)

    def critic_step(real: torch.Tensor, fake: torch.Tensor) -> None:
        c_optimizer.zero_grad()
        accelerator.backward(loss(critic(real), torch.ones(8, 1))
                             + loss(critic(fake.detach()), torch.zeros(8, 1)))
        c_optimizer.step()

    def train() -> None:
        for _ in range(steps):
            real, fake = torch.randn(8, 8, generator=data), generator(
                torch.randn(8, 4, generator=data))
            if not generator_first:
                critic_step(real, fake)
            g_optimizer.zero_grad()
            accelerator.backward(loss(critic(fake), torch.ones(8, 1)))
            g_optimizer.step()
            if generator_first:
                critic_step(real, fake)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        error = error_of(train)
    return {"params": [p.detach().clone() for m in models for p in m.parameters()],
            "error": error,
            "warnings": [str(w.message) for w in caught if "plain order" in str(w.message)]}


def norm_after_the_clip(technique: str | None) -> dict[str, Any]:
    """A loop that, from its third step on (after the overlap began), also asks
    ``clip_grad_norm_(..., inf)`` after its clip: the norms returned, the warnings."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    quiet()
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True)
    model = gpt2()
    model, optimizer = prepared(accelerator, model,
                                torch.optim.AdamW(model.parameters(), lr=LR), technique,
                                MAX_NORM)
    data = accelerator.prepare(torch.utils.data.DataLoader(Tokens("gpt2"), batch_size=2))
    norms = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, batch in enumerate(data, start=1):
            accelerator.backward(model(**batch).loss)
            accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
            if step >= 3:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(),
                                                               float("inf"))))
            optimizer.step()
            optimizer.zero_grad()
            if step == STEPS:
                break
    return {"norms": norms, "warnings": [str(w.message) for w in caught]}


def checkpoint_in_the_window(case: str, technique: str | None, at: int,
                             directory: str) -> dict[str, Any]:
    """A loop calling ``accelerator.save_state`` (``case`` "save") or ``load_state``
    ("load", of the plain loop's checkpoint after its first step, saved in ``directory``
    by ``case`` "make") between the clip and ``optimizer.step()`` of step ``at``: the
    error, whether the call left the parameters as they were, and the parameters after
    STEPS steps (or at the error)."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from helpers import error_of

    quiet()
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True)
    model = gpt2()
    model, optimizer = prepared(accelerator, model,
                                torch.optim.AdamW(model.parameters(), lr=LR), technique,
                                MAX_NORM)
    data = accelerator.prepare(torch.utils.data.DataLoader(Tokens("gpt2"), batch_size=2))
    error, unchanged = None, True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step, batch in enumerate(data, start=1):
            accelerator.backward(model(**batch).loss)
            accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
            if step == at and case in ("save", "load"):
                before = [p.detach().clone() for p in model.parameters()]
                call = accelerator.save_state if case == "save" else accelerator.load_state
                error = error_of(lambda: call(directory))  # noqa: B023
                unchanged = all(p.detach().equal(b) for p, b in
                                zip(model.parameters(), before, strict=True))
                if error is not None:
                    break
            optimizer.step()
            optimizer.zero_grad()
            if step == 1 and case == "make":
                accelerator.save_state(directory)
            if step == STEPS:
                break
    return {"error": error, "unchanged": unchanged,
            "params": parameters(accelerator.unwrap_model(model))}


def checkpoints(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """Per technique, ``save_state`` and ``load_state`` in the window of the third step
    (refused: the error, whether the parameters were left as they were, whether the
    save wrote anything)."""
    import os

    checkpoint_in_the_window("make", None, 0, f"{directory}/made")
    out: dict[str, Any] = {}
    for technique in ("overlap_ddp", "optimizer_in_backward"):
        saved = f"{directory}/{technique}-saved"
        out[technique] = {
            "save": checkpoint_in_the_window("save", technique, 3, saved),
            "load": checkpoint_in_the_window("load", technique, 3, f"{directory}/made")}
        out[technique]["save"]["wrote"] = os.path.exists(saved)
        for result in out[technique].values():
            del result["params"]
    return out
