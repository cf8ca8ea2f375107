"""The post-local-SGD benchmark runs and counts bytes exactly (no timing asserted)."""

from __future__ import annotations

from overlapkit.cli.bench.local_sgd import run_benchmark


def test_quick_benchmark_reports_one_global_averaging_per_period() -> None:
    result = run_benchmark(rounds=1, world_size=2, quick=True, period=4)
    assert result["benchmark"] == "post_local_sgd"
    assert set(result["variants"]) == {"ddp", "torch_post_local_sgd",
                                       "overlapkit_post_local_sgd"}
    ddp = result["variants"]["ddp"]["global_bytes_per_step"]
    ours = result["variants"]["overlapkit_post_local_sgd"]["global_bytes_per_step"]
    theirs = result["variants"]["torch_post_local_sgd"]["global_bytes_per_step"]
    assert ours == theirs == ddp / 4
    assert result["goals"] == [{"goal": "overlapkit / DDP global bytes per step",
                                "value": 0.25, "target": "<= 0.2625", "met": True}]
    assert all(v["step_ms"] > 0 for v in result["variants"].values())
