"""A gradient bucket's reduction that failed during an overlapped backward: kept, and
raised as one overlapkit error when backward ends.

When a rank stops taking part (it raised during backward and the loop went on, it
hangs, or it was killed), the others' reductions fail: at the process group's timeout,
or at once for a rank whose connections closed. Raised where the bucket stepper waits
for the reduction, inside DDP's comm hook or its finalize, the failure reached the
caller as torch's bare ``RuntimeError`` ("Got the following error when running the
callback: ..."), whatever the inner hook had raised (measured on torch 2.13: a
``RanksLostError`` raised in the allreduce's callback lost its type). So the stepper
keeps the first failure of the backward (:meth:`FailedReductions.reduced`), steps
nothing after it, and raises it, as :func:`overlapkit.nodes.failed_collective.
collective_failure` names it, in its end-of-backward callback, before DDP's finalize:
an autograd final callback hands the caller that very exception.

.. versionadded:: 0.4
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from overlapkit.errors import ConfigurationError, OverlapkitError
from overlapkit.nodes.failed_collective import collective_failure
from overlapkit.overlap.core.step_accounting import StepAccount

__all__ = ["FailedReductions"]


class FailedReductions(StepAccount):
    """The reductions of the backward under way, and the first of them that failed.

    The base of :class:`~overlapkit.overlap.ddp.bucket_stepper.BucketStepper`: each
    backward starts afresh (:meth:`starting_backward`); futures no drain waits for
    (global and deferred steps, ``step_thread="comm"``) are kept (:meth:`keep`) and
    waited for at the end of backward (:meth:`raise_failed_reduction`), where DDP's
    finalize would otherwise be the first to wait for them.
    """

    #: the inner comm hook and its state (set by the bucket stepper)
    inner_hook: Any
    inner_state: Any
    #: the first reduction of this backward that failed, as an overlapkit error where
    #: a peer failed (else as it was)
    reduction_error: BaseException | None = None
    _kept: list[torch.futures.Future[Any]]

    def starting_backward(self) -> OverlapkitError | None:
        self.reduction_error = None
        self._kept = []
        return super().starting_backward()

    def keep(self, future: torch.futures.Future[Any]) -> torch.futures.Future[Any]:
        """Keep ``future`` (what the comm hook returns) for the end of backward."""
        self._kept.append(future)
        return future

    def reduced(self, future: torch.futures.Future[Any], bucket: int | None = None) -> bool:
        """Wait for ``future``: whether it reduced. False when it failed (the failure is
        kept) or an earlier reduction of this backward did (nothing to wait for)."""
        if self.reduction_error is not None:
            return False
        try:
            future.wait()
        except Exception as error:  # a peer stalled or is gone: raised at the end
            self._failed(error, bucket)
            return False
        return True

    def hook_result(self, value: Any, buffer: torch.Tensor, bucket: int) -> torch.Tensor | None:
        """The reduced bucket in the value of the comm hook's future: a tensor of the
        bucket's element count, or a list of one (as a process group's future holds).
        Anything else (a plugin's hook returning a slice, a scalar, None, two tensors)
        is refused, kept and raised when backward ends, the bucket not stepped: plain
        DDP fails after backward with torch's bare error ("setStorage: ... out of
        bounds", "Unable to cast"), or reads the first elements of a larger tensor; a
        smaller one was broadcast into the bucket and stepped (f2b92e2)."""
        result = value[0] if isinstance(value, (list, tuple)) and len(value) == 1 else value
        if isinstance(result, torch.Tensor) and result.numel() == buffer.numel():
            return result
        got = (f"a {result.dtype} tensor of shape {tuple(result.shape)}"
               if isinstance(result, torch.Tensor) else
               f"a {type(value).__name__} of {len(value)}" if isinstance(value, (list, tuple))
               else repr(value) if value is None else f"a {type(value).__name__}")
        hook = getattr(self.inner_hook, "__qualname__", repr(self.inner_hook))
        module = getattr(self.inner_hook, "__module__", None)
        self._failed(ConfigurationError(
            f"the comm hook {module + '.' if module else ''}{hook} returned, for gradient "
            f"bucket {bucket} ({buffer.numel()} elements of {buffer.dtype}), a future "
            f"holding {got}; a comm hook's future must hold the reduced bucket: one "
            f"tensor of bucket.buffer()'s {buffer.numel()} elements (e.g. "
            "`return fut.then(lambda f: f.value()[0])` after an allreduce). Nothing was "
            "stepped from this bucket on; fix the hook (or its plugin)."), bucket)
        return None

    def _failed(self, error: BaseException, bucket: int | None) -> None:
        if self.reduction_error is None:  # the first failure of this backward
            what = ("reducing gradient bucket " + (f"{bucket} " if bucket is not None else "")
                    + f"(DDP comm hook of {self.technique})")
            failed = collective_failure(error, what, self._group())
            if failed is None and not isinstance(error, OverlapkitError):
                failed = self._hook_raised(error, what)
            self.reduction_error = failed or error

    def _hook_raised(self, error: BaseException, what: str) -> ConfigurationError:
        """The comm hook's own error (its future set to an exception, a ``then``
        callback raising), not a peer's: at ``cdd1705`` raised as it was, the hook
        unnamed and the buckets stepped before it unsaid, where plain DDP raises after
        backward with nothing stepped."""
        hook = getattr(self.inner_hook, "__qualname__", repr(self.inner_hook))
        module = getattr(self.inner_hook, "__module__", None)
        failed = ConfigurationError(
            f"the comm hook {module + '.' if module else ''}{hook} failed {what}: "
            f"{type(error).__name__}: {error}. Plain DDP raises this after backward with "
            "nothing stepped; here the buckets reduced before it in this backward may "
            "have been stepped already (their parameters and optimizer state changed), "
            "nothing from this bucket on. Fix the hook (or its plugin) and restart from "
            "the last checkpoint.")
        failed.__cause__ = error
        return failed

    def _group(self) -> Any:
        """The process group the inner hook reduces over, for the error's timeout:
        torch's and overlapkit's hooks take it (or a state holding it) as their state,
        None for the default group."""
        group = getattr(self.inner_state, "process_group", self.inner_state)
        return dist.group.WORLD if group is None else group

    def comm_failure(self) -> BaseException | None:
        """The failed collective of this backward, if any."""
        return self.reduction_error

    def raise_failed_reduction(self) -> None:
        """At the end of backward, before DDP's finalize: wait for the kept futures, and
        raise the failure of this backward if there is one (the loop learns of it
        here: :meth:`backward_refused`)."""
        kept, self._kept = self._kept, []
        for future in kept:  # every one: a step_thread="comm" callback may still run
            try:
                future.wait()  # DDP's finalize waits for it next, on this stream too
            except Exception as error:
                self._failed(error, None)
        failed = self.comm_failure()
        if failed is not None:
            self.reduction_error = None
            self.backward_refused()
            raise failed
