"""The Hugging Face trainer tests need transformers and accelerate (the ``trainers``
tox environment installs the pinned versions); elsewhere they are not collected."""

from __future__ import annotations

import importlib.util

collect_ignore_glob = (
    [] if all(importlib.util.find_spec(name) for name in ("transformers", "accelerate"))
    else ["*.py"]
)
