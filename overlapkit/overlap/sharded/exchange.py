"""Sending the parameters each rank stepped to the other ranks: :class:`ParameterExchange`.

After a rank steps the parameters it owns, the others need their new values before
they read them again. Asynchronous broadcasts from the owner send them, per bucket and
owning rank: each parameter of at least :data:`DIRECT_BYTES` (contiguous) on its own,
straight from and into the parameter itself, and the small ones of the bucket together,
flattened into one buffer that the other ranks copy into their parameters once it has
arrived. Each parameter crosses the wire once per step, ``(world_size - 1) /
world_size`` of the parameter bytes per rank, as with ``ZeroRedundancyOptimizer``'s own
broadcasts; and no rank holds more than the small parameters of a few buckets in
buffers. Sending and receiving every parameter through buffers held nearly all the
memory sharding saves (measured on the benchmark's 50 M-parameter MLP at 2 CPU ranks,
Adam: peak RSS 1228 MiB per rank through buffers, 1070 MiB in place; plain DDP 1255 MiB):
the broadcasts of every bucket are in flight at once while backward runs.

*A process group of its own.* Ranks step a bucket when its allreduce has completed,
which happens at different points of their backwards, so broadcasts issued on the DDP
model's group would interleave differently with its allreduces on each rank; gloo and
NCCL match collectives by order, and the ranks would hang (what makes torch's own
``hook_with_zero_step`` refuse gloo, pytorch#62300). On a group of their own the
broadcasts are issued in bucket order on every rank, whatever the timing.

*When updates land.* A received buffer is copied into the parameters on the thread
running backward (the next bucket's comm hook) as soon as it has arrived, and the rest
at the end of backward (:meth:`ParameterExchange.wait`): when ``backward()`` returns,
every parameter holds its update, as without sharding. The next forward (a forward
pre-hook), ``step()``, ``zero_grad()``, the state dicts and checkpoints wait again,
which matters only after a backward that raised. A parameter received in place is
written by the communication thread (or stream) while backward goes on: its autograd
version is bumped when the receive is issued, on the thread running backward, exactly
where the owner's in-place step bumps it, so a backward node that saved the parameter
and runs later raises autograd's "modified by an inplace operation" error on every rank,
as it would without sharding, instead of reading a value half received.

*On an accelerator* every exchange runs on the side stream of the steps
(:mod:`overlapkit.overlap.core.side_stream`): the broadcast is issued from the side stream
right after the bucket's step (NCCL's stream then waits for that step, not for the
compute stream), buffers are allocated and copied out on it, and the compute stream
waits for it before the next forward, as for the steps themselves.

.. versionadded:: 0.3
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Iterable, Sequence
from datetime import timedelta
from operator import is_
from typing import Any

import attrs
import torch
import torch.distributed as dist

from overlapkit.errors import ExchangeFailedError
from overlapkit.nodes.failed_collective import collective_failure, group_timeout
from overlapkit.nodes.lost_ranks import watch
from overlapkit.overlap.core.side_stream import SideStream
from overlapkit.overlap.core.watched_reads import quiet_reads
from overlapkit.overlap.sharded.ownership import Ownership

__all__ = ["DIRECT_BYTES", "ExchangeFailedError", "ParameterExchange", "Traffic", "Transfer",
           "exchange_group", "group_timeout"]

#: parameters of at least this many bytes (and contiguous) are broadcast on their own,
#: straight from and into the parameter; smaller ones are flattened together
DIRECT_BYTES = 64 * 1024


@attrs.frozen(eq=False)
class Transfer:
    """One broadcast: ``params`` (all of one dtype and device) from their owner.

    :param source: the owner, in the DDP process group's numbering.
    :param params: the parameters sent, in order.
    :param numel: their total number of elements.
    :param direct: one contiguous parameter, sent and received in place (no buffer).
    """

    source: int
    params: tuple[torch.Tensor, ...]
    numel: int
    direct: bool = False

    @property
    def nbytes(self) -> int:
        """The bytes sent."""
        return self.numel * self.params[0].element_size()


@attrs.define(eq=False)
class _Pending:
    work: Any
    transfer: Transfer
    #: the received values, to copy into the parameters; None on the sending rank
    received: torch.Tensor | None
    #: the sent buffer, kept alive until the broadcast is done
    sent: torch.Tensor | None


@attrs.define
class Traffic:
    """What the exchange has sent and received (counted since the last reset)."""

    broadcasts: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


def transfers_of(params: Iterable[torch.Tensor], ownership: Ownership,
                 exchanged: set[int], cap_bytes: int | None = None) -> list[Transfer]:
    """The broadcasts that send ``params`` (those in ``exchanged``): per owner (in rank
    order) and dtype/device, one per contiguous parameter of at least
    :data:`DIRECT_BYTES` (or a contiguous parameter alone), and one for the others
    together (split at ``cap_bytes`` when given). The same on every rank for the same
    ``params``."""
    by_source: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
    for param in params:
        if id(param) not in exchanged:
            continue
        owner = ownership.owner_of(param)
        if owner is None:
            continue
        by_source.setdefault((owner, param.dtype, param.device), []).append(param)
    out: list[Transfer] = []
    for (owner, _, _), members in sorted(by_source.items(), key=lambda item: (
            item[0][0], str(item[0][1]), str(item[0][2]))):
        chunk: list[torch.Tensor] = []
        size = 0
        for param in members:
            nbytes = param.numel() * param.element_size()
            if param.is_contiguous() and (nbytes >= DIRECT_BYTES or len(members) == 1):
                out.append(Transfer(owner, (param,), param.numel(), direct=True))
                continue
            if chunk and cap_bytes is not None and size + nbytes > cap_bytes:
                out.append(Transfer(owner, tuple(chunk), sum(p.numel() for p in chunk)))
                chunk, size = [], 0
            chunk.append(param)
            size += nbytes
        if chunk:
            out.append(Transfer(owner, tuple(chunk), sum(p.numel() for p in chunk)))
    return out


class ParameterExchange:
    """Broadcasts each rank's stepped parameters, and copies in what the others sent.

    :param ownership: who owns which parameter.
    :param exchanged: the parameters to exchange (``id``), those DDP reduces: frozen ones
        never change.
    :param group: the process group of the exchange (its own, see the module docstring);
        None at world size 1, where there is nothing to exchange.
    :param side_stream: the steps' side stream (inactive on CPU).
    :param cap_bytes: the most bytes one broadcast of :meth:`launch_all` sends (DDP's
        bucket size).
    """

    def __init__(self, ownership: Ownership, exchanged: set[int], group: Any,
                 side_stream: SideStream | None, cap_bytes: int) -> None:
        self.ownership = ownership
        self.exchanged = exchanged
        self.group = group
        self.side_stream = side_stream
        self.cap_bytes = cap_bytes
        self.active = group is not None and ownership.world_size > 1
        #: bucket index -> (its parameters when planned, its transfers)
        self._bucket_plans: dict[int, tuple[list[torch.Tensor], list[Transfer]]] = {}
        self._all_plan: list[Transfer] | None = None
        self._pending: deque[_Pending] = deque()
        self._global_ranks: list[int] = []
        if self.active:
            self._global_ranks = [dist.get_global_rank(group, r)
                                  for r in range(ownership.world_size)]
            watch()  # a lost node is then named by the survivors (overlapkit.nodes)
        #: what was sent and received since the last :meth:`reset_traffic`
        self.traffic = Traffic()
        #: how many broadcasts had not arrived yet when :meth:`wait` last found any
        #: pending (what waiting was needed for)
        self.still_pending_at_last_wait = 0
        #: the error of the first broadcast that failed (a peer stalled or is gone):
        #: the parameters are no longer the owners', so every later wait raises it and
        #: nothing more is sent
        self.failure: BaseException | None = None

    def set_ownership(self, ownership: Ownership, exchanged: set[int]) -> None:
        """Use a new ownership (parameters added); plans are made again."""
        self.wait()
        self.ownership = ownership
        self.exchanged = exchanged
        self._bucket_plans.clear()
        self._all_plan = None

    # -- launching (on the thread running backward, or in step()) ----------------

    def launch_bucket(self, index: int, params: list[torch.Tensor]) -> None:
        """Broadcast the bucket's parameters (``params``, DDP's bucket order) from their
        owners. Called on every rank, in bucket order, right after the bucket's step."""
        if not self.active or self.failure is not None:
            return
        planned = self._bucket_plans.get(index)
        if planned is None or len(planned[0]) != len(params) \
                or not all(map(is_, planned[0], params)):
            planned = (params, transfers_of(params, self.ownership, self.exchanged))
            self._bucket_plans[index] = planned
        for transfer in planned[1]:
            self._launch(transfer)

    def launch_all(self, *, after_compute: bool = True) -> None:
        """Broadcast every parameter from its owner (after a step of all of them at the
        end of backward, or a full ``step()``).

        :param after_compute: the steps ran on the current stream (not the side stream):
            the side stream waits for it first.
        """
        if not self.active or self.failure is not None:
            return
        if self._all_plan is None:
            self._all_plan = transfers_of(self.ownership.params, self.ownership,
                                          self.exchanged, self.cap_bytes)
        # overlapkit's own read of the stepped parameters, not the loop's: with
        # static_graph=True DDP's first backward steps everything at its end, in a
        # window already watched for the loop's reads (a false ParameterReadInWindow
        # warning, and the loop's own read there was no longer watched for)
        with quiet_reads():
            for transfer in self._all_plan:
                with self._stream(transfer, after_compute=after_compute):
                    self._launch(transfer)

    def _launch(self, transfer: Transfer) -> None:
        params = transfer.params
        if transfer.source == self.ownership.rank:
            if transfer.direct:
                buffer = params[0].detach()
            else:
                buffer = torch.cat([p.detach().reshape(-1) for p in params])
            work = self._broadcast(buffer, transfer.source)
            self._pending.append(_Pending(work, transfer, None, buffer))
            self.traffic.bytes_sent += transfer.nbytes
        elif transfer.direct:
            param = params[0]
            # received in place from now on: a backward node that saved it and runs
            # later must fail as after an in-place step (module docstring)
            torch.autograd.graph.increment_version(param)
            work = self._broadcast(param.detach(), transfer.source)
            self._pending.append(_Pending(work, transfer, None, None))
            self.traffic.bytes_received += transfer.nbytes
        else:
            buffer = torch.empty(transfer.numel, dtype=params[0].dtype,
                                 device=params[0].device)
            work = self._broadcast(buffer, transfer.source)
            self._pending.append(_Pending(work, transfer, buffer, None))
            self.traffic.bytes_received += transfer.nbytes
        self.traffic.broadcasts += 1

    def _broadcast(self, buffer: torch.Tensor, source: int) -> Any:
        """Issue one asynchronous broadcast of ``buffer`` from ``source`` (group rank)."""
        return dist.broadcast(buffer, src=self._global_ranks[source], group=self.group,
                              async_op=True)

    # -- landing -------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Broadcasts issued whose values have not been copied in yet."""
        return len(self._pending)

    def poll(self) -> None:
        """Copy in every broadcast that has arrived, in order, without waiting. Never
        raises (it runs inside DDP's comm hook, where an error would reach the caller as
        a bare ``RuntimeError``): a failed broadcast is kept in :attr:`failure`, which
        the stepper raises at the end of backward."""
        pending = self._pending
        try:
            while pending and pending[0].work.is_completed():
                self._land(pending.popleft())
        except Exception:  # kept in self.failure by _land
            pending.clear()

    def wait(self) -> None:
        """Wait for every broadcast issued and copy in what it brought: after this, every
        parameter holds its owner's last update (on an accelerator: once the compute
        stream has waited for the side stream, which the caller does).

        :raises RanksLostError: a broadcast failed because ranks are gone.
        :raises ExchangeFailedError: a broadcast failed while every rank is there (one
            stopped sending and the group timed out); raised again by every later wait.
        """
        if self.failure is not None:
            self._pending.clear()
            raise self.failure
        pending = self._pending
        if pending:
            self.still_pending_at_last_wait = sum(
                1 for item in pending if not item.work.is_completed())
        try:
            while pending:
                self._land(pending.popleft())
        except Exception:
            pending.clear()
            raise

    def _land(self, item: _Pending) -> None:
        with self._stream(item.transfer, after_compute=False):
            try:
                item.work.wait()
            except Exception as error:  # a peer stalled or is gone: named
                failed = collective_failure(
                    error, "exchanging the updated parameters (sharded optimizer state)",
                    self.group)
                self.failure = failed if failed is not None else error
                if failed is None:
                    raise
                raise failed from error
            received = item.received
            if received is None:
                return
            offset = 0
            # overlapkit's write, not the loop's read of a watched parameter
            with torch.no_grad(), quiet_reads():
                for param in item.transfer.params:
                    count = param.numel()
                    param.copy_(received.narrow(0, offset, count).view(param.shape))
                    offset += count

    def _stream(self, transfer: Transfer, *, after_compute: bool) -> Any:
        from contextlib import nullcontext

        if self.side_stream is None or not self.side_stream.active:
            return nullcontext()
        return self.side_stream.running(transfer.params, after_compute=after_compute)

    # -- counting ------------------------------------------------------------------

    def reset_traffic(self) -> Traffic:
        """The traffic counted so far; the counters restart from zero."""
        counted, self.traffic = self.traffic, Traffic()
        return counted


