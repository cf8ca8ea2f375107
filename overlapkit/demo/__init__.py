"""``overlapkit demo``: every technique on the same small model, side by side.

Trains an MLP on synthetic data on N CPU ranks with plain DDP and with each overlapkit
technique, each in fresh processes, then saves a checkpoint and reloads it at another
world size, and reports step time, peak memory per rank, final loss, and how far each
technique's parameters are from plain DDP's.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from overlapkit.demo.config import TECHNIQUES, DemoConfig, parse_techniques
from overlapkit.demo.report import TechniqueRow, format_table, median_ms, plot
from overlapkit.demo.worker import reload_checkpoint, save_checkpoint, train_technique
from overlapkit.launch import launch

__all__ = ["TECHNIQUES", "DemoConfig", "TechniqueRow", "format_table", "parse_techniques",
           "plot", "run_demo"]


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
        peak_rss_mb=[r["peak_rss_mb"] for r in results],
        final_loss=results[0]["losses"][-1],
        max_param_diff=0.0 if technique == "plain" else _max_diff(params, plain_params),
        losses=results[0]["losses"],
        step_times_ms=[1000 * t for t in results[0]["step_times"]],
        note=("local steps between averages: parameters are expected to differ from DDP's"
              if technique == "post_local_sgd" else ""),
    )
    return row, params


def _checkpoint_row(cfg: DemoConfig) -> TechniqueRow | None:
    with tempfile.TemporaryDirectory(prefix="overlapkit-demo-") as tmp:
        path = str(Path(tmp) / "checkpoint")
        saved = launch(save_checkpoint, cfg.world_size, args=(cfg, path), port=cfg.port)
        loaded = launch(reload_checkpoint, cfg.reload_world_size, args=(cfg, path),
                        port=cfg.port)
    if saved is None or loaded is None:
        return None
    return TechniqueRow(
        technique="checkpoint",
        step_ms=1000 * max(r["load_seconds"] for r in loaded),
        peak_rss_mb=[r["peak_rss_mb"] for r in loaded],
        final_loss=saved[0]["losses"][-1],
        max_param_diff=_max_state_diff(saved[0]["saved"], loaded[0]["loaded"]),
        note=(f"saved at world size {cfg.world_size}, reloaded at {cfg.reload_world_size}; "
              "the time is the load, the difference is saved vs reloaded state "
              "(parameters and every optimizer-state tensor)"),
    )


def run_demo(cfg: DemoConfig) -> list[TechniqueRow] | None:
    """Run the demo; returns the rows of its table (``None`` on non-zero torchrun ranks)."""
    rows: list[TechniqueRow] = []
    plain_params = None
    techniques = list(cfg.techniques)
    if "plain" not in techniques and any(t != "checkpoint" for t in techniques):
        techniques.insert(0, "plain")  # the reference every other row is compared with
    for technique in techniques:
        if technique == "checkpoint":
            row = _checkpoint_row(cfg)
            if row is None:
                return None
            rows.append(row)
            continue
        trained = _train_row(cfg, technique, plain_params)
        if trained is None:
            return None
        row, params = trained
        if technique == "plain":
            plain_params = params
        rows.append(row)
    return rows
