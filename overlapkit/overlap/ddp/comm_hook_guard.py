"""A comm hook the user registers on a DDP model overlapkit already set up: refused by
name, before anything changes.

DDP takes one comm hook per model, for the model's life, and overlapkit's
(:func:`~overlapkit.overlap.ddp.setup.slot_comm_hook`) is it. A later
``ddp_model.register_comm_hook(state, fp16_compress_hook)`` — a trainer's own set-up, a
user compressing gradients after the fact — got torch's bare ``RuntimeError``
("register_comm_hook or register_builtin_comm_hook can only be called once"), which
says nothing of ``comm_hook=``, the way to have a hook run before each bucket's step.

:func:`install` wraps ``DistributedDataParallel.register_comm_hook``,
``_register_builtin_comm_hook`` and ``_register_fused_optim`` (torch's own optimizer
overlap, which registers a comm hook too) once (as the plain-step guard wraps ``step()``): on a
model overlapkit set up (its marker attribute holds a
:class:`~overlapkit.overlap.ddp.setup.CommHookSlot`) they raise a
:class:`~overlapkit.errors.ConfigurationError` naming what to do; on any other model,
a copy of one included (a plain DDP model), they are torch's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from overlapkit.errors import ConfigurationError

__all__ = ["install"]

_installed: list[bool] = []


def _refusal(call: str) -> ConfigurationError:
    return ConfigurationError(
        f"ddp_model.{call}() on a DDP model that overlap_ddp / optimizer_in_backward set "
        "up: DDP takes one comm hook per model, for its life, and overlapkit's is it (it "
        "steps each bucket once reduced). Nothing was registered. Pass the hook by name "
        "instead, comm_hook='fp16_compress' (torch's default hooks are built in; your own "
        "through the overlapkit_register_comm_hooks hook), or, for a plain run with your "
        "own hook, wrap the module in a new DistributedDataParallel.")


def _guarded(call: str, original: Callable[..., Any], is_set_up: Callable[[Any], bool],
             ) -> Callable[..., Any]:
    def guarded(self: DistributedDataParallel, *args: Any, **kwargs: Any) -> Any:
        if is_set_up(self):
            raise _refusal(call)
        return original(self, *args, **kwargs)

    guarded.__doc__, guarded.__name__ = original.__doc__, original.__name__
    guarded.__wrapped__ = original  # type: ignore[attr-defined]
    return guarded


def install(is_set_up: Callable[[Any], bool]) -> None:
    """Wrap DDP's comm-hook registrations (once; idempotent). ``is_set_up(model)``:
    whether overlapkit set ``model`` up."""
    if _installed:
        return
    for call in ("register_comm_hook", "_register_builtin_comm_hook",
                 "_register_fused_optim"):
        setattr(DistributedDataParallel, call,
                _guarded(call, getattr(DistributedDataParallel, call), is_set_up))
    _installed.append(True)
