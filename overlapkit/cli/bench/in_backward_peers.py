"""Benchmark part "peers" of ``overlapkit bench --only optimizer_in_backward``:
optimizer_in_backward beside the peers' optimizer in backward and the plain loop.

The peers, each run only where it imports (CI does not install them; overlapkit never
depends on them):

- torchtune 0.6.1: one ``AdamW`` per parameter, ``training.register_optim_in_bwd_hooks``
  and ``training.create_optim_in_bwd_wrapper`` (its ``OptimizerInBackwardWrapper``), as
  its recipes set it up, and its recipes' loop: backward only;
- torchtitan 0.2.2: ``OptimizersInBackwardContainer`` and its trainer's loop: backward,
  ``step()``, ``zero_grad()`` (both no-ops there).

overlapkit's ``optimizer_in_backward`` runs both loops (backward only; backward,
``step()``, ``zero_grad()``), each compared with the peer whose users write it; the
plain loop (backward, ``AdamW.step()``, ``zero_grad()``) is there for scale.

**Step time**: one process (one thread), every variant set up once on its own copy of
the same model (same initial weights, same batch), warmed up (the first step creates
the optimizer state), then interleaved rounds in a rotating order; each round's figure
is a variant's median step, and a ratio is the median over rounds of the per-round
ratio (the two variants of a round ran seconds apart, so load from other processes
cancels better than in a ratio of medians). Both wall time (``step_ms``) and the
thread's CPU time (``cpu_ms``) are reported; the goals read the CPU time: one thread
with no I/O and no waiting spends its wall time on the CPU when the machine is quiet,
and on a shared machine the CPU time is what other processes change least (measured
under a load of 10 on 2 cores: 192 ms of wall time for 73 ms of CPU time).

**Memory**: a fresh process per variant, model and round (the optimizer state must be
created for the measurement), with glibc's mmap threshold pinned as in the rest of this
benchmark. After the model is built: ``import_mib`` is what importing the variant's
module adds to the RSS (overlapkit's ``overlapkit.overlap.techniques``, the peers'
modules above), ``setup_mib`` what setting the optimizer up adds (overlapkit's plugin
discovery included), and ``peak_above_setup_mib`` the peak RSS of the training steps
above the RSS after set-up (``VmHWM`` restarted there, :func:`reset_peak_rss`).
"""

from __future__ import annotations

import gc
import importlib
import importlib.metadata
import importlib.util
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from overlapkit.cli.bench import goal
from overlapkit.cli.bench.in_backward_peer_table import (
    FIGURES_0_2,
    MODELS,
    PEAK_MARGIN_MIB,
    PEERS,
    SETUP_MORE_MIB,
    STEP_MARGIN,
    VARIANTS,
    ModelSpec,
    peer_status,
)
from overlapkit.cli.bench.timing import paired_ratio
from overlapkit.cli.memory import fix_mmap_threshold, peak_rss_mib, reset_peak_rss, rss_mib
from overlapkit.distributed import run_distributed

__all__ = ["FIGURES_0_2", "MODELS", "PEERS", "STEP_MARGIN", "VARIANTS", "peer_status",
           "run_peers"]

LR = 1e-3
BATCH = 8


def _build(spec: ModelSpec, quick: bool) -> nn.Module:
    torch.manual_seed(0)
    depth = spec.quick_depth if quick else spec.depth
    return nn.Sequential(*[nn.Linear(spec.width, spec.width) for _ in range(depth)])


