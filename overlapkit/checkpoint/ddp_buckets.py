"""DDP's gradient buckets, laid out by a resumed run as the uninterrupted run lays them.

DDP reduces gradients bucket by bucket, and on three ranks or more where an element
sits in its bucket decides the order in which the ranks' values are added (gloo's ring
adds each chunk of the buffer starting from another rank; NCCL's likewise). DDP lays
its buckets out twice: when it is built, in reverse registration order; then once,
at the second forward, in the order in which the first backward produced the
gradients. So the first step after a resume, in the first layout, adds some elements
in another order than the uninterrupted run did in the second one, and the resumed
run ends a few ulps away from it (measured on torch 2.13, the README script on four
ranks: 3e-8, with plain DDP alike).

So :func:`~overlapkit.checkpoint.save` records the second layout in the checkpoint
(the parameters' names, bucket by bucket: as overlapkit's comm hook saw them, or as
DDP gives them for a model without a comm hook or with a stateless one), and
:func:`~overlapkit.checkpoint.load`, into a DDP model that has not laid its buckets
out again yet, replays it: one backward through DDP's reducer in which the parameters
are marked ready in that order, without gradients (overlapkit's comm hook reduces and
steps nothing in it; DDP's own allreduce, or a stateless comm hook such as torch's
``allreduce_hook``, reduces zeros), then DDP's own rebuild from that order. The
resumed run then ends bitwise where the uninterrupted one ends, plain or overlapped.
Gradients are as they were before the load.

Where DDP does not rebuild its buckets (``find_unused_parameters``), where its first
backward is special (``static_graph``, ``mixed_precision``, torch's in-backward
optimizers, sparse gradients) or another library's comm hook would see the replay,
the layout is left to DDP, as without this.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

__all__ = ["LAYOUT_FILE", "KeepsBucketLayout", "read_layout", "replay_layout", "write_layout"]

#: the file holding the bucket layout inside a checkpoint directory
LAYOUT_FILE = ".overlapkit-ddp-buckets.json"


class KeepsBucketLayout(Protocol):
    """What a DDP comm hook's state offers for its layout to be saved and replayed
    (overlapkit's bucket stepper does; this module imports no technique)."""

    #: DDP's parameters bucket by bucket since it rebuilt its buckets, or None
    rebuilt_layout: list[list[torch.Tensor]] | None
    #: whether the hook still notes each bucket's parameters
    recording_layout: bool
    #: set during the replay: the hook must reduce and step nothing
    replaying: bool


def _stepper(model: DistributedDataParallel) -> KeepsBucketLayout | None:
    """The state of ``model``'s comm hook where it keeps the bucket layout, or None."""
    for _, state in getattr(model, "_comm_hooks", ()):
        state = getattr(state, "stepper", state)  # overlapkit's CommHookSlot
        if all(hasattr(state, name) for name in
               ("rebuilt_layout", "recording_layout", "replaying")):
            return cast(KeepsBucketLayout, state)
    return None


#: comm hooks that keep no state and reduce each bucket as it is (module, name): the
#: replay may run them (they reduce zeros)
_STATELESS_HOOKS = frozenset({
    ("torch.distributed.algorithms.ddp_comm_hooks.default_hooks", "allreduce_hook"),
    ("torch.distributed.algorithms.ddp_comm_hooks.default_hooks", "fp16_compress_hook"),
    ("torch.distributed.algorithms.ddp_comm_hooks.default_hooks", "bf16_compress_hook"),
    ("overlapkit.comm_hooks", "allreduce_hook"),
})


def _only_stateless_hooks(model: DistributedDataParallel) -> bool:
    """Whether every comm hook registered on ``model`` (none included) is one of
    :data:`_STATELESS_HOOKS`."""
    return all((getattr(hook, "__module__", None), getattr(hook, "__name__", None))
               in _STATELESS_HOOKS for hook, _ in getattr(model, "_comm_hooks", ()))


def _names(model: DistributedDataParallel) -> dict[int, str]:
    return {id(param): name for name, param in model.module.named_parameters()}


def write_layout(directory: Path, model: torch.nn.Module) -> None:
    """Record ``model``'s rebuilt bucket layout in the checkpoint being saved (rank 0,
    before the manifest), where it is known: a DDP model whose comm hook keeps it
    (overlapkit's, once it has run a backward since DDP rebuilt its buckets), or one
    without a comm hook, or with a stateless one (torch's ``allreduce_hook``), whose
    buckets DDP has rebuilt (read from DDP, see :func:`_reducer_layout`)."""
    if not isinstance(model, DistributedDataParallel):
        return
    stepper = _stepper(model)
    if stepper is not None:
        layout = stepper.rebuilt_layout
    elif _only_stateless_hooks(model):
        layout = _reducer_layout(model)
    else:
        return  # another library's comm hook: the layout is not replayed anyway
    if not layout:
        return
    names = _names(model)
    buckets = [[names[id(param)] for param in bucket] for bucket in layout]
    (directory / LAYOUT_FILE).write_text(json.dumps({"version": 1, "buckets": buckets}))


def _reducer_layout(model: DistributedDataParallel) -> list[list[torch.Tensor]] | None:
    """The layout of a DDP model that has rebuilt its buckets, as DDP gives it: with a
    zero-filled copy of every bucket (torch 2.13 has no other way), freed at once.
    Skipped where that copy would not fit beside what the accelerator holds."""
    if not getattr(model, "_has_rebuilt_buckets", False):
        return None
    params = [param for param in model.parameters() if param.requires_grad]
    if not params:
        return None
    device = params[0].device
    if device.type == "cuda":
        needed = sum(param.numel() * param.element_size() for param in params)
        free, _ = torch.cuda.mem_get_info(device)
        if free < 2 * needed:
            return None
    buckets = model.reducer._get_zeros_like_grad_buckets()
    return [list(bucket.parameters()) for bucket in buckets]


def read_layout(directory: Path) -> list[list[str]] | None:
    """The bucket layout saved with the checkpoint at ``directory`` (verified against
    its manifest), or None: none was saved, or it is not one this version reads."""
    file = directory / LAYOUT_FILE
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
        buckets = data["buckets"] if data.get("version") == 1 else None
    except (OSError, ValueError, AttributeError, KeyError):
        return None
    if not isinstance(buckets, list) or not all(
            isinstance(bucket, list) and all(isinstance(name, str) for name in bucket)
            for bucket in buckets):
        return None
    return buckets


def _why_not_replayed(model: DistributedDataParallel) -> str | None:
    """Why DDP's own layout is kept on ``model``, or None where it can be replayed."""
    if getattr(model, "_has_rebuilt_buckets", True):
        return "DDP has laid its buckets out already"
    if model.find_unused_parameters or model.static_graph:
        return "DDP does not rebuild its buckets, or its first backward is special"
    if getattr(model, "mixed_precision", None) is not None \
            or getattr(model, "_use_python_reducer", False) \
            or getattr(model, "_delay_all_reduce_all_params", False):
        return "DDP reduces this model's gradients its own way"
    if not model.require_backward_grad_sync:
        return "inside no_sync()"
    if torch.is_inference_mode_enabled():
        return "inside torch.inference_mode()"
    if _stepper(model) is None and not _only_stateless_hooks(model):
        return "another library's comm hook would see the replay"
    if any(getattr(module, "sparse", False) is True for module in model.module.modules()):
        return "sparse gradients (a sparse nn.Embedding) are not replayed"
    if any(hasattr(param, "_in_backward_optimizers") for param in model.parameters()):
        return "torch's in-backward optimizers would step in the backward of zeros"
    return None


def _agreed(model: DistributedDataParallel, replay: bool) -> bool:
    """Whether every rank of ``model``'s group replays (a collective)."""
    if not dist.is_initialized():
        return replay
    flag = torch.tensor([1 if replay else 0], dtype=torch.int32)
    backend = dist.get_backend(model.process_group)
    if backend == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=model.process_group)
    return bool(flag.item())


