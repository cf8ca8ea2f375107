"""A hand-written fp16-style AMP loop with its own ``torch.amp.GradScaler`` driving the
optimizer ``overlapkit.integrations.accelerate.prepare`` returns (Accelerate's
``AcceleratedOptimizer`` around the overlapped one): ``scaler.scale(loss).backward()``,
``scaler.unscale_(optimizer)`` and a clip, ``scaler.step(optimizer)``,
``scaler.update()``. The scaler's unscale writes the gradients bumping no version
counter: before, ``overlap_ddp`` stepped the scaled gradients during backward from the
second step on, silently (0.030 off the plain run after 4 AdamW steps; NaN parameters
after an overflowing step the scaler would skip), and ``optimizer_in_backward`` ended a
scaler first used at a later step in torch's bare ``AssertionError``. Run with the plain
``accelerator.prepare`` and with overlapkit's, on gloo ranks (``run``) or in the test
process (``loop``)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

CASES = ("a scaler from the first step", "unscale_ and clip", "an overflow at the second step",
         "a scaler from the third step", "grad_scaler= given to prepare",
         "grad_scaler= given, scaler.step(optimizer.optimizer)")
#: a scaler first used once the steps happen during backward; one driving the wrapper of
#: an optimizer set up with grad_scaler= (before: 0.0012 off, both techniques, with a
#: warning naming gradient reads), which would unscale twice
REFUSED = CASES[3:5]
#: the advice of that refusal followed: the overlap kept, bitwise, no warning (before:
#: the scaler's own inf check taken for a gradient read, the plain order, one warning)
KEPT = CASES[5]
STEPS, MAX_NORM = 4, 0.5


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def loop(case: str, technique: str | None, rank: int = 0) -> dict[str, Any]:
    """STEPS steps of ``case``: the parameters, the scales, the warnings and the error
    (with whether the gradients and parameters were left as they were)."""
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    clip = MAX_NORM if case == "unscale_ and clip" else None
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    given = {"grad_scaler": scaler} if case.startswith("grad_scaler= given") else {}
    out: dict[str, Any] = {"error": None, "scales": []}
    if technique is None:
        model, optimizer = accelerator.prepare(model, optimizer)
    else:
        from overlapkit.integrations.accelerate import prepare

        model, optimizer = prepare(accelerator, model, optimizer, technique=technique,
                                   clip_grad_norm=clip, **given)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            batch = torch.Generator().manual_seed(100 * rank + step)
            x, y = torch.randn(8, 8, generator=batch), torch.randn(8, 4, generator=batch)
            loss = (model(x) - y).square().mean()
            if case == "an overflow at the second step" and step == 1:
                loss = loss * float("inf")  # the scaler skips this step
            if case == "a scaler from the third step" and step < 2:
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                continue
            scaler.scale(loss).backward()
            if case in REFUSED:  # read in the window only here
                grads = [None if p.grad is None else p.grad.clone()
                         for p in model.parameters()]
                params = [p.detach().clone() for p in model.parameters()]
            try:
                if clip is not None:
                    scaler.unscale_(optimizer)
                    accelerator.clip_grad_norm_(model.parameters(), clip)
                scaler.step(optimizer.optimizer if case == KEPT and technique else optimizer)
            except Exception as error:  # reported to the test
                out["error"] = {"type": type(error).__name__, "message": str(error)}
                out["unchanged"] = all(
                    ((g is None and p.grad is None)
                     or (g is not None and p.grad is not None and torch.equal(g, p.grad)))
                    and torch.equal(q, p)
                    for g, q, p in zip(grads, params, model.parameters(), strict=True))
                break
            scaler.update()
            optimizer.zero_grad()
            out["scales"].append(scaler.get_scale())
    out["params"] = [p.detach().clone() for p in model.parameters()]
    facade = getattr(optimizer, "optimizer", None)
    out["overlapping"] = bool(getattr(getattr(facade, "_steps", None), "learned", False))
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, UserWarning)
                       and "takes every step" in str(w.message)]
    return out


def compare(case: str, techniques: tuple[str, ...], rank: int = 0) -> dict[str, Any]:
    """Per technique: (bitwise the plain run, its difference, the warnings, the error)."""
    plain = loop(case, None, rank)
    out = {}
    for technique in techniques:
        got = loop(case, technique, rank)
        diff = max(float((a - b).abs().max()) for a, b in
                   zip(plain["params"], got["params"], strict=True))
        same = (all(torch.equal(a, b) for a, b in zip(plain["params"], got["params"],
                                                       strict=True))
                and plain["scales"] == got["scales"])
        out[technique] = {"same": same, "diff": diff, "warnings": got["warnings"],
                          "error": got["error"], "unchanged": got.get("unchanged"),
                          "overlapping": got["overlapping"]}
    return out


def run(rank: int, world_size: int) -> dict[str, Any]:
    """Every case with both techniques on a gloo rank (Accelerate wraps the model in
    DDP)."""
    out = {case: compare(case, ("overlap_ddp", "optimizer_in_backward"), rank)
           for case in CASES}
    out["after"] = compare_after(("overlap_ddp", "optimizer_in_backward"), rank)
    return out


#: the prepared optimizer released (``optimizer.optimizer.release()``) or replaced by a
#: later call on the same parameters before the scaler's first use (the tenth round)
AFTER = ("released", "replaced")


def after(mode: str, technique: str | None, call: str, rank: int = 0) -> dict[str, Any]:
    """Two plain steps, then ``mode`` (with overlapkit) and a scaler driving the prepared
    optimizer (``scaler.<call>(optimizer)``, then ``step`` if ``call`` is ``unscale_``) for
    two steps. Before: a replaced one was refused only at its ``step()``, after the scaler
    had unscaled the gradients the new call steps (``overlap_ddp``), or torch's bare
    ``AssertionError`` (``optimizer_in_backward``, freed gradients); a released one, whose
    ``step()`` is a plain step, was refused as stepping during backward."""
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    if technique is None:
        model, optimizer = accelerator.prepare(model, optimizer)
    else:
        from overlapkit.integrations.accelerate import prepare

        model, optimizer = prepare(accelerator, model, optimizer, technique=technique,
                                   clip_grad_norm=None)
    out: dict[str, Any] = {"error": None, "unchanged": None}
    new = None
    for step in range(STEPS):
        batch = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(8, 8, generator=batch), torch.randn(8, 4, generator=batch)
        loss = (model(x) - y).square().mean()
        if step < 2:
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            continue
        if step == 2 and technique is not None:
            if mode == "released":
                optimizer.optimizer.release()
            else:
                import overlapkit

                new = getattr(overlapkit, technique)(model, torch.optim.SGD, lr=0.1)
        scaler.scale(loss).backward()
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        try:
            getattr(scaler, call)(optimizer)
            if call == "unscale_":
                scaler.step(optimizer)
        except Exception as error:  # reported to the test
            out["error"] = {"type": type(error).__name__, "message": str(error)}
            out["unchanged"] = all(
                (g is None and p.grad is None)
                or (g is not None and p.grad is not None and torch.equal(g, p.grad))
                for g, p in zip(grads, model.parameters(), strict=True))
            break
        scaler.update()
        optimizer.zero_grad()
    out["params"] = [p.detach().clone() for p in model.parameters()]
    if new is not None:
        new.release()
    return out


def compare_after(techniques: tuple[str, ...], rank: int = 0) -> dict[str, Any]:
    """Per ``mode call technique``: (bitwise the plain run, the error, grads unchanged)."""
    out = {}
    for call in ("step", "unscale_"):
        plain = after("", None, call, rank)
        for mode in AFTER:
            for technique in techniques:
                got = after(mode, technique, call, rank)
                same = all(torch.equal(a, b) for a, b in
                           zip(plain["params"], got["params"], strict=True))
                out[f"{mode} {call} {technique}"] = {
                    "same": same, "error": got["error"], "unchanged": got["unchanged"]}
    return out
