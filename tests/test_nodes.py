"""Past one machine, as users run it: torchrun agents on loopback, each its own node
(``tests/agents.py``), running the README's training script and ``overlapkit demo``.

- on two nodes of two ranks, bitwise the run of one node of four;
- a node lost mid-step (its agent and workers killed with SIGKILL): the survivors end
  with an error naming its ranks, and the last complete checkpoint is intact and loads;
- that checkpoint, saved by two nodes of two ranks, resumes at another shape (one node
  of two ranks, three nodes of one), bitwise the same schedule on one machine;
- a node lost while a checkpoint is being written, then started again under
  ``--max-restarts 1``: the half-written checkpoint is never taken, training resumes
  from the last complete one and ends bitwise as a run stopped there and resumed,
  and as the uninterrupted run;
- post-local SGD's hierarchy taken from the real launch;
- a checkpoint directory that is not shared between the nodes (the same path, each
  node its own disk: a bind mount in a mount namespace per agent): the save fails on
  every rank, and nodes that see different checkpoints refuse to resume, on every rank;
- node 0 killed between the save's two renames: the relaunched job resumes from the
  newest complete checkpoint and ends bitwise as the uninterrupted run.

Each launch costs 10 to 30 s of imports and rendezvous on two cores, so launches are
module fixtures that several tests share.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

import nodes_ranks
import pytest
import torch
from agents import Job, finished, own_disks, private_mounts
from helpers import checkpoint_tensors, compare

from overlapkit import checkpoint
from overlapkit.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
LAST = "step 20: loss"
RANK_TIMEOUT = 240

#: losing a node finds an agent's workers in /proc (tests/lose_node.py)
needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").is_file(),
                                reason="losing a node reads /proc (Linux)")
#: separate disks behind one path: each agent in a mount namespace of its own
UNSHARE = private_mounts()
needs_mounts = pytest.mark.skipif(UNSHARE is None, reason="needs unshare --mount (as root, "
                                  "or with user namespaces) to give each node its own disk")


def _example() -> str:
    section = (ROOT / "README.md").read_text(encoding="utf-8").split(
        "## Use it in your training loop", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block is not None
    return block.group(1)


def _state(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (model and optimizer state), by dotted key."""
    flat = checkpoint_tensors(path, path.parent)
    assert any("exp_avg" in key for key in flat)
    return flat


def _last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.startswith("step ")][-1]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("nodes")
    (directory / "train.py").write_text(_example(), encoding="utf-8")
    return directory


def _readme(workdir: Path, name: str, nodes: list[int], *, stop_at: int = 20,
            lose: dict[str, str] | None = None, env: dict[str, str] | None = None,
            max_restarts: int = 0, disks: list[Path] | None = None) -> Job:
    """The README script under torchrun agents, checkpointing to ``workdir / name``;
    with ``disks``, agent ``i`` sees ``disks[i]`` there (separate disks, one path)."""
    entry = [str(workdir / "train.py")]
    if lose is not None:
        entry = [str(TESTS / "lose_node.py"), *entry]
    wrap = None
    if disks is not None:
        assert UNSHARE is not None
        (workdir / name).mkdir()
        wrap = own_disks(UNSHARE, disks, workdir / name)
    return Job(entry, nodes, workdir, name=name, max_restarts=max_restarts, wrap=wrap,
               env={"CHECKPOINT": str(workdir / name / "checkpoint") if disks
                    else str(workdir / name), "STOP_AT": str(stop_at),
                    **(lose or {}), **(env or {})}).start()


def _reference(workdir: Path, name: str, world_size: int, stop_at: int = 20) -> Path:
    """The README script on ``world_size`` ranks of one machine (no torchrun), resuming
    from ``workdir / name`` if it is there."""
    run_distributed(nodes_ranks.readme_main, world_size, timeout=RANK_TIMEOUT, args=(
        str(workdir / "train.py"),
        {"CHECKPOINT": str(workdir / name), "STOP_AT": str(stop_at)}))
    return workdir / name


# -- across nodes -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def one_node_of_four(workdir: Path) -> Job:
    job = _readme(workdir, "one-node-of-4", [4])
    finished(job, LAST)
    return job


@pytest.fixture(scope="module")
def two_nodes_of_two(workdir: Path) -> Job:
    job = _readme(workdir, "two-nodes-of-2", [2, 2])
    finished(job, LAST)
    return job


def test_the_readme_script_on_two_nodes_is_bitwise_one_node_of_four(
    workdir: Path, one_node_of_four: Job, two_nodes_of_two: Job,
) -> None:
    assert _last_line(two_nodes_of_two.output()) == _last_line(one_node_of_four.output())
    same = compare(_state(workdir / "one-node-of-4"), _state(workdir / "two-nodes-of-2"))
    assert same, same


