"""The command line, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys


def _overlapkit(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "overlapkit", *args],
                          capture_output=True, text=True, timeout=120)


def test_plugins_json_lists_the_builtins() -> None:
    proc = _overlapkit("plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    listed = {p["name"]: p for p in json.loads(proc.stdout)}
    assert listed["overlapkit.comm_hooks"]["provides"]["comm_hooks"] == [
        "allreduce", "bf16_compress", "fp16_compress"]


def test_plugins_table_has_a_header_and_a_row_per_plugin() -> None:
    proc = _overlapkit("plugins")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:4] == ["name", "version", "status", "source"]
    assert any(line.startswith("overlapkit.comm_hooks") for line in lines[1:])


def test_unknown_command_is_a_usage_error() -> None:
    proc = _overlapkit("frobnicate")
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr
