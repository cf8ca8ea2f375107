"""Sharded optimizer state with the overlapped step (ZeRO-1):
``overlap_ddp(..., shard_optimizer_state=True)``.

Each rank keeps the optimizer state of its share of the parameters, steps that share as
each bucket's reduction completes, and sends the updated parameters to the other ranks
while backward goes on. Split by the question each part answers:

- :mod:`~overlapkit.overlap.sharded.ownership`: who owns what (the sharding policy);
- :mod:`~overlapkit.overlap.sharded.setup`: the checks and the set-up;
- :mod:`~overlapkit.overlap.sharded.stepper`: stepping, then exchanging, per bucket;
- :mod:`~overlapkit.overlap.sharded.agreement`: whether the ranks step with the same
  settings (checked once per step, before anything steps), and whether they all make a
  collective call (gathering, checkpoints) when one does;
- :mod:`~overlapkit.overlap.sharded.grad_agreement`: whether they step with the same
  gradients at a full ``step()`` (set by hand, no backward reducing them);
- :mod:`~overlapkit.overlap.sharded.exchange`: sending the updated parameters;
- :mod:`~overlapkit.overlap.sharded.optimizer`: the ``torch.optim.Optimizer`` users get;
- :mod:`~overlapkit.overlap.sharded.hooks`: the hooks it takes (step hooks refused,
  state-dict hooks handed the optimizer itself);
- :mod:`~overlapkit.overlap.sharded.held_params`: its ``param_groups`` edited by hand;
- :mod:`~overlapkit.overlap.sharded.hook_state`: the comm hook's state (PowerSGD's), each
  rank's own, in ``local_state_dict()``;
- :mod:`~overlapkit.overlap.sharded.share_state`: its ``state``, this rank's share;
- :mod:`~overlapkit.overlap.sharded.state_dicts`: whole and per-rank state dicts;
- :mod:`~overlapkit.overlap.sharded.gather_tag`: what a gathering tells the other ranks
  first (which optimizer, its param groups' order), and the refusal when they differ;
- :mod:`~overlapkit.overlap.sharded.misfit`: whether a state dict fits, before loading;
- :mod:`~overlapkit.overlap.sharded.model_group`: whether the DDP model's process group
  is still registered, before a gathering or a checkpoint;
- :mod:`~overlapkit.overlap.sharded.torch_api`: what it answers torch's
  ``get/set_optimizer_state_dict`` and DCP's ``save`` / ``load`` of it.

The engine, the bucket stepper, global clipping, the GradScaler rules and the loop
conventions are ``overlap_ddp``'s own; ``overlapkit.checkpoint`` saves each rank's share
and reshards to any world size.

.. versionadded:: 0.3
"""

from __future__ import annotations

from overlapkit.overlap.core.eager_steps import run_eagerly_when_compiled
from overlapkit.overlap.sharded.optimizer import ShardedOverlapOptimizer
from overlapkit.overlap.sharded.ownership import (
    Ownership,
    ParamSlot,
    ShardingPolicy,
    SizeBalancedPolicy,
)

__all__ = ["Ownership", "ParamSlot", "ShardedOverlapOptimizer", "ShardingPolicy",
           "SizeBalancedPolicy"]

# called from a torch.compile'd function, step() runs eagerly (core/eager_steps.py)
run_eagerly_when_compiled(ShardedOverlapOptimizer, "step")
