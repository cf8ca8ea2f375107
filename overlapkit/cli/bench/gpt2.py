"""Benchmark: GPT-2 (``GPT2LMHeadModel`` from a ``transformers`` config, random weights,
no download) under bf16 autocast with AdamW: plain DDP + ``step()``, ``overlap_ddp``,
``optimizer_in_backward`` on the DDP model, and torch's own overlap
(``DDP._register_fused_optim``).

One code path, two sizes: on CUDA (``overlapkit bench --device cuda --only gpt2
--world-size 1``) GPT-2 small (124 M parameters, 12 layers, width 768, 12 heads,
sequence 1024), where the goal ``overlap_ddp / plain <= 1.02`` at world size 1 is
judged; on CPU, and with ``--quick``, a tiny GPT-2 (2 layers, width 64, 2 heads,
vocabulary 1000, sequence 64) whose figures are shown, not judged: it checks that
every variant runs (and trains to plain's parameters) in CI.

The variants take turns in every round (the order rotates); a round's figure is the
median step time (forward + backward + step + zero_grad, between
``torch.cuda.synchronize()`` calls on a GPU); peak memory comes from a fresh run per
variant. Every variant takes the same steps on the same batch from the same weights,
so at the end each variant's parameters are compared with plain's
(``params_max_diff_vs_plain``: 0.0 is bitwise; dropout is off for that).
"""

from __future__ import annotations

import importlib.util
import statistics
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from overlapkit.cli.bench import goal, torchscript_warnings_silenced
from overlapkit.cli.bench.timing import paired_ratio, slowest_per_round, timed_rounds
from overlapkit.cli.memory import peak_rss_mib
from overlapkit.distributed import run_distributed
from overlapkit.errors import ConfigurationError

__all__ = ["SIZES", "VARIANTS", "run_benchmark"]

VARIANTS = ("plain", "overlap_ddp", "optimizer_in_backward", "torch_overlap")
COMMAND = "overlapkit bench --only gpt2"
LR = 1e-4
GOAL = 1.02
#: size -> GPT2Config fields, and the batch (sequences) and sequence length
SIZES: dict[str, dict[str, int]] = {
    "small": {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257,
              "seq": 1024, "batch": 8},
    "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 1000,
             "seq": 64, "batch": 4},
}
MISSING = ("the gpt2 benchmark needs transformers (GPT2LMHeadModel), which is not "
           "installed: pip install transformers")


def transformers_missing() -> bool:
    """Whether ``transformers`` is absent (found, not imported: it is slow to import)."""
    return importlib.util.find_spec("transformers") is None


