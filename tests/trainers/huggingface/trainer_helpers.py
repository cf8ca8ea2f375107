"""What the Hugging Face Trainer and Accelerate tests share beyond the models
(:mod:`hf_models`): the model and optimizer prepared plainly or by overlapkit, and the
check of a run that uses the window between backward and step."""

from __future__ import annotations

from typing import Any


def prepared(accelerator: Any, model: Any, optimizer: Any, technique: str | None,
             max_norm: float) -> tuple[Any, Any]:
    """``accelerator.prepare(model, optimizer)`` (``technique`` None: the plain run), or
    ``overlapkit.integrations.accelerate.prepare`` with ``technique`` and
    ``clip_grad_norm=max_norm``."""
    if technique is None:
        return accelerator.prepare(model, optimizer)
    from overlapkit.integrations.accelerate import prepare

    return prepare(accelerator, model, optimizer, technique=technique,
                   clip_grad_norm=max_norm)


def check_plain_order(result: tuple[bool, str, list[str]], named: str) -> None:
    """A run that used the window: bitwise the plain one, with one warning naming
    ``named`` and saying how to keep the overlap."""
    same, differences, warned = result
    assert same, differences
    assert len(warned) == 1, warned
    assert named in warned[0] and "To keep the overlap" in warned[0]
