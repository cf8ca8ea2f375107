"""The set-up pass of every overlapped technique: resolve, check, build.

``overlap_ddp`` and ``optimizer_in_backward`` first *resolve* what the call asks for
into one :class:`ResolvedSetup` (the model's kind and parameters in
:class:`ModelFacts`, the real optimizer's class and param groups, the rules, the comm
hook), then *check* it — each fact once, by the module that owns its concept — and only
then *build* from the record (the engine, the stepper, the hooks). Nothing is changed
before every check has passed, and no layer works a fact out again: before 0.4 the
parameters DDP reduces were listed 4 times and checked against the model twice in one
``overlap_ddp`` call (``tests/test_setup_pass.py`` follows the model through set-up).

.. versionadded:: 0.4
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch

from overlapkit.errors import ConfigurationError
from overlapkit.overlap.adopt import check_adoptable, is_instance
from overlapkit.overlap.core.engine import OverlapEngine
from overlapkit.overlap.rules.clipping import GradClipping
from overlapkit.overlap.rules.global_step import check_grad_scaler, model_order
from overlapkit.overlap.setup import (
    build_optimizer,
    check_params_belong,
    check_steppable,
    flatten_params,
    materialise_params,
    optimizer_probe,
    resolve_overlapped_cls,
)
from overlapkit.plugin.records import CommHookRecord

__all__ = ["MODEL_KINDS", "ModelFacts", "ResolvedSetup", "resolve_setup"]

#: what a model handed to a technique is recognised as
MODEL_KINDS = ("ddp", "fsdp2", "module")


@attrs.frozen(kw_only=True, eq=False)
class ModelFacts:
    """What the set-up knows of the model, worked out once.

    :param model: the model as given (the DDP model, an FSDP2 or plain module).
    :param kind: one of :data:`MODEL_KINDS`.
    :param technique: the function set up on it, for messages.
    :param parameters: the model's parameters in its order (for DDP: the wrapped
        module's), each once.
    :param inner: the module holding the parameters (DDP's ``model.module``, else
        ``model``).
    :param parameters: the model's parameters in its order, each once.
    :param names: ``id(param)`` -> its name in the model.
    :param order: ``id(param)`` -> its place in ``parameters``: the order global
        clipping sums the norm in.
    :param reduced: the ``id`` of the trainable parameters (for DDP: those it reduces,
        trainable and not among its parameters to ignore), when the facts were taken.
    """

    model: torch.nn.Module
    kind: str = attrs.field(validator=attrs.validators.in_(MODEL_KINDS))
    technique: str
    inner: torch.nn.Module
    parameters: tuple[torch.Tensor, ...]
    names: dict[int, str]
    order: dict[int, int]
    reduced: frozenset[int]

    @classmethod
    def of(cls, model: torch.nn.Module, kind: str, technique: str,
           inner: torch.nn.Module | None = None) -> ModelFacts:
        """The facts of ``model``; ``inner``: the module holding its parameters (DDP's
        ``model.module``), ``model`` itself by default."""
        inner = model if inner is None else inner
        named = list(inner.named_parameters())
        params = tuple(p for _, p in named)
        return cls(model=model, kind=kind, technique=technique, inner=inner,
                   parameters=params, names={id(p): name for name, p in named},
                   order=model_order(params),
                   reduced=frozenset(id(p) for p in params if p.requires_grad and not (
                       kind == "ddp" and hasattr(p, "_ddp_ignored"))))

    def now(self) -> ModelFacts:
        """The facts of the model as it is now: for ``add_param_group`` after set-up,
        when the model may have grown parameters or changed ``requires_grad``."""
        return ModelFacts.of(self.model, self.kind, self.technique, self.inner)

    def check_params_now(self, params: Iterable[Any],
                         optimizer: torch.optim.Optimizer | None = None) -> None:
        """:meth:`check_params` against the model as it is now (``add_param_group``)."""
        self.now().check_params(params, optimizer)

    def check_params(self, params: Iterable[Any],
                     optimizer: torch.optim.Optimizer | None = None) -> None:
        """Check ``params``; given the ``optimizer`` they are added to (param-group
        dicts, at ``add_param_group``), :func:`~overlapkit.overlap.setup.check_steppable`
        too.

        :raises ConfigurationError: an item of ``params`` is not a parameter of the
            model or is listed twice, or (DDP) a trainable one DDP does not reduce; an
            option the optimizer's step cannot run with. Frozen parameters are
            accepted, as torch's optimizers accept them: they never get a gradient, so
            they are never stepped and have no state (a plain module's or an FSDP2
            model's is hooked if unfrozen later).
        """
        params = list(params)
        self._check_belong(params)
        if optimizer is not None:
            check_steppable(optimizer, [g for g in params if isinstance(g, Mapping)],
                            self.names, self.technique, added=True)

    def _check_belong(self, params: list[Any]) -> None:
        """:meth:`check_params`' check of the parameters against the model."""
        if self.kind != "ddp":
            check_params_belong(
                params, self.names, owner="the module", example="module.parameters()",
                unknown=f"so {self.technique} has no hook on it; pass only the module's "
                "parameters (for FSDP2: the sharded ones, module.parameters() after "
                "fully_shard), and step others with a plain optimizer.",
            )
            return
        for param in check_params_belong(
            params, self.names, owner="the DDP model", example="ddp_model.parameters()",
            unknown="so no bucket ever holds its gradient; pass only the model's "
            "parameters (ddp_model.parameters()), and step others with a plain optimizer.",
        ):
            if param.requires_grad and id(param) not in self.reduced:
                raise ConfigurationError(
                    f"parameter {self.names[id(param)]!r} in params is trainable but not "
                    "reduced by DDP (in DDP's parameters to ignore, or frozen when "
                    "DistributedDataParallel was built and unfrozen since), so no bucket "
                    "ever holds its gradient and it would never be stepped; leave it out "
                    "of params (step it with a plain optimizer), or unfreeze it before "
                    "building DDP."
                )


@attrs.frozen(kw_only=True, eq=False)
class ResolvedSetup:
    """Everything a technique's set-up resolved, before any check or change; the
    checks and the build steps read it whole.

    :param model: the model's facts.
    :param optimizer: the real optimizer the engine steps: the instance the call was
        given (adopted), or ``optim_cls(params, *args, **optim_kwargs)`` built here
        (building an optimizer only records its arguments; its state comes at the first
        step, so nothing has changed yet).
    :param adopted: ``optimizer`` is the caller's instance.
    :param optim_cls: its class.
    :param args: the optimizer's positional arguments (none when adopted).
    :param optim_kwargs: its keyword arguments (none when adopted).
    :param overlapped_cls: the engine class registered for ``optim_cls``.
    :param params: the parameters or param-group dicts the optimizer was built over
        (an adopted one's own ``param_groups``), materialised.
    :param stepped: every parameter of the optimizer, group by group.
    :param clipping: the clipping options.
    :param grad_scaler: the loop's ``torch.amp.GradScaler``, or None.
    :param comm_hook: DDP: the comm hook run before each bucket's step.
    :param comm_hook_options: DDP: its builder's keyword options.
    :param step_thread: DDP: where the buckets are stepped.
    :param policy: DDP: the sharding policy of ``shard_optimizer_state``, or None.
    """

    model: ModelFacts
    optimizer: torch.optim.Optimizer
    adopted: bool
    optim_cls: type[torch.optim.Optimizer]
    args: tuple[Any, ...]
    optim_kwargs: Mapping[str, Any]
    overlapped_cls: type[OverlapEngine]
    params: list[Any]
    stepped: list[torch.Tensor]
    clipping: GradClipping
    grad_scaler: Any = None
    comm_hook: CommHookRecord | None = None
    comm_hook_options: Mapping[str, Any] = attrs.field(factory=dict)
    step_thread: str = "backward"
    policy: Any = None


def resolve_setup(model: ModelFacts, optim: Any, args: tuple[Any, ...],
                  optim_kwargs: dict[str, Any], params: Iterable[Any] | None, *,
                  clipping: GradClipping, grad_scaler: Any | None = None,
                  **options: Any) -> ResolvedSetup:
    """Resolve the optimizer side of a set-up on ``model``: the class or instance
    (``optim``), its engine, the parameters and groups (checked against the model
    here, once), the real optimizer, the grad scaler. ``options`` are
    :class:`ResolvedSetup`'s DDP fields.

    :raises OverlapkitError: what :func:`~overlapkit.overlap.adopt.check_adoptable`,
        :func:`~overlapkit.overlap.setup.resolve_overlapped_cls`,
        :meth:`ModelFacts.check_params`, ``check_grad_scaler``,
        :func:`~overlapkit.overlap.setup.build_optimizer` and
        :func:`~overlapkit.overlap.setup.check_steppable` refuse.
    """
    adopted, given = is_instance(optim), params is not None
    if adopted:
        check_adoptable(optim, args, optim_kwargs, params, model.technique)
        optim_cls, params = type(optim), optim.param_groups
    else:
        optim_cls = optim
    overlapped_cls = resolve_overlapped_cls(optim_cls)
    check_grad_scaler(grad_scaler)
    if params is None:
        params = [p for p in model.parameters if id(p) in model.reduced]
    else:
        params = materialise_params(params, optimizer_probe(optim_cls, args, optim_kwargs))
        model.check_params(params)
    params = list(params)
    if not flatten_params(params):
        _refuse_nothing_to_step(model, given=not adopted and given)
    optimizer = optim if adopted else build_optimizer(optim_cls, params, args, optim_kwargs,
                                                      model.technique)
    check_steppable(optimizer, optimizer.param_groups, model.names, model.technique)
    return ResolvedSetup(
        model=model, optimizer=optimizer, adopted=adopted, optim_cls=optim_cls,
        args=args, optim_kwargs=optim_kwargs, overlapped_cls=overlapped_cls, params=params,
        stepped=[p for group in optimizer.param_groups for p in group["params"]],
        clipping=clipping, grad_scaler=grad_scaler, **options)


def _refuse_nothing_to_step(model: ModelFacts, *, given: bool) -> None:
    """:raises ConfigurationError: ``params`` (``given``) or the model has nothing to
    step, before an optimizer is built over nothing."""
    if given:
        raise ConfigurationError(f"params is empty; pass the parameters {model.technique} "
                                 "should step, or leave params out for all of them.")
    raise ConfigurationError(
        f"{type(model.model).__name__} has no parameter with requires_grad=True, so "
        f"{model.technique} has nothing to step; pass a module with trainable parameters "
        "(or unfreeze some)."
    )
