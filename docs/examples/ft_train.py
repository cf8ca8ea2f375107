"""One replica group of a fault-tolerant local-SGD run (docs/fault_tolerance.rst).

    torchft_lighthouse --min_replicas 1 --heartbeat_timeout_ms 1000 &
    REPLICA_ID=0 TORCHFT_LIGHTHOUSE=http://localhost:29510 \\
        torchrun --nproc_per_node 1 --master_port 29600 docs/examples/ft_train.py
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torchft

import overlapkit.ft

PERIOD, ROUNDS = 20, int(os.environ.get("ROUNDS", "200"))
replica = int(os.environ["REPLICA_ID"])

torch.manual_seed(0)  # every replica group starts from the same weights (init_sync=False)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
manager = torchft.Manager(
    pg=torchft.ProcessGroupGloo(), min_replica_size=1, use_async_quorum=False,
    init_sync=False, load_state_dict=None, state_dict=None,
    replica_id=f"replica_{replica}", timeout=timedelta(seconds=30),
)
optim = overlapkit.ft.local_sgd(manager, model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                period=PERIOD, warmup_steps=PERIOD - 1)
data = torch.Generator().manual_seed(replica)
while manager.current_step() < ROUNDS:
    x, y = torch.randn(64, 32, generator=data), torch.randint(0, 10, (64,), generator=data)
    optim.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    if optim.averager.step % PERIOD == 0:
        print(f"replica {replica}: round {manager.current_step()}, "
              f"{manager.num_participants()} replica groups, loss {loss.item():.3f}", flush=True)
manager.shutdown()
