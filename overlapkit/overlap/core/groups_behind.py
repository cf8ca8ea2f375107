"""Parameters added to the real optimizer behind the overlapped one: refused at the next
backward, before anything steps in it.

A loop that keeps a reference to the optimizer it passed in (``overlap_ddp(model,
optimizer)``; a Lightning module's ``self.optimizer``) may call that optimizer's own
``add_param_group`` (unfreezing a backbone) instead of the overlapped optimizer's. The
engine's index of parameters and the hooks of the technique are then not told: the
added parameters are never stepped during backward, and nothing says so (measured
before this check: 0.038 off the plain loop after 6 steps, silently, on a plain module
and DDP). The overlapped optimizer's ``add_param_group`` validates and hooks them, so
:func:`groups_changed_refusal` refuses each backward that would step while the real
optimizer holds another number of parameters than the engine has indexed (its own
``add_param_group``, or parameters put into ``param_groups`` by hand), naming that
call. Replacing the groups with the same parameters (its ``load_state_dict``) changes
nothing here.
"""

from __future__ import annotations

from typing import Any

from overlapkit.errors import ConfigurationError

__all__ = ["groups_changed_refusal"]


def groups_changed_refusal(steps: Any) -> ConfigurationError | None:
    """The refusal of a backward starting on ``steps`` (a stepper, whose ``engine`` steps
    the real optimizer) while the real optimizer holds parameters its engine does not
    know of, or lost some, else None (two attribute reads and a sum over the groups)."""
    engine = getattr(steps, "engine", None)
    if engine is None:
        return None
    optimizer = engine.optimizer
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    indexed = engine.indexed
    if count == indexed:
        return None
    change = (f"{count - indexed} parameters more" if count > indexed
              else f"{indexed - count} parameters fewer")
    technique = steps.technique
    return ConfigurationError(
        f"the {type(optimizer).__qualname__} that {technique} steps holds {change} than "
        f"{technique} was told of: its own add_param_group() (or param_groups edited by "
        f"hand) was called, not the optimizer {technique} returned, so no backward would "
        "step them. Nothing was stepped in this backward. Call add_param_group() on the "
        f"optimizer {technique} returned (it validates and hooks the parameters, stepped "
        "from the next backward on)."
    )
