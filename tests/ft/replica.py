"""One replica group of a fault-tolerance run (1 process): trains a small MLP with
overlapkit's averagers under a torchft Manager (``--impl overlapkit``), with torchft's
own LocalSGD / DiLoCo (``torchft``), or over a plain gloo process group without torchft
(``plain``), and writes the final parameters and its timings to ``--out``. Forked by
tests/ft/ft_scenarios.py (for tests/ft and benchmarks/ft.py) from a server that
imported torch and torchft once.

Each step's batch depends only on (replica, averagings committed so far, step within
the round), so every implementation sees the same data under the same failures.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batch(replica: int, committed: int, step_in_round: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1_000_003 * replica + 1009 * committed
                                              + step_in_round)
    return (torch.randn(16, 8, generator=generator),
            torch.randint(0, 4, (16,), generator=generator))


def inner_optimizer(args: argparse.Namespace, model: torch.nn.Module) -> torch.optim.Optimizer:
    if args.averager == "diloco":
        return torch.optim.AdamW(model.parameters(), lr=1e-2)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def diloco_options(args: argparse.Namespace) -> dict[str, Any]:
    if args.averager != "diloco":
        return {}
    return {"outer_lr": 0.7, "outer_momentum": 0.9, "fragments": args.fragments,
            "fragment_sync_delay": args.sync_delay, "fragment_update_alpha": args.alpha}


def wait_for(path: str, what: str, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"replica: timed out waiting for {what} ({path})")
        time.sleep(0.02)


def wait_until_heartbeating(lighthouse: str, manager: Any) -> None:
    """Until the Lighthouse lists this replica group's heartbeat: a peer's quorum
    before it would leave this group out (measured: the first heartbeat can come
    over 0.5 s after the Manager is built on a busy machine)."""
    import urllib.request

    replica_id = manager._store.get("replica_id").decode()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with urllib.request.urlopen(lighthouse + "/status", timeout=5) as page:
            if replica_id in page.read().decode(errors="replace"):
                return
        time.sleep(0.05)
    sys.exit("replica: the Lighthouse never listed this replica group's heartbeat")


def wait_for_a_peer_in_quorum(lighthouse: str) -> None:
    """Until another replica group waits in the Lighthouse's next quorum: a restarted
    group then joins this group's next averaging, whichever process is faster (the
    Lighthouse forms a quorum at once when the last quorum's members ask again)."""
    import re
    import urllib.request

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with urllib.request.urlopen(lighthouse + "/status", timeout=5) as page:
            found = re.search(r"\[(\d+)/\d+ participants healthy\]",
                              page.read().decode(errors="replace"))
        if found and int(found.group(1)) >= 1:
            return
        time.sleep(0.02)
    sys.exit("replica: the restarted replica group never asked for a quorum")


def make_manager(args: argparse.Namespace, register: bool, model: Any, opt: Any) -> Any:
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    kwargs: dict[str, Any] = {}
    if register:
        kwargs = {"load_state_dict": lambda sd: (model.load_state_dict(sd["model"]),
                                                 opt[0].load_state_dict(sd["optim"])),
                  "state_dict": lambda: {"model": model.state_dict(),
                                         "optim": opt[0].state_dict()}}
    else:
        kwargs = {"load_state_dict": None, "state_dict": None}
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1,
        use_async_quorum=False, init_sync=False, replica_id=f"replica_{args.replica}",
        store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=args.lighthouse, timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=60), connect_timeout=timedelta(seconds=10),
        **kwargs,
    )
    manager._overlapkit_store = store  # keep the store alive as long as the manager
    if args.kill_in_quorum is not None:
        start_quorum, calls = manager.start_quorum, [0]

        def start_quorum_then_die(*a: Any, **k: Any) -> None:
            start_quorum(*a, **k)
            calls[0] += 1
            if calls[0] == args.kill_in_quorum:
                Path(args.out + ".killed").write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

        manager.start_quorum = start_quorum_then_die
    return manager


