"""The registry: every record the plugins provide, checked and resolvable.

Built once from a plugin manager by calling each hook of each plugin separately, so
that every record is attributed to the plugin that returned it: conflicts name both
providers and ``overlapkit plugins`` shows who provides what. Built at set-up and
cached by the plugin manager; nothing here runs per bucket or per step.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
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

if TYPE_CHECKING:
    import pluggy

__all__ = ["HOOK_RECORDS", "Provided", "Registry"]

R = TypeVar("R")

#: hook name -> (record type it returns, what the records are called in messages)
HOOK_RECORDS: dict[str, tuple[type, str]] = {
    "overlapkit_register_optimizers": (OptimizerRecord, "optimizer"),
    "overlapkit_register_comm_hooks": (CommHookRecord, "comm hook"),
    "overlapkit_register_averagers": (AveragerRecord, "averager"),
    "overlapkit_register_load_planners": (LoadPlannerRecord, "load planner"),
}


@attrs.frozen
class Provided(Generic[R]):
    """A record together with the name of the plugin that returned it."""

    plugin: str
    record: R


def _as_records(plugin: str, hook: str, returned: Any) -> list[Any]:
    record_type, _ = HOOK_RECORDS[hook]
    items = [] if returned is None else (
        list(returned) if isinstance(returned, (list, tuple)) else [returned]
    )
    for item in items:
        if not isinstance(item, record_type):
            raise PluginValidationError(
                plugin,
                f"{hook}() returned {item!r}, expected {record_type.__name__} records "
                f"(a single one, a list of them, or None); return "
                f"overlapkit.{record_type.__name__}(...) instead.",
            )
    return items


def _calls_per_plugin(pm: pluggy.PluginManager, hook: str) -> Iterator[tuple[str, Any]]:
    """Call ``hook`` once per implementing plugin, yielding (plugin name, result).

    Goes through ``subset_hook_caller`` rather than calling the functions directly so
    that hook tracing (``OVERLAPKIT_TRACE_PLUGINS``) sees the calls.
    """
    caller = getattr(pm.hook, hook)
    impls = caller.get_hookimpls()
    for impl in impls:  # registration order
        others = [p for p in pm.get_plugins() if p is not impl.plugin]
        yield impl.plugin_name, pm.subset_hook_caller(hook, others)()


class Registry:
    """What the plugins provide, indexed for lookup.

    Use :meth:`collect` to build one from a plugin manager; the plugin manager caches
    it as ``pm.registry``.
    """

    def __init__(self) -> None:
        self.optimizers: dict[type, Provided[OptimizerRecord]] = {}
        self.comm_hooks: dict[str, Provided[CommHookRecord]] = {}
        self.averagers: dict[str, Provided[AveragerRecord]] = {}
        self.load_planners: dict[str, Provided[LoadPlannerRecord]] = {}

    @classmethod
    def collect(cls, pm: pluggy.PluginManager) -> Registry:
        """Call every hook of every plugin and index the records.

        :raises PluginValidationError: a plugin returned something that is not a record.
        :raises PluginConflictError: two plugins provide the same name or class.
        """
        registry = cls()
        for hook in HOOK_RECORDS:
            for plugin, returned in _calls_per_plugin(pm, hook):
                for returned_one in returned:
                    for record in _as_records(plugin, hook, returned_one):
                        registry._add(hook, Provided(plugin, record))
        return registry

    def _add(self, hook: str, provided: Provided[Any]) -> None:
        record = provided.record
        tables: dict[type, dict[Any, Any]] = {
            OptimizerRecord: self.optimizers,
            CommHookRecord: self.comm_hooks,
            AveragerRecord: self.averagers,
            LoadPlannerRecord: self.load_planners,
        }
        table = tables[type(record)]
        key = record.optim_cls if isinstance(record, OptimizerRecord) else record.name
        label = record.name
        if key in table:
            first = table[key].plugin
            kind = HOOK_RECORDS[hook][1]
            raise PluginConflictError(
                f"{kind} {label!r} is provided by two plugins: {first!r} and "
                f"{provided.plugin!r}. Uninstall one of them, or block one with "
                f"OVERLAPKIT_DISABLE_PLUGINS={provided.plugin}."
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
            "(the built-in 'overlapkit.overlap.ddp' serves every torch.optim.Optimizer)."
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
        tables: Iterable[tuple[str, dict[Any, Provided[Any]]]] = (
            ("optimizers", self.optimizers),
            ("comm_hooks", self.comm_hooks),
            ("averagers", self.averagers),
            ("load_planners", self.load_planners),
        )
        for kind, table in tables:
            names = sorted(p.record.name for p in table.values() if p.plugin == plugin)
            if names:
                out[kind] = names
        return out


def _by_name(table: dict[str, Provided[R]], kind: str, name: str) -> R:
    if not isinstance(name, str):
        raise UnknownNameError(kind, repr(name), list(table))
    key = normalize_name(name)
    if key not in table:
        raise UnknownNameError(kind, name, list(table))
    return table[key].record
