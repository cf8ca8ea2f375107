"""``overlapkit bench`` end to end: every benchmark, every variant, JSON and plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from overlapkit.cli.bench.runner import ALIASES, BENCHMARKS

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

#: the module's one bench run (about 85 s alone) is the fixture of its first test, and
#: the test command runs it beside other workers' ranks: pytest-timeout's default (300 s then)
#: (pyproject.toml) was seen exceeded on a loaded machine, the run's own limit is 600 s
pytestmark = pytest.mark.timeout(660)

#: per benchmark, the variants that must be present: ours, torch's own, plain
EXPECTED_VARIANTS = {
    "overlap_ddp": {"mlp/overlapkit", "mlp/torch_fused", "mlp/plain", "mlp/compute_only"},
    "engine_overhead": {f"{ranks}r/{model}/{variant}" for ranks in (1, 2)
                        for model in ("1_bucket", "50_buckets", "100_buckets", "400_buckets")
                        for variant in ("plain", "plain_comm_hook", "overlap_ddp")}
    | {"1r/1_bucket/module_plain", "1r/1_bucket/optimizer_in_backward"},
    "optimizer_in_backward": {"ddp/optimizer_in_backward", "ddp/plain",
                              "module/optimizer_in_backward", "module/plain",
                              "module/torch_apply_optimizer_in_backward",
                              # the peers part; the peers' own where installed
                              "peers/400_small/plain",
                              "peers/400_small/overlapkit_backward_only",
                              "peers/400_small/overlapkit_step_zero_grad"},
    "mixed_precision": {"plain_amp", "overlap_ddp_amp", "optimizer_in_backward_amp",
                        "plain_clip", "overlap_ddp_clip", "overlap_ddp_clip_bucket"},
    "post_local_sgd": {"overlapkit_post_local_sgd", "torch_post_local_sgd", "ddp"},
    "checkpoint": {"overlapkit", "torch"},
    "sharded_state": {"plain", "overlap_ddp", "sharded", "zero"},
    "network_bound": {f"{speed}/{variant}" for speed in ("10gbps", "1gbps")
                      for variant in ("plain", "overlap_ddp", "torch_overlap", "sharded",
                                      "zero")} | {"compute_only"},
    "gpt2": {"plain", "overlap_ddp", "optimizer_in_backward", "torch_overlap"},
}


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path, str]:
    plot = tmp_path_factory.mktemp("bench") / "bench.png"
    proc = subprocess.run(
        [sys.executable, "-m", "overlapkit", "bench", "--quick", "--rounds", "1", "--json",
         "--plot", str(plot)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), plot, proc.stderr


def test_bench_json_has_every_benchmark(bench: tuple[list[dict[str, Any]], Path, str]) -> None:
    results, _, _ = bench
    assert [r["benchmark"] for r in results] == list(BENCHMARKS)


@pytest.mark.parametrize("name", sorted(EXPECTED_VARIANTS))
def test_bench_json_has_every_variant_with_figures(
    bench: tuple[list[dict[str, Any]], Path, str], name: str
) -> None:
    result = {r["benchmark"]: r for r in bench[0]}[name]
    if result.get("skipped"):  # gpt2 where transformers is missing (tox py311)
        pytest.skip(f"{name}: {result['skipped']}")
    assert EXPECTED_VARIANTS[name] <= set(result["variants"])
    for figures in result["variants"].values():
        assert any(isinstance(v, (int, float)) and v > 0 for v in figures.values())
    assert result["ratios"] and result["machine"] and result["command"]


def test_bench_shows_progress_and_draws_a_png(
    bench: tuple[list[dict[str, Any]], Path, str],
) -> None:
    _, plot, stderr = bench
    assert f"[1/{len(BENCHMARKS)}] overlap_ddp (1 round, quick) ..." in stderr
    assert plot.read_bytes()[:8] == PNG_SIGNATURE
    assert "goals: " in stderr.splitlines()[-1]


def test_bench_prints_no_torchscript_deprecation_warning(
    bench: tuple[list[dict[str, Any]], Path, str],
) -> None:
    assert "DeprecationWarning" not in bench[2]


def _keys(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [k for key, v in value.items() for k in [str(key), *_keys(v)]]
    if isinstance(value, list):
        return [k for v in value for k in _keys(v)]
    return []


def test_bench_spells_memory_in_mib_and_times_as_step_ms(
    bench: tuple[list[dict[str, Any]], Path, str],
) -> None:
    keys = set(_keys(bench[0]))
    assert [k for k in keys if "_mb" in k.replace("_mib", "")] == []
    assert [k for k in keys if "step_time" in k] == []


def test_bench_says_whether_each_goal_was_met_or_why_quick_does_not_judge_it(
    bench: tuple[list[dict[str, Any]], Path, str],
) -> None:
    from overlapkit.cli.bench.goals import NOT_JUDGED_QUICK
    from overlapkit.cli.bench.runner import format_result

    stated = {r["benchmark"]: r["goals"] for r in bench[0] if r.get("goals")}
    assert {"overlap_ddp", "optimizer_in_backward", "post_local_sgd", "checkpoint",
            "mixed_precision", "network_bound"} <= set(stated)
    for name, goals in stated.items():
        for g in goals:
            if name == "post_local_sgd":  # exact byte counts: judged at any size
                assert g["met"] in (True, False) and "not_judged" not in g, g
            else:
                assert g["met"] is None and g["not_judged"] == NOT_JUDGED_QUICK, (name, g)
                assert isinstance(g["value"], float), (name, g)
        table = format_result(next(r for r in bench[0] if r["benchmark"] == name))
        header = next(line for line in table.splitlines() if line.startswith("goal "))
        assert header.split() == ["goal", "value", "target", "met"]


def test_bench_compares_each_installed_peer_and_names_the_others(
    bench: tuple[list[dict[str, Any]], Path, str],
) -> None:
    from overlapkit.cli.bench.in_backward_peers import PEERS
    from overlapkit.cli.bench.runner import format_result

    result = {r["benchmark"]: r for r in bench[0]}["optimizer_in_backward"]
    text = format_result(result)
    for peer, spec in PEERS.items():
        state = result["peers"][peer]
        if state == spec.version:  # installed here and imports: compared
            assert f"peers/400_small/{peer}" in result["variants"]
            assert any(f"/ {peer} step CPU time" in g["goal"] for g in result["goals"])
        else:  # CI: not installed
            assert f"peers/400_small/{peer}" not in result["variants"]
            assert f"{peer} {state}" in text


def test_the_peers_part_says_not_installed_when_the_peers_are_absent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from overlapkit.cli.bench.in_backward_peers import PEERS, run_peers
    from overlapkit.cli.bench.runner import format_result

    for name in PEERS:  # what an environment without them finds (CI's)
        monkeypatch.setitem(sys.modules, name, None)
    part = run_peers(rounds=1, quick=True, steps=1, warmup=1, memory_rounds=1,
                     memory_steps=1)
    assert part["peers"] == {"torchtune": "not installed", "torchtitan": "not installed"}
    assert set(part["variants"]) == {"peers/400_small/plain",
                                     "peers/400_small/overlapkit_backward_only",
                                     "peers/400_small/overlapkit_step_zero_grad"}
    for figures in part["variants"].values():
        assert figures["step_ms"] > 0 and figures["peak_above_setup_mib"] >= 0
    assert part["goals"] == []  # nothing to compare with: no goal, no "not measured"
    text = format_result({"benchmark": "optimizer_in_backward", **part})
    assert "torchtune not installed (pip install torch==2.13.0 torchtune==0.6.1)" in text
    assert "torchtitan not installed (pip install --no-deps torchtitan==0.2.2" in text


def test_the_gpt2_benchmark_says_it_needs_transformers_where_it_is_missing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from overlapkit.cli.bench import gpt2
    from overlapkit.cli.bench.runner import format_result

    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    result = gpt2.run_benchmark(rounds=1, quick=True)
    assert result["variants"] == {} and result["goals"] == []
    assert format_result(result) == ("== gpt2: skipped: the gpt2 benchmark needs "
                                     "transformers (GPT2LMHeadModel), which is not "
                                     "installed: pip install transformers")


def test_old_benchmark_names_still_work() -> None:
    from overlapkit.cli.bench.runner import parse_benchmarks

    assert parse_benchmarks(",".join(ALIASES)) == list(ALIASES.values())


def test_unknown_benchmark_is_a_clear_error() -> None:
    proc = subprocess.run([sys.executable, "-m", "overlapkit", "bench", "--only", "warp"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "unknown benchmark 'warp'" in proc.stderr


def test_a_goal_is_met_missed_or_not_measured() -> None:
    from overlapkit.cli.bench import goal
    from overlapkit.cli.bench.runner import format_result

    goals = [goal("ratio a", 0.9, at_most=0.95), goal("ratio b", 0.8, at_least=0.9),
             goal("ratio c", None, at_most=1.0)]
    assert [g["met"] for g in goals] == [True, False, None]
    table = format_result({"benchmark": "x", "variants": {}, "goals": goals})
    assert [line.split()[-1] for line in table.splitlines()[-3:]] == ["met", "MISSED",
                                                                     "measured"]
    with pytest.raises(ValueError, match="exactly one"):
        goal("both", 1.0, at_most=1.0, at_least=0.5)


def test_a_goal_a_quick_run_cannot_measure_shows_its_figure_without_a_verdict() -> None:
    from overlapkit.cli.bench import goal
    from overlapkit.cli.bench.runner import format_result

    record = goal("peak saving", -6.5, at_least=0.9, judged=False)
    assert record["met"] is None and record["value"] == -6.5
    row = format_result({"benchmark": "x", "variants": {}, "goals": [record]}).splitlines()[-1]
    assert row.split()[:4] == ["peak", "saving", "-6.5", ">="]
    assert row.endswith("not judged in --quick: needs the full sizes")
    assert "MISSED" not in row


def test_a_quick_run_closes_with_a_line_that_does_not_read_as_a_failure() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "overlapkit", "bench", "--quick", "--rounds", "1",
         "--only", "post_local_sgd,mixed_precision"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "MISSED" not in proc.stdout
    # mixed_precision's step-time goals: figures shown, no verdict
    assert proc.stdout.count("not judged in --quick: needs the full sizes") == 4
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("overlapkit bench --quick: 2 benchmarks ran every variant in ")
    # post_local_sgd's byte count is exact at any size: judged, and met
    assert last.endswith("goals: 1 met, 4 not judged (small sizes, one round: run "
                         "without --quick to judge them)"), last
    assert "missed" not in last.lower() and "FAILED" not in last


@pytest.mark.parametrize(("argv", "text"), [
    (["--device", "cuda", "--only", "engine_overhead"], "run(s) on CPU only"),
    (["--device", "cuda", "--only", "overlap_ddp", "--world-size", "2"],
     "needs one GPU per rank: 2 ranks"),
])
def test_device_cuda_is_checked_before_any_benchmark_runs(
        argv: list[str], text: str, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from overlapkit.cli import main

    if "GPU per rank" in text and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs: the benchmark would run")
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert text in err and "[1/" not in err  # nothing started


def test_a_full_run_s_closing_line_counts_every_goal_of_the_table() -> None:
    from overlapkit.cli.bench.goals import goal
    from overlapkit.cli.commands.bench import _summary

    goals = [goal("a", 1.0, at_most=2.0), goal("b", 3.0, at_most=2.0),
             goal("c", 1.0, at_most=2.0, judged=False), goal("d", None, at_most=2.0)]
    line = _summary([{"benchmark": "x", "goals": goals}], 12.0, quick=False)
    assert line == ("overlapkit bench: 1 benchmarks in 12 s; goals: 1 met, 1 missed, "
                    "1 not judged, 1 not measured")
    line = _summary([{"benchmark": "x", "goals": goals[:2]}], 12.0, quick=False)
    assert line.endswith("goals: 1 met, 1 missed")


def test_the_network_bound_table_has_every_variant_at_each_link_and_lists_its_goals(
    bench: tuple[list[dict[str, Any]], Path, str],
) -> None:
    result = {r["benchmark"]: r for r in bench[0]}["network_bound"]
    for speed in ("10gbps", "1gbps"):
        for variant in ("plain", "overlap_ddp", "overlap_ddp_comm_thread", "torch_overlap",
                        "sharded", "zero"):
            assert result["variants"][f"{speed}/{variant}"]["step_ms"] > 0
    assert result["variants"]["1gbps/plain"]["optimizer_step_ms"] > 0
    goals = {g["goal"]: g for g in result["goals"]}
    # at 1 Gb/s the quick model's communication is many times its backward: judged
    # with the full sizes, shown here
    assert {"1gbps: (plain - overlap_ddp) / plain step()",
            "1gbps: sharded / zero step time"} <= set(goals)
    assert all(g["met"] is None and isinstance(g["value"], float) for g in goals.values())
    assert result["plot"]["xs"] == [10.0, 1.0]
