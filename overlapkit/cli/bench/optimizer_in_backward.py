"""Benchmark: optimizer_in_backward vs the plain loop (peak memory, step time), and vs
torch's ``_apply_optimizer_in_backward`` on a plain module.

Every variant trains the same MLP (same initial weights, same data) with AdamW in
fresh processes of its own, so each rank's peak RSS (``VmHWM``, a high-water mark)
belongs to that variant alone; a variant's peak is reported above a baseline taken
after imports and process-group set-up, before the model is built. Rounds run every
variant once, in a rotating order; figures are medians over rounds, largest (peak
RSS) or slowest (step time) rank. The saving is compared with the gradient bytes (the
fp32 gradients of every parameter, per rank).

Variants: DDP (``gradient_as_bucket_view`` False, the default, and True), plain loop
vs optimizer_in_backward; a plain module on each rank (no communication): plain loop,
optimizer_in_backward, torch's ``_apply_optimizer_in_backward``. torch's DDP path
(``_apply_optim_in_backward_hook``) is tried once on a small model and its error noted.

Part "peers" (:mod:`overlapkit.cli.bench.in_backward_peers`): step time and memory
beside torchtune's and torchtitan's optimizer in backward, each where it is installed.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from overlapkit.cli.bench import goal, torchscript_warnings_silenced
from overlapkit.cli.bench.timing import mlp
from overlapkit.cli.memory import fix_mmap_threshold, peak_rss_mib
from overlapkit.distributed import RankFailedError, run_distributed

__all__ = ["VARIANTS", "fix_mmap_threshold", "run_benchmark"]

COMMAND = "python benchmarks/optimizer_in_backward.py"
LR = 1e-3
BATCH = 8
#: (width, depth) of the MLP: 12 x Linear(2048, 2048) = 50.36 M parameters
FULL = (2048, 12)
QUICK = (256, 4)
#: variant -> (model wrapping, optimizer set-up)
VARIANTS: dict[str, tuple[str, str]] = {
    "ddp/plain": ("ddp", "plain"),
    "ddp/optimizer_in_backward": ("ddp", "overlapkit"),
    "ddp_bucket_view/plain": ("ddp_bucket_view", "plain"),
    "ddp_bucket_view/optimizer_in_backward": ("ddp_bucket_view", "overlapkit"),
    "module/plain": ("module", "plain"),
    "module/optimizer_in_backward": ("module", "overlapkit"),
    "module/torch_apply_optimizer_in_backward": ("module", "torch"),
}


def _peak_rss_mib() -> float:
    return peak_rss_mib()


def _set_up(variant: str, width: int, depth: int) -> tuple[nn.Module, Any]:
    import overlapkit

    wrapping, optimizer = VARIANTS[variant]
    model = mlp(width, depth)
    if optimizer == "torch":
        from torch.distributed.optim import _apply_optimizer_in_backward

        with torchscript_warnings_silenced():  # torch.distributed.optim scripts, and warns
            _apply_optimizer_in_backward(torch.optim.AdamW, model.parameters(), {"lr": LR})
        return model, None
    if wrapping.startswith("ddp"):
        model = DDP(model, gradient_as_bucket_view=wrapping == "ddp_bucket_view")
    if optimizer == "overlapkit":
        return model, overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=LR)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def _variant_rank(rank: int, world_size: int, variant: str, width: int, depth: int,
                  steps: int, pin_threshold: bool) -> dict[str, Any]:
    pinned = fix_mmap_threshold() if pin_threshold else False
    baseline = _peak_rss_mib()
    model, optimizer = _set_up(variant, width, depth)
    batch = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(rank))
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        model(batch).square().mean().backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()
        times.append(time.perf_counter() - started)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = _peak_rss_mib()
    return {"peak_rss_mib": peak, "peak_rss_above_baseline_mib": peak - baseline,
            # the first step allocates the optimizer state: left out of the time
            "step_ms": 1000 * statistics.median(times[1:] or times),
            "grad_mib": grad_bytes / 2**20, "pinned": pinned}


def _torch_ddp_rank(rank: int, world_size: int) -> str:
    from torch.distributed.optim import _apply_optimizer_in_backward

    model = mlp(*QUICK)
    with torchscript_warnings_silenced():
        _apply_optimizer_in_backward(torch.optim.AdamW, model.parameters(), {"lr": LR})
    ddp = DDP(model)
    try:
        ddp(torch.randn(BATCH, QUICK[0])).square().mean().backward()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return "ran"


def run_benchmark(*, rounds: int = 5, world_size: int = 2, quick: bool = False,
                  **options: Any) -> dict[str, Any]:
    """Run the benchmark; return a JSON-serialisable dict of medians and ratios.

    :param rounds: rounds; each runs every variant once, in fresh processes.
    :param quick: a small model and few steps, to check that it runs.
    :param options: ``steps`` (per run, the first untimed), ``variants`` (names from
        :data:`VARIANTS`), ``pin_mmap_threshold`` (default True, see
        :func:`fix_mmap_threshold`), ``peers`` (default True: run the peers part;
        ``peer_options``: its options, see
        :func:`~overlapkit.cli.bench.in_backward_peers.run_peers`).
    """
    pin_threshold = bool(options.get("pin_mmap_threshold", True))
    width, depth = QUICK if quick else FULL
    steps = int(options.get("steps", 3 if quick else 5))
    names = list(options.get("variants", VARIANTS))
    if quick:
        rounds = min(rounds, 2)
    runs: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            runs[name].append(run_distributed(_variant_rank, world_size,
                                              args=(name, width, depth, steps, pin_threshold),
                                              timeout=900))
    variants: dict[str, dict[str, float]] = {}
    for name, per_round in runs.items():
        variants[name] = {
            "peak_rss_mib": statistics.median(max(r["peak_rss_mib"] for r in ranks)
                                              for ranks in per_round),
            "peak_rss_above_baseline_mib": statistics.median(
                max(r["peak_rss_above_baseline_mib"] for r in ranks) for ranks in per_round),
            "step_ms": statistics.median(max(r["step_ms"] for r in ranks)
                                         for ranks in per_round),
        }
    grad_mib = runs[names[0]][0][0]["grad_mib"]
    pinned = all(r["pinned"] for per_round in runs.values() for ranks in per_round
                 for r in ranks)
    ratios: dict[str, float] = {}
    goals = []
    for wrapping in ("ddp", "ddp_bucket_view", "module"):
        plain, ours = variants.get(f"{wrapping}/plain"), variants.get(
            f"{wrapping}/optimizer_in_backward")
        if plain is None or ours is None:
            continue
        saved = f"{wrapping}: (plain - ours) peak RSS / gradient bytes"
        ratios[saved] = (plain["peak_rss_mib"] - ours["peak_rss_mib"]) / grad_mib
        if wrapping != "ddp_bucket_view":  # there the gradients are DDP's buckets: kept
            goals.append(goal(saved, ratios[saved], at_least=0.9, judged=not quick))
        ratios[f"{wrapping}: ours / plain step time"] = ours["step_ms"] / plain["step_ms"]
    torch_module = variants.get("module/torch_apply_optimizer_in_backward")
    ours_module = variants.get("module/optimizer_in_backward")
    if torch_module is not None and ours_module is not None:
        ratios["module: ours / torch peak RSS"] = (ours_module["peak_rss_mib"]
                                                   / torch_module["peak_rss_mib"])
        ratios["module: ours / torch step time"] = (ours_module["step_ms"]
                                                    / torch_module["step_ms"])
    try:
        torch_ddp = run_distributed(_torch_ddp_rank, world_size)[0]
    except RankFailedError as exc:  # pragma: no cover - depends on torch
        torch_ddp = str(exc).splitlines()[-1]
    n_params = sum(p.numel() for p in mlp(width, depth).parameters())
    peers: dict[str, Any] = {"variants": {}, "ratios": {}, "goals": [], "peers": {},
                             "notes": ""}
    if options.get("peers", True):
        from overlapkit.cli.bench.in_backward_peers import run_peers

        peers = run_peers(rounds=rounds, quick=quick, **options.get("peer_options", {}))
    variants.update(peers["variants"])
    ratios.update(peers["ratios"])
    goals += peers["goals"]
    return {
        "benchmark": "optimizer_in_backward",
        "command": COMMAND + (" --quick" if quick else ""),
        "variants": variants,
        "ratios": ratios,
        "goals": goals,
        "notes": (
            f"{world_size} gloo ranks on CPU, 1 thread each; MLP {depth} x Linear({width}, "
            f"{width}) = {n_params / 1e6:.2f} M parameters, {grad_mib:.1f} MiB of fp32 "
            f"gradients per rank; AdamW lr={LR}, batch {BATCH}; {steps} steps per run "
            f"(the first untimed); medians of {rounds} rounds, fresh processes per "
            "variant per round; peak RSS = VmHWM, largest rank; glibc mmap "
            f"threshold {'pinned at 128 KiB' if pinned else 'dynamic (glibc default)'}. "
            "torch's DDP optimizer in backward on CPU: "
            f"{torch_ddp.rstrip('.')}. {peers['notes']}"
        ),
        "peers": peers["peers"],
    }
