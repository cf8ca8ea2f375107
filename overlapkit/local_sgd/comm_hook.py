"""The post-local-SGD DDP comm hook, and the subgroups it reduces over after warm-up.

During warm-up the hook averages each gradient bucket over the whole process group,
as plain DDP does; afterwards only over the rank's subgroup (usually the ranks of one
node), so no gradient crosses a node boundary and the model averager alone
communicates globally. It is torch's ``post_localSGD_hook`` with the same arithmetic,
plus what torch's lacks:

- its iteration counter is part of a state that saves and loads
  (:meth:`PostLocalSGDHookState.state_dict`), so a resumed run does not run warm-up
  again (pytorch #74556);
- the default subgroup works on CPU: torch's ``PostLocalSGDState(subgroup=None)``
  calls ``dist.new_subgroups()``, which raises without CUDA (measured on torch 2.13);
  here its size comes from the launcher (:func:`default_subgroup_size`);
- a subgroup of one rank does not communicate at all.

Registered as the comm hook ``post_local_sgd`` by the built-in plugin
``overlapkit.local_sgd``, so ``build_comm_hook("post_local_sgd", ...)`` and anything
taking a comm hook name compose with it.
"""

from __future__ import annotations

import os
import typing
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from overlapkit.errors import CheckpointError, ConfigurationError
from overlapkit.local_sgd.averagers import check_warmup_steps
from overlapkit.nodes.lost_ranks import reduced_tensor, watch
from overlapkit.overlap.core.eager_steps import follow_compile

__all__ = [
    "PostLocalSGDHookState",
    "agreed_default_subgroup_size",
    "build_post_local_sgd_hook",
    "default_subgroup_size",
    "new_subgroup",
    "post_local_sgd_hook",
]

F = TypeVar("F", bound=Callable[..., Any])


def resolved_annotations(fn: F) -> F:
    """Give a comm hook real annotation objects instead of strings.

    DDP's ``register_comm_hook`` compares the ``bucket`` and return annotations with
    ``dist.GradBucket`` and ``Future[Tensor]`` by equality; under
    ``from __future__ import annotations`` they are strings and DDP raises
    ``ValueError``, so they are resolved here once.
    """
    fn.__annotations__ = typing.get_type_hints(fn)
    return fn


class PostLocalSGDHookState:
    """The state of :func:`post_local_sgd_hook`: groups, warm-up length and counter.

    :param process_group: the global group (gradients are averaged over it during
        warm-up).
    :param subgroup: the group averaged over after warm-up; ``None`` means each rank
        is its own subgroup (no gradient communication after warm-up).
    :param start_localSGD_iter: warm-up length in iterations (torch's name).
    :param post_local_gradient_allreduce: ``False``: no gradient communication at all
        after warm-up, whatever the subgroup.
    """

    __slots__ = ("iter", "post_local_gradient_allreduce", "process_group",
                 "start_localSGD_iter", "subgroup")

    def __init__(
        self,
        *,
        process_group: dist.ProcessGroup,
        subgroup: dist.ProcessGroup | None,
        start_localSGD_iter: int,
        post_local_gradient_allreduce: bool = True,
    ) -> None:
        self.process_group = process_group
        self.subgroup = subgroup
        self.start_localSGD_iter = start_localSGD_iter
        self.post_local_gradient_allreduce = post_local_gradient_allreduce
        #: backward passes seen so far, counted up to ``start_localSGD_iter`` (the
        #: count stops there, as torch's does).
        self.iter = 0

    @property
    def in_warmup(self) -> bool:
        """Whether the next backward averages gradients globally."""
        return self.iter < self.start_localSGD_iter

    @property
    def current_group(self) -> dist.ProcessGroup | None:
        """The group the next bucket is averaged over (``None``: not communicated)."""
        if self.in_warmup:
            return self.process_group
        return self.subgroup if self.post_local_gradient_allreduce else None

    def state_dict(self) -> dict[str, int]:
        """``{"iter": ..., "start_localSGD_iter": ...}``: what a resumed run needs."""
        return {"iter": self.iter, "start_localSGD_iter": self.start_localSGD_iter}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the iteration counter saved by :meth:`state_dict`.

        :raises CheckpointError: ``iter`` is missing or not a non-negative integer.
        """
        value = state_dict.get("iter")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(
                f"the post-local-SGD comm hook state has no valid 'iter' entry (got "
                f"{value!r}); pass the 'comm_hook' entry of a PostLocalSGDOptimizer "
                "state_dict."
            )
        self.iter = min(value, self.start_localSGD_iter)

    def __repr__(self) -> str:
        return (f"PostLocalSGDHookState(iter={self.iter}, "
                f"start_localSGD_iter={self.start_localSGD_iter})")


def _allreduce_mean(group: dist.ProcessGroup, tensor: torch.Tensor) -> torch.futures.Future[
        torch.Tensor]:
    # Divide first, then sum: torch's allreduce_hook order, so results match bitwise.
    tensor.div_(group.size())
    work = dist.all_reduce(tensor, group=group, async_op=True)
    assert work is not None
    return work.get_future().then(reduced_tensor)


@resolved_annotations
def post_local_sgd_hook(
    state: PostLocalSGDHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` globally during warm-up, within the subgroup afterwards.

    Register it with ``ddp_model.register_comm_hook(state, post_local_sgd_hook)``;
    :func:`build_post_local_sgd_hook` builds both.
    """
    follow_compile()  # a compiled step() of the optimizer over it: eager (eager_steps)
    tensor = bucket.buffer()
    if state.iter < state.start_localSGD_iter:
        if bucket.is_last():
            state.iter += 1
        return _allreduce_mean(state.process_group, tensor)
    if state.subgroup is None or not state.post_local_gradient_allreduce:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(tensor)
        return fut
    return _allreduce_mean(state.subgroup, tensor)


