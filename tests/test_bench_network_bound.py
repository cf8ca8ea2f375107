"""The network-bound benchmark: its simulated link (the ring-allreduce model, transfers
queued on one serial link, a delay that leaves the cores alone) and its comm hook.
``overlapkit bench --quick``'s network_bound table is checked in ``test_bench_cli.py``,
on that module's one bench run (a second quick run here cost 40-60 s in CI)."""

from __future__ import annotations

import threading
import time

import pytest
from network_link_ranks import delayed_backward, overlap_ddp_over_the_link

from overlapkit.cli.bench.link import Alarm, SimulatedLink, _build
from overlapkit.distributed import run_distributed
from overlapkit.errors import ConfigurationError


def test_a_ring_allreduce_sends_twice_the_bytes_less_one_share_and_pays_latency_per_step(
) -> None:
    link = SimulatedLink(gbps=8.0, latency_us=0.0, ranks=8)
    # 2 (8 - 1) / 8 = 1.75 of 1 GB at 1 GB/s
    assert link.ring_allreduce_s(10**9) == pytest.approx(1.75)
    slow = SimulatedLink(gbps=8.0, latency_us=100.0, ranks=4)
    # 6 steps of 100 us, plus 2 (4 - 1) / 4 = 1.5 of 1 MB at 1 GB/s
    assert slow.ring_allreduce_s(10**6) == pytest.approx(6e-4 + 1.5e-3)


def test_transfers_queue_behind_each_other_on_the_serial_link() -> None:
    link = SimulatedLink(gbps=8.0, latency_us=0.0, ranks=2)  # 1 MB: 1 ms
    assert link.reserve(10**6, now=100.0) == pytest.approx(100.001)
    assert link.reserve(10**6, now=100.0) == pytest.approx(100.002)  # waits for the first
    assert link.reserve(10**6, now=100.0005) == pytest.approx(100.003)
    assert link.reserve(10**6, now=200.0) == pytest.approx(200.001)  # idle link: at once
    modelled, transfers = link.take_counts()
    assert transfers == 4 and modelled == pytest.approx(0.004)
    assert link.take_counts() == (0.0, 0)


def test_the_alarm_runs_callbacks_at_their_deadlines_in_deadline_order() -> None:
    alarm = Alarm()
    fired: list[tuple[str, float]] = []
    done = threading.Event()
    start = time.monotonic()
    alarm.at(start + 0.2, lambda: (fired.append(("late", time.monotonic())), done.set()))
    alarm.at(start + 0.1, lambda: fired.append(("early", time.monotonic())))
    assert done.wait(5)
    assert [name for name, _ in fired] == ["early", "late"]
    assert fired[0][1] - start >= 0.1 and fired[1][1] - start >= 0.2


def test_a_backward_over_the_link_lasts_the_modelled_transfers_and_uses_no_core() -> None:
    # 2 buckets of 4 MiB at 0.25 Gb/s: 2 x 0.235 s, queued one after the other
    result = run_distributed(delayed_backward, 1, args=(0.25, 2), timeout=120)[0]
    assert result["grads"], result["grads"]  # the real allreduce's values, unchanged
    assert result["transfers"] == 2
    assert result["modelled_s"] == pytest.approx(2 * 0.235, rel=0.05)
    assert result["wall_s"] >= result["modelled_s"]
    # no busy wait: the process is idle while the link is busy (a spinning wait would
    # spend about the wall time)
    assert result["cpu_s"] < 0.25 * result["wall_s"], result


def test_overlap_ddp_over_the_link_trains_bitwise_as_plain_ddp_over_it() -> None:
    for result in run_distributed(overlap_ddp_over_the_link, 2, timeout=120):
        assert result["params"], result["params"]
        assert result["transfers"] > 0


def test_the_link_hook_without_a_link_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match=r"comm_hook_options=.*'link'"):
        _build(link=None)
