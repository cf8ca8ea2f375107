"""The attrs records that hook implementations return.

Hooks return records rather than registering things as a side effect, so that the
registry can list, validate and conflict-check everything the plugins provide,
independently of the order in which they were registered. Records are frozen and
keyword-only, and validate their fields when they are built: a plugin that returns a
malformed record fails at set-up, naming the plugin, not in the middle of training.

.. versionadded:: 0.1
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from overlapkit.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

__all__ = [
    "AveragerRecord",
    "AveragerSpec",
    "CommHookRecord",
    "CommHookSpec",
    "LoadPlannerRecord",
    "LoadPlannerSpec",
    "OptimizerRecord",
    "OptimizerSpec",
    "normalize_name",
]

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def normalize_name(name: str) -> str:
    """Return ``name`` lower-cased with ``-`` and spaces as ``_``: ``"FP16-Compress"`` →
    ``"fp16_compress"``. Used for every named record and every lookup by name."""
    return name.strip().lower().replace("-", "_").replace(" ", "_")


def _valid_name(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(
            f"{type(instance).__name__}.name must be a word of lower-case letters, digits "
            f"and underscores starting with a letter, got {value!r}; rename it."
        )


def _callable(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not callable(value):
        raise TypeError(
            f"{type(instance).__name__}.{attribute.name} must be callable, got "
            f"{type(value).__name__}; pass the function or class that builds it."
        )


def _optimizer_class(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    import torch  # records are built at set-up; importing them stays light

    if not (isinstance(value, type) and issubclass(value, torch.optim.Optimizer)):
        raise TypeError(
            f"OptimizerRecord.optim_cls must be a subclass of torch.optim.Optimizer, got "
            f"{value!r}; pass the optimizer class itself, not an instance."
        )


def _an_engine_class(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    from overlapkit.overlap.core.engine import OverlapEngine  # the engine imports the records

    if not (isinstance(value, type) and issubclass(value, OverlapEngine)):
        raise TypeError(
            f"OptimizerRecord.{attribute.name} must be a subclass of "
            f"overlapkit.plugin.OverlapEngine, got {value!r}; pass the OverlapEngine "
            "subclass that steps one bucket of parameters."
        )


class _Buildable:
    """``create(**options)``: check the options against ``build``, then build."""

    name: str
    build: Callable[..., Any]

    def create(self, **options: Any) -> Any:
        """``build(**options)`` after :func:`~overlapkit.plugin.options.check_build_options`.

        :raises ConfigurationError: an option ``build`` does not take, or a missing one.
        """
        from overlapkit.plugin.options import check_build_options

        label = type(self).__name__.removesuffix("Record").replace("CommHook", "comm hook")
        check_build_options(f"{label.lower()} {self.name!r}", self.build, options)
        return self.build(**options)


@attrs.frozen(kw_only=True)
class OptimizerRecord:
    """Which overlapped implementation steps buckets of an optimizer class.

    Returned by :func:`~overlapkit.plugin.hookspecs.overlapkit_register_optimizers`. When
    overlapkit overlaps an optimizer it walks the optimizer class's MRO and uses the
    spec of the most specific class that has one, so a spec for
    ``torch.optim.Optimizer`` serves every optimizer that has no spec of its own.
    """

    #: the ``torch.optim.Optimizer`` subclass this spec serves (and its subclasses)
    optim_cls: type[torch.optim.Optimizer] = attrs.field(validator=_optimizer_class)
    #: the class that steps a subset (one bucket) of the optimizer's parameters
    overlapped_cls: type = attrs.field(validator=_an_engine_class)
    #: one line for ``overlapkit plugins``
    description: str = attrs.field(default="", validator=attrs.validators.instance_of(str))

    @property
    def name(self) -> str:
        """The qualified name of :attr:`optim_cls`, used in listings and errors."""
        return f"{self.optim_cls.__module__}.{self.optim_cls.__qualname__}"


@attrs.frozen(kw_only=True)
class CommHookRecord(_Buildable):
    """A named DDP communication hook.

    Returned by :func:`~overlapkit.plugin.hookspecs.overlapkit_register_comm_hooks`.
    ``build(process_group=..., **options)`` returns ``(state, hook)``, the two
    arguments of ``DistributedDataParallel.register_comm_hook``; ``hook(state, bucket)``
    returns a ``torch.futures.Future`` of the bucket's reduced gradient (summed or
    averaged, as DDP's own ``allreduce`` hook does: averaged over the group).
    """

    name: str = attrs.field(converter=normalize_name, validator=_valid_name)
    build: Callable[..., tuple[Any, Callable[..., Any]]] = attrs.field(validator=_callable)
    description: str = attrs.field(default="", validator=attrs.validators.instance_of(str))

    def create(self, **options: Any) -> Any:
        """``(state, hook)`` from ``build``, refused with a ConfigurationError naming the
        hook unless it is a pair whose hook takes ``(state, bucket)``, before any model
        has it (f2b92e2: a bare "cannot unpack non-iterable function object", or
        "'int' object is not callable" in the first backward)."""
        built = super().create(**options)
        hook = built[1] if isinstance(built, tuple) and len(built) == 2 else None
        problem = None
        if hook is None:
            got = (f"a tuple of {len(built)}" if isinstance(built, tuple)
                   else f"a {type(built).__name__}")
            problem = f"returned {got}, not the pair (state, hook)"
        elif not callable(hook):
            problem = f"returned a hook of type {type(hook).__name__}, which is not callable"
        else:
            try:
                inspect.signature(hook).bind(None, None)
            except TypeError:
                problem = f"returned a hook {hook!r} that cannot be called as hook(state, bucket)"
            except ValueError:  # no signature to read (a builtin): DDP calls it as it is
                pass
        if problem is not None:
            raise ConfigurationError(
                f"the builder of the comm hook {self.name!r} {problem}; it must return "
                "(state, hook), the two arguments of DistributedDataParallel."
                "register_comm_hook, where hook(state, bucket) returns a torch.futures."
                "Future of the reduced bucket. Nothing was set up.")
        return built


@attrs.frozen(kw_only=True)
class AveragerRecord(_Buildable):
    """A named model averager for post-local SGD.

    Returned by :func:`~overlapkit.plugin.hookspecs.overlapkit_register_averagers`.
    ``build(**options)`` returns an object with ``average_parameters(params)``, a
    ``step`` counter, and ``state_dict()`` / ``load_state_dict()`` so a resumed run
    continues where it stopped.
    """

    name: str = attrs.field(converter=normalize_name, validator=_valid_name)
    build: Callable[..., Any] = attrs.field(validator=_callable)
    description: str = attrs.field(default="", validator=attrs.validators.instance_of(str))


@attrs.frozen(kw_only=True)
class LoadPlannerRecord(_Buildable):
    """A named DCP load planner for sharded optimizer state.

    Returned by :func:`~overlapkit.plugin.hookspecs.overlapkit_register_load_planners`.
    ``build(**options)`` returns a ``torch.distributed.checkpoint.LoadPlanner``.
    ``detect(state_dict)``, when given, says whether this planner is the right one for a
    state dict's layout; automatic choice takes the first spec whose ``detect`` accepts
    it, in order of ``priority`` (highest first), and falls back to ``default``.
    """

    name: str = attrs.field(converter=normalize_name, validator=_valid_name)
    build: Callable[..., Any] = attrs.field(validator=_callable)
    description: str = attrs.field(default="", validator=attrs.validators.instance_of(str))
    detect: Callable[[Any], bool] | None = attrs.field(
        default=None, validator=attrs.validators.optional(_callable)
    )
    priority: int = attrs.field(default=0, validator=attrs.validators.instance_of(int))

    def create(self, **options: Any) -> Any:
        """The planner from ``build``, refused unless it is a DCP ``LoadPlanner``, before
        anything is read (f2b92e2: a builder returning None had ``dcp.load`` use DCP's own
        default planner, which unpickles arbitrary objects, silently)."""
        from torch.distributed.checkpoint.planner import LoadPlanner

        planner = super().create(**options)
        if not isinstance(planner, LoadPlanner):
            raise ConfigurationError(
                f"the builder of the load planner {self.name!r} returned a "
                f"{type(planner).__name__}, not a torch.distributed.checkpoint.LoadPlanner;"
                " the plugin's builder must return the planner. Nothing was loaded.")
        return planner


# The names of 0.1: "Spec" also meant a pluggy hook specification, so the records are
# "Record"s now. The old names stay as aliases of the same classes for existing plugins.
OptimizerSpec = OptimizerRecord
CommHookSpec = CommHookRecord
AveragerSpec = AveragerRecord
LoadPlannerSpec = LoadPlannerRecord
