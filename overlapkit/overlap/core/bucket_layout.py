"""What the bucket stepper knows about each DDP gradient bucket, kept from one
backward to the next: which parameters it holds, their gradients as views of the
bucket's buffer, and how the engine groups them.

All of it depends only on DDP's bucket layout and on which parameters the engine owns,
yet working it out again for every bucket of every backward was most of the stepper's
own per-bucket cost (measured on torch 2.13, CPU: 16 us of Python to lay out the
gradient views of a two-parameter bucket alone). A layout is kept per bucket index
for as long as DDP keeps that bucket's buffer — the same tensor object, which DDP
replaces only when it rebuilds its buckets (after the first iteration), and which the
layout holds, so that its identity cannot be reused — and the engine keeps its
:attr:`~overlapkit.OverlapEngine.layout_version`.
"""

from __future__ import annotations

import operator
from typing import Any

import attrs
import torch

from overlapkit.overlap.core.engine import OverlapEngine, StepPlan

#: batch layouts kept at most (the runs of buckets ready together vary with the
#: reductions' timing where other ranks take part)
_MOST_BATCHES = 256

__all__ = ["BatchLayout", "BucketLayout", "BucketLayouts", "bucket_gradient_views"]


def _non_overlapping_and_dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements fill ``numel`` consecutive slots in some dimension
    order (C++'s ``is_non_overlapping_and_dense``, which Python does not expose)."""
    expected = 1
    for size, stride in sorted(zip(tensor.size(), tensor.stride(), strict=True),
                               key=lambda pair: pair[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def bucket_gradient_views(buffer: torch.Tensor,
                          params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each parameter's reduced gradient as a view of the bucket ``buffer``, laid out
    as DDP lays it out: with the parameter's own strides where the parameter is dense
    (a ``channels_last`` convolution weight), contiguous otherwise.

    ``GradBucket.gradients()`` returns contiguous views of the same memory, which
    read a ``channels_last`` gradient's elements in the wrong order (measured on torch
    2.13: 0.0135 off plain DDP after 3 SGD steps, silently) and, lent to the parameter
    as ``.grad``, overlap DDP's own view when it copies the bucket back after backward.
    The reducer places the gradients one after the other, each ``numel`` long
    (``Reducer::initialize_bucket_views``). A complex parameter's gradient is held
    there as its real view (``torch.view_as_real``: ``2 * numel`` real elements of the
    bucket's real dtype); read as ``param.numel()`` elements of the bucket, it was torch's
    bare dtype error at the first stepping backward (0.4.0, ``cdd1705``).
    """
    views = []
    offset = 0
    for param in params:
        size: tuple[int, ...] = tuple(param.size())
        stride, numel = param.stride(), param.numel()
        complex_ = param.is_complex()
        if complex_:  # the reducer holds it as ``view_as_real`` would lay it out
            size, stride, numel = (*size, 2), (*(2 * s for s in stride), 1), 2 * numel
        if _non_overlapping_and_dense(param):
            view = buffer.as_strided(size, stride, offset)
        else:
            view = buffer.narrow(0, offset, numel).view(size)
        views.append(torch.view_as_complex(view) if complex_ else view)
        offset += numel
    return views


@attrs.frozen(eq=False)
class BucketLayout:
    """One bucket as the stepper steps it.

    :param buffer: the bucket's buffer when this was worked out (held: its identity
        is what keeps this layout valid).
    :param version: the engine's ``layout_version`` then.
    :param owned: the bucket's parameters the engine owns, in bucket order.
    :param views: their gradients, as views of ``buffer``.
    :param plan: the engine's :class:`~overlapkit.overlap.core.engine.StepPlan` of ``owned``.
    :param others: the gradients, as views of ``buffer``, of the bucket's parameters
        the optimizer holds but another rank steps (sharded state; else empty).
    """

    buffer: torch.Tensor
    version: int
    owned: list[torch.Tensor]
    views: list[torch.Tensor]
    plan: StepPlan
    others: list[torch.Tensor]


@attrs.frozen(eq=False)
class BatchLayout:
    """Consecutive buckets stepped together, in one call of the engine: their
    :class:`BucketLayout` joined.

    :param parts: the buckets' layouts, in bucket order (held: each must still be the
        bucket's current layout for this to be valid).
    :param owned: every part's owned parameters, in bucket order.
    :param views: their gradients, as views of the parts' buffers.
    :param plan: the engine's plan of ``owned``.
    """

    parts: tuple[BucketLayout, ...]
    owned: list[torch.Tensor]
    views: list[torch.Tensor]
    plan: StepPlan


class BucketLayouts:
    """The :class:`BucketLayout` of each bucket index, worked out again only when DDP
    rebuilt its buckets or the engine's parameters changed; and the
    :class:`BatchLayout` of each run of buckets stepped together.

    Safe to use from several comm threads at once: layouts are immutable, and two
    threads working out the same one only waste the work.
    """

    def __init__(self, engine: OverlapEngine) -> None:
        self._engine = engine
        self._by_index: dict[int, BucketLayout] = {}
        self._batches: dict[tuple[int, ...], BatchLayout] = {}

    def get(self, bucket: Any, buffer: torch.Tensor) -> BucketLayout:
        """The layout of ``bucket`` (a ``dist.GradBucket``) whose buffer is ``buffer``."""
        index = bucket.index()
        layout = self._by_index.get(index)
        engine = self._engine
        if layout is not None and layout.buffer is buffer \
                and layout.version == engine.layout_version:
            return layout
        if layout is not None and layout.buffer is not buffer:
            # DDP rebuilt its buckets: every old buffer goes (none is reused)
            self.clear()
        version = engine.layout_version
        params = bucket.parameters()
        all_pairs = list(zip(params, bucket_gradient_views(buffer, params), strict=True))
        pairs = [(param, view) for param, view in all_pairs if engine.owns(param)]
        owned = [param for param, _ in pairs]
        others = [view for param, view in all_pairs
                  if engine.holds(param) and not engine.owns(param)]
        layout = BucketLayout(buffer=buffer, version=version, owned=owned,
                              views=[view for _, view in pairs], plan=engine.plan(owned),
                              others=others)
        self._by_index[index] = layout
        return layout

    def batch(self, indices: tuple[int, ...], parts: list[BucketLayout]) -> BatchLayout:
        """The layout of the buckets ``indices`` stepped together, whose current layouts
        are ``parts``: kept while they stay current, since the same runs of buckets
        come back step after step (every bucket at once where nothing is left to wait
        for at the end of backward, as on one rank)."""
        batch = self._batches.get(indices)
        if batch is not None and all(map(operator.is_, batch.parts, parts)) \
                and batch.plan.version == self._engine.layout_version:
            return batch
        owned = [param for part in parts for param in part.owned]
        batch = BatchLayout(parts=tuple(parts), owned=owned,
                            views=[view for part in parts for view in part.views],
                            plan=self._engine.plan(owned))
        if len(self._batches) >= _MOST_BATCHES:  # where runs vary with timing (ranks)
            self._batches.clear()
        self._batches[indices] = batch
        return batch

    def clear(self) -> None:
        """Forget every layout (and the buffers they hold)."""
        self._by_index.clear()
        self._batches.clear()
