"""The demo's settings, validated before any rank starts.

Imports no torch: ``overlapkit demo --help`` and every argument error answer at once,
and an unusable ``--checkpoint-dir`` is refused before the first step, not after the
training it would have saved.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import attrs

from overlapkit.cli.textui import parse_names
from overlapkit.errors import ConfigurationError
from overlapkit.launch import check_port_free, check_world_size, under_torchrun

__all__ = ["MODEL_SIZES", "TECHNIQUES", "DemoConfig", "ModelSize", "check_checkpoint_dir",
           "parse_techniques"]


@attrs.frozen(kw_only=True)
class ModelSize:
    """The width and depth of the demo MLP."""

    features: int
    hidden: int
    layers: int
    batch: int

    @property
    def parameters(self) -> int:
        """How many parameters the MLP has."""
        f, h, n = self.features, self.hidden, self.layers
        return (f * h + h) + (n - 1) * (h * h + h) + (h * f + f)


MODEL_SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(features=16, hidden=32, layers=2, batch=8),
    "small": ModelSize(features=128, hidden=512, layers=4, batch=32),
    "medium": ModelSize(features=512, hidden=1024, layers=6, batch=32),
    "large": ModelSize(features=1024, hidden=2048, layers=12, batch=16),
}

#: technique -> what the demo runs for it, in the order the demo runs them
TECHNIQUES: dict[str, str] = {
    "plain": "DDP + AdamW, step() after backward (the reference)",
    "overlap_ddp": "AdamW stepped per gradient bucket as its allreduce completes",
    "sharded": "overlap_ddp with the optimizer state sharded across ranks (ZeRO-1): each "
    "rank steps its share, the updated parameters are exchanged during backward",
    "optimizer_in_backward": "AdamW stepped during backward, gradients freed at once",
    "post_local_sgd": "AdamW with post-local SGD: global allreduce in warm-up, then "
    "local steps and periodic model averaging",
    "checkpoint": "train, save a sharded checkpoint, reload it at another world size",
}


def parse_techniques(text: str) -> tuple[str, ...]:
    """``"all"`` or a comma-separated list of technique names, validated."""
    return tuple(parse_names(text, list(TECHNIQUES), "technique"))


@attrs.frozen(kw_only=True)
class DemoConfig:
    """What ``overlapkit demo`` runs."""

    techniques: tuple[str, ...] = tuple(TECHNIQUES)
    steps: int = 40
    world_size: int = 2
    model_size: str = "small"
    lr: float = 1e-3
    seed: int = 0
    #: post-local SGD: averaging period and warm-up steps
    period: int = 4
    warmup_steps: int = 10
    #: DDP bucket size: small enough that the small model has several buckets
    bucket_cap_mb: float = 1.0
    port: int | None = None
    #: where the checkpoint technique writes (default: a temporary directory); under
    #: torchrun on several nodes, a directory every node shares
    checkpoint_dir: str | None = None
    progress: bool = True

    def __attrs_post_init__(self) -> None:
        if self.steps < 2:
            raise ConfigurationError(f"--steps must be at least 2, got {self.steps}.")
        if self.model_size not in MODEL_SIZES:
            raise ConfigurationError(
                f"unknown model size {self.model_size!r}; choose one of "
                f"{', '.join(MODEL_SIZES)}."
            )
        if not under_torchrun():  # under torchrun, torchrun's world size is the one used
            check_world_size(self.world_size)
            if "checkpoint" in self.techniques:
                check_world_size(self.reload_world_size)
        if self.port is not None:
            check_port_free(self.port)
        if self.checkpoint_dir is not None and "checkpoint" in self.techniques:
            check_checkpoint_dir(self.checkpoint_dir)
        unknown = [t for t in self.techniques if t not in TECHNIQUES]
        if unknown:
            raise ConfigurationError(
                f"unknown technique {unknown[0]!r}; choose from {', '.join(TECHNIQUES)}."
            )

    @property
    def size(self) -> ModelSize:
        """The model size preset."""
        return MODEL_SIZES[self.model_size]

    @property
    def ranks(self) -> int:
        """How many ranks train: torchrun's world size under torchrun, else ``world_size``."""
        return int(os.environ["WORLD_SIZE"]) if under_torchrun() else self.world_size

    @property
    def reload_world_size(self) -> int:
        """The world size the checkpoint is reloaded at: another one than it was saved
        at, except under torchrun, which fixes the world size for the whole job."""
        if under_torchrun():
            return self.ranks
        return self.world_size // 2 if self.world_size > 1 else 2

    def describe(self) -> str:
        """The run's settings in one line: the demo's header and the plot's title."""
        launcher = "torchrun" if under_torchrun() else "spawned"
        n = self.size.parameters
        count = f"{n / 1e6:.2f}M" if n >= 100_000 else f"{n:,}"
        return (f"{count}-parameter MLP ({self.model_size}), "
                f"{self.ranks} CPU ranks (gloo, {launcher}), {self.steps} steps per technique")


def check_checkpoint_dir(directory: str) -> None:
    """Raise a ConfigurationError unless ``directory`` is (or can be made) a directory
    this process can write in; creates it when missing."""
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ConfigurationError(
            f"--checkpoint-dir {directory} is a file, or lies under one; pass a directory "
            "(it is created if missing)."
        ) from None
    except OSError as exc:
        raise ConfigurationError(
            f"--checkpoint-dir {directory} cannot be created ({exc.strerror}); pass a "
            "directory you can write to."
        ) from None
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ConfigurationError(
            f"--checkpoint-dir {directory} is not writable ({exc.strerror}); pass a "
            "directory you can write to."
        ) from None