def _demo(workdir: Path, name: str, nodes: list[int]) -> dict[str, dict[str, Any]]:
    job = Job(["-m", "overlapkit", "demo", "--model-size", "tiny", "--steps", "4", "--json"],
              nodes, workdir, name=name).start()
    finished(job, '"technique": "checkpoint"')
    return {row["technique"]: row for row in json.loads(job.agents[0].stdout)}


def test_the_demo_on_two_nodes_is_bitwise_one_node_of_four(workdir: Path) -> None:
    one, two = _demo(workdir, "demo-1x4", [4]), _demo(workdir, "demo-2x2", [2, 2])
    assert list(one) == list(two) == ["plain", "overlap_ddp", "sharded",
                                      "optimizer_in_backward", "post_local_sgd", "checkpoint"]
    for technique, row in two.items():
        for figure in ("losses", "final_loss", "max_param_diff"):
            assert row[figure] == one[technique][figure], (technique, figure)
        assert len(row["peak_rss_mib"]) == 4
    assert two["overlap_ddp"]["max_param_diff"] == 0.0
    assert two["sharded"]["max_param_diff"] == 0.0
    assert two["checkpoint"]["max_param_diff"] == 0.0
    assert "saved at world size 4, reloaded at 4" in two["checkpoint"]["note"]


def test_the_hierarchy_from_the_launch_under_torchrun(workdir: Path) -> None:
    job = Job([str(TESTS / "nodes_probe.py")], [2, 2], workdir, name="probe").start()
    finished(job, "PROBE ")
    line = next(line for line in job.output().splitlines() if line.startswith("PROBE "))
    answers = json.loads(line[len("PROBE "):])
    assert [answer["plan"] for answer in answers] == [{"1": 2, "4": 4}] * 4
    assert all(answer["same"] for answer in answers)  # bitwise the explicit groups
    # after step 7 (of 0-7): averaged within each node, not across (that is at step 8)
    lasts = [answer["last"] for answer in answers]
    assert lasts[0] == lasts[1] and lasts[2] == lasts[3] and lasts[0] != lasts[2]


# -- a node lost, and resuming at another shape -----------------------------------------

@pytest.fixture(scope="module")
def lost_mid_step(workdir: Path) -> tuple[Job, float]:
    """Node 1 (ranks 2 and 3) lost in the forward of step 12 (the 13th loss); the last
    checkpoint is step 10's. Returns the job and when the node was lost."""
    mark = workdir / "lost-mid-step.mark"
    job = _readme(workdir, "lost-mid-step", [2, 2], lose={
        "LOSE_GROUP": "1", "LOSE_AT": "loss:13", "LOSE_MARK": str(mark)})
    job.wait(timeout=180)
    return job, float(mark.read_text())


@pytest.fixture(scope="module")
def saved_by_one_machine(workdir: Path) -> Path:
    """The README script to step 10 on 4 ranks of one machine (no torchrun)."""
    return _reference(workdir, "saved-by-4", 4, stop_at=10)


@needs_proc
def test_a_lost_node_is_named_by_the_survivors_within_seconds(
    lost_mid_step: tuple[Job, float],
) -> None:
    job, lost_at = lost_mid_step
    survivor, lost = job.agents
    assert lost.proc.returncode == -9 and survivor.proc.returncode != 0
    errors = survivor.stderr
    assert re.search(r"RanksLostError: ranks 2, 3 \(torchrun node 1 on host \S+\) were lost "
                     r"while reducing a gradient bucket \(DDP comm hook\)", errors), errors[-3000:]
    assert "Connection" in errors and "where ranks 0, 1 did" in errors
    # the README's process group times out after 3 minutes (gloo's default: 30): the
    # survivors end long before it (the figure, measured: docs/benchmarks.md)
    assert survivor.ended is not None and survivor.ended - lost_at < 60


@needs_proc
def test_the_last_checkpoint_before_a_lost_node_is_intact_and_loads(
    workdir: Path, lost_mid_step: tuple[Job, float], saved_by_one_machine: Path,
) -> None:
    # bitwise what 4 ranks of one machine save at step 10: saved by two nodes, intact
    same = compare(_state(saved_by_one_machine), _state(workdir / "lost-mid-step"))
    assert same, same
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    progress = checkpoint.load(workdir / "lost-mid-step", model)
    assert progress["step"] == 10 and progress["scheduler"]["last_epoch"] == 10


@needs_proc
@pytest.mark.parametrize("nodes", [[2], [1, 1, 1]],
                         ids=["one node of 2 ranks", "three nodes of 1 rank"])
