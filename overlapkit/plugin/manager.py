"""The plugin manager: built-in plugins, entry points, blocking, tracing, listing.

Reads top to bottom in the order things happen when overlapkit first needs its
plugins:

1. the block list is read from ``OVERLAPKIT_DISABLE_PLUGINS`` (comma-separated plugin
   names; built-ins can be blocked too, so a plugin can replace one);
2. the built-in plugins are registered;
3. unless ``OVERLAPKIT_DISABLE_PLUGIN_AUTOLOAD`` is set, every entry point of the
   ``overlapkit`` group is imported and registered under the entry point's name. One
   that fails to import raises :class:`~overlapkit.errors.PluginLoadError`: a rank
   that silently skipped a plugin would hang the others in a collective;
4. ``check_pending()`` rejects hook functions whose names look like hooks but match
   none (a typo in ``overlapkit_register_*`` would otherwise be ignored);
5. with ``OVERLAPKIT_TRACE_PLUGINS`` set, every hook call is traced to stderr.

The registry of records is built from the hooks on first use and cached; registering
or unregistering a plugin drops the cache.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterable
from typing import Any

import attrs
import pluggy

try:  # the backport selects entry points the same way on every Python overlapkit supports
    import importlib_metadata
except ImportError:  # pragma: no cover - a bare machine (a GPU host) has the stdlib's
    import importlib.metadata as importlib_metadata  # type: ignore[no-redef]

from overlapkit.errors import PluginConflictError, PluginLoadError, PluginValidationError
from overlapkit.plugin import hookspecs
from overlapkit.plugin.registry import Registry

__all__ = [
    "BUILTIN_PLUGINS",
    "ENTRY_POINT_GROUP",
    "OverlapkitPluginManager",
    "PluginInfo",
    "create_plugin_manager",
    "get_plugin_manager",
    "list_plugins",
    "set_plugin_manager",
]

ENTRY_POINT_GROUP = "overlapkit"

#: plugin name -> module, registered in this order before any entry point
BUILTIN_PLUGINS: dict[str, str] = {
    "overlapkit.comm_hooks": "overlapkit.comm_hooks",
    "overlapkit.overlap": "overlapkit.overlap.plugin",
    "overlapkit.local_sgd": "overlapkit.local_sgd.plugin",
    "overlapkit.checkpoint": "overlapkit.checkpoint.plugin",
}

#: built-in plugin name -> the public techniques it serves (what users call, beside
#: the records it registers)
BUILTIN_TECHNIQUES: dict[str, tuple[str, ...]] = {
    "overlapkit.overlap": ("overlap_ddp", "optimizer_in_backward"),
    "overlapkit.local_sgd": ("post_local_sgd",),
    "overlapkit.checkpoint": ("checkpoint",),
}

ENV_DISABLE_AUTOLOAD = "OVERLAPKIT_DISABLE_PLUGIN_AUTOLOAD"
ENV_DISABLE_PLUGINS = "OVERLAPKIT_DISABLE_PLUGINS"
ENV_TRACE = "OVERLAPKIT_TRACE_PLUGINS"

_FALSE = {"", "0", "false", "no", "off"}


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in _FALSE


def _env_list(name: str) -> list[str]:
    return [part.strip() for part in os.environ.get(name, "").split(",") if part.strip()]


@attrs.frozen(kw_only=True)
class PluginInfo:
    """One plugin as ``overlapkit plugins`` shows it."""

    name: str
    #: ``builtin`` or ``entry point``
    source: str
    #: ``active``, ``blocked``, or ``not loaded`` (autoload disabled)
    status: str
    distribution: str | None = None
    version: str | None = None
    #: the entry point's ``module:attr`` or the built-in's module
    target: str = ""
    #: record kind (``optimizers``, ``comm_hooks``, ...) -> names it provides
    provides: dict[str, list[str]] = attrs.field(factory=dict)
    #: the public techniques a built-in serves (``overlap_ddp``, ...); empty for others
    techniques: list[str] = attrs.field(factory=list)

    def to_json(self) -> dict[str, Any]:
        """A plain dict for ``overlapkit plugins --json``."""
        return attrs.asdict(self)


class OverlapkitPluginManager(pluggy.PluginManager):
    """A pluggy plugin manager with overlapkit's hooks, plus what it loaded from where."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT)
        self.add_hookspecs(hookspecs)
        self._registry: Registry | None = None
        self._origins: dict[str, PluginInfo] = {}

    # Any change to the set of plugins invalidates the cached registry.
    def register(self, plugin: Any, name: str | None = None) -> str | None:
        """Register ``plugin``; a name already taken is a PluginConflictError."""
        if name is not None and name in self._name2plugin and not self.is_blocked(name):
            raise PluginConflictError(
                f"two plugins are named {name!r}; rename one of the entry points or "
                f"block one with OVERLAPKIT_DISABLE_PLUGINS={name}."
            )
        earlier = self.get_name(plugin)
        if earlier is not None and name is not None and earlier != name:
            # one module under two entry point names (a renamed one kept): pluggy's bare
            # "ValueError: Plugin already registered under a different name" at 968cf42
            raise PluginConflictError(
                f"the plugin {getattr(plugin, '__name__', plugin)!r} is registered twice, "
                f"as {earlier!r} and as {name!r} (two overlapkit entry points naming one "
                "module); keep one entry point in its pyproject.toml, or block one with "
                f"OVERLAPKIT_DISABLE_PLUGINS={name}."
            )
        try:
            registered = super().register(plugin, name)
        except pluggy.PluginValidationError as exc:
            raise PluginValidationError(
                name or self.get_canonical_name(plugin),
                f"{exc}. overlapkit's hooks take no arguments: define the hook "
                "function with none.",
            ) from exc
        self._registry = None
        return registered

    def unregister(self, plugin: Any = None, name: str | None = None) -> Any:
        self._registry = None
        return super().unregister(plugin, name)

    @property
    def registry(self) -> Registry:
        """Every record the registered plugins provide (built on first use, cached)."""
        if self._registry is None:
            self._registry = Registry.collect(self)
        return self._registry

    # -- loading, in the order it happens ----------------------------------------

    def block(self, names: Iterable[str]) -> None:
        """Block these plugin names: they are neither registered nor imported."""
        for name in names:
            self.set_blocked(name)

    def load_builtins(self) -> None:
        """Register the built-in plugins that are not blocked."""
        for name, module in BUILTIN_PLUGINS.items():
            info = PluginInfo(name=name, source="builtin", status="active", target=module,
                              distribution="overlapkit", version=_own_version(),
                              techniques=list(BUILTIN_TECHNIQUES.get(name, ())))
            if self.is_blocked(name):
                self._origins[name] = attrs.evolve(info, status="blocked")
                continue
            self.register(importlib.import_module(module), name=name)
            self._origins[name] = info

    def load_entry_points(self, *, autoload: bool = True) -> None:
        """Import and register every ``overlapkit`` entry point not blocked.

        With ``autoload=False`` nothing is imported; the entry points are only noted,
        so listings still show what is installed.

        :raises PluginLoadError: an entry point failed to import.
        """
        seen: dict[str, str] = {}
        for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist_name, version = _distribution_of(ep)
            if ep.name in BUILTIN_PLUGINS:
                raise PluginConflictError(
                    f"the entry point {ep.name!r} of distribution {dist_name} {version} "
                    "has the name of a built-in overlapkit plugin. Rename the entry point "
                    f"in {dist_name}'s pyproject.toml ([project.entry-points.overlapkit]), "
                    f"e.g. to {ep.name.rsplit('.', 1)[-1] + '_' + dist_name.replace('-', '_')!r}, "
                    f"or uninstall {dist_name}; the built-in stays as it is."
                )
            if ep.name in seen:
                if seen[ep.name] == dist_name:  # one distribution found twice on sys.path
                    continue
                raise PluginConflictError(
                    f"two installed distributions register an overlapkit plugin named "
                    f"{ep.name!r}: {seen[ep.name]} and {dist_name}; which one is loaded "
                    "would depend on sys.path order (and could differ between nodes). "
                    "Uninstall one of them, or rename the entry point in one; "
                    f"OVERLAPKIT_DISABLE_PLUGINS={ep.name} blocks both."
                )
            seen[ep.name] = dist_name
            info = PluginInfo(name=ep.name, source="entry point", status="active",
                              distribution=dist_name, version=version, target=ep.value)
            if self.is_blocked(ep.name):
                self._origins[ep.name] = attrs.evolve(info, status="blocked")
                continue
            if not autoload:
                self._origins[ep.name] = attrs.evolve(info, status="not loaded")
                continue
            try:
                plugin = ep.load()
            except (Exception, SystemExit) as exc:
                # SystemExit: a module calling sys.exit() as it is imported (a script's
                # module given as the entry point) ended the process with no word, at
                # be7423f: `overlapkit plugins` and every set-up exited with its code
                what = (f"SystemExit({exc.code!r}): the module called sys.exit() (or "
                        "exit()) while being imported; an entry point names a module "
                        "whose import registers hooks, not a script"
                        if isinstance(exc, SystemExit) else f"{type(exc).__name__}: {exc}")
                raise PluginLoadError(
                    f"error importing overlapkit plugin {ep.name!r} (entry point "
                    f"{ep.value!r} of distribution {dist_name} {version}): "
                    f"{what}. Fix or uninstall {dist_name}, or block "
                    f"the plugin with OVERLAPKIT_DISABLE_PLUGINS={ep.name}."
                ) from exc
            self.register(plugin, name=ep.name)
            self._origins[ep.name] = info

    def check_hooks(self) -> None:
        """Reject hook functions that match no hook specification (likely typos)."""
        try:
            self.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginValidationError(
                self.get_name(exc.plugin) or repr(exc.plugin),
                f"{exc} Hook names are listed in `overlapkit.plugin.hookspecs`.",
            ) from exc

    def distribution_of(self, name: str) -> str | None:
        """``"<distribution> <version>"`` of the plugin registered as ``name``, if known."""
        info = self._origins.get(name)
        if info is None or info.distribution is None:
            return None
        return f"{info.distribution} {info.version or ''}".strip()

    def enable_trace(self) -> None:
        """Trace every hook call and its result to stderr."""
        self.trace.root.setwriter(sys.stderr.write)
        self.enable_tracing()

    # -- listing ------------------------------------------------------------------

    def plugin_infos(self) -> list[PluginInfo]:
        """Every known plugin (built-in, installed, or registered by hand), in load order."""
        registry = self.registry
        infos = []
        for name, plugin in self.list_name_plugin():
            if plugin is None:
                continue
            info = self._origins.get(name) or PluginInfo(
                name=name, source="registered", status="active",
                target=getattr(plugin, "__name__", repr(plugin)),
            )
            infos.append(attrs.evolve(info, provides=registry.provided_by(name)))
        registered = {i.name for i in infos}
        infos.extend(i for n, i in self._origins.items() if n not in registered)
        return infos


