"""PyTorch Lightning: step time and peak RSS per rank of overlapkit's strategies against
the same Trainer with the plain strategy (needs the `lightning` extra).

    python benchmarks/lightning_strategies.py [--quick] [--rounds N] [--json]

Every variant fits the same LightningModule (an MLP, AdamW, the same data) in fresh gloo
ranks of its own, so each rank's peak RSS (``VmHWM``) belongs to that variant alone;
rounds run every variant once, in a rotating order. Step time is the median time from
one ``on_train_batch_start`` to the next (the whole of Lightning's step: forward,
backward, the optimizer step, Lightning's bookkeeping), the first steps left out;
figures are medians over rounds of the slowest rank (step time) and the largest
(peak RSS, and peak above the baseline taken after imports and process-group set-up).
Not part of ``overlapkit bench``, which must run without Lightning installed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

#: variant -> (strategy, devices)
VARIANTS: dict[str, tuple[str, int]] = {
    "ddp/plain": ("ddp", 2),
    "ddp/overlap_ddp": ("overlap_ddp", 2),
    "ddp/optimizer_in_backward": ("optimizer_in_backward", 2),
    "one device/plain": ("single device", 1),
    "one device/optimizer_in_backward": ("one device", 1),
}
#: (width, depth): 8 x Linear(1024, 1024) = 8.4 M parameters, 32 MiB of gradients
FULL = (1024, 8)
QUICK = (128, 2)
BATCH = 32
WARMUP = 3


def _strategy(name: str) -> Any:
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    from overlapkit.integrations.lightning import OverlapDDPStrategy, OverlapSingleDeviceStrategy

    return {"ddp": DDPStrategy, "single device": lambda: SingleDeviceStrategy("cpu"),
            "overlap_ddp": lambda: OverlapDDPStrategy("overlap_ddp"),
            "optimizer_in_backward": lambda: OverlapDDPStrategy("optimizer_in_backward"),
            "one device": OverlapSingleDeviceStrategy}[name]()


def _rank(rank: int, world_size: int, variant: str, width: int, depth: int,
          steps: int) -> dict[str, float]:
    import logging
    import warnings

    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from overlapkit.cli.memory import fix_mmap_threshold, peak_rss_mib

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    fix_mmap_threshold()
    baseline = peak_rss_mib()

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            layers: list[torch.nn.Module] = []
            for _ in range(depth):
                layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
            self.net = torch.nn.Sequential(*layers)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class StepTimes(L.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, *args: Any) -> None:
            self.starts.append(time.perf_counter())

    devices = VARIANTS[variant][1]
    x = torch.randn(BATCH * devices * (steps + 1), width,
                    generator=torch.Generator().manual_seed(0))
    times = StepTimes()
    trainer = L.Trainer(strategy=_strategy(VARIANTS[variant][0]), devices=devices,
                        accelerator="cpu", max_steps=steps + 1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[times])
    trainer.fit(MLP(), DataLoader(TensorDataset(x), batch_size=BATCH))
    gaps = [b - a for a, b in zip(times.starts, times.starts[1:], strict=False)][WARMUP:]
    peak = peak_rss_mib()
    return {"step_ms": 1000 * statistics.median(gaps), "peak_rss_mib": peak,
            "peak_rss_above_baseline_mib": peak - baseline}


def run_benchmark(rounds: int, quick: bool) -> dict[str, Any]:
    from overlapkit.distributed import run_distributed

    width, depth = QUICK if quick else FULL
    steps = 8 if quick else 30
    names = list(VARIANTS)
    runs: dict[str, list[list[dict[str, float]]]] = {name: [] for name in names}
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            runs[name].append(run_distributed(_rank, VARIANTS[name][1],
                                              args=(name, width, depth, steps), timeout=600))
    variants = {
        name: {metric: statistics.median(max(r[metric] for r in ranks) for ranks in per_round)
               for metric in ("step_ms", "peak_rss_mib", "peak_rss_above_baseline_mib")}
        for name, per_round in runs.items()}
    ratios = {}
    for group in ("ddp", "one device"):
        plain = variants[f"{group}/plain"]
        for name in names:
            if name.startswith(group + "/") and not name.endswith("/plain"):
                ours = variants[name]
                ratios[f"{name} / plain step time"] = ours["step_ms"] / plain["step_ms"]
                ratios[f"{name} - plain peak RSS (MiB)"] = (ours["peak_rss_mib"]
                                                            - plain["peak_rss_mib"])
    grad_mib = depth * (width * width + width) * 4 / 2**20
    return {"benchmark": "lightning", "variants": variants, "ratios": ratios,
            "notes": f"Lightning fits of an MLP {depth} x Linear({width}, {width}) "
                     f"({grad_mib:.1f} MiB of fp32 gradients), AdamW, batch {BATCH} per "
                     f"rank, {steps + 1} steps (the first {WARMUP + 1} untimed), gloo on "
                     f"CPU, 1 thread per rank; medians of {rounds} rounds; glibc mmap "
                     "threshold pinned at 128 KiB"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, 1 round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run_benchmark(1 if args.quick else args.rounds, args.quick)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{'variant':36} {'step ms':>9} {'peak RSS MiB':>13} {'above baseline':>15}")
    for name, figures in result["variants"].items():
        print(f"{name:36} {figures['step_ms']:9.2f} {figures['peak_rss_mib']:13.1f} "
              f"{figures['peak_rss_above_baseline_mib']:15.1f}")
    for name, value in result["ratios"].items():
        print(f"{name}: {value:.3f}")
    print(result["notes"])


if __name__ == "__main__":
    main()