def _model(size: str) -> torch.nn.Module:
    """GPT-2 of ``size``, random weights seeded alike on every call; dropout off, so
    that every variant's run is deterministic and comparable with plain's."""
    from transformers import GPT2Config, GPT2LMHeadModel

    fields = SIZES[size]
    config = GPT2Config(n_layer=fields["n_layer"], n_embd=fields["n_embd"],
                        n_head=fields["n_head"], vocab_size=fields["vocab_size"],
                        n_positions=fields["seq"], resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, bos_token_id=fields["vocab_size"] - 1,
                        eos_token_id=fields["vocab_size"] - 1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # GPT-2's own loss, named: else transformers warns
    return model


class _Variant:
    """One variant's DDP model, optimizer (None for torch_overlap: stepped in its comm
    hook) and a ``train_step(input_ids)``."""

    def __init__(self, name: str, size: str, device: str) -> None:
        import overlapkit

        self.name = name
        self.device = (torch.device("cuda", dist.get_rank()) if device == "cuda"
                       else torch.device("cpu"))
        model = _model(size).to(self.device)
        self.ddp = DDP(model, device_ids=None if device == "cpu" else [self.device.index])
        self.optimizer: Any = None
        if name == "plain":
            self.optimizer = torch.optim.AdamW(self.ddp.parameters(), lr=LR)
        elif name in ("overlap_ddp", "optimizer_in_backward"):
            self.optimizer = getattr(overlapkit, name)(self.ddp, torch.optim.AdamW, lr=LR)
        elif name == "torch_overlap":
            with torchscript_warnings_silenced():  # torch warns on every construction
                self.ddp._register_fused_optim(torch.optim.AdamW, lr=LR)
        else:
            raise ValueError(f"unknown variant {name!r}")

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def train_step(self, input_ids: torch.Tensor) -> None:
        self._sync()  # time the step, not what came before
        with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16):
            loss = self.ddp(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        if self.optimizer is None:
            self.ddp.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
            self.optimizer.zero_grad()
        self._sync()


def _batch(rank: int, size: str, device: torch.device) -> torch.Tensor:
    fields = SIZES[size]
    generator = torch.Generator().manual_seed(rank)
    return torch.randint(0, fields["vocab_size"], (fields["batch"], fields["seq"]),
                         generator=generator).to(device)


def _max_diff(ours: torch.nn.Module, plain: torch.nn.Module) -> float:
    """The largest absolute difference between two models' parameters."""
    return max(float((a.detach().float() - b.detach().float()).abs().max())
               for a, b in zip(ours.parameters(), plain.parameters(), strict=True))


def _timing_rank(rank: int, world_size: int, size: str, rounds: int, steps: int,
                 warmup: int, device: str) -> dict[str, Any]:
    variants = {name: _Variant(name, size, device) for name in VARIANTS}
    batch = _batch(rank, size, variants["plain"].device)
    for variant in variants.values():
        for _ in range(warmup):
            variant.train_step(batch)
    per_round = timed_rounds(variants, VARIANTS, rounds, steps, batch)
    plain = variants["plain"].ddp.module
    diffs = {name: _max_diff(variants[name].ddp.module, plain) for name in VARIANTS}
    return {"per_round": per_round, "diffs": diffs}


def _memory_rank(rank: int, world_size: int, name: str, size: str, steps: int,
                 device: str) -> dict[str, float]:
    baseline = peak_rss_mib()
    variant = _Variant(name, size, device)
    batch = _batch(rank, size, variant.device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats(variant.device)
    for _ in range(steps):
        variant.train_step(batch)
    if device == "cuda":
        return {"peak_cuda_mib": torch.cuda.max_memory_allocated(variant.device) / 2**20}
    peak = peak_rss_mib()
    return {"peak_rss_mib": peak, "peak_rss_above_baseline_mib": peak - baseline}


def _skipped(quick: bool) -> dict[str, Any]:
    return {"benchmark": "gpt2", "command": COMMAND + (" --quick" if quick else ""),
            "skipped": MISSING, "variants": {}, "ratios": {}, "goals": [],
            "notes": MISSING}


def run_benchmark(*, rounds: int = 5, world_size: int = 1, quick: bool = False,
                  **options: Any) -> dict[str, Any]:
    """Run the benchmark; return a JSON-serialisable dict of medians and ratios, or,
    where transformers is missing, a result that says so (``"skipped"``) and has no
    variants.

    :param quick: the tiny GPT-2 and few steps, to check that every variant runs.
    :param options: ``device`` (``"cpu"``, or ``"cuda"``: NCCL, one GPU per rank),
        ``size`` (``"tiny"`` or ``"small"``; default: small on CUDA, tiny on CPU or
        with ``quick``), ``steps``, ``warmup``.
    """
    if transformers_missing():
        return _skipped(quick)
    device = str(options.get("device", "cpu"))
    backend = "nccl" if device == "cuda" else "gloo"
    size = str(options.get("size", "small" if device == "cuda" and not quick else "tiny"))
    if size not in SIZES:
        raise ConfigurationError(f"gpt2: size must be one of {', '.join(SIZES)}, got "
                                 f"{size!r}.")
    steps = int(options.get("steps", 3 if quick else 10))
    warmup = int(options.get("warmup", 1 if quick else 3))
    if quick:
        rounds = min(rounds, 2)
    per_rank = run_distributed(_timing_rank, world_size,
                               args=(size, rounds, steps, warmup, device),
                               timeout=600, backend=backend)
    timings = [r["per_round"] for r in per_rank]
    slowest = {name: slowest_per_round(timings, name) for name in VARIANTS}
    variants: dict[str, dict[str, float]] = {}
    for name in VARIANTS:
        memory = run_distributed(_memory_rank, world_size,
                                 args=(name, size, warmup + 1, device), timeout=600,
                                 backend=backend)
        variants[name] = {"step_ms": 1000 * statistics.median(slowest[name])}
        for key in memory[0]:
            variants[name][key] = max(m[key] for m in memory)
        variants[name]["params_max_diff_vs_plain"] = max(r["diffs"][name] for r in per_rank)
    ratios = {f"{name} / plain step time": paired_ratio(slowest[name], slowest["plain"])
              for name in VARIANTS if name != "plain"}
    judged = device == "cuda" and size == "small" and world_size == 1 and not quick
    record = goal(f"gpt2 {size}: overlap_ddp / plain step time (CUDA, world size 1)",
                  ratios["overlap_ddp / plain step time"], at_most=GOAL, judged=judged)
    if not judged and not quick:
        record["not_judged"] = ("not judged: the goal is about GPT-2 small on CUDA at "
                                "world size 1")
    fields = SIZES[size]
    return {
        "benchmark": "gpt2",
        "command": (COMMAND + (" --quick" if quick else "")
                    + (f" --device cuda --world-size {world_size}" if device == "cuda"
                       else "")),
        "variants": variants,
        "ratios": ratios,
        "goals": [record],
        "notes": (
            f"GPT-2 {size} (n_layer {fields['n_layer']}, n_embd {fields['n_embd']}, "
            f"n_head {fields['n_head']}, vocab {fields['vocab_size']}; random weights, "
            f"dropout off), batch {fields['batch']} x {fields['seq']} tokens, bf16 "
            f"autocast, AdamW lr={LR}; {world_size} "
            + ("NCCL rank(s), one GPU each" if device == "cuda" else "gloo rank(s) on CPU")
            + f"; median of {rounds} interleaved rounds of {steps} steps (slowest rank); "
            "ratios: median over rounds of the per-round ratio; peak memory from a "
            "fresh run per variant; params_max_diff_vs_plain after the same steps "
            "(0.0: bitwise)."
        ),
    }