#: the exchange groups made so far, by (ranks, timeout): one per set of ranks, shared by
#: every sharded optimizer on them
_GROUPS: dict[tuple[tuple[int, ...], timedelta | None], Any] = {}


def exchange_group(group: Any, world_size: int) -> Any:
    """A process group with the ranks of ``group`` (the DDP model's) and its timeout, for
    the exchange; None at world size 1. Only the members call it (local synchronisation),
    so a DDP model on a subgroup works too.

    Without the timeout the group got torch's default of 30 minutes: a rank raising
    mid-backward and staying alive kept the others waiting until its process exited
    (45 s in the issue's probe), where plain DDP raises at its group's timeout.

    One group per set of ranks, reused by every later sharded optimizer on them: a new
    one per optimizer was never destroyed (building and dropping DDP + a sharded
    optimizer 10 times took a rank from 10 to 37 threads, 36 to 81 file descriptors and
    2 to 11 process groups, gloo at 2 ranks). Sharing is safe: exchanges are launched
    on the thread running backward, in the same order on every rank."""
    if world_size <= 1:
        return None
    ranks: Sequence[int] = dist.get_process_group_ranks(group)
    timeout = group_timeout(group)
    key = (tuple(ranks), timeout)
    live = dist.distributed_c10d._world.pg_map
    for gone in [k for k, made in _GROUPS.items() if made not in live]:
        del _GROUPS[gone]  # destroyed (destroy_process_group): not kept referenced
    known = _GROUPS.get(key)
    if known is not None:
        return known
    made = _new_local_group(group, list(ranks), timeout)
    _GROUPS[key] = made
    return made


