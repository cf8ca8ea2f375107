"""The one base class for every overlapkit optimizer that wraps a real one.

``overlap_ddp`` and ``optimizer_in_backward`` return a facade whose steps happen during
backward; ``post_local_sgd`` returns an optimizer that steps a local optimizer and then
averages. Both are :class:`OptimizerWrapper` subclasses: real ``torch.optim.Optimizer``
instances (LR schedulers and ``isinstance`` checks accept them) whose ``param_groups``,
``state`` and ``defaults`` *are* the wrapped optimizer's, read through live, so a
checkpoint has the plain optimizer's format and loads into either.

Code that must reach the real optimizer (checkpoint save and load) calls
:meth:`OptimizerWrapper.unwrap`, or holds :meth:`OptimizerWrapper.quiesced` at every level
while it works, without knowing which technique built the wrapper.

.. versionadded:: 0.2
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

import torch

__all__ = ["OptimizerWrapper", "local_state_params", "meet_for_checkpoint", "unwrapped"]


class OptimizerWrapper(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that takes its steps through one wrapped optimizer.

    Subclasses implement :meth:`step`; everything else reads through to the wrapped
    optimizer: ``param_groups``, ``state``, ``defaults``, ``zero_grad``,
    ``add_param_group``, ``state_dict``, ``load_state_dict`` and the registration of
    step and state-dict hooks (step hooks run around each step of the wrapped optimizer,
    which is where the parameters change).

    :param optimizer: the wrapped optimizer (a real one, or another wrapper).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        # Optimizer.__init__ is not called: it would build param_groups and state of
        # its own, where these are the wrapped optimizer's. Nothing here patches step():
        # step hooks are registered on the wrapped optimizer, whose step is patched.
        self._wrapped = optimizer
        from overlapkit.overlap.core.eager_steps import follow_compile  # (no cycle)

        follow_compile()  # torch.compile in use: step() runs eagerly there (eager_steps)

    # -- what the wrapper wraps ---------------------------------------------------

    @property
    def wrapped(self) -> torch.optim.Optimizer:
        """The optimizer one level down (a real one, or another wrapper)."""
        return self._wrapped

    def unwrap(self) -> torch.optim.Optimizer:
        """The real optimizer at the bottom of the wrappers."""
        inner = self._wrapped
        while isinstance(inner, OptimizerWrapper):
            inner = inner.wrapped
        return inner

    def checkpoint_refusal(self, *, loading: bool = False) -> str | None:
        """Why :mod:`overlapkit.checkpoint` cannot save (or, ``loading``, load) this
        wrapper exactly (it saves the real optimizer's state, one copy of what DDP
        replicates), with what to do instead; None (the default) when it can."""
        return None

    def meet_for_checkpoint(self, *, loading: bool = False) -> None:
        """Called by :mod:`overlapkit.checkpoint` on every level of wrappers before its
        first collective of a save (or, ``loading``, a load), which every rank makes: a
        wrapper whose ranks run collectives of their own can refuse there, at once,
        where some ranks went on training instead (raising an ``OverlapkitError``).
        Nothing by default.

        .. versionadded:: 0.4
        """

    def rewritten_unchanged(self, versions: dict[int, int]) -> None:
        """:mod:`overlapkit.checkpoint` rewrote parameters in place with their own values
        (torch's ``get_state_dict`` creating state with a zero step): ``versions`` maps
        ``id`` of each parameter to its version counter before. Not a change of the
        loop's; nothing to do by default (the overlapped optimizer compares versions)."""

    def local_state_params(self) -> set[int] | None:
        """``id`` of the parameters whose optimizer state this rank keeps, when it keeps
        the state of a share of them only (sharded optimizer state); None (the default)
        when it keeps all of it. :mod:`overlapkit.checkpoint` saves and loads only that
        share on this rank.

        .. versionadded:: 0.3
        """
        return None

    def quiesced(self) -> AbstractContextManager[Any]:
        """Held while code outside the training loop (checkpoint save or load) works on
        the wrapped optimizer directly: nothing this wrapper runs may step it meanwhile.
        The default holds nothing; a wrapper that steps from other threads holds its
        lock."""
        return nullcontext()

    # -- the wrapped optimizer's data, live -------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._wrapped.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.replace_param_groups(groups)

    def replace_param_groups(self, groups: list[dict[str, Any]]) -> None:
        """What ``wrapper.param_groups = groups`` does: give the wrapped optimizer the
        new list. A wrapper that indexes the groups overrides it to re-index."""
        self._wrapped.param_groups = groups

    @property
    def state(self) -> Any:
        return self._wrapped.state

    @state.setter
    def state(self, state: Any) -> None:
        self._wrapped.state = state

    @property
    def defaults(self) -> dict[str, Any]:
        return self._wrapped.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self._wrapped.defaults = defaults

    # -- the Optimizer API, forwarded ---------------------------------------------

    def step(self, closure: Any = None) -> Any:
        raise NotImplementedError(f"{type(self).__qualname__} must implement step()")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._wrapped.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._wrapped.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self._wrapped.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._wrapped.load_state_dict(state_dict)

    def register_step_pre_hook(self, hook: Any) -> Any:
        """Register on the wrapped optimizer: runs before each of its steps."""
        return self._wrapped.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Any) -> Any:
        """Register on the wrapped optimizer: runs after each of its steps."""
        return self._wrapped.register_step_post_hook(hook)

    def register_state_dict_pre_hook(self, hook: Any, prepend: bool = False) -> Any:
        return self._wrapped.register_state_dict_pre_hook(hook, prepend)

    def register_state_dict_post_hook(self, hook: Any, prepend: bool = False) -> Any:
        return self._wrapped.register_state_dict_post_hook(hook, prepend)

    def register_load_state_dict_pre_hook(self, hook: Any, prepend: bool = False) -> Any:
        return self._wrapped.register_load_state_dict_pre_hook(hook, prepend)

    def register_load_state_dict_post_hook(self, hook: Any, prepend: bool = False) -> Any:
        return self._wrapped.register_load_state_dict_post_hook(hook, prepend)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._wrapped!r})"


