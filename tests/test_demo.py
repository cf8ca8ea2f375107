"""``overlapkit demo`` and ``overlapkit bench`` end to end, at a tiny size."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
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
        "plain", "overlap_ddp", "sharded", "optimizer_in_backward", "post_local_sgd",
        "checkpoint"}
    for name, row in demo_rows.items():
        if name != "_plot":
            assert len(row["peak_rss_mib"]) >= 1 and row["step_ms"] > 0


@pytest.mark.parametrize("technique", ["overlap_ddp", "sharded", "optimizer_in_backward"])
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


@pytest.fixture(scope="module")
def table_run() -> subprocess.CompletedProcess[str]:
    """The demo for people (a table on stdout, progress bars on stderr): overlap_ddp and
    the plain baseline it is compared with, one run for both tests below."""
    proc = _overlapkit("demo", "--model-size", "tiny", "--steps", "3", "--technique",
                       "overlap_ddp")
    assert proc.returncode == 0, proc.stderr
    return proc


def test_demo_table_for_people(table_run: subprocess.CompletedProcess[str]) -> None:
    header, _rule, *rows = table_run.stdout.splitlines()
    assert header.split()[:3] == ["technique", "step", "(ms)"]
    assert [row.split()[0] for row in rows[:2]] == ["plain", "overlap_ddp"]
    assert "overlap_ddp [" in table_run.stderr  # the progress bar
    assert table_run.stderr.startswith(
        "overlapkit demo: 2,128-parameter MLP (tiny), 2 CPU ranks")


def test_the_progress_bar_shows_the_loss_the_table_shows(
        table_run: subprocess.CompletedProcess[str]) -> None:
    for row, technique in enumerate(("plain", "overlap_ddp"), start=2):
        last_bar = [line for line in table_run.stderr.splitlines()
                    if f"{technique} [" in line][-1]
        shown = float(last_bar.split("loss ")[1].split()[0])
        table_loss = float(table_run.stdout.splitlines()[row].split()[4])
        assert "(mean over ranks)" in last_bar
        assert shown == round(table_loss, 4), technique


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--technique", "magic"], "unknown technique 'magic'"),
        (["--world-size", "1000"], "more than this machine runs usefully"),
        (["--steps", "1"], "--steps must be at least 2"),
        (["--checkpoint-dir", "{file}"], "is a file, or lies under one"),
        (["--checkpoint-dir", "{file}/sub"], "is a file, or lies under one"),
        (["--plot", "{tmp}/demo.xyz"], "'xyz' file format; end the name with one of"),
        (["--plot", "{tmp}/demo"], "no file format"),
        (["--plot", "{tmp}"], "is a directory"),
        (["--plot", "{file}/demo.png"], "cannot be written"),
    ],
)
def test_demo_bad_input_is_one_clear_line_before_training(
    args: list[str], message: str, tmp_path: Path
) -> None:
    (tmp_path / "a-file").write_text("")
    args = [a.format(file=tmp_path / "a-file", tmp=tmp_path) for a in args]
    proc = _overlapkit("demo", *args, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1  # one line, no training started
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing written


def test_demo_without_matplotlib_refuses_plot_before_training(tmp_path: Path) -> None:
    (tmp_path / "matplotlib").mkdir()  # a package that fails to import shadows the real one
    (tmp_path / "matplotlib" / "__init__.py").write_text("raise ImportError('no matplotlib')")
    proc = subprocess.run(
        [sys.executable, "-m", "overlapkit", "demo", "--plot", str(tmp_path / "d.png")],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--plot needs matplotlib" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_demo_help_shows_the_defaults() -> None:
    proc = _overlapkit("demo", "--help", timeout=60)
    assert proc.returncode == 0
    for default in ("(default: 40)", "(default: 2)", "(default: small)", "(default: all)"):
        assert default in " ".join(proc.stdout.split()), default


def test_demo_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        proc = _overlapkit("demo", "--port", str(port))
    assert proc.returncode == 2
    assert f"port {port} is in use" in proc.stderr and "Traceback" not in proc.stderr


def _group_members(pgid: int) -> list[str]:
    found = subprocess.run(["ps", "-o", "pid=", "-g", str(pgid)], capture_output=True, text=True)
    return found.stdout.split()


def test_ctrl_c_stops_every_rank() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "overlapkit", "demo", "--steps", "100000", "--technique",
         "plain"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stderr is not None
    deadline = time.monotonic() + 120
    while "plain [" not in proc.stderr.readline():  # training has started on the ranks
        assert time.monotonic() < deadline and proc.poll() is None
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground group
    assert proc.wait(timeout=60) == 130
    assert "overlapkit: interrupted" in proc.stderr.read()
    deadline = time.monotonic() + 30
    while _group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _group_members(proc.pid) == []


def test_a_killed_demo_leaves_no_rank_behind() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "overlapkit", "demo", "--steps", "100000", "--technique",
         "plain"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    assert proc.stderr is not None
    while "plain [" not in proc.stderr.readline():
        assert proc.poll() is None
    os.kill(proc.pid, signal.SIGKILL)  # no clean-up runs in the parent
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while _group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _group_members(proc.pid) == []


def test_demo_under_torchrun_uses_its_ranks() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(_free_port()), "-m", "overlapkit", "demo", "--model-size",
         "tiny", "--steps", "4", "--technique", "overlap_ddp,checkpoint", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {row["technique"]: row for row in json.loads(proc.stdout)}  # rank 0 reports alone
    assert rows["overlap_ddp"]["max_param_diff"] == 0.0
    assert len(rows["overlap_ddp"]["peak_rss_mib"]) == 2
    assert rows["checkpoint"]["max_param_diff"] == 0.0
    assert "reloaded at 2 (torchrun fixes the world size" in rows["checkpoint"]["note"]


def test_demo_under_torchrun_prints_its_header_once() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(_free_port()), "-m", "overlapkit", "demo", "--model-size",
         "tiny", "--steps", "2", "--technique", "plain"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    headers = [line for line in proc.stderr.splitlines() if line.startswith("overlapkit demo:")]
    assert headers == ["overlapkit demo: 2,128-parameter MLP (tiny), 2 CPU ranks (gloo, "
                       "torchrun), 2 steps per technique"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
