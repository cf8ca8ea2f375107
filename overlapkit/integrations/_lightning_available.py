"""Whether PyTorch Lightning is installed: imported first by
:mod:`overlapkit.integrations.lightning`, so that a missing extra is one clear error
(:func:`~overlapkit.integrations.requirements.require`, as for the other integrations)
instead of an ``ImportError`` from deep inside."""

from __future__ import annotations

from overlapkit.integrations.requirements import require

__all__ = ["TESTED_LIGHTNING", "pl"]

#: the Lightning release the strategies are tested with (the ``lightning`` extra)
TESTED_LIGHTNING = "2.6.6"

require("lightning", "lightning", TESTED_LIGHTNING)

import lightning.pytorch as pl  # noqa: E402  (after the check that it is installed)
