"""Accelerate's gradient accumulation (``accelerator.accumulate``, two micro-batches a
step) with ``accelerator.clip_grad_norm_`` called after every micro-batch's backward, not
only where ``accelerator.sync_gradients`` is true (twelfth probe): the plain
``accelerator.prepare`` run and ``overlapkit.integrations.accelerate.prepare``'s, in the
test process or on gloo ranks (``run``)."""

from __future__ import annotations

import warnings
from typing import Any

from hf_models import Tokens, gpt2, parameters, quiet
from trainer_helpers import prepared

STEPS, MAX_NORM, LR = 4, 1.0, 1e-2


def loop(technique: str | None) -> dict[str, Any]:
    """STEPS optimizer steps of two micro-batches, each clipped: parameters, optimizer
    state, the norms the clips returned and the warnings given."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    quiet()
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    model, optimizer = prepared(accelerator, model, optimizer, technique, MAX_NORM)
    data = accelerator.prepare(torch.utils.data.DataLoader(Tokens("gpt2"), batch_size=2))
    norms: list[Any] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for index, batch in enumerate(data):
            if index == 2 * STEPS:
                break
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                norms.append(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM))
                optimizer.step()
                optimizer.zero_grad()
    inner = getattr(optimizer, "optimizer", optimizer)
    inner = getattr(inner, "optimizer", inner)
    return {"params": parameters(accelerator.unwrap_model(model)),
            "state": [v for s in inner.state.values() for v in s.values()],
            "norms": [n.detach().clone() for n in norms],
            "warnings": [str(w.message) for w in caught if "overlap" in str(w.message)]}


def compare_runs(techniques: tuple[str, ...]) -> dict[str, Any]:
    """Per technique: (bitwise the plain run, what differs, the warnings)."""
    from helpers import compare

    plain = loop(None)
    out: dict[str, Any] = {}
    for technique in techniques:
        ours = loop(technique)
        found = (compare(plain["params"], ours["params"])
                 and compare(plain["state"], ours["state"])
                 and compare(plain["norms"], ours["norms"]))
        out[technique] = (bool(found), str(found), ours["warnings"])
    return out


def run(rank: int, world_size: int) -> dict[str, Any]:
    return compare_runs(("overlap_ddp", "optimizer_in_backward"))
