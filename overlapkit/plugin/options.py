"""One check of the options a user passes to a plugin's ``build``, before it runs.

Every named record (comm hook, averager, load planner) is built through
``record.create(**options)``, which calls :func:`check_build_options` first: an
unknown or missing option is a :class:`~overlapkit.errors.ConfigurationError` naming
the record and listing what it takes, before ``build`` creates process groups or
allocates anything — never a bare ``TypeError`` from inside the plugin.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from overlapkit.errors import ConfigurationError

__all__ = ["check_build_options"]


def check_build_options(what: str, build: Callable[..., Any],
                        options: Mapping[str, Any]) -> None:
    """Reject options ``build`` does not take, and required ones that are missing.

    :param what: how the message names the record, e.g. ``"averager 'periodic'"``.
    :raises ConfigurationError: naming the unknown or missing options and the accepted ones.
    """
    try:
        signature = inspect.signature(build)
    except (TypeError, ValueError):  # a builtin or C callable: let it check
        return
    params = signature.parameters.values()
    accepted_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    accepted = [p.name for p in params
                if p.kind in (inspect.Parameter.KEYWORD_ONLY,
                              inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    unknown = sorted(set(options) - set(accepted))
    if unknown and not accepted_any:
        raise ConfigurationError(
            f"{what} takes no options {unknown}; its options are {accepted}."
        )
    missing = [p.name for p in params if p.default is inspect.Parameter.empty
               and p.kind in (inspect.Parameter.KEYWORD_ONLY,
                              inspect.Parameter.POSITIONAL_OR_KEYWORD)
               and p.name not in options]
    if missing:
        raise ConfigurationError(f"{what} needs the options {missing}; pass them.")
