"""``overlapkit demo`` and ``overlapkit bench`` end to end, at a tiny size."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _overlapkit(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "overlapkit", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def demo_rows(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    plot = tmp_path_factory.mktemp("demo") / "demo.png"
    proc = _overlapkit("demo", "--model-size", "tiny", "--steps", "6", "--json",
                       "--plot", str(plot))
    assert proc.returncode == 0, proc.stderr
    rows = {row["technique"]: row for row in json.loads(proc.stdout)}
    rows["_plot"] = {"path": str(plot)}
    return rows


def test_demo_runs_every_technique(demo_rows: dict[str, dict[str, object]]) -> None:
    assert set(demo_rows) - {"_plot"} == {
        "plain", "overlap_ddp", "optimizer_in_backward", "post_local_sgd", "checkpoint"}
    for name, row in demo_rows.items():
        if name != "_plot":
            assert len(row["peak_rss_mb"]) >= 1 and row["step_ms"] > 0


@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
def test_demo_reports_bitwise_parity_with_plain_ddp(
    demo_rows: dict[str, dict[str, object]], technique: str
) -> None:
    assert demo_rows[technique]["max_param_diff"] == 0.0
    assert demo_rows[technique]["losses"] == demo_rows["plain"]["losses"]


def test_demo_checkpoint_reloads_exactly_at_another_world_size(
    demo_rows: dict[str, dict[str, object]],
) -> None:
    assert demo_rows["checkpoint"]["max_param_diff"] == 0.0
    assert "reloaded at 1" in str(demo_rows["checkpoint"]["note"])


def test_demo_plot_is_a_png(demo_rows: dict[str, dict[str, object]]) -> None:
    assert Path(str(demo_rows["_plot"]["path"])).read_bytes()[:8] == PNG_SIGNATURE


def test_demo_table_for_people() -> None:
    proc = _overlapkit("demo", "--model-size", "tiny", "--steps", "3", "--technique",
                       "overlap_ddp")
    assert proc.returncode == 0, proc.stderr
    header, _rule, *rows = proc.stdout.splitlines()
    assert header.split()[:3] == ["technique", "step", "(ms)"]
    assert [row.split()[0] for row in rows[:2]] == ["plain", "overlap_ddp"]
    assert "overlap_ddp [" in proc.stderr  # the progress bar


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--technique", "magic"], "unknown technique 'magic'"),
        (["--world-size", "1000"], "more than this machine runs usefully"),
        (["--steps", "1"], "--steps must be at least 2"),
    ],
)
def test_demo_bad_input_is_one_clear_line(args: list[str], message: str) -> None:
    proc = _overlapkit("demo", *args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert message in proc.stderr


def test_demo_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        proc = _overlapkit("demo", "--port", str(port))
    assert proc.returncode == 2
    assert f"port {port} is in use" in proc.stderr and "Traceback" not in proc.stderr
