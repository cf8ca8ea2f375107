"""Lion's bucket step (flat buffers, the plugin's) against overlapkit's generic engine.

One process, no communication: the time to step one DDP-sized bucket of parameters,
which is what each comm hook call pays. Variants interleaved, medians of rounds.

    python plugins/overlapkit-lion/benchmarks/bucket_step.py [--params 400] [--numel 4096]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from overlapkit.plugin import GenericOverlapEngine
from overlapkit_lion import Lion, LionOverlapped


def _bucket(count: int, numel: int) -> list[torch.nn.Parameter]:
    """Parameters whose gradients are views of one flat buffer, as in a DDP bucket."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(count)]
    buffer = torch.randn(count * numel)
    for index, p in enumerate(params):
        p.grad = buffer[index * numel:(index + 1) * numel]
    return params


def _time_steps(engine: object, params: list[torch.nn.Parameter], steps: int) -> float:
    started = time.perf_counter()
    for _ in range(steps):
        engine.step_params(params)  # type: ignore[attr-defined]
    return (time.perf_counter() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=400, help="parameters in the bucket")
    parser.add_argument("--numel", type=int, default=4096, help="elements per parameter")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=50, help="bucket steps per round")
    args = parser.parse_args()
    torch.set_num_threads(1)

    params = _bucket(args.params, args.numel)
    engines = {
        "lion plugin (flat bucket step)": LionOverlapped(Lion(params, lr=1e-4)),
        "generic engine, foreach=True": GenericOverlapEngine(Lion(params, lr=1e-4)),
        "generic engine, foreach=False": GenericOverlapEngine(
            Lion(params, lr=1e-4, foreach=False)),
    }
    times: dict[str, list[float]] = {name: [] for name in engines}
    for engine in engines.values():
        _time_steps(engine, params, 3)  # state created, caches warm
    for _ in range(args.rounds):
        for name, engine in engines.items():
            times[name].append(_time_steps(engine, params, args.steps))
    plugin = statistics.median(times["lion plugin (flat bucket step)"])
    print(f"bucket: {args.params} parameters x {args.numel} elements, "
          f"torch {torch.__version__}, 1 thread, median of {args.rounds} rounds")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:<36} {1e3 * median:8.3f} ms/bucket   plugin/this = {plugin / median:.2f}")


if __name__ == "__main__":
    main()
