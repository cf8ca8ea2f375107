"""Run the demo: every technique on the same small model, side by side.

Trains an MLP on synthetic data on N CPU ranks with plain DDP and with each overlapkit
technique, each in fresh processes, then saves a checkpoint and reloads it at another
world size, and reports step time, peak memory per rank, final loss, and how far each
technique's parameters are from plain DDP's.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from overlapkit.cli.demo.config import DemoConfig
from overlapkit.cli.demo.report import TechniqueRow, median_ms
from overlapkit.cli.demo.worker import reload_checkpoint, save_checkpoint, train_technique
from overlapkit.launch import launch, under_torchrun

__all__ = ["run_demo"]


def _max_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float | None:
    if a is None or b is None:
        return None
    return float((a - b).abs().max())


def _max_state_diff(saved: dict[str, Any], loaded: dict[str, Any]) -> float:
    """The largest difference between two snapshots of model and optimizer state."""
    worst = 0.0
    for key, tensor in saved["model"].items():
        worst = max(worst, float((tensor - loaded["model"][key]).abs().max()))
    for index, state in saved["optimizer"]["state"].items():
        for name, value in state.items():
            other = loaded["optimizer"]["state"][index][name]
            worst = max(worst, float((torch.as_tensor(value) - torch.as_tensor(other)).abs().max()))
    return worst


def _train_row(cfg: DemoConfig, technique: str, plain_params: torch.Tensor | None
               ) -> tuple[TechniqueRow, torch.Tensor | None] | None:
    results = launch(train_technique, cfg.world_size, args=(cfg, technique), port=cfg.port)
    if results is None:  # a non-zero torchrun rank
        return None
    params = results[0]["params"]
    row = TechniqueRow(
        technique=technique,
        step_ms=median_ms(results[0]["step_times"]),
        peak_rss_mib=[r["peak_rss_mib"] for r in results],
        final_loss=results[0]["losses"][-1],
        max_param_diff=0.0 if technique == "plain" else _max_diff(params, plain_params),
        losses=results[0]["losses"],
        step_times_ms=[1000 * t for t in results[0]["step_times"]],
        note=("local steps between averages: parameters are expected to differ from DDP's"
              if technique == "post_local_sgd" else ""),
    )
    return row, params


@contextmanager
def _checkpoint_path(cfg: DemoConfig) -> Iterator[str]:
    """Where the demo's checkpoint goes: the same path on every rank, removed after."""
    if cfg.checkpoint_dir is not None:
        yield str(Path(cfg.checkpoint_dir) / "overlapkit-demo-checkpoint")
        return
    if not under_torchrun():
        with tempfile.TemporaryDirectory(prefix="overlapkit-demo-") as tmp:
            yield str(Path(tmp) / "checkpoint")
        return
    # Under torchrun each rank is its own process: derive one name from the run.
    run = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}-{os.environ['MASTER_PORT']}"
    directory = Path(tempfile.gettempdir()) / f"overlapkit-demo-{run}"
    try:
        yield str(directory / "checkpoint")
    finally:
        if os.environ.get("RANK") == "0":  # launch() ends with a barrier: all are done
            shutil.rmtree(directory, ignore_errors=True)


def _checkpoint_row(cfg: DemoConfig) -> TechniqueRow | None:
    with _checkpoint_path(cfg) as path:
        saved = launch(save_checkpoint, cfg.world_size, args=(cfg, path), port=cfg.port)
        loaded = launch(reload_checkpoint, cfg.reload_world_size, args=(cfg, path),
                        port=cfg.port)
    if saved is None or loaded is None:  # a non-zero torchrun rank
        return None
    saved_at = len(saved)
    return TechniqueRow(
        technique="checkpoint",
        step_ms=1000 * max(r["load_seconds"] for r in loaded),
        peak_rss_mib=[r["peak_rss_mib"] for r in loaded],
        final_loss=saved[0]["losses"][-1],
        max_param_diff=_max_state_diff(saved[0]["saved"], loaded[0]["loaded"]),
        note=(f"saved at world size {saved_at}, reloaded at {len(loaded)}"
              + (" (torchrun fixes the world size; without torchrun the demo reloads at "
                 "another one)" if under_torchrun() else "")
              + "; the time is the load, the difference is saved vs reloaded state "
              "(parameters and every optimizer-state tensor)"),
    )


def run_demo(cfg: DemoConfig) -> list[TechniqueRow] | None:
    """Run the demo; returns the rows of its table (``None`` on non-zero torchrun ranks,
    which take part in every run but leave the report to rank 0)."""
    rows: list[TechniqueRow] = []
    plain_params = None
    techniques = list(cfg.techniques)
    if "plain" not in techniques and any(t != "checkpoint" for t in techniques):
        techniques.insert(0, "plain")  # the reference every other row is compared with
    for technique in techniques:
        if technique == "checkpoint":
            row = _checkpoint_row(cfg)
            if row is not None:
                rows.append(row)
            continue
        trained = _train_row(cfg, technique, plain_params)
        if trained is None:
            continue
        row, params = trained
        if technique == "plain":
            plain_params = params
        rows.append(row)
    if under_torchrun() and os.environ.get("RANK") != "0":
        return None
    return rows
