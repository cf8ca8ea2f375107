"""overlapkit-diloco: DiLoCo's outer optimizer step as an overlapkit model averager.

    optimizer = overlapkit.post_local_sgd(ddp_model, torch.optim.AdamW(params),
                                          period=500, warmup_steps=1000,
                                          averager="diloco", outer_lr=0.7)
"""

from overlapkit_diloco.averager import DiLoCoAverager, nesterov_sgd

__all__ = ["DiLoCoAverager", "nesterov_sgd"]