def train(args: argparse.Namespace) -> dict[str, Any]:
    started = time.time()
    model = build_model()
    opt_box: list[Any] = [inner_optimizer(args, model)]
    inner = opt_box[0]
    timings: dict[str, Any] = {"started": started, "syncs": [], "steps": []}
    if args.impl == "plain":
        import torch.distributed as dist

        import overlapkit
        from overlapkit.local_sgd.optimizer import PostLocalSGDOptimizer

        dist.init_process_group("gloo", init_method=args.init_method, rank=args.replica,
                                world_size=args.replicas, timeout=timedelta(seconds=30))
        warmup = 0 if args.averager == "diloco" else args.period - 1
        options = diloco_options(args)
        averager = overlapkit.create_averager(args.averager, period=args.period,
                                              warmup_steps=warmup, **options)
        opt: Any = PostLocalSGDOptimizer(inner, averager)
        sync_every = args.period // (args.fragments if args.averager == "diloco" else 1)
        committed = lambda: averager.step // sync_every  # noqa: E731
        manager = None
    else:
        register = args.impl == "torchft"
        manager = make_manager(args, register, model, opt_box)
        committed = manager.current_step
        if args.impl == "overlapkit":
            import overlapkit.ft

            warmup = 0 if args.averager == "diloco" else args.period - 1
            options = diloco_options(args)
            opt = overlapkit.ft.local_sgd(manager, model, inner, period=args.period,
                                          warmup_steps=warmup, averager=args.averager,
                                          **options)
        else:
            from torchft.local_sgd import DiLoCo, LocalSGD

            opt = inner
            if args.averager == "diloco":
                # fragments: the first Linear, the second (the MLP's two halves), an
                # outer optimizer each (one over the whole model would also step the
                # other fragment's parameters with their inner gradients)
                fragments = [model] if args.fragments == 1 else [model[0], model[2]]
                outer = [torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True)
                         for f in fragments]
                wrapper: Any = DiLoCo(manager, fragments, inner, outer,
                                      sync_every=args.period, pin_memory=False,
                                      fragment_sync_delay=args.sync_delay,
                                      fragment_update_alpha=args.alpha)
            else:
                wrapper = LocalSGD(manager, model, inner, sync_every=args.period)
            wrapper.__enter__()
    if args.ready:
        if manager is not None:
            wait_until_heartbeating(args.lighthouse, manager)
        Path(args.ready).write_text(str(time.time()))
    for other in args.barrier or []:
        wait_for(other, "the other replicas to start")
    step_in_round, last_committed, steps = 0, committed(), 0
    waited = False
    while committed() < args.syncs:
        if args.wait_at is not None and committed() == args.wait_at and not waited:
            wait_for_a_peer_in_quorum(args.lighthouse)
            waited = True
        x, y = batch(args.replica, committed(), step_in_round)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        began = time.time()
        opt.step()
        ended = time.time()
        steps += 1
        timings["steps"].append((began, ended))
        if committed() != last_committed:
            timings["syncs"].append((committed(), began, ended))
            last_committed, step_in_round = committed(), 0
        else:
            step_in_round += 1
        if args.kill_after == steps:
            Path(args.out + ".killed").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        if steps > 20 * args.syncs * args.period:
            sys.exit("replica: no progress (the averagings are not committed)")
    result = {"params": [p.detach().clone() for p in model.parameters()],
              "timings": timings, "committed": committed(),
              "failed_commits": getattr(opt, "failed_commits", 0)}
    if manager is not None:
        manager.shutdown(wait=False)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["overlapkit", "torchft", "plain"], required=True)
    parser.add_argument("--averager", choices=["periodic", "diloco"], default="periodic")
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--lighthouse", default=None)
    parser.add_argument("--init-method", default=None)
    parser.add_argument("--period", type=int, default=3)
    parser.add_argument("--fragments", type=int, choices=[1, 2], default=1,
                        help="Streaming DiLoCo's fragments")
    parser.add_argument("--sync-delay", type=int, default=0,
                        help="Streaming DiLoCo's fragment_sync_delay")
    parser.add_argument("--alpha", type=float, default=0.0,
                        help="Streaming DiLoCo's fragment_update_alpha")
    parser.add_argument("--syncs", type=int, default=6)
    parser.add_argument("--kill-after", type=int, default=None, help="SIGKILL after step N")
    parser.add_argument("--kill-in-quorum", type=int, default=None,
                        help="SIGKILL right after the N-th quorum (before its averaging)")
    parser.add_argument("--wait-at", type=int, default=None,
                        help="before stepping at this many averagings, wait for another "
                        "replica group to ask the Lighthouse for a quorum")
    parser.add_argument("--ready", default=None, help="file written once the manager is up")
    parser.add_argument("--barrier", nargs="*", help="files to wait for before training")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    result = train(args)
    torch.save(result, args.out)


if __name__ == "__main__":
    main()