def replay_layout(directory: Path, model: torch.nn.Module) -> bool:
    """Lay ``model``'s DDP buckets out as the saved layout at ``directory`` says, where
    one was saved and DDP has not rebuilt its buckets yet (see the module's
    docstring). Call on every rank after the load. Returns whether it was replayed.
    """
    if not isinstance(model, DistributedDataParallel):
        return False
    saved = read_layout(directory)
    params = {name: param for name, param in model.module.named_parameters()}
    reduced = {id(param) for param in DistributedDataParallel._get_data_parallel_params(
        model.module) if param.requires_grad}
    order = [] if saved is None else [name for bucket in saved for name in bucket]
    usable = (saved is not None and _why_not_replayed(model) is None
              and len(set(order)) == len(order) == len(reduced)
              and all(name in params and id(params[name]) in reduced for name in order))
    if not _agreed(model, usable):
        return False
    assert saved is not None
    if model.reducer._rebuild_buckets():
        # a backward since DDP was built already gave DDP its own order: taken
        model._has_rebuilt_buckets = True
        return False
    _backward_of_zeros(model, [params[name] for name in order])
    if not model.reducer._rebuild_buckets():
        return False
    model._has_rebuilt_buckets = True
    stepper = _stepper(model)
    if stepper is not None:
        stepper.rebuilt_layout = [[params[name] for name in bucket] for bucket in saved]
        stepper.recording_layout = False
    return True