def test_a_checkpoint_of_two_nodes_resumes_bitwise_at_another_shape(
    workdir: Path, lost_mid_step: tuple[Job, float], saved_by_one_machine: Path,
    nodes: list[int],
) -> None:
    """The checkpoint two nodes of two ranks saved (the one left by the lost node)
    resumes on one node of two ranks and on three nodes of one, bitwise the same
    schedule on one machine: 4 ranks to step 10, then ``sum(nodes)`` ranks."""
    name = "resumed-" + "x".join(map(str, nodes))
    shutil.copytree(workdir / "lost-mid-step", workdir / name)
    job = _readme(workdir, name, nodes)
    finished(job, LAST)
    assert f"resumed from {workdir / name} at step 10" in job.output()
    shutil.copytree(saved_by_one_machine, workdir / f"reference-{name}")
    reference = _reference(workdir, f"reference-{name}", sum(nodes))
    same = compare(_state(reference), _state(workdir / name))
    assert same, same


@pytest.fixture(scope="module")
def lost_while_saving(workdir: Path) -> tuple[Job, list[str]]:
    """Node 1 lost once its ranks wrote their part of step 10's checkpoint (the 2nd
    save), then its torchrun started again; ``--max-restarts 1``. Returns the job and
    what was in the checkpoint's folder while node 1 was gone."""
    name = "lost-while-saving"
    job = _readme(workdir, name, [2, 2], max_restarts=1, lose={
        "LOSE_GROUP": "1", "LOSE_AT": "save:2", "LOSE_MARK": str(workdir / f"{name}.mark")},
        # torch 2.13: a restarted node cannot rejoin while the store is shared
        env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    survivor, lost = job.agents
    assert lost.wait(time.monotonic() + 120) == -9, lost.stderr[-3000:]
    deadline = time.monotonic() + 60
    while "RanksLostError" not in survivor.stderr:  # the survivors have named it
        assert time.monotonic() < deadline and survivor.proc.poll() is None, \
            survivor.stderr[-3000:]
        time.sleep(0.2)
    halfway = sorted(path.name for path in (workdir / f".{name}.saving").iterdir())
    job.start_agent(2)  # the lost node comes back
    finished(job, LAST, lost=[lost])
    return job, halfway


@needs_proc
def test_a_node_lost_while_saving_leaves_the_last_complete_checkpoint(
    workdir: Path, lost_while_saving: tuple[Job, list[str]],
) -> None:
    job, halfway = lost_while_saving
    assert ".metadata" not in halfway and halfway  # written in part, never completed
    errors = job.agents[0].stderr
    assert re.search(r"RanksLostError: ranks 2, 3 \(torchrun node 1 on host \S+\) were lost "
                     r"while saving the checkpoint to \S+lost-while-saving", errors)
    # after the restart, global rank 0 is on whichever node the rendezvous numbers 0:
    # the survivor's agent or the one started again
    output = job.output()
    assert "step 5: loss" in output
    assert f"resumed from {workdir / 'lost-while-saving'} at step 5" in output  # not 10
    assert not (workdir / ".lost-while-saving.saving").exists()  # cleaned by the next save


@needs_proc
def test_a_restarted_node_resumes_bitwise_as_a_run_resumed_without_loss(
    workdir: Path, lost_while_saving: tuple[Job, list[str]],
) -> None:
    """The loss costs the steps since the last checkpoint, nothing else: the run ends
    bitwise where a run stopped at that checkpoint and resumed ends."""
    _reference(workdir, "stopped-at-5", 4, stop_at=5)
    reference = _reference(workdir, "stopped-at-5", 4)
    same = compare(_state(reference), _state(workdir / "lost-while-saving"))
    assert same, same


@needs_proc
def test_a_restarted_node_ends_where_the_uninterrupted_run_ends(
    workdir: Path, lost_while_saving: tuple[Job, list[str]], two_nodes_of_two: Job,
) -> None:
    """Bitwise, on four ranks too: the checkpoint carries DDP's bucket layout, which
    the restarted run takes from its first step (overlapkit.checkpoint.ddp_buckets;
    without it the first step after the restart sums the ranks' gradients in another
    order: 3e-8 off, measured on torch 2.13)."""
    job, _ = lost_while_saving
    assert _last_line(job.output()) == _last_line(two_nodes_of_two.output())
    same = compare(_state(workdir / "two-nodes-of-2"), _state(workdir / "lost-while-saving"))
    assert same, same


# -- a checkpoint directory the nodes do not share ---------------------------------------

def _disks(workdir: Path, name: str, count: int) -> list[Path]:
    disks = [workdir / f"{name}-disk{node}" for node in range(count)]
    for disk in disks:
        disk.mkdir()
    return disks


@needs_mounts
def test_a_checkpoint_directory_the_nodes_do_not_share_fails_the_save_on_every_rank(
    workdir: Path,
) -> None:
    """Two nodes of one rank, CHECKPOINT at the same path on both, each on its own disk:
    the first save (step 5) raises on both ranks, naming the directory's problem, and
    nothing is marked complete on either disk. (Before: both printed "saved" and node
    0's checkpoint lacked node 1's shards.)"""
    name = "unshared-save"
    disks = _disks(workdir, name, 2)
    job = _readme(workdir, name, [1, 1], stop_at=5, disks=disks)
    codes = job.wait(timeout=180)
    assert all(code != 0 for code in codes), codes
    assert "saved" not in job.output()
    for agent in job.agents:
        assert re.search(r"CheckpointError: saving the checkpoint to \S+ failed: the ranks do "
                         r"not all see the files the others wrote", agent.stderr), \
            agent.stderr[-3000:]
        assert "rank 1 (torchrun node 1 on host" in agent.stderr
        assert "must be on storage every node sees" in agent.stderr
    assert not (disks[0] / "checkpoint").exists() and not (disks[1] / "checkpoint").exists()
    assert not (disks[0] / ".checkpoint.saving" / ".overlapkit-files.json").exists()
    assert checkpoint.latest(disks[0] / "checkpoint") is None


@needs_mounts
def test_nodes_that_see_different_checkpoints_refuse_to_resume_on_every_rank(
    workdir: Path,
) -> None:
    """A complete checkpoint on node 0's disk only: every rank raises at ``latest``,
    naming what each node sees, and none trains. (Before: node 0's ranks resumed, node
    1's trained from the start, and the job hung for gloo's 30 minutes.)"""
    name = "unshared-resume"
    disks = _disks(workdir, name, 2)
    _reference(workdir, f"{name}-saved", 2, stop_at=5)
    shutil.copytree(workdir / f"{name}-saved", disks[0] / "checkpoint")
    started = time.monotonic()
    job = _readme(workdir, name, [1, 1], disks=disks)
    codes = job.wait(timeout=180)
    assert all(code != 0 for code in codes), codes
    assert time.monotonic() - started < 150  # the job's timeout: never gloo's 30 minutes
    assert "resumed" not in job.output() and "step " not in job.output()
    for agent in job.agents:
        errors = agent.stderr
        assert "CheckpointError: latest: the ranks do not find the same checkpoint" in errors, \
            errors[-3000:]
        assert re.search(r"rank 0 \(torchrun node 0 on host \S+\) sees the checkpoint at \S+"
                         r"checkpoint \(file list [0-9a-f]+\); rank 1 \(torchrun node 1 on "
                         r"host \S+\) sees no checkpoint", errors), errors[-3000:]


def test_the_readme_script_waits_minutes_not_glooss_half_hour_for_a_node() -> None:
    """A node that hangs, or dies while starting, fails the others after the process
    group's timeout: the README sets one a reader would choose."""
    calls = re.findall(r"dist\.init_process_group\((.*)\)", _example())
    assert calls == ['"gloo", timeout=datetime.timedelta(minutes=3)']


# -- node 0 lost between the save's two renames ------------------------------------------

@needs_proc
def test_node_0_lost_between_the_renames_resumes_from_the_newest_complete_checkpoint(
    workdir: Path, two_nodes_of_two: Job,
) -> None:
    """Node 0 (rank 0 moves checkpoints into place) killed between the two renames of
    step 10's save: step 5's checkpoint at ``.NAME.old``, step 10's complete at
    ``.NAME.saving``, nothing at the path. The job launched again resumes at step 10
    and ends bitwise as the uninterrupted run. (Before: it trained from step 0 without
    a word, and its first save threw step 10's checkpoint away.)"""
    name = "lost-between-renames"
    path = workdir / name
    lost = _readme(workdir, name, [2, 2], lose={
        "LOSE_GROUP": "0", "LOSE_AT": "rename:2", "LOSE_MARK": str(workdir / f"{name}.mark")})
    codes = lost.wait(timeout=180)
    assert codes[0] == -9 and codes[1] != 0, codes
    assert not path.exists()
    for left in (f".{name}.old", f".{name}.saving"):
        assert (workdir / left / ".overlapkit-files.json").is_file(), left
    job = _readme(workdir, name, [2, 2])
    finished(job, LAST)
    assert f"resumed from {path} at step 10" in job.output()
    assert sorted(p.name for p in workdir.iterdir() if name in p.name and "agent" not in p.name
                  and not p.name.endswith(".mark")) == [name]
    assert _last_line(job.output()) == _last_line(two_nodes_of_two.output())
    same = compare(_state(workdir / "two-nodes-of-2"), _state(path))
    assert same, same
