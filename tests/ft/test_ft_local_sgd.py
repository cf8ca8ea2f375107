"""overlapkit's post-local SGD and DiLoCo under a torchft Manager, in real processes:
a Lighthouse, two replica groups (one process each, gloo), a replica group SIGKILLed
and restarted. Compared bitwise with the same run without torchft and with torchft's
own LocalSGD / DiLoCo under the same failures (tests/ft/ft_scenarios.py).

All runs start at once in one module-scoped fixture (they mostly wait on each other
and on the Lighthouse), so the module takes about as long as its slowest run."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchft")

from ft_scenarios import (
    HEARTBEAT_TIMEOUT_MS,
    KILLED_IN_ROUND,
    PERIOD,
    SYNCS,
    Scenario,
    next_averaging,
    run,
)
from helpers import compare

pytestmark = pytest.mark.timeout(240)

AVERAGERS = ["periodic", "diloco"]
SCENARIOS = [
    *(Scenario(impl=impl, averager=averager, failure=failure)
      for averager in AVERAGERS
      for impl in ("overlapkit", "torchft")
      for failure in (None, "kill")),
    *(Scenario(impl="plain", averager=averager) for averager in AVERAGERS),
    Scenario(impl="overlapkit", failure="kill-in-averaging"),
    Scenario(impl="torchft", failure="kill-in-averaging"),
    Scenario(impl="overlapkit", averager="diloco", failure="kill-in-averaging"),
    *(Scenario(impl=impl, averager="diloco", fragments=2, period=4, syncs=8)
      for impl in ("overlapkit", "torchft", "plain")),
    *(Scenario(impl=impl, averager="diloco", fragments=2, period=6, syncs=6, delay=2,
               alpha=0.5)
      for impl in ("overlapkit", "torchft", "plain")),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("ft")
    with ThreadPoolExecutor(max_workers=len(SCENARIOS)) as pool:
        futures = {s.name: pool.submit(run, s, Path(root / s.name)) for s in SCENARIOS}
        return {name: future.result() for name, future in futures.items()}


def _params(runs: dict[str, dict[str, Any]], name: str, label: str) -> list[Any]:
    return runs[name][label]["params"]


@pytest.mark.parametrize("averager", AVERAGERS)
def test_without_a_failure_it_is_bitwise_the_same_run_without_torchft(
    runs: dict[str, dict[str, Any]], averager: str
) -> None:
    for replica in ("0", "1"):
        assert compare(_params(runs, f"plain-{averager}-none", replica),
                       _params(runs, f"overlapkit-{averager}-none", replica))
    assert runs[f"overlapkit-{averager}-none"]["0"]["committed"] == SYNCS


@pytest.mark.parametrize("averager", AVERAGERS)
def test_without_a_failure_it_is_bitwise_torchfts_own_local_sgd_or_diloco(
    runs: dict[str, dict[str, Any]], averager: str
) -> None:
    for replica in ("0", "1"):
        assert compare(_params(runs, f"torchft-{averager}-none", replica),
                       _params(runs, f"overlapkit-{averager}-none", replica))


@pytest.mark.parametrize("averager", AVERAGERS)
def test_a_killed_replica_group_does_not_stop_the_survivor(
    runs: dict[str, dict[str, Any]], averager: str
) -> None:
    run_ = runs[f"overlapkit-{averager}-kill"]
    survivor, killed_at = run_["0"], run_["killed_at"]
    assert survivor["committed"] == SYNCS
    assert len(survivor["timings"]["steps"]) == SYNCS * PERIOD
    # its next averaging waits for the dead group's heartbeat to expire, then goes on
    waited = next_averaging(survivor, KILLED_IN_ROUND) - killed_at
    assert HEARTBEAT_TIMEOUT_MS / 1000 / 2 < waited < HEARTBEAT_TIMEOUT_MS / 1000 + 5.0


@pytest.mark.parametrize("averager", AVERAGERS)
def test_the_restarted_replica_group_recovers_live_from_its_peer(
    runs: dict[str, dict[str, Any]], averager: str
) -> None:
    run_ = runs[f"overlapkit-{averager}-kill"]
    rejoined = run_["1b"]
    assert rejoined["committed"] == SYNCS
    # one round from its fresh start (discarded when it recovers), then the survivor's
    # last round: it recovered the model, the optimizer and the averager at averaging 4
    assert len(rejoined["timings"]["steps"]) == 2 * PERIOD
    assert compare(_params(runs, f"overlapkit-{averager}-kill", "0"), rejoined["params"])


@pytest.mark.parametrize("averager", AVERAGERS)
def test_under_the_same_kill_and_rejoin_it_is_bitwise_torchfts_own(
    runs: dict[str, dict[str, Any]], averager: str
) -> None:
    for label in ("0", "1b"):
        assert compare(_params(runs, f"torchft-{averager}-kill", label),
                       _params(runs, f"overlapkit-{averager}-kill", label))


def test_an_averaging_a_replica_died_in_is_rolled_back_as_torchfts_local_sgd_does(
    runs: dict[str, dict[str, Any]],
) -> None:
    survivor = runs["overlapkit-periodic-kill-in-averaging"]["0"]
    assert survivor["failed_commits"] == 1 and survivor["committed"] == SYNCS
    assert len(survivor["timings"]["steps"]) == (SYNCS + 1) * PERIOD
    assert compare(_params(runs, "torchft-periodic-kill-in-averaging", "0"),
                   survivor["params"])


def test_diloco_keeps_the_inner_steps_of_a_round_whose_averaging_failed(
    runs: dict[str, dict[str, Any]],
) -> None:
    # torchft's DiLoCo puts the parameters back to the round's start instead
    # (docs/fault_tolerance.rst, "Where it differs from torchft")
    survivor = runs["overlapkit-diloco-kill-in-averaging"]["0"]
    assert survivor["failed_commits"] == 1 and survivor["committed"] == SYNCS
    assert len(survivor["timings"]["steps"]) == (SYNCS + 1) * PERIOD


@pytest.mark.parametrize("other", ["torchft", "plain"])
def test_streaming_diloco_fragments_are_bitwise_torchfts_and_the_run_without_torchft(
    runs: dict[str, dict[str, Any]], other: str
) -> None:
    # two fragments (the MLP's two Linear layers), period 4: one fragment's outer step
    # every 2 steps, in turn; torchft's DiLoCo(model_fragments, fragment_sync_delay=0)
    for replica in ("0", "1"):
        assert compare(_params(runs, f"{other}-diloco-2fragments-none", replica),
                       _params(runs, "overlapkit-diloco-2fragments-none", replica))
    assert runs["overlapkit-diloco-2fragments-none"]["0"]["committed"] == 8


@pytest.mark.parametrize("other", ["torchft", "plain"])
def test_streaming_diloco_overlapped_and_mixed_is_bitwise_torchfts_and_without_torchft(
    runs: dict[str, dict[str, Any]], other: str
) -> None:
    # two fragments, period 6: a fragment's allreduce starts after inner step 1 of
    # every 3 and its outer step comes 2 steps later, the result mixed half and half
    # with the local parameters; torchft's DiLoCo(fragment_sync_delay=2,
    # fragment_update_alpha=0.5)
    name = "diloco-2fragments-delay2-alpha0.5-none"
    for replica in ("0", "1"):
        assert compare(_params(runs, f"{other}-{name}", replica),
                       _params(runs, f"overlapkit-{name}", replica))
    assert runs[f"overlapkit-{name}"]["0"]["committed"] == 6
