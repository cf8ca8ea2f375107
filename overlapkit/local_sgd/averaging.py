"""The arithmetic of model averaging: which tensors are averaged, and how.

Shared by every averager (:mod:`overlapkit.local_sgd.averagers`, DiLoCo's): the
selection rule — floating-point tensors that can learn, whatever their gradients — and
torch's flat-buffer arithmetic (divide by the group size, then all-reduce), so results
are bitwise torch's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from overlapkit.errors import ConfigurationError

__all__ = ["average_in_place", "parameters_to_average"]


def parameters_to_average(
    params: Iterable[torch.Tensor] | Iterable[Mapping[str, Any]],
) -> list[torch.Tensor]:
    """The tensors of ``params`` (parameters, or an optimizer's ``param_groups``) that
    are averaged, once each, in order, whether or not they have a gradient: every
    floating-point tensor but ``nn.Parameter`` objects with ``requires_grad=False``.

    Integer parameters (step counters, index tables) and frozen parameters are left
    out: they never get a gradient, so torch's averagers leave them out too, and the
    flat buffer — whose layout decides the order in which a ring all-reduce sums each
    element — stays exactly torch's.

    :raises ConfigurationError: an item is neither a tensor nor a parameter group.
    """
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    for item in params:
        if isinstance(item, torch.Tensor):
            tensors: Iterable[Any] = (item,)
        elif isinstance(item, Mapping) and "params" in item:
            tensors = item["params"]
        else:
            raise ConfigurationError(
                f"cannot average {type(item).__name__} objects; pass model.parameters() "
                "or an optimizer's param_groups."
            )
        for tensor in tensors:
            if id(tensor) not in seen and _learns(tensor):
                seen.add(id(tensor))
                out.append(tensor)
    return out


def _learns(tensor: torch.Tensor) -> bool:
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return False
    return tensor.requires_grad or not isinstance(tensor, torch.nn.Parameter)


def average_in_place(params: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Replace each tensor in ``params`` by its mean over ``group``, in place.

    Tensors are flattened into one buffer per (device, dtype), divided by the group
    size, then all-reduced: torch's ``average_parameters`` arithmetic, so results are
    bitwise equal to it. The values are copied back into the parameters rather than
    rebinding ``p.data`` to views of the flat buffer as torch does, so code that holds
    a parameter's storage (fused optimizers, bucket views) keeps seeing it.
    Ranks outside ``group`` and groups of one rank do nothing.
    """
    if dist._rank_not_in_group(group):
        return
    size = dist.get_world_size(group)
    if size == 1 or not params:
        return
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        by_kind.setdefault((p.device, p.dtype), []).append(p)
    for tensors in by_kind.values():
        flat = torch.cat([p.detach().reshape(-1) for p in tensors])
        flat.div_(size)
        dist.all_reduce(flat, group=group)
        offset = 0
        with torch.no_grad():
            for p in tensors:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
