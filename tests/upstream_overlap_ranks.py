"""PyTorch's own upstream tests of the code overlapkit replaces, ported to overlapkit's
API with their loops unchanged (the rank side of tests/test_upstream_overlap.py).

From torch 2.13's ``torch/testing/_internal/distributed/distributed_test.py``:

- ``_test_ddp_hook_with_optimizer_parity`` (``DDP._register_fused_optim``): a model
  whose optimizer runs in DDP's comm hook against plain DDP + ``step()``, over
  ``gradient_as_bucket_view``, ``static_graph`` and ``optimize_subset`` (only the first
  parameter), for Adam, AdamW and SGD with upstream's hyperparameters. Its loop is
  backward only (with ``ddp_model.zero_grad()``); ``_register_fused_optim(cls, *args,
  optim_params=p, **kw)`` becomes ``overlapkit.overlap_ddp(ddp, cls, *args, params=p,
  **kw)``. upstream compares with ``assertEqual``'s tolerance; here bitwise.
- ``_test_ddp_apply_optim_in_backward`` (``_apply_optimizer_in_backward`` on DDP): the
  two MLPs (ResNet-50 runs in tests/models), SGD and Adam, both
  ``gradient_as_bucket_view`` settings; its loop checks the parameters and that every
  gradient is None after each backward. ``init_before=True`` (the optimizer applied
  before DDP wraps the model) steps local gradients in overlapkit's reading, so it is
  refused with a clear error at the first forward, before anything changes.

LargeNet is upstream's (``fc1 = Linear(1000, 2000, bias=False)``, ``fc2 = Linear(2000,
500, bias=False)``). CUDA calls are dropped (gloo on CPU).
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import torch
import torch.distributed as dist
from helpers import compare, error_of
from torch import nn

import overlapkit

#: upstream's optimizers and arguments (test_ddp_hook_with_optimizer_parity_*)
PARITY_OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], tuple[Any, ...],
                                   dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, (1e-2,), {"betas": (0.9, 0.99), "eps": 1e-6}),
    "adam": (torch.optim.Adam, (1e-2,), {"betas": (0.9, 0.99), "eps": 1e-6}),
    "sgd": (torch.optim.SGD, (1e-2,), {"momentum": 0.9, "weight_decay": 0.01}),
}


class LargeNet(nn.Module):
    """upstream's LargeNet (torch/testing/_internal/distributed/distributed_test.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(1000, 2000, bias=False)
        self.fc2 = nn.Linear(2000, 500, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x))  # type: ignore[no-any-return]


def parity_cases() -> list[tuple[str, bool, bool, bool]]:
    return list(itertools.product(PARITY_OPTIMIZERS, (True, False), (True, False),
                                  (True, False)))


def hook_with_optimizer_parity(rank: int, optim: str, grad_as_bucket_view: bool,
                               static_graph: bool, optimize_subset: bool,
                               model: nn.Module, inp: torch.Tensor) -> dict[str, Any]:
    """upstream's body, with overlap_ddp for _register_fused_optim."""
    optim_cls, functional_optim_args, functional_optim_kwargs = PARITY_OPTIMIZERS[optim]
    ddp_model_with_optimizer_hook = torch.nn.parallel.DistributedDataParallel(
        copy.deepcopy(model), gradient_as_bucket_view=grad_as_bucket_view,
        static_graph=static_graph)
    ddp_model_with_no_hook = torch.nn.parallel.DistributedDataParallel(
        copy.deepcopy(model), gradient_as_bucket_view=grad_as_bucket_view,
        static_graph=static_graph)
    hook_params: Any = ddp_model_with_optimizer_hook.parameters()
    no_hook_params: Any = ddp_model_with_no_hook.parameters()
    if optimize_subset:
        hook_params = [next(iter(hook_params))]
        no_hook_params = [next(iter(no_hook_params))]
    overlapkit.overlap_ddp(ddp_model_with_optimizer_hook, optim_cls, *functional_optim_args,
                           params=hook_params, **functional_optim_kwargs)
    optimizer_no_hook = optim_cls(no_hook_params, *functional_optim_args,
                                  **functional_optim_kwargs)
    initially = compare(list(ddp_model_with_no_hook.parameters()),
                        list(ddp_model_with_optimizer_hook.parameters()))
    opt_hook_init_params = copy.deepcopy(list(ddp_model_with_optimizer_hook.parameters()))
    # Run optimizer with hook model.
    for _ in range(6):
        ddp_model_with_optimizer_hook.zero_grad()
        out = ddp_model_with_optimizer_hook(inp)
        loss = out.sum()
        loss.backward()
    dist.barrier()
    # Run regular model.
    for _ in range(6):
        ddp_model_with_no_hook.zero_grad()
        out = ddp_model_with_no_hook(inp)
        loss = out.sum()
        loss.backward()
        optimizer_no_hook.step()
    dist.barrier()
    hooked = list(ddp_model_with_optimizer_hook.parameters())
    result = {"initially": initially,
              "equal": compare([p.detach() for p in ddp_model_with_no_hook.parameters()],
                               [p.detach() for p in hooked])}
    if optimize_subset:
        result["first moved"] = not torch.equal(opt_hook_init_params[0], hooked[0])
        result["others untouched"] = compare(opt_hook_init_params[1:],
                                             [p.detach() for p in hooked[1:]])
    else:
        result["first moved"] = not compare(opt_hook_init_params,
                                            [p.detach() for p in hooked])
        result["others untouched"] = compare([], [])
    return result


