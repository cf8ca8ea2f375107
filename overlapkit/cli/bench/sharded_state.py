"""Benchmark: sharded optimizer state (``overlap_ddp(..., shard_optimizer_state=True)``)
vs plain DDP + Adam, ``overlap_ddp`` without sharding, and PyTorch's
``ZeroRedundancyOptimizer`` with and without ``overlap_with_ddp``.

Step time: every variant on the same MLP (same initial weights, same data) in the same
processes, taking turns in interleaved rounds (the order rotates); each round's figure
is the median step (forward + backward + step + zero_grad) of its timed steps, the
result the median over rounds, slowest rank. The machine is shared: interleaving and
medians keep the ratios comparable even when the absolute times drift.

Memory: each variant trains a 50 M-parameter MLP (12 x Linear(2048, 2048), where Adam's
state, 2 x the parameters, dominates) in fresh processes of its own, with glibc's mmap
threshold pinned (freed tensors go back to the OS; see the optimizer_in_backward
benchmark), several rounds; the peak RSS per rank (``VmHWM``, largest rank, median over
rounds) and the optimizer-state bytes each rank holds. The goal of the issue: the
sharded peak below plain DDP's by at least ``0.9 x (1 - 1/world_size)`` of the Adam
state bytes.

Traffic per step, counted: the gradient bytes reduced (every variant), and the parameter
bytes each rank sends and receives in the exchange (sharded: counted by the exchange;
ZeRO: its broadcasts of each rank's partition, from its partition sizes).

``ZeroRedundancyOptimizer(overlap_with_ddp=True)`` needs ``hook_with_zero_step``, which
refuses gloo ("Gloo backend using Overlapping DDP with ZeRO may meet hangs",
pytorch#62300): on CPU it is tried once and its error noted; with ``device="cuda"`` (NCCL)
it runs (its first iterations do not update: the warm-up steps cover them).
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from overlapkit.cli.bench import goal, torchscript_warnings_silenced
from overlapkit.cli.bench.timing import mlp, paired_ratio, slowest_per_round, timed_rounds
from overlapkit.cli.memory import fix_mmap_threshold, peak_rss_mib
from overlapkit.distributed import RankFailedError, run_distributed

__all__ = ["VARIANTS", "run_benchmark"]

COMMAND = "python benchmarks/sharded_state.py"
LR = 1e-3
BATCH = 16
#: the variants, in the order they are listed
VARIANTS = ("plain", "overlap_ddp", "sharded", "zero", "zero_overlap")
#: (width, depth, DDP bucket_cap_mb) of the timing MLP: 8 x Linear(1024) = 8.4 M params
TIMING = (1024, 8, 4.0)
#: the memory MLP: 12 x Linear(2048) = 50.36 M parameters, DDP's default buckets
MEMORY = (2048, 12, 25.0)
QUICK = (256, 3, 0.25)


def zero_overlap_refusal() -> str | None:
    """Why ``hook_with_zero_step`` cannot run on this process group (None: it can)."""
    if dist.get_backend() == "gloo":
        return ("torch's hook_with_zero_step refuses gloo: 'Gloo backend using "
                "Overlapping DDP with ZeRO may meet hangs' (pytorch#62300)")
    return None


class _Variant:
    """One variant's DDP model and optimizer, and a ``train_step(x)``."""

    def __init__(self, name: str, width: int, depth: int, cap: float,
                 device: torch.device | None) -> None:
        import overlapkit

        model = mlp(width, depth)
        if device is not None:
            model = model.to(device)
        self.name = name
        self.device = device
        self.ddp = DDP(model, bucket_cap_mb=cap,
                       device_ids=None if device is None else [device.index])
        self.optimizer: Any = None
        self.zero: Any = None
        if name == "plain":
            self.optimizer = torch.optim.Adam(self.ddp.parameters(), lr=LR)
        elif name in ("overlap_ddp", "sharded"):
            self.optimizer = overlapkit.overlap_ddp(
                self.ddp, torch.optim.Adam, lr=LR,
                shard_optimizer_state=name == "sharded")
        elif name == "zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.zero = ZeroRedundancyOptimizer(self.ddp.parameters(),
                                                optimizer_class=torch.optim.Adam, lr=LR)
            self.optimizer = self.zero
        elif name == "zero_overlap":
            from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import (
                hook_with_zero_step,
            )
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
                allreduce_hook,
            )
            from torch.distributed.optim import ZeroRedundancyOptimizer

            with torchscript_warnings_silenced():  # functional optimizers are scripted
                self.zero = ZeroRedundancyOptimizer(
                    self.ddp.parameters(), optimizer_class=torch.optim.Adam,
                    overlap_with_ddp=True, lr=LR)
            self.ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, self.ddp,
                                                                  self.zero))
        else:
            raise ValueError(f"unknown variant {name!r}")

    def train_step(self, x: torch.Tensor) -> None:
        if self.device is not None:
            torch.cuda.synchronize(self.device)
        self.ddp(x).square().mean().backward()
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad()
        else:  # ZeRO overlapped: the step is in the comm hook; no step() in the loop
            self.ddp.zero_grad(set_to_none=True)
        if self.device is not None:
            torch.cuda.synchronize(self.device)

    def state_bytes(self) -> int:
        """The optimizer-state bytes this rank holds."""
        if self.zero is not None:
            state = self.zero.optim.state
        elif hasattr(self.optimizer, "unwrap"):
            state = self.optimizer.unwrap().state
        else:
            state = self.optimizer.state
        return sum(v.numel() * v.element_size() for per_param in state.values()
                   for v in per_param.values() if isinstance(v, torch.Tensor))

    def exchanged_bytes(self) -> tuple[int, int]:
        """Parameter bytes this rank sends and receives per step after its step."""
        if self.name == "sharded":
            traffic = self.optimizer._stepper.exchange.reset_traffic()
            return traffic.bytes_sent, traffic.bytes_received
        if self.zero is not None and dist.get_world_size() > 1:
            # each rank broadcasts its partition to the others
            rank = dist.get_rank()
            sizes = [sum(p.numel() * p.element_size() for group in groups
                         for p in group["params"])
                     for groups in self.zero._partition_parameters()]
            return sizes[rank], sum(sizes) - sizes[rank]
        return 0, 0