def meet_for_checkpoint(optimizer: torch.optim.Optimizer, *, loading: bool) -> None:
    """:meth:`OptimizerWrapper.meet_for_checkpoint` of every wrapper level of
    ``optimizer``, outermost first."""
    level: Any = optimizer
    while isinstance(level, OptimizerWrapper):
        level.meet_for_checkpoint(loading=loading)
        level = level.wrapped


def local_state_params(optimizer: torch.optim.Optimizer) -> set[int] | None:
    """What the outermost wrapper of ``optimizer`` that keeps a share of the state says
    (:meth:`OptimizerWrapper.local_state_params`); None for a plain optimizer, or when
    no wrapper keeps a share."""
    while isinstance(optimizer, OptimizerWrapper):
        share = optimizer.local_state_params()
        if share is not None:
            return share
        optimizer = optimizer.wrapped
    return None


def rewritten_unchanged(optimizer: torch.optim.Optimizer | None,
                        versions: dict[int, int]) -> None:
    """Tell every wrapper level of ``optimizer``
    (:meth:`OptimizerWrapper.rewritten_unchanged`)."""
    while isinstance(optimizer, OptimizerWrapper):
        optimizer.rewritten_unchanged(versions)
        optimizer = optimizer.wrapped


@contextmanager
def unwrapped(optimizer: torch.optim.Optimizer) -> Iterator[torch.optim.Optimizer]:
    """The real optimizer behind any wrappers, with every wrapper quiesced meanwhile.

    Checkpoint code works on the real optimizer: a wrapper's ``step()`` is not a plain
    step (the facade's is a no-op after a stepping backward and clears its flag;
    ``PostLocalSGDOptimizer``'s counts an averager step and may average).
    """
    with ExitStack() as held:
        while isinstance(optimizer, OptimizerWrapper):
            held.enter_context(optimizer.quiesced())
            optimizer = optimizer.wrapped
        yield optimizer
