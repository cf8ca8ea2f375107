"""What overlapkit refuses under torchft's ``DistributedDataParallel``, and why.

torchft's DDP (``torchft.ddp.DistributedDataParallel``) reduces gradients through its
``Manager`` and lets the training loop step only when ``manager.should_commit()`` says
every replica group's gradients arrived; a step it drops must leave the parameters
untouched. :func:`overlapkit.overlap_ddp` steps each bucket's parameters *during*
backward, before that decision exists, so a dropped step would already be applied, and
the peer a recovering replica copies from could hold half a step.
:func:`overlapkit.post_local_sgd` registers its own comm hook, where torchft's already
sits. Both are refused before anything changes, naming what to use.

The check reads ``sys.modules``: a model cannot be torchft's DDP unless torchft's
``ddp`` module was imported, so it costs nothing where torchft is not used.
"""

from __future__ import annotations

import sys

from overlapkit.errors import UnsupportedModelError

__all__ = ["refuse_torchft_ddp", "is_torchft_ddp"]

_ALTERNATIVES = {
    "overlap_ddp": (
        "torchft decides whether to commit a step after backward "
        "(manager.should_commit()), but overlap_ddp steps the parameters during backward, "
        "before that decision, so a step torchft drops would be applied anyway. Step a "
        "plain optimizer through torchft.optim.OptimizerWrapper(manager, optim) for "
        "per-step fault tolerance, or use overlapkit.ft.local_sgd(manager, model, optim, "
        "period=...) for local SGD / DiLoCo across replica groups; overlap_ddp is for a "
        "plain torch DistributedDataParallel."
    ),
    "post_local_sgd": (
        "torchft's DDP already averages the gradients over the replica groups through "
        "its own comm hook. For local SGD or DiLoCo across torchft replica groups, give "
        "the plain module (no torchft DDP) to overlapkit.ft.local_sgd(manager, model, "
        "optim, period=...)."
    ),
}


def is_torchft_ddp(model_type: type) -> bool:
    """Whether ``model_type`` is torchft's fault-tolerant ``DistributedDataParallel``
    (or a subclass of it)."""
    module = sys.modules.get("torchft.ddp")
    ddp_cls = getattr(module, "DistributedDataParallel", None)
    return isinstance(ddp_cls, type) and issubclass(model_type, ddp_cls)


def refuse_torchft_ddp(model_type: type, technique: str) -> None:
    """Raise if ``model_type`` (the model's class: set-up follows the model itself
    through one pass) is torchft's DDP, saying why ``technique`` cannot run on it and
    what to use instead.

    :raises UnsupportedModelError: ``model_type`` is ``torchft.ddp.DistributedDataParallel``.
    """
    if is_torchft_ddp(model_type):
        raise UnsupportedModelError(
            f"{technique} cannot run on torchft's fault-tolerant DistributedDataParallel: "
            f"{_ALTERNATIVES.get(technique, _ALTERNATIVES['overlap_ddp'])} Nothing was "
            "changed."
        )