def _device(device: str) -> torch.device | None:
    return torch.device("cuda", dist.get_rank()) if device == "cuda" else None


def _names(device: str) -> list[str]:
    return [n for n in VARIANTS if n != "zero_overlap" or zero_overlap_refusal() is None]


def _timing_rank(rank: int, world_size: int, shape: tuple[int, int, float], rounds: int,
                 steps: int, warmup: int, device: str) -> dict[str, Any]:
    names = _names(device)
    width, depth, cap = shape
    where = _device(device)
    variants = {name: _Variant(name, width, depth, cap, where) for name in names}
    batch = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(rank))
    if where is not None:
        batch = batch.to(where)
    for variant in variants.values():
        for _ in range(warmup):
            variant.train_step(batch)
    traffic = {}
    for name, variant in variants.items():
        variant.exchanged_bytes()  # reset the count
        variant.train_step(batch)
        traffic[name] = variant.exchanged_bytes()
    per_round = timed_rounds(variants, names, rounds, steps, batch)
    grad_bytes = sum(p.numel() * p.element_size() for p in variants[names[0]].ddp.parameters())
    return {"per_round": per_round, "traffic": traffic, "grad_bytes": grad_bytes,
            "state_bytes": {n: v.state_bytes() for n, v in variants.items()}}


