"""Whether the ranks of a sharded optimizer step with the same settings: one small
asynchronous all-reduce per step, before anything steps (:class:`SettingsAgreement`).

Each rank steps its share of the parameters with its own ``param_groups``' settings
(``lr``, ``betas``, ``weight_decay``, ...). A loop changing one on some ranks only (an LR
scheduler stepped under ``if rank == 0``, ``opt.param_groups[0]["lr"] = x`` on one rank)
stepped each share with its owner's setting, silently: the replicas stayed equal, each
a mix of the two learning rates, unlike plain DDP + the plain optimizer where each
replica keeps its own (measured up to 0.4.0: 2 gloo ranks, AdamW, ``lr`` doubled on rank
0 before the first step: 0.058 off plain rank 0's parameters and 0.050 off rank 1's after
3 steps). No result of sharding is right then; every rank now refuses that backward
(nothing stepped) or that ``step()``, naming the settings and each rank's value.

The check compares a 62-bit digest of the settings each step reads (the keys of the
optimizer's ``defaults``: a key of the loop's own that no step reads may differ): its
maximum and minimum over the ranks, one all-reduce of two integers on the parameter
exchange's group, launched when a backward starts (before the first bucket's
reduction) and read before its first step, by which time it has arrived (measured:
see ``CHANGELOG.md``). Where the settings differ, every rank sees it from the same
reduced values, so every rank refuses, and only then are the settings themselves
gathered, to name them. The exchange group is used in the order of its broadcasts:
the check is issued on the thread running backward, before any broadcast of that
backward, on every rank alike.

The same all-reduce is the meeting of a collective call of the sharded optimizer
(``consolidate_state_dict()``, ``overlapkit.checkpoint.save`` / ``load``): those send a
marker above every digest (:meth:`SettingsAgreement.meet`), so a rank making the call
while another starts a backward or ``step()`` (the call under ``if rank == 0:``) is
told at once, and so is that other rank, instead of each waiting in its own collective
until the group's timeout.

Not checked where the exchange's group has no CPU backend (NCCL alone): reading the
result there would wait for the compute stream in the middle of backward.

.. versionadded:: 0.4
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from overlapkit.errors import ConfigurationError
from overlapkit.nodes.exit_safe import Hold
from overlapkit.nodes.failed_collective import collective_failure
from overlapkit.overlap.sharded.grad_agreement import gradients_refusal

__all__ = ["GATHERING", "MET_BY", "SettingsAgreement", "settings_read", "settings_refusal"]

_MASK = (1 << 62) - 1
#: what a collective call of the sharded optimizer (:data:`MET_BY`) sends in the
#: check's place, plus the call's index (above every digest): a rank making it while
#: another starts a backward or ``step()`` is told at once (:meth:`SettingsAgreement.meet`)
GATHERING = 1 << 62
#: the calls that meet the other ranks first, by marker
MET_BY = ("consolidate_state_dict()", "overlapkit.checkpoint.save", "overlapkit.checkpoint.load")


def _value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):  # a tensor lr: its value where it is on the CPU
        if value.device.type == "cpu" and value.numel() == 1:
            return ("tensor", value.item())
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, (list, tuple)):
        return tuple(map(_value, value))
    if isinstance(value, (int, float, bool, str, type(None))):
        return value
    # an object (a function, a device): its type only, as its repr may differ between
    # processes (an address) or ranks (cuda:0, cuda:1) where the step is the same
    return ("object", type(value).__qualname__)


def settings_read(optimizer: torch.optim.Optimizer) -> list[list[tuple[str, Any]]]:
    """Each param group's settings that a step reads: the optimizer's ``defaults`` keys
    (a key of the loop's own, e.g. a group's name for logging, is no step's)."""
    keys = sorted(optimizer.defaults)
    return [[(key, _value(group.get(key))) for key in keys]
            for group in optimizer.param_groups]


def _digest(read: list[list[tuple[str, Any]]]) -> int:
    data = hashlib.blake2b(repr(read).encode(), digest_size=8).digest()
    return int.from_bytes(data, "big") & _MASK


def _cpu_backend(group: Any) -> bool:
    try:
        group._get_backend(torch.device("cpu"))
    except Exception:  # NCCL alone (module docstring)
        return False
    return True


def _shown(value: Any) -> str:
    if isinstance(value, tuple) and value and value[0] in ("tensor", "object"):
        return f"{value[0]}{value[1:]!r}" if len(value) > 2 else f"{value[0]}({value[1]!r})"
    return repr(value)


def settings_refusal(gathered: list[list[list[tuple[str, Any]]]], what: str
                     ) -> ConfigurationError:
    """The refusal of ``what`` when the ranks' settings (``gathered``: each rank's
    :func:`settings_read`, in rank order) differ, naming up to three of them."""
    named: list[str] = []
    counts = {len(each) for each in gathered}
    if len(counts) > 1:
        named.append("the number of param groups: " + ", ".join(
            f"{len(each)} on rank {rank}" for rank, each in enumerate(gathered)))
    else:
        for index in range(counts.pop()):
            for position, (key, _) in enumerate(gathered[0][index]):
                seen = [each[index][position][1] for each in gathered]
                if any(value != seen[0] for value in seen):
                    named.append(f"{key} of param group {index}: " + ", ".join(
                        f"{_shown(value)} on rank {rank}" for rank, value in enumerate(seen)))
    shown = "; ".join(named[:3]) + ("; ..." if len(named) > 3 else "")
    return ConfigurationError(
        f"{what}: the ranks' optimizers hold different settings ({shown}). With sharded "
        "optimizer state each rank steps only the parameters it owns, with its own "
        "settings, so every replica would be a mix of them (plain DDP's replicas would "
        "drift apart instead). Nothing was stepped. Change settings on every rank alike: "
        "step the LR scheduler on every rank, and set param_groups[...]['lr'] outside "
        "any `if rank == ...`.")


class SettingsAgreement:
    """The check of one sharded optimizer (module docstring): :meth:`launch` when a
    backward starts, :meth:`refusal` before its first step (or at its end when nothing
    stepped); :meth:`now` for a full ``step()``.

    :param optimizer: the real optimizer, whose settings are compared.
    :param group: the parameter exchange's process group (None at one rank).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, group: Any) -> None:
        self._optimizer = optimizer
        self._group = group if group is not None and _cpu_backend(group) else None
        self._pending: tuple[Any, torch.Tensor, list[list[tuple[str, Any]]]] | None = None
        self._keys = sorted(optimizer.defaults)
        #: the settings as last read (no tensor among them), their read and digest:
        #: unchanged settings are not read and hashed again
        self._last: tuple[list[list[Any]], list[list[tuple[str, Any]]], int] | None = None
        #: the refusal read when a peer was gathering instead (:meth:`peer_gathering`)
        self._gathering: ConfigurationError | None = None
        #: whether the launched digest had the gradients' mixed in (:meth:`now`)
        self._mixed = False

    def _read(self) -> tuple[list[list[tuple[str, Any]]], int]:
        """This rank's :func:`settings_read` and its digest, from the last ones when the
        settings are the same objects or equal (a tensor among them: read again)."""
        keys = self._keys
        raw = [[group.get(key) for key in keys] for group in self._optimizer.param_groups]
        last = self._last
        if last is not None and raw == last[0]:
            return last[1], last[2]
        read = settings_read(self._optimizer)
        digest = _digest(read)
        tensors = any(isinstance(value, torch.Tensor) for group in raw for value in group)
        self._last = None if tensors else (raw, read, digest)
        return read, digest

    def launch(self, mixed: int = 0) -> None:
        """Start the all-reduce of this rank's digest (on every rank, in the same order
        as the exchange's broadcasts); one at a time. ``mixed``: a digest of the
        gradients mixed in (a full step: :mod:`~overlapkit.overlap.sharded.grad_agreement`)."""
        if self._group is None:
            return
        if self._pending is not None:  # (a backward that raised before its end)
            self.refusal()
        read, digest = self._read()
        digest = (digest ^ mixed) & _MASK
        sent = torch.tensor([digest, -digest], dtype=torch.int64)
        work = dist.all_reduce(sent, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._pending = (work, sent, read)
        self._mixed = mixed != 0

    def refusal(self, what: str = "backward()") -> ConfigurationError | Exception | None:
        """Wait for the launched check: the refusal when the ranks' settings differ (the
        same on every rank: they gather the settings to name them), the named failure of
        the collective, or None (also when nothing was launched)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        work, reduced, read = pending
        # the first message of each step's exchange: a peer missing is named as missing
        # from the exchange (it skipped step(), or raised in backward and went on)
        description = "exchanging the updated parameters (sharded optimizer state)"
        try:
            work.wait()
            highest, lowest = reduced.tolist()
            if highest == -lowest:
                return None
            if highest >= GATHERING:  # a peer is in consolidate_state_dict() instead
                self._gathering = _gathering_refusal(what, here="a backward or step()",
                                                     call=_called(highest))
                return self._gathering
            gathered: list[Any] = [None] * dist.get_world_size(self._group)
            dist.all_gather_object(gathered, read, group=self._group)
        except Exception as error:  # a peer stalled or is gone
            failed = collective_failure(error, description, self._group)
            return failed if failed is not None else error
        if self._mixed and all(each == gathered[0] for each in gathered):
            return gradients_refusal(what)  # the same settings: the gradients differ
        return settings_refusal(gathered, what)

    def now(self, what: str, mixed: int = 0) -> ConfigurationError | Exception | None:
        """Check at once (a full ``step()``, before it steps anything, ``mixed`` the
        digest of its gradients): as :meth:`refusal`."""
        self.launch(mixed)
        return self.refusal(what)

    def peer_gathering(self, what: str) -> ConfigurationError | None:
        """Where this backward's reduction failed: the refusal of ``what`` when its
        launched check has arrived and says a peer is in ``consolidate_state_dict()``
        (the reduction waited for that peer), else None. No wait."""
        seen, self._gathering = self._gathering, None
        pending = self._pending
        if seen is not None or pending is None or not pending[0].is_completed() or \
                pending[1][0].item() < GATHERING:
            return seen
        self._pending = None
        return _gathering_refusal(what, here="a backward or step()",
                                  call=_called(int(pending[1][0].item())))

    def meet(self, call: str) -> None:
        """Before a collective call of the sharded optimizer's ranks (``call``, one of
        :data:`MET_BY`: ``consolidate_state_dict()``, ``overlapkit.checkpoint.save`` or
        ``load``): the check's all-reduce with its marker (above :data:`GATHERING`) in
        place of the digest, on every rank. Where a rank started a backward or ``step()``
        instead (the call under ``if rank == 0:``, the others training on), its check
        pairs with this one: both refuse at once, nothing changed (0.4.0: the calling
        rank waited until the process group's timeout, the others in their gradients'
        reduction); ranks in different calls refuse alike. No-op where the check is
        off (module docstring).

        :raises ConfigurationError: a rank started a backward or ``step()``, or another
            of these calls.
        :raises ExchangeFailedError: a rank did neither within the group's timeout (it
            waits in another collective, e.g. a ``dist.barrier()`` called before its
            own ``call``), named (or ``RanksLostError``)."""
        if self._group is None:
            return
        if self._pending is not None:  # (a backward that raised before its end)
            self.refusal()
        marker = GATHERING + MET_BY.index(call)
        with torch.inference_mode(False):  # (an inference tensor cannot be held)
            sent = torch.tensor([marker, -marker], dtype=torch.int64)
        what = (f"meeting the other ranks for {call} (a collective: every rank of the DDP "
                "model's process group calls it, none under `if rank == 0:`, and in the "
                "same order as its other collectives, e.g. all before or all after a "
                "dist.barrier())")
        try:  # held: gloo's threads must not need the GIL for it (nodes.exit_safe)
            with Hold([sent], self._group):
                dist.all_reduce(sent, op=dist.ReduceOp.MAX, group=self._group)
        except Exception as error:  # a peer stalled in another collective, or is gone
            failed = collective_failure(error, what, self._group)
            if failed is None:
                raise
            raise failed from error
        highest, lowest = int(sent[0].item()), -int(sent[1].item())
        if lowest < GATHERING:  # a rank sent its settings' digest
            raise _gathering_refusal(call, here="")
        if highest != lowest:
            others = MET_BY[(highest if lowest == marker else lowest) - GATHERING]
            raise ConfigurationError(
                f"{call}: another rank of the DDP model's process group called {others} "
                "at the same time. Both are collectives: every rank calls the same one, "
                "in the same order. Nothing was saved, gathered or loaded.")