def _set_up(variant: str, model: nn.Module) -> Any:
    """The optimizer (or what holds it) of ``variant`` on ``model``, set up as its users
    do; kept alive by the caller."""
    if variant == "plain":
        return torch.optim.AdamW(model.parameters(), lr=LR)
    if variant.startswith("overlapkit"):
        from overlapkit.overlap.techniques import optimizer_in_backward

        return optimizer_in_backward(model, torch.optim.AdamW, lr=LR)
    # imported by name: neither is a dependency, and neither ships type information
    if variant == "torchtune":
        training = importlib.import_module("torchtune.training")
        optim_dict = {p: torch.optim.AdamW([p], lr=LR) for p in model.parameters()}
        training.register_optim_in_bwd_hooks(model=model, optim_dict=optim_dict)
        return training.create_optim_in_bwd_wrapper(model=model, optim_dict=optim_dict)
    titan_optimizer = importlib.import_module("torchtitan.components.optimizer")
    return titan_optimizer.OptimizersInBackwardContainer([model], torch.optim.AdamW,
                                                         {"lr": LR})


def _train_step(variant: str, model: nn.Module, optimizer: Any,
                batch: torch.Tensor) -> Callable[[], None]:
    calls_step = VARIANTS[variant][1]

    def train_step() -> None:
        model(batch).square().mean().backward()
        if calls_step:
            optimizer.step()
            optimizer.zero_grad()
    return train_step


def _importable(variant: str) -> str | None:
    """None, or why ``variant``'s module does not import here."""
    module = VARIANTS[variant][0]
    if module is None:
        return None
    try:
        importlib.import_module(module)
    except Exception as exc:  # a peer installed without what it imports
        return f"does not import: {type(exc).__name__}: {exc}".splitlines()[0]
    return None


def _timing_rank(rank: int, world_size: int, variants: list[str], models: list[str],
                 rounds: int, steps: int, warmup: int, quick: bool) -> dict[str, Any]:
    failed = {v: why for v in variants if (why := _importable(v)) is not None}
    names = [f"{m}/{v}" for m in models for v in variants if v not in failed]
    steppers: dict[str, Callable[[], None]] = {}
    keep = []
    for name in names:
        model_name, variant = name.split("/")
        spec = MODELS[model_name]
        model = _build(spec, quick)
        optimizer = _set_up(variant, model)
        batch = torch.randn(BATCH, spec.width, generator=torch.Generator().manual_seed(1))
        keep.append((model, optimizer))
        steppers[name] = _train_step(variant, model, optimizer, batch)
        for _ in range(warmup):  # the first step creates the optimizer state
            steppers[name]()
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            train_step = steppers[name]
            times, cpu_times = [], []
            for _ in range(steps):
                started, cpu_started = time.perf_counter(), time.thread_time()
                train_step()
                cpu_times.append(time.thread_time() - cpu_started)
                times.append(time.perf_counter() - started)
            wall[name].append(statistics.median(times))
            cpu[name].append(statistics.median(cpu_times))
    return {"wall": wall, "cpu": cpu, "failed": failed}


def _warm_up_torch() -> None:
    """One ``AdamW`` step on a one-element tensor, so that what torch itself imports on
    an optimizer's first use (``torch._dynamo``: 90 MiB of RSS measured, whichever
    optimizer comes first) is not counted as any variant's set-up."""
    param = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.AdamW([param], lr=LR)
    param.grad = torch.ones(1)
    optimizer.step()
    optimizer.zero_grad()


def _memory_rank(rank: int, world_size: int, variant: str, model_name: str, steps: int,
                 quick: bool) -> dict[str, Any]:
    pinned = fix_mmap_threshold()
    spec = MODELS[model_name]
    model = _build(spec, quick)
    batch = torch.randn(BATCH, spec.width, generator=torch.Generator().manual_seed(1))
    _warm_up_torch()
    gc.collect()
    before = rss_mib() or 0.0
    module = VARIANTS[variant][0]
    if module is not None:
        importlib.import_module(module)
    imported = rss_mib() or 0.0
    optimizer = _set_up(variant, model)
    gc.collect()
    set_up = rss_mib() or 0.0
    reset = reset_peak_rss()
    train_step = _train_step(variant, model, optimizer, batch)
    for _ in range(steps):
        train_step()
    return {"import_mib": imported - before, "setup_mib": set_up - imported,
            "peak_above_setup_mib": peak_rss_mib() - set_up, "reset": reset,
            "pinned": pinned}