def apply_optim_in_backward_cases() -> list[tuple[str, bool, bool]]:
    """(optimizer, init_before, gradient_as_bucket_view): upstream's
    test_ddp_apply_optim_in_backward (SGD and Adam, lr 0.03) and its
    _grad_as_bucket_view_false variant (SGD)."""
    return [(optim, init_before, True) for optim in ("SGD", "Adam")
            for init_before in (True, False)] + \
           [("SGD", init_before, False) for init_before in (True, False)]


def ddp_apply_optim_in_backward(rank: int, optim_name: str, init_before: bool,
                                gradient_as_bucket_view: bool,
                                models: list[tuple[nn.Module, tuple[int, ...]]] | None = None,
                                ) -> dict[str, Any]:
    """upstream's body, with overlapkit.optimizer_in_backward for
    _apply_optimizer_in_backward.

    :param models: (model, input shape) pairs; default upstream's two MLPs.
    """
    optim_cls = getattr(torch.optim, optim_name)
    optim_kwargs = {"lr": 0.03}
    torch.manual_seed(rank)
    models_to_test = models if models is not None else [
        (nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)), (10, 3)),
        # run model of at least 1M parameters to hit potential race conditions in
        # stream semantics
        (nn.Sequential(nn.Linear(3, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 3)),
         (10, 3)),
    ]
    results: dict[str, Any] = {}
    for j, (model, shape) in enumerate(models_to_test):
        model_optim_in_bwd = copy.deepcopy(model)
        model = nn.parallel.DistributedDataParallel(
            model, gradient_as_bucket_view=gradient_as_bucket_view)
        optim = optim_cls(model.parameters(), **optim_kwargs)
        if init_before:
            overlapkit.optimizer_in_backward(model_optim_in_bwd, optim_cls, **optim_kwargs)
        model_optim_in_bwd = nn.parallel.DistributedDataParallel(
            model_optim_in_bwd, gradient_as_bucket_view=gradient_as_bucket_view)
        if not init_before:
            overlapkit.optimizer_in_backward(model_optim_in_bwd, optim_cls, **optim_kwargs)
        equal, grads_none = [], []
        initially = compare(list(model.parameters()), list(model_optim_in_bwd.parameters()))
        for _ in range(8):
            inp = torch.randn(*shape)
            model(inp).sum().backward()
            optim.step()
            if init_before:
                before = [p.detach().clone() for p in model_optim_in_bwd.parameters()]
                error = error_of(lambda m=model_optim_in_bwd, x=inp: m(x).sum().backward())
                results[f"model {j}"] = {
                    "error": error,
                    "unchanged": compare(before, [p.detach() for p in
                                                  model_optim_in_bwd.parameters()])}
                break
            model_optim_in_bwd(inp).sum().backward()  # runs optimizer as well
            # upstream's assertEqual counts NaNs in the same places as equal: SGD at lr
            # 0.03 on the sum of the 1M-parameter model's outputs diverges by step 8
            equal.append(compare([p.detach() for p in model.parameters()],
                                 [p.detach() for p in model_optim_in_bwd.parameters()],
                                 equal_nan=True))
            grads_none.append(all(p.grad is None for p in model_optim_in_bwd.parameters()))
            # set_to_none for regular optimizer to match in backward case.
            optim.zero_grad(set_to_none=True)
        else:
            results[f"model {j}"] = {"initially": initially, "equal": equal,
                                     "grads none": grads_none}
        dist.barrier()
    return results


def run(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    torch.manual_seed(rank)  # as upstream: DDP broadcasts rank 0's weights
    model, inp = LargeNet(), torch.randn(1, 1000)
    for case in parity_cases():
        out["parity " + " ".join(map(str, case))] = hook_with_optimizer_parity(
            rank, *case, model=model, inp=inp)
    for case in apply_optim_in_backward_cases():
        out["apply " + " ".join(map(str, case))] = ddp_apply_optim_in_backward(rank, *case)
    return out
