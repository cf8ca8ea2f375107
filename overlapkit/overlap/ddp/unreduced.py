"""Local gradients freed into a DDP bucket whose reduction never ran in that backward.

With ``gradient_as_bucket_view=False``, ``optimizer_in_backward`` frees each local
gradient as soon as DDP has copied it into its bucket
(:func:`~overlapkit.overlap.ddp.param_hooks.free_local_grads_once_bucketed`): the bucket
is stepped once reduced. A bucket DDP never reduces in a backward (a parameter the
forward did not use, with ``find_unused_parameters=False``: DDP waits for its gradient)
is then never stepped, and its gradients are gone. The plain loop's ``step()`` steps
them unreduced, and plain DDP raises only at the next forward ("Expected to have
finished reduction in the prior iteration"): measured, the last step of such a loop
was 0.0099 off (Adam, 2 gloo ranks), silently, its ``step()`` stepping nothing.

:class:`UnreducedGradients` notes each gradient freed (:meth:`freed`) and each bucket
whose comm hook ran (:meth:`reduced`); once the backward has ended (after DDP's
finalize and the stepper's end of backward), any freed gradient whose bucket never ran
raises a :class:`~overlapkit.errors.ConfigurationError` from ``backward()``. Where no
bucket ran, nothing was stepped in that backward; and where no forward with autograd ran
through the DDP model since the last check either (:meth:`forward_through_ddp`, a forward
pre-hook of the DDP model), the forward went past DDP (``model.module(batch)``, the
unwrapped module called), which the message says instead of blaming an unused
parameter (measured before: a hand-written loop calling ``model.module`` was told to pass
``find_unused_parameters=True``, which does not help).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable

from overlapkit.errors import ConfigurationError
from overlapkit.overlap.core.backward_scope import NEW, BackwardScope

__all__ = ["UnreducedGradients"]


class UnreducedGradients:
    """The local gradients freed in the backward under way whose bucket has not run.

    :param refused: called before the error is raised (the stepper closes its window).
    :param technique: for the message.
    """

    def __init__(self, refused: Callable[[], None], technique: str) -> None:
        self._refused = refused
        self._technique = technique
        #: set where local gradients are freed once bucketed (``ddp.setup``)
        self.active = False
        #: set by an integration that refuses this backward with its own error (a
        #: backward inside Lightning's training_step, where DDP reduces nothing)
        self.refused_elsewhere = False
        #: ``id(param)`` -> its shape, freed and not reduced yet in this backward
        self._waiting: dict[int, tuple[int, ...]] = {}
        #: ``id`` of each parameter whose bucket ran in this backward (the last
        #: parameter of a bucket is freed after its bucket's comm hook ran)
        self._reduced: set[int] = set()
        #: the backward under way, nested reentrant-checkpointing ones included: its
        #: end (the outermost one's) checks
        self._scope = BackwardScope(self._check_after_the_others)
        #: a forward with autograd ran through the DDP model since the last check
        self._through_ddp = False
        #: this backward runs again through a graph kept with ``retain_graph=True``
        #: (:mod:`~overlapkit.overlap.core.kept_graph` sets it): DDP reduces once per
        #: forward, so nothing here, the forward having run through it all the same
        self.again_through_kept_graph = False

    def forward_through_ddp(self, module: torch.nn.Module, args: Any) -> None:
        """A forward pre-hook of the DDP model (an :class:`~overlapkit.overlap.core.
        own_hooks.OwnHook`): a forward with autograd reaches DDP, whose reducer then
        expects this backward's gradients."""
        if torch.is_grad_enabled():
            self._through_ddp = True

    def _check_at_the_end(self) -> None:
        if self._scope.enter() == NEW:  # a backward that raised left its own behind
            self._waiting, self._reduced = {}, set()

    def freed(self, param: torch.Tensor) -> None:
        """``param``'s local gradient was freed once copied into its bucket."""
        self._check_at_the_end()
        if id(param) not in self._reduced:
            self._waiting[id(param)] = tuple(param.shape)

    def reduced(self, bucket: dist.GradBucket) -> None:
        """DDP runs the comm hook for ``bucket``: its gradients reach the stepper, whatever
        it does with them (steps them, replays a layout, a refused backward)."""
        if self.active:
            self._check_at_the_end()
            for param in bucket.parameters():
                self._reduced.add(id(param))
                self._waiting.pop(id(param), None)

    def _check_after_the_others(self) -> None:
        # the end of the backward (queued at its first freed gradient or bucket) comes
        # before the stepper's and DDP's own end-of-backward callbacks: queued again,
        # it runs after them
        Variable._execution_engine.queue_callback(self._check)

    def _check(self) -> None:
        waiting, self._waiting = self._waiting, {}
        reduced_any, self._reduced = bool(self._reduced), set()
        through_ddp, self._through_ddp = self._through_ddp, False
        again, self.again_through_kept_graph = self.again_through_kept_graph, False
        if not waiting or self.refused_elsewhere:
            self.refused_elsewhere = False
            return
        self._refused()
        if not reduced_any and again:  # 968cf42: named a forward past the DDP model
            raise ConfigurationError(
                f"backward() ran again through a graph kept with retain_graph=True, with no "
                f"new forward of the DistributedDataParallel model: DDP reduces once per "
                f"forward, so it reduced nothing in this backward ({len(waiting)} "
                "parameters' gradients were freed into their buckets, nothing was "
                f"stepped; the plain loop would add this rank's unreduced gradients to the "
                f"first backward's averaged ones). {self._technique} steps each bucket once "
                "reduced. Sum the losses into one backward (loss + aux_loss), or run a "
                "forward of the DDP model before each backward; restart from the last "
                "checkpoint after fixing the loop.")
        if not reduced_any and not through_ddp:
            raise ConfigurationError(
                f"backward() ended with no DDP reduction run ({len(waiting)} parameters' "
                "gradients were freed into their buckets, nothing was stepped): the "
                "forward did not run through the DistributedDataParallel model (the module "
                "it wraps was called, e.g. model.module(batch)), so DDP reduced nothing. "
                f"{self._technique} steps each bucket once reduced; call the DDP model "
                "itself for the training forward (calling the module directly skips the "
                "reduction in the plain loop too, each rank then stepping its own "
                "gradient). Nothing was stepped in this backward.")
        shapes = ", ".join(str(shape) for shape in list(waiting.values())[:3])
        raise ConfigurationError(
            f"backward() ended with the DDP reduction of {len(waiting)} parameters "
            f"(shapes {shapes}{' ...' if len(waiting) > 3 else ''}) never run: DDP waits "
            "for the gradient of a parameter this forward did not use, with "
            f"find_unused_parameters=False. {self._technique} steps each bucket once "
            "reduced, so these were not stepped (the plain step() would step them on "
            "this rank's unreduced gradient; plain DDP raises at the next forward). "
            "Pass find_unused_parameters=True to DistributedDataParallel, or use every "
            "parameter in each forward; restart from the last checkpoint if other "
            "buckets of this backward were stepped.")