def _memory_runs(names: list[str], rounds: int, steps: int, quick: bool
                 ) -> dict[str, list[dict[str, Any]]]:
    """``_memory_rank`` in a fresh process per ``model/variant`` and round, the order
    rotating from round to round."""
    memory: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            model_name, variant = name.split("/")
            memory[name].append(run_distributed(
                _memory_rank, 1, args=(variant, model_name, steps, quick), timeout=600)[0])
    return memory


def _figures(timing: dict[str, Any], memory: dict[str, list[dict[str, Any]]]
             ) -> dict[str, dict[str, float]]:
    figures: dict[str, dict[str, float]] = {}
    for name, wall in timing["wall"].items():
        figures[f"peers/{name}"] = {"step_ms": 1000 * statistics.median(wall),
                                    "cpu_ms": 1000 * statistics.median(timing["cpu"][name])}
        if memory.get(name):
            figures[f"peers/{name}"].update(
                {key: statistics.median(r[key] for r in memory[name])
                 for key in ("peak_above_setup_mib", "setup_mib", "import_mib")})
    return figures


def _compare(model_name: str, peer: str, timing: dict[str, Any],
             figures: dict[str, dict[str, float]], quick: bool
             ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Ratios and goals of overlapkit against ``peer`` on ``model_name``: the step time
    of both of overlapkit's loops (0.2 ran only backward, step(), zero_grad(): its
    figures are for that loop), the memory of the loop ``peer``'s users write."""
    ratios: dict[str, float] = {}
    goals: list[dict[str, Any]] = []
    figure_0_2 = FIGURES_0_2[(model_name, peer)]
    peer_name = f"{model_name}/{peer}"
    for ours in ("overlapkit_step_zero_grad", "overlapkit_backward_only"):
        label = f"peers {model_name}: {ours} / {peer}"
        ours_name = f"{model_name}/{ours}"
        ratios[f"{label} step time"] = paired_ratio(timing["wall"][ours_name],
                                                     timing["wall"][peer_name])
        cpu_ratio = paired_ratio(timing["cpu"][ours_name], timing["cpu"][peer_name])
        ratios[f"{label} step CPU time"] = cpu_ratio
        goals.append(goal(f"{label} step CPU time (0.2: {figure_0_2:g})", cpu_ratio,
                          at_most=round(figure_0_2 + STEP_MARGIN[model_name], 4),
                          judged=not quick))
    ours = PEERS[peer].ours
    label = f"peers {model_name}: {ours} / {peer}"
    ours_fig, peer_fig = figures[f"peers/{model_name}/{ours}"], figures[f"peers/{peer_name}"]
    if "setup_mib" in ours_fig and "setup_mib" in peer_fig:
        peak_more = ours_fig["peak_above_setup_mib"] - peer_fig["peak_above_setup_mib"]
        # ours with its imports, the peer's without (a peer's import is its whole
        # framework: torchtune 150 MiB, torchtitan 54 MiB measured; in import_mib)
        setup_more = ours_fig["import_mib"] + ours_fig["setup_mib"] - peer_fig["setup_mib"]
        ratios[f"{label}: training peak above set-up, MiB more"] = peak_more
        ratios[f"{label}: set-up with imports, MiB more"] = setup_more
        goals.append(goal(f"{label}: training peak above set-up, MiB more", peak_more,
                          at_most=PEAK_MARGIN_MIB, judged=not quick))
        goals.append(goal(f"{label}: set-up with imports, MiB more", setup_more,
                          at_most=SETUP_MORE_MIB, judged=not quick))
    return ratios, goals


def _peers_text(status: dict[str, str]) -> str:
    parts = []
    for peer, spec in PEERS.items():
        state = status[peer]
        if state == "not installed":
            parts.append(f"{peer} not installed ({spec.install})")
        elif state != spec.version:
            parts.append(f"{peer} {state} (the figures to keep are for {spec.version})")
        else:
            parts.append(f"{peer} {state}")
    return "; ".join(parts)


