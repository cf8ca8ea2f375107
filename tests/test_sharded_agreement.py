"""Ranks whose sharded optimizers hold different settings (``lr`` set on one rank only,
an LR scheduler stepped on one rank only): refused on every rank before anything steps,
naming the setting and each rank's value (``overlap/sharded/agreement.py``); training
then goes on bitwise plain DDP + AdamW. 2 and 3 gloo ranks."""

from __future__ import annotations

import pytest
import sharded_agreement_ranks as ranks_
from helpers import failures

from overlapkit.distributed import run_distributed


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("how", ["lr", "scheduler"])
def test_settings_differing_between_ranks_are_refused_on_every_rank_before_stepping(
        world_size: int, how: str) -> None:
    # was: each rank stepped its share with its own lr, silently: 0.058 off plain rank
    # 0's parameters and 0.050 off rank 1's after 3 steps (2 ranks, lr doubled on rank 0)
    results = run_distributed(ranks_.lr_on_one_rank, world_size, args=(how,), timeout=180)
    for rank, result in enumerate(results):
        for key in ("refused", "full step"):
            refused = result[key]
            assert refused is not None and refused["type"] == "ConfigurationError", (
                rank, key, refused)
            assert "lr of param group 0" in refused["message"], refused
            assert "on rank 1" in refused["message"], refused
        assert result["step"] is None, (rank, result["step"])
    assert not failures(results, "unchanged")
    assert not failures(results, "full step unchanged")
    assert not failures(results, "values")


def test_settings_compared_are_the_steps_own_and_alike_between_processes() -> None:
    import torch

    from overlapkit.overlap.sharded.agreement import settings_read, settings_refusal

    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [param], "name": "decoder"}], lr=0.1)
    opt.defaults["device"] = torch.device("cpu")  # as an optimizer with a device option
    opt.param_groups[0]["device"] = torch.device("cpu", 0)
    opt.param_groups[0]["lr"] = torch.tensor(0.5)
    read = dict(settings_read(opt)[0])
    assert "name" not in read  # a key of the loop's own: no step reads it
    assert read["device"] == ("object", "device")  # no repr differing between ranks
    assert read["lr"] == ("tensor", 0.5)
    other = [[(key, 0.25 if key == "lr" else value) for key, value in settings_read(opt)[0]]]
    message = str(settings_refusal([settings_read(opt), other], "backward()"))
    assert "lr of param group 0: tensor(0.5) on rank 0, 0.25 on rank 1" in message, message


@pytest.mark.parametrize("how", ["learnt", "global clip"])
def test_settings_differing_are_refused_where_steps_are_taken_at_step_or_backward_s_end(
        how: str) -> None:
    results = run_distributed(ranks_.lr_on_one_rank_steps_elsewhere, 2, args=(how,),
                              timeout=180)
    for rank, result in enumerate(results):
        refused = result["refused"]
        assert refused is not None and "lr of param group 0" in refused["message"], (
            rank, refused)
    assert not failures(results, "unchanged")
