"""A sharded optimizer handed to ``torch.distributed.checkpoint`` itself
(``dcp.save({"optim": optimizer})`` / ``dcp.load``): each rank's share is saved, the plain
optimizer's checkpoint, bitwise, also after ``consolidate_state_dict(0)``; saved at 2
gloo ranks, loaded at 3 and trained bitwise as plain DDP + AdamW loading the plain
checkpoint (also with ranks owning nothing); torch's ``AppState`` recipe the same. And
torch's ``get_state_dict`` + ``dcp.save`` after that gathering: the ranks that cannot
answer say that rank 0 waits in the save for them. A loop ported from
``ZeroRedundancyOptimizer``: its arguments refused saying what to do, its consolidated
state dict loaded (bitwise ZeRO going on). Two sharded optimizers gathered crosswise:
refused on every rank.

Was (0.4.x): ``state_dict()`` answered DCP as any caller: refused on every rank without
a gathering, and after ``consolidate_state_dict(0)`` the whole state on rank 0 and
refused on the others, so rank 0 went on into DCP's collectives and waited there until
the group's timeout (8.0 s at an 8 s group; the default group: 30 minutes)."""

from __future__ import annotations

import pytest
import sharded_dcp_ranks as ranks_
from helpers import failures

from overlapkit.distributed import run_distributed


@pytest.fixture(scope="module", params=[False, True], ids=["balanced", "owning nothing"])
def stateful(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
             ) -> list[dict]:
    path = str(tmp_path_factory.mktemp("dcp"))
    return run_distributed(ranks_.dcp_stateful, 3, args=(path, request.param), timeout=300)


def test_dcp_save_of_the_optimizer_writes_the_plain_optimizer_s_checkpoint(
        stateful: list[dict]) -> None:
    for rank in (0, 1):
        assert stateful[rank]["save"] is None, stateful[rank]["save"]
        assert stateful[rank]["seconds"] < ranks_.TIMEOUT_SECONDS, stateful[rank]
    assert stateful[0]["file"], stateful[0]["file"]


def test_dcp_load_of_the_optimizer_at_another_world_size_resumes_bitwise(
        stateful: list[dict]) -> None:
    for rank, result in enumerate(stateful):
        assert result["load"] is None, (rank, result["load"])
    assert not failures(stateful, "values")
    assert stateful[0]["state"], stateful[0]["state"]


def test_dcp_save_of_the_optimizer_between_backward_and_step_is_refused_on_every_rank(
        stateful: list[dict]) -> None:
    for rank, result in enumerate(stateful):
        refused = result["in the window"]
        assert refused is not None and refused["type"] == "ConfigurationError", (rank, refused)
        assert "between backward() and optimizer.step()" in refused["message"]


def test_a_collective_save_of_the_gathered_dict_says_rank_0_waits(tmp_path) -> None:
    results = run_distributed(ranks_.get_state_dict_after_gathering, 2,
                              args=(str(tmp_path),), timeout=120)
    refused = results[1]["error"]
    assert refused is not None and refused["type"] == "ConfigurationError", refused
    assert "rank 0 holds the whole state and waits" in refused["message"]
    assert "dcp.save({'optim': optimizer})" in refused["message"]
    assert results[1]["seconds"] < 1.0
    # rank 0 cannot tell without a collective: it waits in DCP's until the timeout
    assert results[0]["seconds"] < ranks_.TIMEOUT_SECONDS + 5


@pytest.fixture(scope="module")
def ported() -> list[dict]:
    return run_distributed(ranks_.ported_from_zero, 2, timeout=120)


def test_zero_s_arguments_are_refused_saying_what_overlap_ddp_does_instead(
        ported: list[dict]) -> None:
    # was: "AdamW rejected the arguments ... Fix the optimizer arguments", naming
    # neither the DDP model's process group nor that the step overlaps already
    for rank, result in enumerate(ported):
        for name in ("process_group", "overlap_with_ddp"):
            refused = result[name]
            assert refused is not None and refused["type"] == "ConfigurationError", refused
            assert "ZeroRedundancyOptimizer's" in refused["message"], (rank, refused)
            assert "pass process_group= to DistributedDataParallel" in refused["message"]


def test_zero_s_consolidated_dict_loads_and_trains_on_bitwise(ported: list[dict]) -> None:
    for rank, result in enumerate(ported):
        assert result["load"] is None, (rank, result["load"])
    assert not failures(ported, "values")


@pytest.mark.parametrize("kind", ["other model", "same model", "twin"])
def test_two_optimizers_gathered_crosswise_are_refused_on_every_rank(kind: str) -> None:
    # was: gathered, silently, the first optimizer's dict on rank 0 holding the second
    # one's state under its indices (a (6,) exp_avg for a (16,) parameter, 5 of 9; of
    # the same model under SGD, momentum buffers for Adam's state). "twin" (AdamW over
    # the same model, one step behind) up to the tenth round: the dict of one held the
    # other's Adam 'step' counts (1.0 for 2.0, 4 of 9 entries at 2 ranks), silently
    results = run_distributed(ranks_.two_optimizers_gathered_crosswise, 2,
                              args=(kind,), timeout=120)
    for rank, result in enumerate(results):
        for refused in result["crosswise"]:
            assert refused is not None and refused["type"] == "ConfigurationError", (
                rank, refused)
            assert "for different optimizers" in refused["message"]
    assert results[0]["state"], results[0]["state"]


def test_torch_s_app_state_recipe_saves_the_plain_checkpoint_and_resumes_bitwise(
        tmp_path) -> None:
    # was: after consolidate_state_dict(0) rank 1 refused and rank 0 waited in the save
    # until the group's timeout (without the gathering: refused on every rank)
    results = run_distributed(ranks_.app_state_recipe, 2, args=(str(tmp_path),),
                              timeout=120)
    for rank, result in enumerate(results):
        assert result["save"] is None, (rank, result["save"])
        assert result["load"] is None, (rank, result["load"])
    assert results[0]["file"], results[0]["file"]
    assert not failures(results, "values")
