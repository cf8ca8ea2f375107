"""The conformance checks of overlapkit.testing (2 gloo ranks each): the built-in
engine, averagers and comm hooks pass; a plugin whose bucket step does nothing fails
with a message that names the parameter and the difference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from plugin_dists import make_plugin_dist, run_python

from overlapkit.testing import (
    ConformanceError,
    check_averager,
    check_comm_hook,
    check_overlapped_optimizer,
)


@pytest.mark.parametrize(("optim_cls", "kwargs"), [
    (torch.optim.AdamW, {"lr": 0.01}), (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})])
def test_the_generic_engine_conforms(optim_cls: type[torch.optim.Optimizer],
                                     kwargs: dict[str, float]) -> None:
    check_overlapped_optimizer(optim_cls, kwargs)


def test_a_bucket_step_that_does_nothing_fails_saying_what_differed() -> None:
    from noop_plugin import NoOpSGD

    with pytest.raises(ConformanceError) as caught:
        check_overlapped_optimizer(NoOpSGD, {"lr": 0.1})
    message = str(caught.value)
    assert "after step 1" in message and "differ from NoOpSGD.step()" in message
    assert "0.weight (max |diff|" in message


def test_the_builtin_averagers_conform() -> None:
    check_averager("periodic", {"period": 2, "warmup_steps": 1})
    check_averager("hierarchical", {"period_group_size_dict": {2: 2}, "warmup_steps": 0})


NOOP_AVERAGER = """
import overlapkit
from overlapkit.plugin import AveragerRecord, PeriodicAverager

class NoOpAverager(PeriodicAverager):
    def average(self, params, group):
        ...  # the bug: counts steps on schedule, never averages

@overlapkit.hookimpl
def overlapkit_register_averagers():
    return AveragerRecord(name="noop_average", build=NoOpAverager)
"""


def test_an_averager_that_does_not_average_fails(tmp_path: Path) -> None:
    # installed as users install plugins (an entry point), so the spawned ranks find it
    root = make_plugin_dist(tmp_path / "dist", dist="noop-averager",
                            entry_points={"noop_averager": "noop_averager_plugin"},
                            modules={"noop_averager_plugin": NOOP_AVERAGER})
    proc = run_python("""
        from overlapkit.testing import ConformanceError, check_averager
        try:
            check_averager("noop_average", {"period": 1, "warmup_steps": 0})
        except ConformanceError as error:
            print("FAILED:", error)
        """, root, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "FAILED:" in proc.stdout and "are not the mean over the ranks" in proc.stdout


def test_the_builtin_comm_hooks_conform() -> None:
    check_comm_hook("allreduce")
    check_comm_hook("fp16_compress", tolerance=1e-2)
    with pytest.raises(ConformanceError, match="from DDP's allreduce"):
        check_comm_hook("fp16_compress", tolerance=0.0)
