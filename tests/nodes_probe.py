"""Run under torchrun agents by tests/test_nodes.py: post-local SGD's hierarchy taken
from the real launch, against the same groups given explicitly; rank 0 prints one JSON
line (``PROBE {...}``) with what it found."""

from __future__ import annotations

import json
import os

import nodes_ranks  # beside this script: torchrun puts the script's folder on sys.path
import torch
import torch.distributed as dist

import overlapkit


def main() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    model = nodes_ranks.make_ddp()
    opt = overlapkit.post_local_sgd(model, torch.optim.SGD(model.parameters(), lr=0.05),
                                    period=4, warmup_steps=2, averager="hierarchical")
    plan = dict(opt.averager.period_group_size_dict)
    from_launch = nodes_ranks.train(model, opt, rank, 8)
    model = nodes_ranks.make_ddp()
    explicit = overlapkit.post_local_sgd(
        model, torch.optim.SGD(model.parameters(), lr=0.05), period=4, warmup_steps=2,
        averager="hierarchical", subgroup_size=1, period_group_size_dict={1: per_node, 4: world})
    explicit_run = nodes_ranks.train(model, explicit, rank, 8)
    same = all(torch.equal(a, b) for a, b in zip(from_launch, explicit_run, strict=True))
    answers: list[object] = [None] * world
    dist.all_gather_object(answers, {"rank": rank, "plan": {str(k): v for k, v in plan.items()},
                                     "same": same, "last": from_launch[-1].tolist()})
    if rank == 0:
        print("PROBE " + json.dumps(answers), flush=True)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    main()
    dist.destroy_process_group()
