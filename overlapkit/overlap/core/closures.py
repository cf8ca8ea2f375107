"""``step(closure)``: what overlapkit cannot pass, refused with the reason.

A step taken during backward is called ``step()``, without a closure: the engine has
no loss to re-evaluate, and a closure re-running forward and backward inside backward
would step from other gradients. Two refusals:

- :func:`required_closure_refusal`, at set-up: an optimizer class whose ``step()``
  requires its closure (``def step(self, closure)``, no default: a user's line search,
  a second-order method). Before, its first backward raised torch's bare ``TypeError:
  step() missing 1 required positional argument: 'closure'`` from inside backward.
- :func:`closure_needed`: the error a step raised during backward, where the
  optimizer's ``step(closure=None)`` calls or asserts its closure all the same
  (``closure()``, ``assert closure is not None``), told as that; before, torch's bare
  ``TypeError: 'NoneType' object is not callable`` came out of backward.
- :func:`closure_refusal`, at ``step(closure)`` on the overlapped optimizer (torch's
  recipe ``opt.step(closure)``, Lightning's automatic optimization).
"""

from __future__ import annotations

import inspect

from overlapkit.errors import ConfigurationError, UnsupportedOptimizerError

__all__ = ["closure_needed", "closure_refusal", "required_closure_refusal"]


def required_closure_refusal(optim_cls: type) -> UnsupportedOptimizerError | None:
    """The set-up's refusal of ``optim_cls`` where its ``step()`` has a parameter without
    a default after ``self`` (the closure it needs), else None."""
    try:
        signature = inspect.signature(inspect.unwrap(optim_cls.step))  # type: ignore[attr-defined]
    except (TypeError, ValueError):  # pragma: no cover - a builtin step
        return None
    required = [
        name
        for index, (name, param) in enumerate(signature.parameters.items())
        if index > 0
        and param.default is inspect.Parameter.empty
        and param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)
    ]
    if not required:
        return None
    return UnsupportedOptimizerError(
        f"{optim_cls.__qualname__}.step() requires {', '.join(repr(n) for n in required)} "
        "(a closure re-evaluating the loss), and a step taken during backward has none to "
        "pass: the engine calls step() with no argument, part by part, while backward "
        "runs. Use this optimizer without overlap, or give the argument a default of "
        "None where the step works without it (torch's optimizers do)."
    )


def closure_refusal(technique: str, stepped: bool = False) -> ConfigurationError:
    """The refusal of ``step(closure)`` on the overlapped optimizer; ``stepped``: a
    backward since the last ``step()`` has stepped the parameters already (a loop
    calling ``loss.backward()`` and then ``step(closure)``), which the message says."""
    taken = (" The backward before this call has stepped the parameters already, with its "
             "own gradients, where the plain step would have taken the closure's: restart "
             "from the last checkpoint after fixing the loop." if stepped else "")
    return ConfigurationError(
        f"{technique} steps during backward, so step() takes no closure.{taken} Instead, "
        "call loss.backward() yourself and then step() (or nothing). With PyTorch "
        "Lightning (whose automatic optimization calls step(closure)), return the "
        "plain optimizer from configure_optimizers and pass strategy="
        "OverlapDDPStrategy() or OverlapSingleDeviceStrategy() from "
        "overlapkit.integrations.lightning (FSDPStrategy, FSDP1, is not supported)."
    )


def closure_needed(error: BaseException) -> BaseException:
    """``error``, raised by a step taken during backward, as an
    :class:`~overlapkit.errors.UnsupportedOptimizerError` (chained to it) where it is a
    ``TypeError`` or ``AssertionError`` raised in the ``step()`` of an optimizer outside
    torch whose ``closure`` was None; else ``error`` itself. Only on a step's error."""
    if not isinstance(error, (TypeError, AssertionError)) or error.__traceback__ is None:
        return error
    last = error.__traceback__
    while last.tb_next is not None:
        last = last.tb_next
    frame = last.tb_frame
    code = frame.f_code
    if (
        code.co_name != "step"
        or "closure" not in code.co_varnames[: code.co_argcount]
        or frame.f_locals.get("closure", False) is not None
        or str(frame.f_globals.get("__name__", "")).startswith("torch.")
    ):
        return error
    owner = frame.f_locals.get("self")
    name = (
        type(owner).__qualname__
        if owner is not None
        else getattr(code, "co_qualname", code.co_name)
    )
    refusal = UnsupportedOptimizerError(
        f"{name}.step() raised {type(error).__name__}: {error} with its closure None: it "
        "needs a closure (a loss to re-evaluate), and a step taken during backward has "
        "none to pass (the engine calls step() with no argument, part by part, while "
        "backward runs; this backward stepped no part after it). Use this optimizer "
        "without overlap, or have its step() work without a closure, as torch's "
        "optimizers do."
    )
    refusal.__cause__ = error
    return refusal
