"""A sharded optimizer driven by torch's ``torch.distributed.checkpoint.state_dict``
(``get_optimizer_state_dict`` / ``set_optimizer_state_dict``): where those functions
call the optimizer, and what it answers there.

torch's functions assume every rank holds the whole optimizer state: each rank decides
alone whether to take an initialising step (from its own ``state``), reads
``state_dict()`` as the template of what it loads, and keeps a whole state dict on rank 0
only (``full_state_dict`` with ``cpu_offload``). A sharded optimizer holds its share
only, so it looks up the caller (by torch's function's own code, a few frames up: an
ordinary call is never mistaken for one of these) and answers each as the plain
optimizer would end up: :func:`in_torch_s_initialising_step`,
:func:`torch_s_load_template` with :func:`load_template`, and
:func:`torch_s_offloaded_get`. DCP's ``save`` / ``load`` handed the optimizer itself (a
``Stateful``) get each rank's share: :func:`dcp_stateful_call`, :func:`share_for_dcp`.

.. versionadded:: 0.4
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from overlapkit.errors import ConfigurationError
from overlapkit.overlap.sharded.ownership import Ownership

__all__ = ["TEMPLATE_DEVICE_KEY", "dcp_stateful_call", "in_torch_s_initialising_step",
           "initialising_step_kept", "load_template", "share_for_dcp",
           "offloaded_refusal", "offloaded_to", "torch_s_broadcast_load",
           "torch_s_load_template", "torch_s_offloaded_get"]


def _torch_frame(name: str, depth: int, module: str = "state_dict") -> Any:
    """The frame of ``torch.distributed.checkpoint.<module>``'s function ``name`` among
    the ``depth`` callers of this function's caller, or None (looked up by its code:
    torch may wrap the functions between, so an ordinary call is never mistaken for
    it)."""
    try:
        torch_module = importlib.import_module(f"torch.distributed.checkpoint.{module}")
    except ImportError:  # pragma: no cover - torch without torch.distributed
        return None
    function = getattr(torch_module, name, None)
    # torch.no_grad() wraps some of them: their own code, not the shared wrapper's
    code = getattr(inspect.unwrap(function), "__code__", None) if function else None
    if code is None:
        return None
    frame = sys._getframe(2)
    for _ in range(depth):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return None
        if frame.f_code is code:
            return frame
    return None


def in_torch_s_initialising_step() -> bool:
    """Whether the optimizer's ``step()`` is being called by torch's
    ``torch.distributed.checkpoint.state_dict`` to create the optimizer state before
    reading or loading it (``_init_optim_state``: zero gradients, ``lr`` 0, one step,
    on a rank whose ``optimizer.state`` is empty).

    Each rank decides alone whether to take that step, from its own ``state``, which
    with sharded state holds its share only: a rank owning nothing (or only parameters
    without state) took it while the others did not, and its parameter exchange waited
    for them until the group's timeout (``ExchangeFailedError``, every later call
    refused). That step is not exchanged now (:func:`initialising_step_kept`); it is
    still skipped where the plain optimizer holds state and would take none."""
    return _torch_frame("_init_optim_state", 6) is not None


@contextmanager
def initialising_step_kept(params: list[torch.Tensor], optimizer: torch.optim.Optimizer
                           ) -> Iterator[None]:
    """Around torch's initialising step of this rank's share (``params``), which is
    not exchanged: torch takes it at ``lr`` 0 on zero gradients, so it creates the
    state and changes no parameter, and the other ranks hold the same values already.

    Exchanged (up to 0.4), it was a collective that each rank joined or not by its own
    ``state``: ``get_optimizer_state_dict`` on rank 0 alone before the first step (the
    plain optimizer's recipe for saving from one rank) made rank 0 wait for the others
    until the group's timeout (measured: 5.1 s at a 5 s timeout, 2 gloo ranks, AdamW;
    ``ExchangeFailedError``, and the process group unusable after: the next backward
    failed on every rank), where the plain optimizer steps alone.

    :raises ConfigurationError: the step changed a parameter of the share all the same
        (an optimizer whose update does not scale with ``lr``): the parameters are put
        back as they were (the other ranks', which did not see the change).
    """
    before = [p.detach().clone() for p in params]
    yield
    changed = [p for p, b in zip(params, before, strict=True)
               if not torch.allclose(p.detach(), b, rtol=0.0, atol=0.0, equal_nan=True)]
    if not changed:
        return
    with torch.no_grad():
        for param, kept in zip(params, before, strict=True):
            param.copy_(kept)
    raise ConfigurationError(
        "torch's get_optimizer_state_dict / set_optimizer_state_dict took its "
        f"initialising step of {type(optimizer).__name__} (zero gradients, lr 0) and it "
        f"changed {len(changed)} of this rank's parameters: with sharded optimizer state "
        "that step is taken on each rank's share without sending the parameters to the "
        "other ranks (a rank may take it alone), so the ranks' copies would differ. The "
        "parameters were put back. Take a first training step (backward(), step()) "
        "before calling them, or save and load with overlapkit.checkpoint.")


def torch_s_load_template() -> Mapping[str, Any] | None:
    """When ``state_dict()`` is being called by torch's ``set_optimizer_state_dict`` with
    ``StateDictOptions(full_state_dict=True)`` (``_load_optim_state_dict``), the dict
    being loaded on this rank (``{}`` on a rank given none: ``broadcast_from_rank0``);
    else None.

    torch reads the optimizer's own state dict there as the template of what this rank
    loads, fills it from the whole dict (or from rank 0's broadcast), then hands it to
    ``load_state_dict``: the template of a sharded optimizer is built by
    :func:`load_template`."""
    frame = _torch_frame("_load_optim_state_dict", 8)
    if frame is None:
        return None
    given = frame.f_locals.get("optim_state_dict")
    return given if isinstance(given, Mapping) else {}


#: the state entry a rank holding no tensor state puts in its load template
#: (:func:`load_template`), under a parameter another rank owns
TEMPLATE_DEVICE_KEY = "overlapkit_template_device"


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() > 0
    if isinstance(value, Mapping):
        return any(_holds_tensor(v) for v in value.values())
    return False


def load_template(local: dict[str, Any], ownership: Ownership,
                  given: Mapping[str, Any]) -> dict[str, Any]:
    """What torch's ``set_optimizer_state_dict(..., full_state_dict=True)`` reads as this
    rank's state dict (:func:`torch_s_load_template`; ``given``: the dict it loads on
    this rank). ``local`` is the real optimizer's own (the param groups and this
    rank's share of the state); ``load_state_dict`` keeps this rank's share of what
    torch fills in, as without the option.

    Taken as it is, that template failed in two ways (2 gloo ranks, AdamW; the plain
    optimizer loads both): every rank given the whole dict, torch copied each scalar
    entry (``step``) of another rank's parameters into it without the path to put it
    back (its bare ``KeyError: 'state.embed.weight.step'``); and a rank whose share
    holds no tensor (it owns nothing, or only parameters without state) left torch no
    device to load onto (its bare ``AssertionError``, that rank alone, the others
    waiting in the broadcast). So the other ranks' parameters of ``given`` are in the
    template too (their tensors as empty ones on the parameter's device, their scalars
    as given), and a rank still without a tensor gets one empty tensor under a
    parameter another rank owns; ``load_state_dict`` drops both with the rest of the
    other ranks' share."""
    owned = ownership.my_indices()
    state = dict(local["state"])
    given_state = given.get("state")
    if isinstance(given_state, Mapping):
        saved = [key for group in given.get("param_groups", ()) for key in group["params"]]
        for index, key in enumerate(saved[:len(ownership.params)]):
            entry = given_state.get(key)
            if index in owned or not isinstance(entry, Mapping):
                continue
            device = ownership.params[index].device
            state[index] = {name: torch.empty(0, dtype=value.dtype, device=device)
                            if isinstance(value, torch.Tensor) and value.dim() > 0 else value
                            for name, value in entry.items()}
    if not _holds_tensor(state):
        other = next((index for index in range(len(ownership.params))
                      if index not in owned), None)
        if other is not None:  # (else this rank owns everything: torch's error, as plain)
            param = ownership.params[other]
            state[other] = {**state.get(other, {}), TEMPLATE_DEVICE_KEY: torch.empty(
                0, dtype=param.dtype, device=param.device)}
    return {**local, "state": state}


def torch_s_offloaded_get() -> bool:
    """Whether ``state_dict()`` is being called by torch's ``get_optimizer_state_dict``
    with ``StateDictOptions(full_state_dict=True, cpu_offload=True)``, which returns the
    whole state on global rank 0 and ``{}`` on every other rank (the recipe for saving
    one file from rank 0; called on every rank)."""
    frame = _torch_frame("_get_optim_state_dict", 2)
    info = None if frame is None else frame.f_locals.get("info")
    return bool(getattr(info, "full_state_dict", False) and getattr(info, "cpu_offload", False))


def offloaded_to(group: Any) -> int | None:
    """The rank of ``group`` (the DDP model's) that is global rank 0, where torch's
    :func:`torch_s_offloaded_get` keeps the whole state; None when it is not a member."""
    try:
        return dist.get_group_rank(group, 0)
    except (ValueError, RuntimeError):
        return None


def offloaded_refusal(to: int | None) -> ConfigurationError:
    """:func:`torch_s_offloaded_get` without a current gathering on rank ``to`` (the
    group's rank of global rank 0, None when it is not a member): the same refusal on
    every rank (0.4.0 refused it on every rank but the gathering one, which went on)."""
    if to is None:
        how = ("global rank 0, where torch keeps the whole state, is not in the DDP "
               "model's process group: gather with optimizer.consolidate_state_dict(to=r) "
               "on every rank, then optimizer.state_dict() on rank r")
    else:
        how = (f"call optimizer.consolidate_state_dict(to={to}) on every rank first, after "
               "the last step to save (torch keeps the whole state on global rank 0, "
               f"rank {to} of the DDP model's process group, and {{}} on the others, as "
               "for a plain optimizer; an optimizer without state is first stepped once "
               "by torch, with lr 0, which makes an earlier gathering stale: gather "
               "again then)")
    return ConfigurationError(
        "torch's get_optimizer_state_dict(..., options=StateDictOptions("
        "full_state_dict=True, cpu_offload=True)) of a sharded optimizer: each rank holds "
        f"its share of the state, so the whole of it is gathered first; {how}. Or save "
        "with overlapkit.checkpoint.save(path, model, optimizer) on every rank (no "
        "gathering, loads at any world size).")


def dcp_stateful_call() -> str | None:
    """``"save"`` or ``"load"`` when ``state_dict()`` is being called by
    ``torch.distributed.checkpoint.save`` (or ``async_save``) or ``load`` on the optimizer
    itself, passed in the dict it saves or loads (``dcp.save({"optim": optimizer})``: a
    ``Stateful``, whose ``state_dict()`` DCP calls on every rank and consumes itself;
    the loop never sees that dict), also
    through a ``Stateful`` of the loop's own calling it or torch's ``get_state_dict``
    (torch's ``AppState`` recipe).

    A DCP checkpoint is the union of what the ranks hand it, so each rank's share
    (:func:`share_for_dcp`) saves the plain optimizer's checkpoint, and as the template
    of a load, reads each rank's share back, at any world size. Answered as any
    ``state_dict()`` (up to 0.4.0): refused on every rank without a gathering, and after
    ``consolidate_state_dict(to=0)`` the whole state on rank 0 and refused on the others,
    so rank 0 went on into DCP's collectives and waited there for the others (measured:
    2 gloo ranks: until the group's timeout, then gloo's bare ``RuntimeError``; the default
    group's timeout is 30 minutes), else None."""
    # (a Stateful of the loop's own may call it, or torch's get_state_dict, between)
    if _torch_frame("_stateful_to_state_dict", 16, "state_dict_saver") is not None:
        return "save"
    return "load" if _torch_frame("load", 16, "state_dict_loader") is not None else None


def share_for_dcp(local: dict[str, Any], ownership: Ownership, refusal: str | None, *,
                  loading: bool) -> dict[str, Any]:
    """What a rank hands DCP's save or load (:func:`dcp_stateful_call`): ``local`` (the
    real optimizer's ``state_dict()``) with the state of this rank's parameters only (an
    entry written on another rank, ``opt.state[p] = ...``, is its owner's to save). As
    the template of a load (``loading``), the other ranks' parameters have an empty
    entry, which DCP reads nothing into: torch's ``set_state_dict`` in a ``Stateful``
    (its ``AppState`` recipe) refuses a dict without an entry for every parameter
    ("Missing optimizer state for parameter 'embed.weight' in checkpoint").

    :raises ConfigurationError: ``refusal``, why a checkpoint cannot be taken now
        (between a stepping backward and ``step()``, as ``overlapkit.checkpoint``'s):
        every rank is there alike, and DCP has not started its collectives. A save
        there held this backward's update where the plain optimizer's holds the last
        step's (measured: 2 gloo ranks, AdamW, the checkpoint's ``exp_avg`` not the
        plain one's, with a warning only)."""
    if refusal is not None:
        raise ConfigurationError(f"torch.distributed.checkpoint of the optimizer: {refusal} "
                                 "Nothing was written or read.")
    owned = ownership.my_indices()
    state = {index: value for index, value in local["state"].items() if index in owned}
    if loading:  # an empty entry per other rank's parameter: DCP reads nothing for it
        state.update({index: {} for index in range(len(ownership.params))
                      if index not in owned})
    return {**local, "state": dict(sorted(state.items()))}


def torch_s_broadcast_load() -> bool:
    """Whether ``load_state_dict`` is being called by torch's ``set_optimizer_state_dict``
    with ``broadcast_from_rank0=True``: the dict then holds this rank's share only (the
    keys of :func:`load_template`, filled from rank 0's broadcast), not the whole."""
    frame = _torch_frame("_load_optim_state_dict", 2)
    info = None if frame is None else frame.f_locals.get("info")
    return bool(getattr(info, "full_state_dict", False)
                and getattr(info, "broadcast_from_rank0", False))