def run_peers(*, rounds: int, quick: bool, **options: Any) -> dict[str, Any]:
    """Run the part; return ``{"variants", "ratios", "goals", "peers", "notes"}``
    (variants named ``peers/<model>/<variant>``; ``peers``: per peer its version, or
    ``"not installed"``, or why it does not import).

    :param rounds: interleaved rounds of the step times.
    :param quick: a shallow ``400_small`` and no memory runs, unless ``options`` say.
    :param options: ``steps`` (timed per round), ``warmup``, ``memory_steps``,
        ``memory_rounds`` (fresh processes per variant and model each),
        ``models`` (names from :data:`MODELS`).
    """
    status = peer_status()
    models = list(options.get("models", ["400_small"] if quick else MODELS))
    steps = int(options.get("steps", 3 if quick else 10))
    warmup = int(options.get("warmup", 2 if quick else 3))
    memory_steps = int(options.get("memory_steps", 2 if quick else 3))
    memory_rounds = int(options.get("memory_rounds", 0 if quick else min(rounds, 3)))
    variants = [v for v in VARIANTS if v not in PEERS or status[v] != "not installed"]
    timing = run_distributed(_timing_rank, 1, timeout=1800,
                             args=(variants, models, rounds, steps, warmup, quick))[0]
    for peer, why in timing["failed"].items():
        status[peer] = f"{status[peer]}, {why}"
    variants = [v for v in variants if v not in timing["failed"]]
    memory = _memory_runs([f"{m}/{v}" for m in models for v in variants], memory_rounds,
                          memory_steps, quick)
    figures = _figures(timing, memory)
    ratios: dict[str, float] = {}
    goals: list[dict[str, Any]] = []
    for model_name in models:
        for ours in ("overlapkit_backward_only", "overlapkit_step_zero_grad"):
            ratios[f"peers {model_name}: {ours} / plain step time"] = paired_ratio(
                timing["wall"][f"{model_name}/{ours}"], timing["wall"][f"{model_name}/plain"])
        for peer in PEERS:
            if peer in variants:
                peer_ratios, peer_goals = _compare(model_name, peer, timing, figures,
                                                     quick)
                ratios.update(peer_ratios)
                goals += peer_goals
    runs = [r for rs in memory.values() for r in rs]
    described = "; ".join(f"{m} = {MODELS[m].description}" for m in models)
    if runs:
        restarted = all(r["reset"] for r in runs)
        memory_text = (
            f"memory: a fresh process per variant, median of {memory_rounds} round(s) of "
            f"{memory_steps} steps, peak above set-up "
            f"{'(VmHWM restarted after set-up)' if restarted else '(VmHWM NOT restarted)'}, "
            f"glibc mmap threshold {'pinned' if all(r['pinned'] for r in runs) else 'dynamic'}")
    else:
        memory_text = "memory: not measured (--quick)"
    notes = (
        f"Peers part: one process, 1 thread, AdamW lr={LR}, batch {BATCH}; {described}"
        f"{' (quick: shallower)' if quick else ''}; step time: median of {rounds} "
        f"interleaved round(s) of {steps} steps after {warmup} warm-up steps, ratios: "
        f"median of per-round ratios; {memory_text}. Goals: ours / peer step CPU time <= "
        f"the 0.2 figure + {', '.join(f'{v:g} ({m})' for m, v in STEP_MARGIN.items())}; "
        f"training peak <= the peer's + {PEAK_MARGIN_MIB:g} "
        f"MiB; set-up with overlapkit's imports <= the peer's set-up + "
        f"{SETUP_MORE_MIB:g} MiB. Peers: {_peers_text(status)}."
    )
    return {"variants": figures, "ratios": ratios, "goals": goals, "peers": status,
            "notes": notes}