def _memory_rank(rank: int, world_size: int, name: str, shape: tuple[int, int, float],
                 steps: int, device: str) -> dict[str, float]:
    pinned = fix_mmap_threshold()
    baseline = peak_rss_mib()
    width, depth, cap = shape
    where = _device(device)
    if where is not None:
        torch.cuda.reset_peak_memory_stats(where)
    variant = _Variant(name, width, depth, cap, where)
    batch = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(rank))
    if where is not None:
        batch = batch.to(where)
    for _ in range(steps):
        variant.train_step(batch)
    peak = peak_rss_mib()
    out = {"peak_rss_mib": peak, "peak_rss_above_baseline_mib": peak - baseline,
           "state_mib": variant.state_bytes() / 2**20, "pinned": float(pinned)}
    if where is not None:
        out["peak_cuda_mib"] = torch.cuda.max_memory_allocated(where) / 2**20
    return out


def _zero_overlap_on_cpu(rank: int, world_size: int) -> str:
    """torch's overlapped ZeRO on gloo, tried once on a small model: its error."""
    try:
        _Variant("zero_overlap", *QUICK, device=None)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return "ran"


def run_benchmark(*, rounds: int = 5, world_size: int = 2, quick: bool = False,
                  **options: Any) -> dict[str, Any]:
    """Run the benchmark; return a JSON-serialisable dict of medians and ratios.

    :param rounds: interleaved timing rounds; memory runs ``min(rounds, 3)`` fresh runs
        per variant.
    :param quick: a small model and few steps, to check that it runs.
    :param options: ``steps``, ``warmup``, ``device`` (``"cpu"``, or ``"cuda"``: NCCL,
        one GPU per rank).
    """
    device = str(options.get("device", "cpu"))
    backend = "nccl" if device == "cuda" else "gloo"
    timing = QUICK if quick else TIMING
    memory_shape = QUICK if quick else MEMORY
    steps = int(options.get("steps", 3 if quick else 8))
    warmup = int(options.get("warmup", 3 if quick else 4))  # ZeRO-overlap's no-op steps
    if quick:
        rounds = min(rounds, 1)
    per_rank = run_distributed(_timing_rank, world_size,
                               args=(timing, rounds, steps, warmup, device),
                               timeout=900, backend=backend)
    names = list(per_rank[0]["per_round"])
    timings = [r["per_round"] for r in per_rank]
    variants: dict[str, dict[str, Any]] = {}
    for name in names:
        slowest = slowest_per_round(timings, name)
        sent = max(r["traffic"][name][0] for r in per_rank)
        received = max(r["traffic"][name][1] for r in per_rank)
        variants[name] = {
            "step_ms": 1000 * statistics.median(slowest),
            "reduced_mib_per_step": per_rank[0]["grad_bytes"] / 2**20,
            "exchange_sent_mib_per_step": sent / 2**20,
            "exchange_received_mib_per_step": received / 2**20,
            "timing_state_mib_per_rank": max(r["state_bytes"][name] for r in per_rank) / 2**20,
        }
    # GPU memory (max_memory_allocated) is the same in every run: one is enough there
    memory_rounds = 1 if device == "cuda" else min(rounds, 3)
    # --quick: the memory runs of the two variants the memory goal compares
    memory_names = ["plain", "sharded"] if quick else names
    memory_runs: dict[str, list[list[dict[str, float]]]] = {n: [] for n in memory_names}
    for round_index in range(memory_rounds):
        shift = round_index % len(memory_names)
        for name in memory_names[shift:] + memory_names[:shift]:
            memory_runs[name].append(run_distributed(
                _memory_rank, world_size, args=(name, memory_shape, 2 if quick else 3,
                                                device),
                timeout=900, backend=backend))
    for name, runs in memory_runs.items():
        for key in ("peak_rss_mib", "peak_rss_above_baseline_mib", "state_mib",
                    "peak_cuda_mib"):
            if key in runs[0][0]:
                variants[name][key] = statistics.median(max(r[key] for r in ranks)
                                                        for ranks in runs)
    pinned = all(r["pinned"] for runs in memory_runs.values() for ranks in runs for r in ranks)
    refusal = None
    if "zero_overlap" not in names:
        try:
            refusal = run_distributed(_zero_overlap_on_cpu, world_size)[0]
        except RankFailedError as exc:  # pragma: no cover - depends on torch
            refusal = str(exc).splitlines()[-1]
    sharded, plain = variants["sharded"], variants["plain"]
    state_mib = variants["plain"]["state_mib"]

    def paired(other: str) -> float:
        """The median over rounds of sharded / ``other`` within each round (the two ran
        back to back): steadier than a ratio of medians when the machine's load drifts
        between rounds."""
        return paired_ratio(
            slowest_per_round(timings, "sharded"), slowest_per_round(timings, other))

    ratios: dict[str, float] = {
        "sharded / overlap_ddp step time": paired("overlap_ddp"),
        "sharded / plain step time": paired("plain"),
        "sharded / zero step time": paired("zero"),
        "(plain - sharded) peak RSS / ((1 - 1/ws) x Adam state)": (
            (plain["peak_rss_mib"] - sharded["peak_rss_mib"])
            / ((1 - 1 / world_size) * state_mib)) if world_size > 1 else float("nan"),
        "sharded / plain optimizer state per rank": (
            sharded["timing_state_mib_per_rank"] / plain["timing_state_mib_per_rank"]),
        "zero / plain optimizer state per rank": (
            variants["zero"]["timing_state_mib_per_rank"] / plain["timing_state_mib_per_rank"]),
    }
    if "zero_overlap" in variants:
        ratios["sharded / zero_overlap step time"] = paired("zero_overlap")
    goals = [
        goal("sharded / overlap_ddp step time", ratios["sharded / overlap_ddp step time"],
             at_most=1.05, judged=not quick),
        goal("sharded / zero step time", ratios["sharded / zero step time"], at_most=1.0,
             judged=not quick),
    ]
    if "sharded / zero_overlap step time" in ratios:  # not on gloo: see the notes
        goals.append(goal("sharded / zero_overlap step time",
                          ratios["sharded / zero_overlap step time"], at_most=1.0,
                          judged=not quick))
    if world_size > 1:
        goals.append(goal("(plain - sharded) peak RSS / ((1 - 1/ws) x Adam state)",
                          ratios["(plain - sharded) peak RSS / ((1 - 1/ws) x Adam state)"],
                          at_least=0.9, judged=not quick))
    t_width, t_depth, t_cap = timing
    m_width, m_depth, m_cap = memory_shape
    n_timing = sum(p.numel() for p in mlp(t_width, t_depth).parameters())
    n_memory = sum(p.numel() for p in mlp(m_width, m_depth).parameters())
    return {
        "benchmark": "sharded_state",
        "command": COMMAND + (" --quick" if quick else ""),
        "variants": variants,
        "ratios": ratios,
        "goals": goals,
        "notes": (
            f"{world_size} "
            + ("NCCL ranks, one GPU each" if device == "cuda" else "gloo ranks on CPU, 1 "
               "thread each, on a shared machine")
            + f"; Adam lr={LR}, batch {BATCH}. Step time: MLP {t_depth} x Linear({t_width}) "
            f"= {n_timing / 1e6:.2f} M parameters, bucket_cap_mb={t_cap}, median of "
            f"{rounds} interleaved rounds of {steps} steps after {warmup} warm-up steps "
            "(slowest rank); step-time ratios are medians of the per-round ratios. "
            f"Memory: MLP {m_depth} x Linear({m_width}) = "
            f"{n_memory / 1e6:.2f} M parameters, bucket_cap_mb={m_cap}, "
            f"{2 if quick else 3} steps per fresh run, median of {memory_rounds} rounds"
            + (" (plain and sharded only)" if quick else "") + ", "
            "largest rank; glibc mmap threshold "
            f"{'pinned at 128 KiB' if pinned else 'dynamic (glibc default)'}. Traffic per "
            "step: one reduction of every gradient (reduced_mib) plus, sharded and ZeRO, "
            "one exchange of the parameters (exchange_*_mib, largest rank). "
            + ("" if refusal is None else
               f"zero_overlap not measured: {refusal}.")
        ),
    }
