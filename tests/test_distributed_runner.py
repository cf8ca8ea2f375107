"""The multi-process harness every distributed test stands on."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from overlapkit.distributed import RankFailedError, RankTimeoutError, run_distributed


def _sum_of_ranks(rank: int, world_size: int, scale: float) -> torch.Tensor:
    value = torch.tensor([float(rank) * scale])
    dist.all_reduce(value)
    return value


def _rank_one_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one is broken")
    dist.barrier()


def _rank_one_hangs(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(600)


def _first_optimizer_imports(rank: int, world_size: int) -> list[str]:
    import sys

    before = set(sys.modules)
    torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    return sorted(name for name in set(sys.modules) - before if name.startswith("torch"))


def test_a_ranks_first_optimizer_imports_nothing_of_torch_the_server_did_not() -> None:
    # torch.optim.Optimizer.__init__ imports torch._dynamo: 1.6 s of CPU per rank on the
    # loaded 2-core machine when each rank imported it (before: 300 torch modules here)
    for imported in run_distributed(_first_optimizer_imports, 2, timeout=120):
        assert imported == [], imported[:10]


def test_every_rank_returns_its_result() -> None:
    results = run_distributed(_sum_of_ranks, 3, args=(2.0,), timeout=60)
    assert [r.item() for r in results] == [6.0, 6.0, 6.0]


def test_a_failing_rank_fails_the_run_with_its_traceback() -> None:
    with pytest.raises(RankFailedError, match=r"(?s)rank 1 of 2 failed.*rank one is broken"):
        run_distributed(_rank_one_raises, 2, timeout=60)


def test_a_hanging_rank_times_out_instead_of_hanging() -> None:
    started = time.monotonic()
    with pytest.raises(RankTimeoutError, match=r"ranks \[1\] of 2 did not report"):
        run_distributed(_rank_one_hangs, 2, timeout=15)
    assert time.monotonic() - started < 60


def test_a_chosen_port_taken_before_the_ranks_meet_is_chosen_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Test environments side by side: a free port taken by another process before rank
    0 listens on it (CI, before: ``RankFailedError`` ... ``EADDRINUSE``)."""
    import socket

    import overlapkit.distributed as runner

    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    real_free_port = runner.free_port
    monkeypatch.setattr(runner, "free_port",
                        lambda: ports.pop() if ports else real_free_port())
    try:
        found = run_distributed(_sum_of_ranks, 2, args=(2.0,), timeout=60)
    finally:
        taken.close()
    assert not ports and [float(t) for t in found] == [2.0, 2.0]
    with (pytest.raises(RankFailedError, match="EADDRINUSE"),  # a port given: not chosen
          socket.socket(socket.AF_INET, socket.SOCK_STREAM) as again):
        again.bind(("127.0.0.1", 0))
        again.listen()
        run_distributed(_sum_of_ranks, 2, args=(2.0,), timeout=60,
                        port=again.getsockname()[1])
