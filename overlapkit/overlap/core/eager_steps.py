"""The overlapped optimizers' ``step()`` run eagerly when a ``torch.compile``'d function
calls it (torch's recipe for compiling the optimizer: ``@torch.compile def fn():
opt.step()``).

Traced by dynamo, overlapkit's bookkeeping failed there (0.4.0 before the tenth round:
a bare ``AssertionError: expected WrapperDescriptorType`` from dynamo under
``overlap_ddp`` and ``optimizer_in_backward``, a false "changed in place" refusal with
sharded state, ``InternalTorchDynamoError`` in ``PostLocalSGDOptimizer``'s averaging).
The steps were taken during backward, eagerly, so ``step()`` has nothing to compile:
the methods registered here (:func:`run_eagerly_when_compiled`) are wrapped by
``torch.compiler.disable`` (a graph break; 0.5 µs a call).

Wrapped lazily, once ``torch._dynamo`` is imported (``torch.compile`` imports it),
never before: :func:`follow_compile` looks as a stepping backward starts and as an
overlapped optimizer is set up, one dictionary lookup. Wrapping as overlapkit is
imported would import ``torch._dynamo`` in every process that never compiles
(0.35 s on the 2-core test machine, which shifted a restarted torchft replica group's
timing in ``tests/ft``) and put a dynamo frame into every traceback of a refusal
raised by ``step()``.
"""

from __future__ import annotations

import sys

__all__ = ["follow_compile", "run_eagerly_when_compiled"]

#: the methods to wrap, as ``(class, name)``
_METHODS: list[tuple[type, str]] = []
_WRAPPED = False


def run_eagerly_when_compiled(owner: type, name: str) -> None:
    """Have ``owner.name`` (defined on ``owner`` itself) run eagerly when called from
    compiled code, from the time ``torch._dynamo`` is imported."""
    _METHODS.append((owner, name))
    if _WRAPPED:
        _wrap(owner, name)


def follow_compile() -> None:
    """Wrap every registered method once ``torch._dynamo`` is imported (once)."""
    global _WRAPPED
    if _WRAPPED or "torch._dynamo" not in sys.modules:
        return
    _WRAPPED = True
    for owner, name in _METHODS:
        _wrap(owner, name)


def _wrap(owner: type, name: str) -> None:
    import torch

    setattr(owner, name, torch.compiler.disable(vars(owner)[name]))