def _gathering_refusal(what: str, *, here: str, call: str | None = None
                       ) -> ConfigurationError:
    """The refusal of ``what`` where some ranks made a collective call of the sharded
    optimizer (``call``, else ``what``) and the others started a backward or ``step()``
    (``here``: which this rank did)."""
    call = call or what
    if here:
        did = (f"another rank of the DDP model's process group called {call} while this "
               f"rank started {here}")
    else:
        did = ("another rank of the DDP model's process group started a backward or "
               "step() instead of calling it")
    fix = ("`optimizer.consolidate_state_dict(to=0)` on every rank, then `if rank == 0: "
           "torch.save(optimizer.state_dict(), path)`; or save with "
           "overlapkit.checkpoint.save(path, model, optimizer) on every rank"
           if call.startswith("consolidate") else
           f"call {call}(path, model, optimizer) on every rank with the same path")
    return ConfigurationError(
        f"{what}: {did}. {call} is a collective: every rank calls it, at the same point "
        f"of the loop (not under `if rank == 0:`): {fix}. Nothing was saved, gathered, "
        "loaded or stepped; the ranks' collectives may be out of step now (a gradient "
        "reduction may be waiting): fix the loop and restart.")


def _called(marker: int) -> str:
    """The call a peer's marker names (the check's maximum: one of them)."""
    index = marker - GATHERING
    return MET_BY[index] if 0 <= index < len(MET_BY) else MET_BY[0]
