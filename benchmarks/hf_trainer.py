"""Benchmark: Hugging Face's ``Trainer.train()`` with plain AdamW against
``OverlapTrainer`` with each technique: step time and peak RSS per rank.

    python benchmarks/hf_trainer.py [--rounds 3] [--steps 6] [--quick] [--json]

GPT-2 small (``GPT2Config()``: 124.4 M parameters, tied embedding and head, random
weights) on 2 gloo ranks, 1 thread each, the Trainer's defaults (AdamW, fp32) with
``max_grad_norm=1.0`` and with ``max_grad_norm=0``: global clipping needs every
gradient at once, so under ``optimizer_in_backward`` the steps wait for the end of
backward and the gradients are not freed early (no memory saved); without clipping
each gradient is freed once stepped. Every variant runs in fresh processes of its own
per round (peak RSS is a process high-water mark, ``VmHWM``), rounds in a rotating
order, glibc's mmap threshold pinned so freed tensors leave the RSS at once (see
``overlapkit.cli.memory``). Step time: ``on_step_begin`` to
``on_step_end`` of each optimizer step but the first (which allocates the optimizer
state), median per rank, slowest rank; peak RSS: largest rank, also above a baseline
taken after imports and the process group, before the model is built. Figures: medians
over rounds. Needs ``pip install 'overlapkit[transformers]'``; the figures are in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

from overlapkit.cli.memory import fix_mmap_threshold, peak_rss_mib
from overlapkit.distributed import run_distributed

#: variant -> (technique or None for the plain Trainer, max_grad_norm)
VARIANTS: dict[str, tuple[str | None, float]] = {
    "plain Trainer, max_grad_norm=1.0": (None, 1.0),
    "overlap_ddp, max_grad_norm=1.0": ("overlap_ddp", 1.0),
    "optimizer_in_backward, max_grad_norm=1.0": ("optimizer_in_backward", 1.0),
    "plain Trainer, max_grad_norm=0": (None, 0.0),
    "optimizer_in_backward, max_grad_norm=0": ("optimizer_in_backward", 0.0),
}
BATCH, LENGTH = 2, 128


def rank(rank: int, world_size: int, technique: str | None, max_norm: float, steps: int,
         quick: bool) -> dict[str, Any]:
    """One Trainer run on this rank: its step times (s) and peak RSS (MiB)."""
    fix_mmap_threshold()
    import torch
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        logging,
    )

    from overlapkit.integrations.transformers import OverlapTrainer

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    baseline = peak_rss_mib()
    torch.manual_seed(0)
    config = (GPT2Config(n_layer=2, n_embd=128, n_head=2, vocab_size=1024) if quick
              else GPT2Config())
    model = GPT2LMHeadModel(config)
    vocab = config.vocab_size

    class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return BATCH * world_size * (steps + 1)

        def __getitem__(self, index: int) -> dict[str, Any]:
            ids = torch.randint(0, vocab, (LENGTH,),
                                generator=torch.Generator().manual_seed(index))
            return {"input_ids": ids, "labels": ids}

    times: list[float] = []

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            times.append(time.perf_counter() - self.start)

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=steps, use_cpu=True,
                                 per_device_train_batch_size=BATCH, max_grad_norm=max_norm,
                                 save_strategy="no", logging_strategy="no", report_to=[],
                                 disable_tqdm=True, dataloader_num_workers=0, seed=0)
        common: dict[str, Any] = dict(model=model, args=args, train_dataset=Tokens(),
                                      callbacks=[Clock()])
        trainer = (Trainer(**common) if technique is None
                   else OverlapTrainer(technique=technique, **common))
        trainer.train()
    grad_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    return {"step_s": statistics.median(times[1:]), "peak_mib": peak_rss_mib(),
            "above_baseline_mib": peak_rss_mib() - baseline, "gradient_mib": grad_mib,
            "parameters": sum(p.numel() for p in model.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--quick", action="store_true", help="a tiny GPT-2, seconds")
    parser.add_argument("--json", action="store_true", help="print the raw results")
    options = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    names = list(VARIANTS)
    found: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for index in range(options.rounds):
        order = names[index % len(names):] + names[:index % len(names)]
        for name in order:
            technique, max_norm = VARIANTS[name]
            ranks = run_distributed(rank, 2, args=(technique, max_norm, options.steps,
                                                   options.quick), timeout=1800)
            found[name].append({
                "step_s": max(r["step_s"] for r in ranks),
                "peak_mib": max(r["peak_mib"] for r in ranks),
                "above_baseline_mib": max(r["above_baseline_mib"] for r in ranks),
                "gradient_mib": ranks[0]["gradient_mib"],
                "parameters": ranks[0]["parameters"],
            })
            print(f"round {index + 1}: {name}: {found[name][-1]}", flush=True)
    summary = {name: {key: statistics.median(r[key] for r in runs)
                      for key in ("step_s", "peak_mib", "above_baseline_mib")}
               for name, runs in found.items()}
    if options.json:
        print(json.dumps({"rounds": found, "medians": summary}, indent=2))
    gradient = found[names[0]][0]["gradient_mib"]
    print(f"\nGPT-2 {'(quick) ' if options.quick else ''}"
          f"{found[names[0]][0]['parameters'] / 1e6:.1f} M parameters, "
          f"{gradient:.1f} MiB of fp32 gradients per rank; medians of {options.rounds} "
          "rounds, 2 gloo ranks")
    print("| variant | step s | peak RSS MiB / rank | above baseline MiB |")
    print("|---|---:|---:|---:|")
    for name, figures in summary.items():
        print(f"| {name} | {figures['step_s']:.3f} | {figures['peak_mib']:.1f} | "
              f"{figures['above_baseline_mib']:.1f} |")
    for clip in ("1.0", "0"):
        plain = summary[f"plain Trainer, max_grad_norm={clip}"]
        ours = summary[f"optimizer_in_backward, max_grad_norm={clip}"]
        saved = plain["peak_mib"] - ours["peak_mib"]
        print(f"optimizer_in_backward, max_grad_norm={clip}: peak RSS saved "
              f"{saved:.1f} MiB = {saved / gradient:.2f} x the gradient bytes; step time "
              f"{ours['step_s'] / plain['step_s']:.2f} x plain")


if __name__ == "__main__":
    main()
