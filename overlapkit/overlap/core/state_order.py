"""The optimizer's ``state`` in the plain loop's order.

A torch optimizer makes a parameter's state entry the first time its ``step()`` steps
that parameter, group by group in ``param_groups`` order (``Adam._init_group``), so the
plain loop's ``optimizer.state`` lists the parameters in the optimizer's order. Stepped
during backward, bucket by bucket or parameter by parameter, the entries were made in
backward's order, last layer first. Anything that reads the state by position saw
another parameter (measured before this module, 0.4.0: ``opt.state.pop(next(iter(
opt.state)))`` between steps reset ``2.bias`` instead of ``0.weight``, 0.044 off the
plain loop after 5 AdamW steps, silently; ``list(opt.state_dict()["state"])`` was
``[3, 2, 1, 0]``, a checkpoint's bytes another order than the plain one's).

:class:`PlainStateOrder` puts the entries a stepping backward made back in the plain
order, as that backward ends: the entries made before stay first (a plain loop
appends later ones, a layer unfrozen), the new ones follow in ``param_groups`` order.
A backward that made no entry costs one ``len()``.
"""

from __future__ import annotations

from typing import Any

from overlapkit.overlap.core.data_writes import plain_state

__all__ = ["PlainStateOrder"]


class PlainStateOrder:
    """Keeps one optimizer's ``state`` entries in the plain loop's order
    (see the module docstring)."""

    def __init__(self) -> None:
        #: the number of entries the state held when last put in order
        self.known = 0

    def follow(self, optimizer: Any) -> None:
        """After a backward that stepped parameters of ``optimizer`` (the real one):
        the entries it made moved to the end, in ``param_groups`` order."""
        state = plain_state(optimizer)
        size = len(state)
        if size <= self.known:  # nothing new; entries the loop removed are not made again
            self.known = size
            return
        added = list(state)[self.known:]
        self.known = size
        position = {id(p): index for index, p in enumerate(
            p for group in optimizer.param_groups for p in group["params"])}
        ordered = sorted(added, key=lambda key: position.get(id(key), len(position)))
        if all(a is b for a, b in zip(ordered, added, strict=True)):
            return
        for key in ordered:  # each moved to the end, in order
            state[key] = state.pop(key)
