"""The overlapkit error hierarchy.

Every error raised on purpose by overlapkit is an :class:`OverlapkitError`, and each
subclass also derives from the built-in exception a caller would naturally catch
(``ValueError``, ``TypeError``, ``LookupError``, ``ImportError``), so existing
``except ValueError`` code keeps working. Every message ends with what to do about it.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "ConfigurationError",
    "ExchangeFailedError",
    "MissingDependencyError",
    "NotPicklableError",
    "OverlapkitError",
    "PluginConflictError",
    "PluginLoadError",
    "PluginValidationError",
    "RanksLostError",
    "UnknownNameError",
    "UnsupportedOptimizerError",
    "UnsupportedModelError",
]


class OverlapkitError(Exception):
    """Base class of every error overlapkit raises on purpose."""


class ConfigurationError(OverlapkitError, ValueError):
    """An argument or option has a value overlapkit cannot work with."""


class UnknownNameError(OverlapkitError, LookupError):
    """A comm hook, averager or load planner name that no plugin provides.

    The message lists every valid name.
    """

    def __init__(self, kind: str, name: str, valid: list[str]) -> None:
        self.kind = kind
        self.name = name
        self.valid = sorted(valid)
        choices = ", ".join(repr(v) for v in self.valid) or "none are registered"
        super().__init__(
            f"unknown {kind} {name!r}; valid names: {choices}. "
            f"Use one of these, or install the plugin that provides {name!r} "
            "(`overlapkit plugins` lists what is installed)."
        )

    def __str__(self) -> str:  # LookupError would otherwise repr() the message
        return str(self.args[0])


class UnsupportedOptimizerError(OverlapkitError, TypeError):
    """The optimizer class cannot be overlapped (not an optimizer, needs a closure, ...)."""


class UnsupportedModelError(OverlapkitError, TypeError):
    """The model is not of a kind the requested technique works with."""


class NotPicklableError(OverlapkitError, TypeError):
    """An object bound to a live model and process group (an overlapped optimizer) was
    pickled or deep-copied; the message says which state dict to save or copy instead.

    .. versionadded:: 0.4
    """


class CheckpointError(OverlapkitError, ValueError):
    """A checkpoint is missing, corrupt, or does not fit the model it is loaded into."""


class MissingDependencyError(OverlapkitError, ImportError):
    """An optional dependency is not installed (a trainer framework an integration needs);
    the message names the extra that installs it.

    .. versionadded:: 0.3
    """


class PluginLoadError(OverlapkitError, ImportError):
    """A plugin's entry point failed to import; the original error is chained.

    overlapkit fails fast here instead of skipping the plugin: ranks that end up with
    different plugin sets would pick different comm hooks or averagers and hang in a
    collective.
    """


class PluginConflictError(OverlapkitError, ValueError):
    """Two plugins provide the same name or claim the same optimizer class."""


class PluginValidationError(OverlapkitError, TypeError):
    """A plugin returned something that is not a valid overlapkit record."""

    def __init__(self, plugin: str, message: str) -> None:
        self.plugin = plugin
        super().__init__(f"plugin {plugin!r}: {message}")


class RanksLostError(OverlapkitError, RuntimeError):
    """Ranks of the job were lost (a node killed, powered off or cut off) while
    overlapkit ran a collective; the message names them and their node.

    Raised on the surviving ranks instead of the transport's own error (gloo:
    "Connection reset by peer", or a timeout for a node that hangs), which names no
    rank; the original error is its ``__cause__``. Inside ``loss.backward()`` autograd
    re-raises it as a ``RuntimeError`` carrying this message.

    :ivar lost: the lost ranks (of the default process group).
    :ivar what: what overlapkit was doing, e.g. ``"saving the checkpoint to ckpt"``.
    """

    def __init__(self, message: str, *, lost: list[int], what: str) -> None:
        super().__init__(message)
        self.lost = lost
        self.what = what

    def __reduce__(self) -> tuple[object, ...]:  # picklable with its keyword arguments
        return (_ranks_lost, (str(self), self.lost, self.what))


def _ranks_lost(message: str, lost: list[int], what: str) -> RanksLostError:
    return RanksLostError(message, lost=lost, what=what)


class ExchangeFailedError(OverlapkitError, RuntimeError):
    """A collective of an overlapped step failed while every rank is still there: a
    gradient bucket's reduction (the DDP comm hook of ``overlap_ddp`` and
    ``optimizer_in_backward``) or the parameter exchange of sharded optimizer state.

    Another rank stopped taking part (it raised during backward and went on, or hangs)
    and the process group gave up at its timeout, or a rank ended on an error of its
    own. Raised on the waiting ranks instead of the transport's error (gloo: "Timed out
    waiting 8000ms for recv operation to complete"), which names no rank; the original
    error is its ``__cause__``. Ranks that are gone raise :class:`RanksLostError`
    instead.

    :ivar what: what overlapkit was doing, e.g. ``"reducing gradient bucket 2"``.
    :ivar silent: the ranks that are alive but did not report this failure: the ones
        that stopped taking part.

    .. versionadded:: 0.4
    """

    def __init__(self, message: str, *, what: str, silent: list[int]) -> None:
        super().__init__(message)
        self.what = what
        self.silent = silent

    def __reduce__(self) -> tuple[object, ...]:  # picklable with its keyword arguments
        return (_exchange_failed, (str(self), self.what, self.silent))


def _exchange_failed(message: str, what: str, silent: list[int]) -> ExchangeFailedError:
    return ExchangeFailedError(message, what=what, silent=silent)


class QuorumError(OverlapkitError, RuntimeError):
    """A torchft quorum could not be formed at an averaging step of
    :func:`overlapkit.ft.local_sgd` (the Lighthouse unreachable, or fewer replica
    groups than its ``min_replicas`` within the quorum timeout); torchft's own error is
    its ``__cause__``. The step's local update was applied, its averaging was not, and
    the step is not counted: the next ``step()`` averages again.

    .. versionadded:: 0.4
    """
