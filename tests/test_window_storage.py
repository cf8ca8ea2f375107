"""Writes through the storage between backward and ``step()``: a tensor built over
``p.grad.untyped_storage()`` (or ``p.untyped_storage()``) and written, the storage's own
``copy_``, a tensor ``set_`` on the gradient (``torch.empty(0).set_(p.grad)``), torch's
legacy DLPack capsule (``from_dlpack(to_dlpack(p.grad))``). Each has
a version counter of its own, or none, so the window's version checks did not see them:
measured on f2b92e2 after 4 steps (2 gloo ranks), gradients halved over their storage
under ``overlap_ddp`` SGD 0.020 off the plain loop silently, and 0.014 after
``learn_first_step``; weights scaled over their storage 0.0027 (SGD) / 0.0064 (AdamW)
off under ``overlap_ddp`` with only the parameter-read warning, 0.0041 (SGD) under
``optimizer_in_backward``; the capsule as the storage. ``untyped_storage()``,
``set_()`` and ``to_dlpack`` are now noted as
``numpy()`` is (``overlap/core/data_writes.py``): refused at that ``step()``, or,
learnt, the plain order, bitwise; a read over the storage is no change.

Cost out of a window, measured on the 2-core test machine (best of 7 x 200 000 calls):
``t.untyped_storage()`` 0.06 -> 0.085 µs, ``e.set_(src)`` 0.61 -> 0.86 µs. (DDP: 2 gloo
ranks, ``tests/window_storage_ranks.py``.)"""

from __future__ import annotations

from typing import Any

import pytest
from window_storage_ranks import run

from overlapkit.distributed import run_distributed

OPTIMIZERS = ("SGD", "AdamW")
GRAD_WRITES = ("grads halved over storage", "grads halved by storage copy",
               "grads halved over set", "grads halved over legacy dlpack")


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_distributed(run, 2, timeout=300)


def _each(two_ranks: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    return [rank_results[key] for rank_results in two_ranks]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize(("technique", "window", "words"), [
    *[("overlap_ddp", window, "the gradients of module.0.weight") for window in GRAD_WRITES],
    ("overlap_ddp", "weights scaled over storage", "the values of module.0.weight"),
    ("optimizer_in_backward", "weights scaled over storage", "the values of module.0.weight")])
def test_a_write_through_the_storage_is_refused_at_that_step(
        two_ranks: list[dict[str, Any]], optimizer: str, technique: str, window: str,
        words: str) -> None:
    # before: not seen (overlap_ddp, gradients halved: SGD 0.020 off after 4 steps)
    for found in _each(two_ranks, f"{optimizer} {technique} {window}"):
        error = found["error"]
        assert error is not None and error["type"] == "ConfigurationError", found
        assert words in error["message"], error["message"]
        assert found["at"] == 0, found


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
@pytest.mark.parametrize("window", [*GRAD_WRITES, "weights scaled over storage"])
def test_a_write_through_the_storage_in_a_learnt_window_keeps_the_plain_order_bitwise(
        two_ranks: list[dict[str, Any]], optimizer: str, technique: str, window: str) -> None:
    # before (overlap_ddp, gradients halved over their storage): SGD 0.014 off, silently
    for found in _each(two_ranks, f"{optimizer} {technique} {window} learnt"):
        assert found["error"] is None, found
        assert found["bitwise plain"], (found["bitwise plain"], found["off"])
        plain_order = [w for w in found["warnings"] if "in the plain order" in w]
        assert len(plain_order) == 1, found["warnings"]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("technique", ["overlap_ddp", "optimizer_in_backward"])
@pytest.mark.parametrize("learnt", [False, True])
def test_a_read_over_the_storage_is_no_change(
        two_ranks: list[dict[str, Any]], optimizer: str, technique: str,
        learnt: bool) -> None:
    for found in _each(two_ranks, f"{optimizer} {technique} storage read"
                                  f"{' learnt' if learnt else ''}"):
        assert found["error"] is None, found
        if learnt:  # the parameters read: the plain order
            assert found["bitwise plain"], found["bitwise plain"]