def default_subgroup_size(group_size: int) -> int:
    """The subgroup size used when none is given: one subgroup per node.

    The launcher's ``LOCAL_WORLD_SIZE`` (set by ``torchrun``: the ranks on this node,
    which torchrun numbers consecutively) when set; otherwise 1, with a warning:
    without it overlapkit cannot tell which ranks share a node, and a one-rank
    subgroup is the choice that never communicates across nodes after warm-up.

    :raises ConfigurationError: ``LOCAL_WORLD_SIZE`` is not a divisor of ``group_size``.
    """
    raw = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    if not raw:
        warnings.warn(
            "LOCAL_WORLD_SIZE is not set (not launched by torchrun), so overlapkit cannot "
            "tell which ranks share a node: after warm-up each rank averages gradients with "
            "no one (subgroup size 1). Pass subgroup_size=N to average within groups of N "
            "consecutive ranks instead.", UserWarning, stacklevel=3,
        )
        return 1
    try:
        size = int(raw)
    except ValueError:
        size = 0
    if size < 1 or group_size % size != 0:
        raise ConfigurationError(
            f"LOCAL_WORLD_SIZE={raw!r} is not a divisor of the process group's {group_size} "
            "ranks, so it cannot give one subgroup per node; pass subgroup_size=N with N "
            f"dividing {group_size}."
        )
    return size


def agreed_default_subgroup_size(group: dist.ProcessGroup) -> int:
    """:func:`default_subgroup_size` on every rank of ``group``, checked to be the same
    everywhere (one small ``all_gather_object``; a collective).

    Nodes that run different numbers of ranks (``torchrun --nproc-per-node`` differing
    between nodes) give their ranks different ``LOCAL_WORLD_SIZE`` values: creating
    subgroups of different sizes on different ranks would hang, or fail on some ranks
    only.

    :raises ConfigurationError: on every rank alike, where the ranks' ``LOCAL_WORLD_SIZE``
        differ, or any rank's is not a divisor of the group's size.
    """
    raw = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    size: int | None = None
    error: str | None = None
    try:
        size = default_subgroup_size(group.size())
    except ConfigurationError as exc:
        error = str(exc)
    answers: list[tuple[str, int | None, str | None] | None] = [None] * group.size()
    dist.all_gather_object(answers, (raw, size, error), group=group)
    by_value: dict[str, list[int]] = {}
    for rank, answer in enumerate(answers):
        assert answer is not None
        by_value.setdefault(answer[0] or "unset", []).append(rank)
    if len(by_value) > 1:
        seen = "; ".join(f"{value} on ranks {ranks}" for value, ranks in by_value.items())
        raise ConfigurationError(
            f"the nodes run different numbers of ranks (LOCAL_WORLD_SIZE {seen}), so one "
            "subgroup per node cannot be made of equal groups of consecutive ranks; "
            "launch the same number of ranks on every node (torchrun --nproc-per-node N "
            "on each), or pass subgroup_size=N."
        )
    if error is not None:
        raise ConfigurationError(error)
    refused = [(rank, answer[2]) for rank, answer in enumerate(answers)
               if answer is not None and answer[2] is not None]
    if refused:
        raise ConfigurationError(f"rank {refused[0][0]} refused: {refused[0][1]}")
    assert size is not None
    return size


