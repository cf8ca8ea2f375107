"""Whether PyTorch Lightning is installed: imported first by
:mod:`overlapkit.integrations.lightning`, so that a missing extra is one clear error
instead of an ``ImportError`` from deep inside."""

from __future__ import annotations

from overlapkit.errors import MissingDependencyError

__all__ = ["TESTED_LIGHTNING", "pl"]

#: the Lightning release the strategies are tested with (the ``lightning`` extra)
TESTED_LIGHTNING = "2.6.6"

try:
    import lightning.pytorch as pl
except ImportError as error:  # the extra is not installed
    raise MissingDependencyError(
        "overlapkit.integrations.lightning needs PyTorch Lightning (the `lightning` "
        f"package), which is not installed: pip install 'overlapkit[lightning]' (Lightning "
        f"{TESTED_LIGHTNING}, the version it is tested with)."
    ) from error
