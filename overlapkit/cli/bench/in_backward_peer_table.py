"""What the "peers" part of the optimizer_in_backward benchmark compares
(:mod:`overlapkit.cli.bench.in_backward_peers`): the peers and how to install them, the
variants and their loops, the two models, and the 0.2 figures with the margins that make
the goals. Finding which peers are installed imports none of them."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import attrs

__all__ = ["FIGURES_0_2", "MODELS", "PEAK_MARGIN_MIB", "PEERS", "SETUP_MORE_MIB",
           "STEP_MARGIN", "VARIANTS", "ModelSpec", "Peer", "peer_status"]


@attrs.frozen(kw_only=True)
class Peer:
    """A peer's optimizer in backward, what its set-up imports and which of overlapkit's
    loops it is compared with (the one its users write)."""

    version: str  #: the version the figures are for
    module: str  #: what its set-up imports
    ours: str  #: the overlapkit variant with the same loop
    install: str  #: how to install it beside torch==2.13.0 (docs/benchmarks.md)


PEERS: dict[str, Peer] = {
    "torchtune": Peer(version="0.6.1", module="torchtune.training",
                      ours="overlapkit_backward_only",
                      install="pip install torch==2.13.0 torchtune==0.6.1"),
    "torchtitan": Peer(version="0.2.2", module="torchtitan.components.optimizer",
                       ours="overlapkit_step_zero_grad",
                       install="pip install --no-deps torchtitan==0.2.2 torchao==0.14.1 "
                               "triton==3.5.1; pip install tyro==0.9.35"),
}

#: variant -> (module its set-up imports, its loop calls step() and zero_grad())
VARIANTS: dict[str, tuple[str | None, bool]] = {
    "plain": (None, True),
    "overlapkit_backward_only": ("overlapkit.overlap.techniques", False),
    "overlapkit_step_zero_grad": ("overlapkit.overlap.techniques", True),
    "torchtune": (PEERS["torchtune"].module, False),
    "torchtitan": (PEERS["torchtitan"].module, True),
}


@attrs.frozen(kw_only=True)
class ModelSpec:
    """``depth`` x ``Linear(width, width)`` (``quick_depth`` with ``--quick``)."""

    width: int
    depth: int
    quick_depth: int
    description: str


MODELS: dict[str, ModelSpec] = {
    "400_small": ModelSpec(width=64, depth=200, quick_depth=20,
                           description="200 x Linear(64, 64), 400 parameters"),
    "8_large": ModelSpec(width=1024, depth=8, quick_depth=2,
                         description="8 x Linear(1024, 1024), 8.4 M parameters"),
}

#: ours / peer step time measured on overlapkit 0.2 (PEERS.md): the lead to keep
FIGURES_0_2: dict[tuple[str, str], float] = {
    ("400_small", "torchtune"): 0.64, ("400_small", "torchtitan"): 0.66,
    ("8_large", "torchtune"): 0.98, ("8_large", "torchtitan"): 0.92,
}
#: per model, added to a 0.2 figure to make its goal: the spread of the CPU-time ratio
#: between runs of the same code on the shared 2-core machine (docs/benchmarks.md):
#: 0.61-0.70 on 400 small parameters; 0.80-1.03 on 8 large ones, where every variant
#: runs the same AdamW arithmetic on 4 MiB tensors and the per-parameter work is noise
STEP_MARGIN: dict[str, float] = {"400_small": 0.05, "8_large": 0.10}
#: ours' training peak above set-up may exceed the peer's by this much (MiB): the
#: spread between rounds of the same variant
PEAK_MARGIN_MIB = 1.0
#: what setting up may cost more than the peer (MiB): 0.2's 3.1 MiB, plus the spread
SETUP_MORE_MIB = 3.1 + 1.0


def peer_status() -> dict[str, str]:
    """Per peer: its installed version, or ``"not installed"``; found without importing
    it (torchtune takes seconds to import)."""
    status = {}
    for name in PEERS:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        try:
            status[name] = importlib.metadata.version(name) if found else "not installed"
        except importlib.metadata.PackageNotFoundError:
            status[name] = "installed (version unknown)"
    return status