class _NoGradient(torch.autograd.Function):
    """``after`` passed through, with ``param`` as an input whose gradient is None: its
    accumulation node runs (DDP's hook on it included) without a gradient to write."""

    @staticmethod
    def forward(ctx: Any, after: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        return after.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _accumulation_node(param: torch.Tensor) -> Any:
    """The node that accumulates ``param``'s gradient (DDP's hook is on it)."""
    view = param.view_as(param)
    assert view.grad_fn is not None  # a leaf that requires grad, under enable_grad
    return view.grad_fn.next_functions[0][0]


def _backward_of_zeros(model: DistributedDataParallel, order: list[torch.Tensor]) -> None:
    """One backward through DDP's reducer in which the parameters of ``order`` are
    marked ready in that order, none with a gradient (DDP zeroes its part of the
    bucket), and nothing is stepped; ``.grad`` is put back after. Costs a pass over
    the buckets (zeroed, and copied out into ``.grad`` by DDP's finalize unless the
    gradients are bucket views) and DDP's rebuild, at load only: 0.64 s on a
    50 M-parameter model, 2 ranks on 2 cores, less than one training step
    (``benchmarks/resume_layout.py``)."""
    kept = [(param, param.grad) for param in order]
    for param in order:
        param.grad = None
    arrived: list[int] = []
    # a hook on each accumulation node (where DDP's own is) sees the order it runs in
    with torch.enable_grad():  # a load may run under no_grad()
        nodes = [_accumulation_node(param) for param in order]
    handles = [node.register_hook(lambda *_, index=index: arrived.append(index))
               for index, node in enumerate(nodes)]
    stepper = _stepper(model)
    if stepper is not None:
        stepper.replaying = True
    try:
        with torch.enable_grad():
            model.reducer.prepare_for_backward([])
            # autograd runs an accumulation node as soon as it is ready, and of the
            # other ready nodes the latest created first: the last parameter chained
            # arrives first
            total = torch.zeros((), device=order[0].device, requires_grad=True)
            for param in reversed(order):
                total = _NoGradient.apply(total, param)
            total.backward()
    finally:
        if stepper is not None:
            stepper.replaying = False
        for handle in handles:
            handle.remove()
        for param, grad in kept:
            param.grad = grad
    if arrived != list(range(len(order))):
        warnings.warn(
            "overlapkit.checkpoint.load could not replay DDP's gradient bucket layout "
            "(the parameters arrived in another order): the resumed run may end a few "
            "ulps away from an uninterrupted one, as with plain DDP.",
            RuntimeWarning, stacklevel=3)