def check_subgroup_size(size: object, group_size: int) -> int:
    """``size`` as a subgroup size, or a ConfigurationError saying what to pass."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or group_size % size:
        divisors = [d for d in range(1, group_size + 1) if group_size % d == 0]
        raise ConfigurationError(
            f"subgroup_size must divide the process group's {group_size} ranks, got "
            f"{size!r}; use one of {divisors} (usually the number of ranks per node)."
        )
    return size


def new_subgroup(size: int, group: dist.ProcessGroup) -> dist.ProcessGroup | None:
    """This rank's subgroup of ``size`` consecutive ranks of ``group``.

    A collective: every rank of ``group`` must call it, with the same size. Returns
    ``group`` itself when ``size`` is its size and ``None`` for size 1 (no group is
    created for either).
    """
    if size == group.size():
        return group
    if size == 1:
        return None
    subgroup, _ = dist.new_subgroups(group_size=size, group=group)
    return subgroup


_HOOK_OPTIONS = ("start_localSGD_iter", "subgroup", "subgroup_size",
                 "post_local_gradient_allreduce")


def overlapped_hook_state(optim: Any) -> PostLocalSGDHookState | None:
    """The ``post_local_sgd`` comm hook's state of an ``overlap_ddp(...,
    comm_hook="post_local_sgd")`` optimizer (its model's), else None."""
    from overlapkit.overlap.ddp.setup import reduce_hook_state  # it imports the plugins

    state = reduce_hook_state(getattr(optim, "_model", None))
    return state if isinstance(state, PostLocalSGDHookState) else None


def build_post_local_sgd_hook(
    *, process_group: dist.ProcessGroup | None = None, **options: Any
) -> tuple[PostLocalSGDHookState, Callable[..., Any]]:
    """Build ``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``.

    Options: ``start_localSGD_iter`` (required: warm-up iterations of global
    averaging), and at most one of ``subgroup`` (a process group) or
    ``subgroup_size`` (default: :func:`default_subgroup_size`);
    ``post_local_gradient_allreduce`` (default ``True``).

    Creating subgroups is a collective: call it on every rank of ``process_group``.

    :raises ConfigurationError: an unknown or invalid option, or no process group.
    """
    unknown = sorted(set(options) - set(_HOOK_OPTIONS))
    if unknown:
        raise ConfigurationError(
            f"the post_local_sgd comm hook has no options {unknown}; its options are "
            f"{list(_HOOK_OPTIONS)}."
        )
    if "start_localSGD_iter" not in options:
        raise ConfigurationError(
            "the post_local_sgd comm hook needs start_localSGD_iter=N, the number of "
            "iterations of global gradient averaging before local SGD starts; pass the "
            "averager's warmup_steps."
        )
    start = check_warmup_steps(options["start_localSGD_iter"])
    subgroup = options.get("subgroup")
    subgroup_size = options.get("subgroup_size")
    if subgroup is not None and subgroup_size is not None:
        raise ConfigurationError(
            "pass either subgroup= (a process group) or subgroup_size= to the "
            "post_local_sgd comm hook, not both."
        )
    if not dist.is_initialized():
        raise ConfigurationError(
            "the post_local_sgd comm hook needs torch.distributed; call "
            "torch.distributed.init_process_group() first."
        )
    group = process_group if process_group is not None else dist.group.WORLD
    assert group is not None
    if subgroup is not None and not isinstance(subgroup, dist.ProcessGroup):
        raise ConfigurationError(
            f"subgroup must be a torch.distributed.ProcessGroup, got {type(subgroup).__name__}; "
            "pass subgroup_size=N to let overlapkit create the subgroups."
        )
    if subgroup is None:
        size = (agreed_default_subgroup_size(group) if subgroup_size is None
                else check_subgroup_size(subgroup_size, group.size()))
        subgroup = new_subgroup(size, group)
    watch()  # a lost node is then named by the survivors (overlapkit.nodes.lost_ranks)
    state = PostLocalSGDHookState(
        process_group=group,
        subgroup=subgroup,
        start_localSGD_iter=start,
        post_local_gradient_allreduce=bool(options.get("post_local_gradient_allreduce", True)),
    )
    return state, post_local_sgd_hook
