"""Make tiny, real plugin distributions on disk for the entry-point tests.

A distribution here is what pip would leave in site-packages: the plugin's module and
a ``NAME-VERSION.dist-info`` folder with ``METADATA`` and ``entry_points.txt``. Put its
folder on ``PYTHONPATH`` of a subprocess and ``importlib.metadata`` finds the entry
point exactly as it finds an installed package's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path


def make_plugin_dist(
    root: Path,
    *,
    dist: str,
    version: str = "1.0.0",
    entry_points: dict[str, str],
    modules: dict[str, str],
) -> Path:
    """Write a distribution into ``root`` and return ``root`` (for ``PYTHONPATH``)."""
    root.mkdir(parents=True, exist_ok=True)
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
    )
    lines = ["[overlapkit]"] + [f"{name} = {target}" for name, target in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    (info / "RECORD").write_text("")
    return root


def run_python(code: str, *paths: Path, env: dict[str, str] | None = None,
               timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter with ``paths`` prepended to ``PYTHONPATH``."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("OVERLAPKIT_")}
    full_env["PYTHONPATH"] = os.pathsep.join(
        [*map(str, paths), full_env.get("PYTHONPATH", "")]
    )
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env, capture_output=True, text=True, timeout=timeout,
    )


def plugins_json(*paths: Path, env: dict[str, str] | None = None) -> list[dict[str, object]]:
    """``overlapkit plugins --json`` in a subprocess, parsed."""
    proc = run_python(
        "import sys; from overlapkit.cli import main; sys.exit(main(['plugins', '--json']))",
        *paths, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    return list(json.loads(proc.stdout))