def _new_local_group(group: Any, ranks: list[int], timeout: timedelta | None) -> Any:
    """``dist.new_group(ranks, use_local_synchronization=True)`` under a name the
    members agree on (group rank 0's token, broadcast over ``group``).

    torch names such a group by its ranks and the number of process groups the calling
    process holds, which differs between members once one of them was outside an
    earlier group: the members then waited for each other under different names until
    the default group's timeout (measured: two sharded optimizers on ``new_group([0,
    1])`` and ``new_group([1, 2])`` at 3 gloo ranks, or one after any ``new_group``
    leaving one of its ranks out; torch 2.13)."""
    from overlapkit.nodes.exit_safe import broadcast_text

    token = broadcast_text(uuid.uuid4().hex if dist.get_rank(group) == 0 else None,
                           src=dist.get_global_rank(group, 0), group=group)
    c10d = dist.distributed_c10d
    hashed = getattr(c10d, "_hash_ranks_to_str", None)
    if hashed is not None:  # (torch's private naming; else its own name is used)
        c10d._hash_ranks_to_str = lambda ranks: f"overlapkit_exchange_{token}"
    try:
        return dist.new_group(ranks=ranks, timeout=timeout, use_local_synchronization=True,
                              group_desc="overlapkit_parameter_exchange")
    finally:
        if hashed is not None:
            c10d._hash_ranks_to_str = hashed
