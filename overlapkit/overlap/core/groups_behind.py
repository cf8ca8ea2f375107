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
nothing here. A parameter put into a second group by hand is named as that, not as an
``add_param_group()`` to move to the overlapped optimizer (which would refuse it:
before, the refusal said to call it there).
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
    technique = steps.technique
    twice = _listed_twice(optimizer.param_groups)
    if twice:
        return ConfigurationError(
            f"the {type(optimizer).__qualname__} that {technique} steps lists a parameter "
            f"in more than one param group ({', '.join(twice)}; param_groups edited by "
            "hand): the plain step() would step it once per group it is in, and torch's "
            "add_param_group() refuses such a group. Nothing was stepped in this "
            "backward. List each parameter in one param group.")
    change = (f"{count - indexed} parameters more" if count > indexed
              else f"{indexed - count} parameters fewer")
    return ConfigurationError(
        f"the {type(optimizer).__qualname__} that {technique} steps holds {change} than "
        f"{technique} was told of: its own add_param_group() (or param_groups edited by "
        f"hand) was called, not the optimizer {technique} returned, so no backward would "
        "step them. Nothing was stepped in this backward. Call add_param_group() on the "
        f"optimizer {technique} returned (it validates and hooks the parameters, stepped "
        "from the next backward on)."
    )


def _listed_twice(groups: list[dict[str, Any]]) -> list[str]:
    """Where a parameter is listed again, in words (``"#3 of group 0 in group 1"``):
    asked only as a backward is refused."""
    first: dict[int, str] = {}
    found = []
    for index, group in enumerate(groups):
        for position, param in enumerate(group["params"]):
            where = f"#{position} of group {index}"
            if id(param) in first:
                found.append(f"{first[id(param)]} again as {where}")
            else:
                first[id(param)] = where
    return found
