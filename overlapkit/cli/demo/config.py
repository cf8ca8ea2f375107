"""The demo's settings, validated before any rank starts."""

from __future__ import annotations

import attrs

from overlapkit.cli.demo.model import MODEL_SIZES, ModelSize
from overlapkit.cli.textui import parse_names
from overlapkit.errors import ConfigurationError
from overlapkit.launch import check_port_free, check_world_size, under_torchrun

__all__ = ["TECHNIQUES", "DemoConfig", "parse_techniques"]

#: technique -> what the demo runs for it, in the order the demo runs them
TECHNIQUES: dict[str, str] = {
    "plain": "DDP + AdamW, step() after backward (the reference)",
    "overlap_ddp": "AdamW stepped per gradient bucket as its allreduce completes",
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
    def reload_world_size(self) -> int:
        """The world size the checkpoint is reloaded at: different from the saving one."""
        return self.world_size // 2 if self.world_size > 1 else 2
