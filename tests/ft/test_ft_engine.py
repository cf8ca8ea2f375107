"""The torchft release overlapkit[ft] pins, as the `ft` tox environment installs it:
it imports beside torch 2.13.0 and its Lighthouse (the quorum server shipped in its
wheel) starts and stops. Skipped where torchft is not installed."""

from __future__ import annotations

from importlib.metadata import version

import pytest

torchft = pytest.importorskip("torchft")


def test_the_pinned_torchft_runs_beside_the_pinned_torch() -> None:
    assert version("torchft") == "0.2.0"
    assert version("torch").split("+")[0] == "2.13.0"


def test_the_lighthouse_from_the_wheel_starts_and_reports_its_address() -> None:
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        address = lighthouse.address()
        assert address.startswith("http://") and not address.endswith(":0")
    finally:
        lighthouse.shutdown()