def _distribution_of(ep: importlib_metadata.EntryPoint) -> tuple[str, str]:
    dist = ep.dist
    if dist is None:
        return "unknown", "unknown"
    return dist.metadata["Name"] or dist.name, dist.version


def _own_version() -> str:
    try:
        return importlib_metadata.version("overlapkit")
    except importlib_metadata.PackageNotFoundError:
        return "unknown"


def create_plugin_manager(
    *,
    autoload: bool | None = None,
    disabled: Iterable[str] | None = None,
    trace: bool | None = None,
) -> OverlapkitPluginManager:
    """Build a plugin manager: block list, built-ins, entry points, checks, tracing.

    Each argument left as ``None`` is read from its environment variable
    (``OVERLAPKIT_DISABLE_PLUGIN_AUTOLOAD``, ``OVERLAPKIT_DISABLE_PLUGINS``,
    ``OVERLAPKIT_TRACE_PLUGINS``).
    """
    if autoload is None:
        autoload = not _env_flag(ENV_DISABLE_AUTOLOAD)
    if disabled is None:
        disabled = _env_list(ENV_DISABLE_PLUGINS)
    if trace is None:
        trace = _env_flag(ENV_TRACE)
    pm = OverlapkitPluginManager()
    if trace:
        pm.enable_trace()
    pm.block(disabled)
    pm.load_builtins()
    pm.load_entry_points(autoload=autoload)
    pm.check_hooks()
    return pm


_current: OverlapkitPluginManager | None = None


def get_plugin_manager() -> OverlapkitPluginManager:
    """The process-wide plugin manager, created from the environment on first use."""
    global _current
    if _current is None:
        _current = create_plugin_manager()
    return _current


def set_plugin_manager(pm: OverlapkitPluginManager | None) -> OverlapkitPluginManager | None:
    """Replace the process-wide plugin manager (``None``: rebuild on next use).

    Returns the previous one so tests can restore it; ``overlapkit.testing``'s
    ``overlapkit_plugin_manager`` fixture does this for you.
    """
    global _current
    previous, _current = _current, pm
    return previous


def list_plugins() -> list[PluginInfo]:
    """Every plugin overlapkit knows of, with its distribution, version, status and
    the records it provides."""
    return get_plugin_manager().plugin_infos()
