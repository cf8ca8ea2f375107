"""The registry: every record the plugins provide, checked and resolvable.

Built once from a plugin manager by calling each hook of each plugin separately, so
that every record is attributed to the plugin that returned it: conflicts name both
providers and ``overlapkit plugins`` shows who provides what. Built at set-up and
cached by the plugin manager; nothing here runs per bucket or per step.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import attrs

from overlapkit.errors import (
    PluginConflictError,
    PluginValidationError,
    UnknownNameError,
    UnsupportedOptimizerError,
)
from overlapkit.plugin.records import (
    AveragerRecord,
    CommHookRecord,
    LoadPlannerRecord,
    OptimizerRecord,
    normalize_name,
)
from overlapkit.plugin.wrappers import is_wrapper, wrapped_results

if TYPE_CHECKING:
    import pluggy

__all__ = ["HOOK_KINDS", "HOOK_RECORDS", "HookKind", "Provided", "Registry"]

R = TypeVar("R")


@attrs.frozen
class HookKind:
    """One extension point: the hook, the record it returns, and how records are keyed.

    :data:`HOOK_KINDS` drives everything the registry does per kind — collection,
    conflict checks, listing and lookup — so adding a fifth extension point is one row.
    """

    #: the hook specification's name
    hook: str
    #: the record class its implementations return
    record_type: type
    #: what one record is called in messages ("comm hook")
    label: str
    #: the key in listings and the Registry table's attribute ("comm_hooks")
    table: str

    def key(self, record: Any) -> Any:
        """What two records of this kind must not share: the class for optimizers."""
        return record.optim_cls if isinstance(record, OptimizerRecord) else record.name


HOOK_KINDS: tuple[HookKind, ...] = (
    HookKind("overlapkit_register_optimizers", OptimizerRecord, "optimizer", "optimizers"),
    HookKind("overlapkit_register_comm_hooks", CommHookRecord, "comm hook", "comm_hooks"),
    HookKind("overlapkit_register_averagers", AveragerRecord, "averager", "averagers"),
    HookKind("overlapkit_register_load_planners", LoadPlannerRecord, "load planner",
             "load_planners"),
)

#: hook name -> (record type it returns, what the records are called in messages);
#: the 0.1 form of :data:`HOOK_KINDS`, kept for existing imports
HOOK_RECORDS: dict[str, tuple[type, str]] = {
    kind.hook: (kind.record_type, kind.label) for kind in HOOK_KINDS
}


@attrs.frozen
class Provided(Generic[R]):
    """A record together with the name of the plugin that returned it."""

    plugin: str
    record: R


def _as_records(plugin: str, kind: HookKind, returned: Any) -> list[Any]:
    """The records in what a hook returned: None, one record, or any iterable of them
    (a list, a tuple, a set; a generator's are taken as the hook is called, see
    :func:`_calls_per_plugin`). A mapping is refused: its keys would be taken."""
    if isinstance(returned, Mapping):
        raise PluginValidationError(
            plugin,
            f"{kind.hook}() returned a {type(returned).__name__}; return a list of the "
            f"records (e.g. list(records.values())), expected "
            f"{kind.record_type.__name__} records.",
        )
    if returned is None:
        items: list[Any] = []
    elif isinstance(returned, Iterable) and not isinstance(returned, (str, bytes)):
        items = list(returned)
    else:
        items = [returned]
    for item in items:
        if not isinstance(item, kind.record_type):
            raise PluginValidationError(
                plugin,
                f"{kind.hook}() returned {item!r}, expected {kind.record_type.__name__} "
                f"records (a single one, an iterable of them, or None); return "
                f"overlapkit.plugin.{kind.record_type.__name__}(...) instead.",
            )
    return items


def _calls_per_plugin(pm: pluggy.PluginManager, kind: HookKind) -> Iterator[tuple[str, Any]]:
    """Call ``kind.hook`` of each implementing plugin once, yielding (plugin name, result).

    Each implementation is called directly — one call per plugin, linear in the number
    of plugins — so every record is attributed to the plugin that returned it. The
    calls are written to pluggy's trace (``OVERLAPKIT_TRACE_PLUGINS``) like hook calls.

    :raises PluginValidationError: an implementation raised; the message names the
        plugin, its distribution and the hook, and the original error is chained.
    """
    trace = pm.trace.root.get("registry")
    distribution_of = getattr(pm, "distribution_of", lambda name: None)

    def fail(plugin: str, what: str, error: BaseException | None) -> PluginValidationError:
        where = distribution_of(plugin)
        return PluginValidationError(
            plugin,
            what + (f" (distribution {where})" if where else "")
            + f". Fix the plugin, or block it with OVERLAPKIT_DISABLE_PLUGINS={plugin}.",
        )

    def call(impl: Any) -> Any:
        trace(f"{kind.hook} [{impl.plugin_name}]")
        try:
            result = impl.function()
            if isinstance(result, Iterator):  # a generator function: its records, now,
                result = list(result)  # so that one raising part-way is named here
        except Exception as error:
            raise fail(impl.plugin_name,
                       f"its {kind.hook}() hook raised {type(error).__name__}: {error}",
                       error) from error
        trace(f"  -> {result!r}")
        return result

    impls = getattr(pm.hook, kind.hook).get_hookimpls()  # registration order
    if any(is_wrapper(impl) for impl in impls):  # run around the others, as pluggy does
        yield from wrapped_results(impls, kind.hook, call, fail)
        return
    for impl in impls:
        yield impl.plugin_name, call(impl)


class Registry:
    """What the plugins provide, indexed for lookup.

    Use :meth:`collect` to build one from a plugin manager; the plugin manager caches
    it as ``pm.registry``. One table per :data:`HOOK_KINDS` row, keyed by record name
    (by optimizer class for optimizers).
    """

    def __init__(self) -> None:
        self.tables: dict[str, dict[Any, Provided[Any]]] = {
            kind.table: {} for kind in HOOK_KINDS
        }

    @property
    def optimizers(self) -> dict[type, Provided[OptimizerRecord]]:
        """Optimizer class -> the record serving it."""
        return self.tables["optimizers"]

    @property
    def comm_hooks(self) -> dict[str, Provided[CommHookRecord]]:
        """Comm hook name -> record."""
        return self.tables["comm_hooks"]

    @property
    def averagers(self) -> dict[str, Provided[AveragerRecord]]:
        """Averager name -> record."""
        return self.tables["averagers"]

    @property
    def load_planners(self) -> dict[str, Provided[LoadPlannerRecord]]:
        """Load planner name -> record."""
        return self.tables["load_planners"]

    @classmethod
    def collect(cls, pm: pluggy.PluginManager) -> Registry:
        """Call every hook of every plugin once and index the records.

        :raises PluginValidationError: a plugin returned something that is not a record,
            or its hook raised.
        :raises PluginConflictError: two plugins provide the same name or class.
        """
        registry = cls()
        for kind in HOOK_KINDS:
            for plugin, returned in _calls_per_plugin(pm, kind):
                for record in _as_records(plugin, kind, returned):
                    registry._add(kind, Provided(plugin, record))
        return registry

    def _add(self, kind: HookKind, provided: Provided[Any]) -> None:
        table = self.tables[kind.table]
        key = kind.key(provided.record)
        if key in table and table[key].plugin == provided.plugin:
            raise PluginConflictError(
                f"plugin {provided.plugin!r} returns two {kind.label}s named "
                f"{provided.record.name!r} from its {kind.hook}(); return each "
                f"{kind.label} once (rename one), or block the plugin with "
                f"OVERLAPKIT_DISABLE_PLUGINS={provided.plugin}."
            )
        if key in table:
            first = table[key].plugin
            # never suggest blocking a built-in: that takes its other records away too
            blockable = [p for p in (first, provided.plugin) if not p.startswith("overlapkit.")]
            fix = (f"block the other with OVERLAPKIT_DISABLE_PLUGINS={blockable[-1]}"
                   if blockable else "report this as an overlapkit bug")
            raise PluginConflictError(
                f"{kind.label} {provided.record.name!r} is provided by two plugins: "
                f"{first!r} and {provided.plugin!r}. Rename the {kind.label} in your "
                f"plugin, uninstall one of them, or {fix}."
            )
        table[key] = provided

    # -- lookups --------------------------------------------------------------------

    def optimizer_spec(self, optim_cls: type) -> OptimizerRecord:
        """The spec of the most specific class in ``optim_cls``'s MRO that has one.

        :raises UnsupportedOptimizerError: ``optim_cls`` is not an optimizer class, or
            no plugin serves any class in its MRO.
        """
        return self.optimizer_provider(optim_cls).record

    def optimizer_provider(self, optim_cls: type) -> Provided[OptimizerRecord]:
        """Like :meth:`optimizer_spec`, with the name of the providing plugin."""
        import torch

        if not (isinstance(optim_cls, type) and issubclass(optim_cls, torch.optim.Optimizer)):
            raise UnsupportedOptimizerError(
                f"{optim_cls!r} is not a torch.optim.Optimizer subclass; pass the "
                "optimizer class itself (e.g. torch.optim.AdamW), not an instance."
            )
        for klass in optim_cls.__mro__:
            if klass in self.optimizers:
                return self.optimizers[klass]
        raise UnsupportedOptimizerError(
            f"no plugin provides an overlapped implementation for {optim_cls.__qualname__} "
            "or any of its base classes; install or unblock a plugin that does "
            "(the built-in 'overlapkit.overlap' serves every torch.optim.Optimizer)."
        )

    def comm_hook(self, name: str) -> CommHookRecord:
        """The comm hook called ``name``. :raises UnknownNameError: listing valid names."""
        return _by_name(self.comm_hooks, "comm hook", name)

    def averager(self, name: str) -> AveragerRecord:
        """The averager called ``name``. :raises UnknownNameError: listing valid names."""
        return _by_name(self.averagers, "averager", name)

    def load_planner(self, name: str) -> LoadPlannerRecord:
        """The load planner called ``name``. :raises UnknownNameError: listing valid names."""
        return _by_name(self.load_planners, "load planner", name)

    def load_planners_by_priority(self) -> list[LoadPlannerRecord]:
        """Every load planner, highest ``priority`` first (ties by name)."""
        specs = [p.record for p in self.load_planners.values()]
        return sorted(specs, key=lambda s: (-s.priority, s.name))

    def provided_by(self, plugin: str) -> dict[str, list[str]]:
        """What ``plugin`` provides: record kind -> names, for listings."""
        out: dict[str, list[str]] = {}
        for kind in HOOK_KINDS:
            names = sorted(p.record.name for p in self.tables[kind.table].values()
                           if p.plugin == plugin)
            if names:
                out[kind.table] = names
        return out


def _by_name(table: dict[str, Provided[R]], kind: str, name: str) -> R:
    if not isinstance(name, str):
        raise UnknownNameError(kind, repr(name), list(table))
    key = normalize_name(name)
    if key not in table:
        raise UnknownNameError(kind, name, list(table))
    return table[key].record
