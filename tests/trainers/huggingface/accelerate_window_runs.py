"""Accelerate loops that work in the window between backward and ``optimizer.step()``
(issue 30, cases 5 and 6): the manual accumulation of Accelerate's guide (``loss / 2``,
backward every micro-batch, step every second, no ``accelerator.accumulate``), gradient
noise and gradient masking between backward and step, and per-parameter gradient norms
read there (before the clip). Each run with the plain
``accelerator.prepare`` and with ``overlapkit.integrations.accelerate.prepare``, in the
test process or on gloo ranks (``run``)."""

from __future__ import annotations

import warnings
from typing import Any

from hf_models import Tokens, gpt2, parameters, quiet
from trainer_helpers import prepared

CASES = ("manual accumulation", "gradient noise", "gradient masking",
         "gradient norms logged")
STEPS, MAX_NORM, LR = 4, 1.0, 1e-2


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
            for param in model.parameters():
                if case == "gradient noise":
                    param.grad.add_(torch.randn(param.grad.shape, generator=noise), alpha=1e-3)
                elif case == "gradient masking" and param.grad.dim() == 2:
                    param.grad[:4] = 0
                elif case == "gradient norms logged":  # read only, before the clip
                    logged.append(torch.linalg.vector_norm(param.grad))
            norms.append(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM))
            optimizer.step()
            optimizer.zero_grad()
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
    return out
