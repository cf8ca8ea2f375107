"""The command line, as a user runs it."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from plugin_dists import run_python


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


def test_plugins_lists_the_techniques_each_builtin_serves() -> None:
    proc = _overlapkit("plugins", "--json")
    listed = {p["name"]: p["techniques"] for p in json.loads(proc.stdout)}
    assert listed["overlapkit.overlap"] == ["overlap_ddp", "optimizer_in_backward"]
    assert listed["overlapkit.local_sgd"] == ["post_local_sgd"]
    assert listed["overlapkit.checkpoint"] == ["checkpoint"]
    table = _overlapkit("plugins").stdout
    assert "techniques: overlap_ddp, optimizer_in_backward" in table


@pytest.mark.parametrize("command", ["plugins", "demo", "bench", "new-plugin", "checkpoint"])
def test_every_command_has_a_description(command: str) -> None:
    from overlapkit.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert (sub.choices[command].description or "").strip(), command


def test_help_and_version_import_no_torch() -> None:
    # the timings are in benchmarks/cli_startup.py; here, the cause of a slow start
    code = ("import sys; from overlapkit.cli import main\n"
            "for argv in (['--help'], ['--version'], ['demo', '--help'], ['bench', '--help'],"
            " ['plugins', '--help']):\n"
            "    try: main(argv)\n"
            "    except SystemExit: pass\n"
            "import overlapkit; overlapkit.hookimpl; overlapkit.OverlapkitError\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)")
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr


def test_listing_the_plugins_imports_neither_checkpoint_nor_fsdp() -> None:
    # the built-in plugins' registration read the whole checkpoint package (DCP, FSDP
    # and DTensor with it): 7.6 s of CPU for `overlapkit plugins` on a busy machine,
    # 4.6 s without (benchmarks/cli_startup.py has the quiet figures)
    code = ("import sys, overlapkit; overlapkit.list_plugins()\n"
            "heavy = [m for m in ('torch.distributed.checkpoint', 'torch.distributed.fsdp',"
            " 'torch.distributed.tensor') if m in sys.modules]\n"
            "assert heavy == [], heavy\n"
            "from overlapkit import checkpoint\n"
            "assert checkpoint.save.__module__ == 'overlapkit.checkpoint.saving'\n"
            "from overlapkit.checkpoint import MODEL_KEY, load\n"
            "assert (MODEL_KEY, load.__name__) == ('model', 'load')\n"
            "assert 'torch.distributed.checkpoint' in sys.modules")
    proc = run_python(code, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_the_public_api_still_resolves_lazily() -> None:
    import overlapkit

    assert overlapkit.overlap_ddp.__module__ == "overlapkit.overlap.techniques"
    assert overlapkit.checkpoint.save.__module__.startswith("overlapkit.checkpoint")
    assert set(overlapkit.__all__) <= set(dir(overlapkit))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        overlapkit.nope  # noqa: B018


def test_the_pytest_plugin_imports_no_torch(tmp_path: Path) -> None:
    """pytest loads overlapkit.testing at start-up wherever overlapkit is installed; with
    torch it cost every pytest session 2 s (benchmarks/pytest_startup.py: now +17 ms)."""
    (tmp_path / "test_nothing.py").write_text(
        "import sys\n\ndef test_nothing():\n"
        "    assert 'overlapkit.testing' in sys.modules  # the plugin was loaded\n"
        "    assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
