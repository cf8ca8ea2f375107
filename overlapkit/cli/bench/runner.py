"""``overlapkit bench``: run the technique benchmarks and report medians and ratios.

Each benchmark interleaves its variants (ours, torch's own, plain) in one run, so
their figures are comparable; this module only runs them in turn and presents what
they return.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from overlapkit.cli.bench.tables import format_result
from overlapkit.cli.textui import parse_names, pyplot
from overlapkit.errors import ConfigurationError
from overlapkit.launch import check_world_size

__all__ = ["ALIASES", "BENCHMARKS", "GPU_BENCHMARKS", "QUICK_ROUNDS", "format_result",
           "machine_description", "plot_results", "run_benchmarks"]

#: benchmark name -> module under overlapkit.cli.bench, in the order they run; the
#: names are the demo's technique names
BENCHMARKS: dict[str, str] = {
    "overlap_ddp": "overlapkit.cli.bench.ddp_overlap",
    "engine_overhead": "overlapkit.cli.bench.engine_overhead",
    "optimizer_in_backward": "overlapkit.cli.bench.optimizer_in_backward",
    "mixed_precision": "overlapkit.cli.bench.mixed_precision",
    "post_local_sgd": "overlapkit.cli.bench.local_sgd",
    "checkpoint": "overlapkit.cli.bench.checkpoint",
    "sharded_state": "overlapkit.cli.bench.sharded_state",
    "network_bound": "overlapkit.cli.bench.network_bound",
    "gpt2": "overlapkit.cli.bench.gpt2",
}

#: names used before 0.2 -> the name now; still accepted by ``--only``
ALIASES: dict[str, str] = {"ddp_overlap": "overlap_ddp", "local_sgd": "post_local_sgd"}

#: rounds per benchmark with ``--quick``: a smoke test of every variant, not figures
QUICK_ROUNDS = 1

#: the benchmarks that also run on GPUs (``--device cuda``: NCCL, one GPU per rank)
GPU_BENCHMARKS = ("overlap_ddp", "sharded_state", "network_bound", "gpt2")


def machine_description() -> str:
    """One line naming the machine the figures come from."""
    import torch

    return (f"{platform.machine()}, {os.cpu_count()} cores, Python "
            f"{platform.python_version()}, torch {torch.__version__}")


def available_benchmarks() -> list[str]:
    """The benchmarks whose modules are present (found, not imported: importing one
    imports torch, and ``overlapkit bench --help`` lists them)."""
    return [name for name, module in BENCHMARKS.items()
            if importlib.util.find_spec(module) is not None]


def parse_benchmarks(text: str, log: TextIO | None = None) -> list[str]:
    """``"all"`` or a comma-separated list of benchmark names, validated; an old name
    (:data:`ALIASES`) is accepted with a note on ``log`` (stderr)."""
    available = available_benchmarks()
    if not available:
        raise ConfigurationError("no benchmark modules are installed; reinstall overlapkit.")
    names = []
    for part in text.split(","):
        name = part.strip().replace("-", "_")
        if name in ALIASES:
            print(f"overlapkit bench: {name!r} is now called {ALIASES[name]!r}.",
                  file=sys.stderr if log is None else log)
            name = ALIASES[name]
        names.append(name)
    return parse_names(",".join(names), available, "benchmark")


def benchmarks_for_device(names: Sequence[str], device: str, *, chosen: bool,
                          log: TextIO | None = None) -> list[str]:
    """The benchmarks of ``names`` that run on ``device``.

    :param chosen: the names were given with ``--only`` (else: every benchmark).
    :raises ConfigurationError: an unknown device; no GPU (or fewer than ``world_size``);
        ``--only`` names a benchmark that runs on CPU only.
    """
    if device not in ("cpu", "cuda"):
        raise ConfigurationError(f"--device must be 'cpu' or 'cuda', got {device!r}.")
    if device == "cpu":
        return list(names)
    cpu_only = [n for n in names if n not in GPU_BENCHMARKS]
    if chosen and cpu_only:
        raise ConfigurationError(
            f"--device cuda: {', '.join(cpu_only)} run(s) on CPU only; the benchmarks "
            f"with a GPU variant are: {', '.join(GPU_BENCHMARKS)}."
        )
    if cpu_only:
        print(f"overlapkit bench --device cuda: running {', '.join(GPU_BENCHMARKS)} "
              f"(the others run on CPU only)", file=sys.stderr if log is None else log)
    return [n for n in names if n in GPU_BENCHMARKS]


def check_gpus(world_size: int) -> None:
    """:raises ConfigurationError: fewer than ``world_size`` CUDA GPUs are visible."""
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < world_size:
        raise ConfigurationError(
            f"--device cuda needs one GPU per rank: {world_size} ranks, {found} CUDA GPU(s) "
            "visible. Run on a machine with GPUs (or pass --world-size), or leave "
            "--device out to benchmark on CPU."
        )


def effective_rounds(rounds: int, quick: bool) -> int:
    """The rounds a run makes: ``rounds``, or at most :data:`QUICK_ROUNDS` with
    ``--quick``."""
    return min(rounds, QUICK_ROUNDS) if quick else rounds


def run_benchmarks(names: Sequence[str], *, rounds: int, world_size: int | None,
                   quick: bool, log: TextIO | None = None,
                   device: str = "cpu") -> list[dict[str, Any]]:
    """Run each named benchmark and return their results in order.

    ``world_size=None`` lets each benchmark use its own default (the checkpoint one
    reshards 2 -> 4 ranks, the others run on 2). Progress goes to ``log`` (stderr).
    ``device="cuda"``: the benchmarks of :data:`GPU_BENCHMARKS` on one GPU per rank.
    """
    if rounds < 1:
        raise ConfigurationError(f"--rounds must be at least 1, got {rounds}.")
    if world_size is not None:
        check_world_size(world_size)
    log = sys.stderr if log is None else log
    rounds = effective_rounds(rounds, quick)
    if device == "cuda":
        check_gpus(world_size or 2)
    results = []
    for index, name in enumerate(names, 1):
        module = importlib.import_module(BENCHMARKS[name])
        options: dict[str, Any] = {"rounds": rounds, "quick": quick}
        if world_size is not None:
            options["world_size"] = world_size
        if device != "cpu":
            options["device"] = device
        print(f"[{index}/{len(names)}] {name} ({rounds} round{'s' if rounds > 1 else ''}"
              f"{', quick' if quick else ''}) ...", file=log, flush=True)
        started = time.monotonic()
        try:
            result = module.run_benchmark(**options)
        except Exception as exc:  # the others still run; the command then exits 1
            print(f"[{index}/{len(names)}] {name} FAILED: {type(exc).__name__}: {exc}",
                  file=log, flush=True)
            results.append({"benchmark": name, "error": f"{type(exc).__name__}: {exc}",
                            "machine": machine_description()})
            continue
        print(f"[{index}/{len(names)}] {name} done in {time.monotonic() - started:.0f}s",
              file=log, flush=True)
        result["benchmark"] = name
        result["rounds"] = rounds
        result["machine"] = machine_description()
        results.append(result)
    return results


def plot_results(results: list[dict[str, Any]], path: Path) -> None:
    """A chart per benchmark into a PNG: the lines of a result's ``"plot"`` (``{"x",
    "y", "xs", "series": {name: [y per x]}}``, e.g. step time against link speed, where
    the lines cross), else a bar per variant of its first metric."""
    plt = pyplot()
    figure, axes = plt.subplots(1, max(len(results), 1), figsize=(5 * max(len(results), 1), 4),
                                squeeze=False)
    for ax, result in zip(axes[0], results, strict=False):
        lines = result.get("plot")
        if lines:
            for name, ys in lines["series"].items():
                ax.plot(lines["xs"], ys, marker="o", label=name)
            ax.set(title=result.get("benchmark", ""), xlabel=lines["x"], ylabel=lines["y"],
                   xscale="log")
            ax.legend(fontsize="small")
            continue
        variants = result.get("variants", {})
        metric = next((m for f in variants.values() for m, v in f.items()
                       if isinstance(v, (int, float))), None)
        if metric is None:
            continue
        names = list(variants)
        ax.bar(names, [float(variants[n].get(metric, 0.0)) for n in names])
        ax.set(title=result.get("benchmark", ""), ylabel=metric)
        ax.tick_params(axis="x", rotation=20)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
