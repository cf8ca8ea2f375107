"""DDP comm hooks by name: :func:`build_comm_hook`, and the built-in plugin
``overlapkit.comm_hooks`` that registers the standard ones.

``allreduce`` (DDP's default: average over the group, bitwise as plain DDP does it
without a hook, see :func:`allreduce_hook`), ``fp16_compress`` and ``bf16_compress``
(cast to half precision for the allreduce, cast back after: torch's own hooks, so
results match DDP with the same hook registered by hand). Other packages register more
(``post_local_sgd`` comes from :mod:`overlapkit.local_sgd`).

``bf16_compress`` runs on gloo (CPU) too, where plain DDP refuses torch's
``bf16_compress_hook`` at ``register_comm_hook`` on a torch built without CUDA 11+ and
NCCL 2.10+: DDP checks the hook's *name* against the build, not the backend the model
uses, and gloo reduces bfloat16. overlapkit registers its own hook, which runs torch's,
so that check does not apply; the gradients are those of plain DDP running the same
hook under another name, bitwise (``tests/test_comm_hook_bf16.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from overlapkit.errors import ConfigurationError
from overlapkit.nodes.lost_ranks import reduced_tensor, watch
from overlapkit.plugin.hookspecs import hookimpl
from overlapkit.plugin.manager import get_plugin_manager
from overlapkit.plugin.records import CommHookRecord

__all__ = ["allreduce_hook", "build_comm_hook", "launch_allreduce",
           "overlapkit_register_comm_hooks", "reduce_bucket"]


def build_comm_hook(
    name: str, *, process_group: Any = None, **options: Any
) -> tuple[Any, Callable[..., Any]]:
    """Build the comm hook registered as ``name``: ``(state, hook)`` for
    ``DistributedDataParallel.register_comm_hook(state, hook)``.

    :param process_group: the group to communicate over (``None``: the default group).
    :param options: the hook's own options (``overlapkit plugins`` lists the hooks).
    :raises UnknownNameError: no plugin provides ``name``; the message lists the valid names.
    """
    spec = get_plugin_manager().registry.comm_hook(name)
    return spec.create(process_group=process_group, **options)


def allreduce_hook(process_group, bucket):  # type: ignore[no-untyped-def]
    """DDP's own averaging, as a comm hook: the bucket multiplied by the inverse of the
    group size, then summed over the group — bitwise the gradients of plain DDP
    without a comm hook (which multiplies while it copies the gradients into the
    bucket), with less work per bucket than torch's ``default_hooks.allreduce_hook``.

    - torch's hook *divides* by the group size. For a group whose size is a power of
      two that is the same bits; for another size (3, 6, 12 ranks) the two differ in
      the last bit (measured on torch 2.13, 3 gloo ranks: every parameter of a small
      MLP after one backward), and the plain loop this library is measured against is
      DDP without a hook. A sparse gradient's bucket (``nn.Embedding(sparse=True)``)
      is divided, as plain DDP divides it. (A ``gradient_as_bucket_view=True`` model whose gradients
      are kept between iterations, ``zero_grad(set_to_none=False)``, is divided by
      plain DDP itself: ``overlap_ddp`` follows it there, passing ``average``, see
      :mod:`overlapkit.overlap.ddp.kept_gradients`.)

    - A group of one rank is not divided by 1. That division is an identity, but a
      separate pass over every bucket: plain DDP (no comm hook) folds it into its copy
      of the gradients into the bucket, and a comm hook cannot. Measured on torch
      2.13, CPU: 42 us per 256 KiB bucket, 6 % of a one-rank step of 100 x
      ``Linear(256, 256)`` in 100 buckets.
    - A group of one rank on the CPU is not reduced at all: the bucket is its own sum,
      returned in an already completed future. Launching gloo's allreduce of one rank
      wakes its worker thread for every bucket and parses its future in DDP's finalize;
      measured on torch 2.13, 2-core VM, 1 rank, 100 x ``Linear(256, 256)`` in 100
      buckets: see ``docs/benchmarks.md`` (engine overhead). A CUDA bucket still goes
      through the process group: a completed Python future would carry no stream
      ordering for the steps that wait on it.
    - The process group's ``allreduce`` is called directly, as ``dist.all_reduce``
      ends up doing for a real (not complex) tensor outside a coalescing manager, which
      a bucket is: 4-8 us of Python less per bucket (measured, 400 buckets).
    - An allreduce that fails because ranks were lost raises a ``RanksLostError``
      naming them (:func:`overlapkit.nodes.lost_ranks.reduced_tensor`).
    """
    # Left unannotated, as DDP's own check of a registered hook's signature wants
    # (``from __future__ import annotations`` would make the annotations strings).
    return reduce_bucket(process_group, bucket)


def reduce_bucket(process_group: Any, bucket: dist.GradBucket,
                  average: Callable[[dist.GradBucket, int], None] | None = None,
                  ) -> torch.futures.Future[torch.Tensor]:
    """What :func:`allreduce_hook` returns for ``bucket``, averaged by ``average``
    where given (see :func:`launch_allreduce`)."""
    launched = launch_allreduce(process_group, bucket, average)
    if launched is None:
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done
    return launched.then(reduced_tensor)


def launch_allreduce(process_group: Any, bucket: dist.GradBucket,
                     average: Callable[[dist.GradBucket, int], None] | None = None) -> Any:
    """Launch :func:`allreduce_hook`'s reduction of ``bucket``: its process group's
    future (its value the list ``[reduced buffer]``), or None where there is nothing
    to reduce (a group of one rank, on the CPU: the buffer is its own sum).

    :param average: averages the bucket's buffer in place, given the group size,
        instead of the multiplication by its inverse (the bucket stepper's, where
        plain DDP divides gradients kept as bucket views:
        :mod:`overlapkit.overlap.ddp.kept_gradients`).

    For a caller that waits for the future itself (the bucket stepper): without
    :func:`allreduce_hook`'s ``then``, no Python callback runs on the process group's
    thread, which then does not wait for the GIL while the training thread holds it.
    """
    group: Any = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    size = group.size()
    if size == 1 and buffer.device.type == "cpu":
        return None
    if size > 1 and buffer.is_sparse:
        buffer.div_(size)  # as plain DDP averages a sparse gradient (it divides)
    elif size > 1 and average is not None:
        average(bucket, size)
    elif size > 1:  # see allreduce_hook: a group of one rank is not divided by 1
        # plain DDP's own averaging (no comm hook): the gradients multiplied by the
        # inverse of the group size (see allreduce_hook)
        buffer.mul_(1.0 / size)
    if buffer.is_complex():
        work = dist.all_reduce(buffer, group=group, async_op=True)
    else:
        work = group.allreduce([buffer], _SUM)
    return work.get_future()


def _sum_options() -> dist.AllreduceOptions:
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]
    options.asyncOp = True
    return options


#: the options of every bucket's allreduce (read by each call, never changed)
_SUM = _sum_options()


def _stateless(name: str, hook: Callable[..., Any]) -> Callable[..., tuple[Any, Any]]:
    def build(*, process_group: Any = None, **options: Any) -> tuple[Any, Any]:
        if options:
            raise ConfigurationError(
                f"comm hook {name!r} takes no options, got {sorted(options)}; "
                "remove them from comm_hook_options."
            )
        watch()  # a lost node is then named by the survivors (overlapkit.nodes.lost_ranks)
        return process_group, hook

    build.__name__ = f"build_{name}"
    build.__doc__ = f"Build torch's ``{hook.__name__}`` as ``(process_group, hook)``."
    return build


@hookimpl
def overlapkit_register_comm_hooks() -> list[CommHookRecord]:
    return [
        CommHookRecord(
            name="allreduce",
            build=_stateless("allreduce", allreduce_hook),
            description="average gradients over the group (DDP's default)",
        ),
        CommHookRecord(
            name="fp16_compress",
            build=_stateless("fp16_compress", default_hooks.fp16_compress_hook),
            description="allreduce in float16, then cast back",
        ),
        CommHookRecord(
            name="bf16_compress",
            build=_stateless("bf16_compress", default_hooks.bf16_compress_hook),
            description="allreduce in bfloat16, then cast back",
        ),
    ]
