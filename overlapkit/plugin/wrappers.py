"""Hook wrappers (``@hookimpl(wrapper=True)`` and ``@hookimpl(hookwrapper=True)``) in
the registry's per-plugin collection.

The registry calls each plugin's hook function separately (:mod:`.registry`), so that
every record is attributed to the plugin that returned it. A wrapper is a generator
that pluggy runs around the other implementations and that may change their combined
result (drop a record, add its own, replace a built-in's). Called directly it only
returns a generator; at ``cdd1705`` that was refused as a plugin returning "a generator
object, expected … records", which is not what the plugin did.

:func:`wrapped_results` runs the wrappers as pluggy does (innermost first, around the
list of the other implementations' non-None results, in pluggy's call order) and then
attributes each record of the final result: to the plugin whose plain implementation
returned that very object, else to the innermost wrapper whose result first held it.
Runs once per registry build, at set-up; nothing here runs per step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import pluggy

__all__ = ["is_wrapper", "wrapped_results"]


def is_wrapper(impl: Any) -> bool:
    """Whether ``impl`` (a pluggy ``HookImpl``) wraps the other implementations."""
    return bool(getattr(impl, "wrapper", False) or getattr(impl, "hookwrapper", False))


def _members(returned: Any) -> list[Any]:
    """The objects one implementation's result stands for (a record, or an iterable
    of them: a generator's were listed as it was called)."""
    if returned is None:
        return []
    if (isinstance(returned, Iterable) and not isinstance(returned, (str, bytes, Mapping))):
        return list(returned)
    return [returned]


def _run_wrapper(impl: Any, hook: str, inner: list[Any],
                 fail: Callable[[str, str, BaseException | None], Exception]) -> Any:
    """Run one wrapper around ``inner`` (the result so far) as pluggy does; its result."""
    name = impl.plugin_name
    try:
        gen = impl.function()
        next(gen)
    except StopIteration:
        raise fail(name, f"its {hook}() wrapper did not yield; a wrapper yields "
                         "exactly once (see pluggy's hook wrappers)", None) from None
    except Exception as error:
        raise fail(name, f"its {hook}() wrapper raised {type(error).__name__}: {error}",
                   error) from error
    outcome: Any = pluggy.Result(inner, None) if impl.hookwrapper else inner
    try:
        gen.send(outcome)
    except StopIteration as stop:
        result = stop.value if impl.wrapper else outcome.get_result()
    except Exception as error:
        raise fail(name, f"its {hook}() wrapper raised {type(error).__name__}: {error}",
                   error) from error
    else:
        gen.close()
        raise fail(name, f"its {hook}() wrapper yielded twice; a wrapper yields exactly "
                         "once (see pluggy's hook wrappers)", None)
    if not isinstance(result, list):
        raise fail(name, f"its {hook}() wrapper returned {result!r}; a wrapper returns "
                         "the list it was sent (changed or not), as pluggy's wrappers "
                         "do: one entry per implementation, each a record, a sequence "
                         "of records or None", None)
    return result


def wrapped_results(impls: Sequence[Any], hook: str,
                    call: Callable[[Any], Any],
                    fail: Callable[[str, str, BaseException | None], Exception],
                    ) -> Iterator[tuple[str, Any]]:
    """(plugin name, result) pairs for the records of ``hook`` once its wrappers ran.

    :param impls: the hook's implementations as ``get_hookimpls()`` lists them
        (registration order, wrappers last).
    :param call: calls one plain implementation (the registry's, which names a plugin
        that raised).
    :param fail: builds the error naming a plugin, given its name, what it did and the
        error it raised (if any).
    """
    plain = [impl for impl in impls if not is_wrapper(impl)]
    wrappers = [impl for impl in impls if is_wrapper(impl)]
    owner: dict[int, str] = {}
    keep: list[Any] = []  # the objects whose ids are in ``owner``, kept alive
    results: list[Any] = []
    for impl in reversed(plain):  # pluggy's call order: last registered first
        returned = call(impl)
        if returned is None:
            continue
        results.append(returned)
        for member in [returned, *_members(returned)]:
            owner.setdefault(id(member), impl.plugin_name)
            keep.append(member)
    for impl in wrappers:  # innermost first: pluggy enters the last one listed first
        results = _run_wrapper(impl, hook, results, fail)
        for returned in results:
            for member in [returned, *_members(returned)]:
                if id(member) not in owner:
                    owner[id(member)] = impl.plugin_name
                    keep.append(member)
    # pluggy's order is the reverse of registration; the registry's is registration's
    for returned in reversed(results):
        if returned is None:
            continue
        by_plugin: dict[str, list[Any]] = {}
        for member in _members(returned):
            by_plugin.setdefault(owner.get(id(member), owner.get(id(returned), "?")),
                                 []).append(member)
        yield from by_plugin.items()
