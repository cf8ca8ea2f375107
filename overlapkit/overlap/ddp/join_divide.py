"""``ddp_model.join(divide_by_initial_world_size=False)``, refused at the forward.

Under that join plain DDP divides each reduced gradient by the number of ranks that
have not joined yet (its reducer's divide factor, from the collective DDP's forward
runs with the join context), where its default reduction runs. Once a comm hook is
registered -- overlapkit's, which reduces and steps each bucket -- the reducer leaves
the division to the hook, which knows only the process group's size: after the first
rank joined, every step divided by the initial world size, silently (0.4.0,
``cdd1705``: AdamW 0.0063 off the plain loop after rank 1's last two of 5 steps, both
techniques, learnt or not). The count is not readable from Python, and a collective of
our own would not pair with what the joined ranks shadow, so such a forward is refused
before DDP's own collective runs, on every rank still training (the first forward
under the join: no rank has joined yet, nothing has stepped). Checked per forward of
the DDP model: two reads of the model's ``__dict__``.
"""

from __future__ import annotations

from typing import Any

import torch

from overlapkit.errors import ConfigurationError

__all__ = ["refuse_join_dividing_by_remaining_ranks"]


def refuse_join_dividing_by_remaining_ranks(module: torch.nn.Module, args: Any,
                                            technique: str) -> None:
    """A forward pre-hook of the DDP model (bound to ``technique`` by an
    :class:`~overlapkit.overlap.core.own_hooks.OwnHook`): refuse a join that divides by
    the remaining ranks (``throw_on_early_termination=True`` ignores the setting, as
    torch does).

    :raises ConfigurationError: the model is under
        ``join(divide_by_initial_world_size=False)``.
    """
    # the instance's dict, not getattr: a name DDP has not set goes through
    # nn.Module.__getattr__, whose AttributeError cost 17 us per forward (measured)
    attributes = module.__dict__
    if attributes.get("_divide_by_initial_world_size", True):
        return
    config = attributes.get("_join_config")
    if config is None or not config.enable or config.throw_on_early_termination:
        return
    raise ConfigurationError(
        f"ddp_model.join(divide_by_initial_world_size=False) with {technique}: plain DDP "
        "then divides the gradients by the ranks that have not run out of inputs, a "
        f"count only its default reduction sees; {technique}'s reduction, which steps "
        "each bucket, divides by the initial world size, so the steps after a rank "
        "joined would differ from the plain loop's. Nothing was stepped. Use "
        "ddp_model.join() (divide_by_initial_world_size=True, the default), or "
        "throw_on_early_termination=True to stop all ranks when the first runs out.")
