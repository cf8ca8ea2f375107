"""Rank functions for the checkpoint tests (spawned by run_distributed, so importable).

Every rank trains on the same batches, so the gradient averaged over ranks equals the
single-process gradient, and runs at different world sizes can be compared.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

CPU = torch.device("cpu")


class Net(nn.Module):
    """A tiny MLP whose layers split evenly over 1, 2 or 4 ranks on every dim."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.down(torch.relu(self.up(x)))))


def _tensor_parallel(model: Net, tp_mesh: DeviceMesh) -> Net:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    return parallelize_module(model, tp_mesh, {"up": ColwiseParallel(),
                                               "down": RowwiseParallel()})


def build(kind: str, *, seed: int = 0, lr: float = 0.01) -> tuple[nn.Module, Any]:
    """A Net wrapped as ``kind``, with AdamW: same initial weights on every rank."""
    torch.manual_seed(seed)
    model: nn.Module = Net()
    ws = dist.get_world_size() if dist.is_initialized() else 1
    if kind == "plain":
        pass
    elif kind == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (ws,)))
    elif kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model = FSDP(model, device_id=CPU, use_orig_params=True)
    elif kind == "fsdp2_tp":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (ws // 2, 2), mesh_dim_names=("dp", "tp"))
        model = _tensor_parallel(model, mesh["tp"])
        fully_shard(model, mesh=mesh["dp"])
    elif kind == "fsdp1_tp":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        mesh = init_device_mesh("cpu", (ws // 2, 2), mesh_dim_names=("dp", "tp"))
        model = _tensor_parallel(model, mesh["tp"])
        model = FSDP(model, device_mesh=mesh["dp"], device_id=CPU, use_orig_params=True)
    else:
        raise ValueError(kind)
    return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def train(model: nn.Module, optimizer: Any, steps: int, *, first: int = 0) -> None:
    for step in range(first, first + steps):
        gen = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(4, 8, generator=gen)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def full_state(model: nn.Module, optimizer: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter and optimizer-state tensor, gathered whole, by flat name."""
    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(
        full_state_dict=True))
    out = {f"model.{k}": v.detach().clone() for k, v in msd.items()}
    for fqn, state in osd["state"].items():
        for name, value in state.items():
            out[f"optimizer.{fqn}.{name}"] = value.detach().clone()
    return {"tensors": out, "lr": osd["param_groups"][0]["lr"]}


# -- the resharding chain: save at 2 -> load at 4 (and save 2-D) -> load at 2 -> at 1 ------

def _path(root: str, name: str) -> str:
    return f"{root}/{name}"


def save_at_two(rank: int, ws: int, root: str) -> dict[str, Any]:
    """Train each layout one step, save, then train two more (the uninterrupted run)."""
    from overlapkit import checkpoint

    out: dict[str, Any] = {}
    for kind in ("fsdp2", "ddp", "fsdp1"):
        model, opt = build(kind)
        train(model, opt, 1)
        checkpoint.save(_path(root, kind), model, opt)
        out[f"{kind}/saved"] = full_state(model, opt)
        train(model, opt, 2, first=1)
        out[f"{kind}/after2"] = full_state(model, opt)
    return out if rank == 0 else {}


def _load_and_continue(root: str, saved_kind: str, into_kind: str) -> dict[str, Any]:
    from overlapkit import checkpoint

    model, opt = build(into_kind, seed=123, lr=0.5)  # other weights and lr: all replaced
    checkpoint.load(_path(root, saved_kind), model, opt)
    loaded = full_state(model, opt)
    train(model, opt, 2, first=1)
    return {"loaded": loaded, "after2": full_state(model, opt)}


def load_at_four(rank: int, ws: int, root: str) -> dict[str, Any]:
    """Load the world-size-2 checkpoints on 4 ranks; save a dp2 x tp2 checkpoint; run the
    2-D FSDP1 + TP comparison with torch's load_sharded_optimizer_state_dict."""
    from overlapkit import checkpoint

    out: dict[str, Any] = {}
    out["fsdp2->fsdp2"] = _load_and_continue(root, "fsdp2", "fsdp2")
    out["fsdp1->fsdp1"] = _load_and_continue(root, "fsdp1", "fsdp1")
    model, opt = build("fsdp2_tp")
    train(model, opt, 1)
    checkpoint.save(_path(root, "fsdp2_tp"), model, opt)
    out["fsdp2_tp/saved"] = full_state(model, opt)
    train(model, opt, 2, first=1)
    out["fsdp2_tp/after2"] = full_state(model, opt)
    out["fsdp1_tp"] = fsdp1_tp_regression(rank, ws, _path(root, "fsdp1_tp"))
    return out if rank == 0 else {"fsdp1_tp": out["fsdp1_tp"]}


def load_at_two(rank: int, ws: int, root: str) -> dict[str, Any]:
    """2-D -> 1-D FSDP2, DDP -> FSDP2, FSDP2 -> DDP, FSDP2 2 -> 2; then 1-D FSDP2 -> 2-D;
    and a shape error raised alike on every rank."""
    from overlapkit import checkpoint
    from overlapkit.errors import CheckpointError

    out: dict[str, Any] = {}
    out["fsdp2_tp->fsdp2"] = _load_and_continue(root, "fsdp2_tp", "fsdp2")
    out["ddp->fsdp2"] = _load_and_continue(root, "ddp", "fsdp2")
    out["fsdp2->ddp"] = _load_and_continue(root, "fsdp2", "ddp")
    out["fsdp2->fsdp2@2"] = _load_and_continue(root, "fsdp2", "fsdp2")
    out["fsdp2->fsdp2_tp"] = _load_and_continue(root, "fsdp2", "fsdp2_tp")
    torch.manual_seed(0)
    wide = Net()
    wide.up, wide.down = nn.Linear(8, 32), nn.Linear(32, 8)  # same names, wider
    from torch.distributed.fsdp import fully_shard

    fully_shard(wide, mesh=init_device_mesh("cpu", (ws,)))
    try:
        checkpoint.load(_path(root, "fsdp2"), wide, torch.optim.AdamW(wide.parameters()))
        out["error"] = None
    except CheckpointError as exc:
        out["error"] = str(exc)
    return out if rank == 0 else {"error": out["error"]}


def load_at_one(rank: int, ws: int, root: str) -> dict[str, Any]:
    return {
        "fsdp2->fsdp2@1": _load_and_continue(root, "fsdp2", "fsdp2"),
        "fsdp1->fsdp1@1": _load_and_continue(root, "fsdp1", "fsdp1"),
        "fsdp2_tp->plain": _load_and_continue(root, "fsdp2_tp", "plain"),
    }


# -- the 2-D FSDP1 + TP case where torch's load_sharded_optimizer_state_dict is wrong --------

def _optimizer_state_after(model: nn.Module, optim_state: dict[str, Any]) -> list[torch.Tensor]:
    """Load ``optim_state`` (FSDP1's sharded optimizer state dict) into a fresh optimizer
    of a fresh copy of the model, and return every state tensor in parameter order."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    fresh, opt = build("fsdp1_tp", seed=7)
    with FSDP.state_dict_type(fresh, StateDictType.SHARDED_STATE_DICT):
        flat = FSDP.optim_state_dict_to_load(fresh, opt, optim_state)
    opt.load_state_dict(flat)
    return [opt.state[p][k].clone() for p in opt.param_groups[0]["params"]
            for k in sorted(opt.state[p])]


def fsdp1_tp_regression(rank: int, ws: int, path: str) -> dict[str, Any]:
    import copy
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.optimizer import (
        load_sharded_optimizer_state_dict as torch_load_sharded,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType
    from torch.distributed.tensor import DTensor

    from overlapkit.checkpoint import load_sharded_optimizer_state_dict

    model, opt = build("fsdp1_tp")
    train(model, opt, 1)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        model_sd = model.state_dict()
        optim_sd = FSDP.optim_state_dict(model, opt)
    truth = copy.deepcopy(optim_sd)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = load_sharded_optimizer_state_dict(model_sd, "optim", dcp.FileSystemReader(path))
    our_warnings = [str(w.message) for w in caught]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        theirs = torch_load_sharded(model_sd, "optim", dcp.FileSystemReader(path))
    torch_warnings = sorted({str(w.message)[:60] for w in caught
                             if issubclass(w.category, FutureWarning | DeprecationWarning)
                             or "deprecat" in str(w.message)})

    same_layout_and_values = []
    for fqn, state in truth["state"].items():
        for name, value in state.items():
            got = ours["optim"]["state"][fqn][name]
            if isinstance(value, DTensor):
                same_layout_and_values.append(
                    isinstance(got, DTensor) and got.placements == value.placements
                    and torch.equal(got.to_local(), value.to_local()))
            else:
                same_layout_and_values.append(torch.equal(got, value))
    expected = _optimizer_state_after(model, copy.deepcopy(truth))
    with_ours = _optimizer_state_after(model, ours["optim"])
    with_torch = _optimizer_state_after(model, theirs["optim"])
    return {
        "ours_match_saved": same_layout_and_values,
        "ours_roundtrip_equal": [torch.equal(a, b) for a, b in zip(expected, with_ours,
                                                                   strict=True)],
        "torch_roundtrip_equal": [torch.equal(a, b) for a, b in zip(expected, with_torch,
                                                                    strict=True)],
        "our_warnings": our_warnings,
        "torch_warnings": torch_warnings,
    }


def overlap_and_failing_swap(rank: int, ws: int, root: str) -> dict[str, Any]:
    """overlap_ddp with state-free SGD, saved after a stepping backward (taken in the
    first window, refused in the second: the loop has called step() by then) against
    the same run without the saves; then a save whose final rename on rank 0 is
    refused."""
    from pathlib import Path

    import overlapkit
    from overlapkit import checkpoint
    from overlapkit.checkpoint import saving
    from overlapkit.errors import CheckpointError

    finals, refusals = [], []
    for save in (False, True):
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(Net())
        opt = overlapkit.overlap_ddp(model, torch.optim.SGD, lr=0.1)
        batches = torch.Generator().manual_seed(1)
        for step in range(3):
            model(torch.randn(4, 8, generator=batches)).square().mean().backward()
            if save and step < 2:
                try:
                    checkpoint.save(f"{root}/overlap-{step}", model, opt)
                except CheckpointError as error:
                    refusals.append((step, str(error)))
            opt.step()  # the backward stepped: a no-op
            opt.zero_grad()
        finals.append([p.detach().clone() for p in model.parameters()])
    results: dict[str, Any] = {"overlap_save_changes_nothing": all(
        torch.equal(a, b) for a, b in zip(*finals, strict=True)),
        "window_saves_refused": [step for step, error in refusals
                                 if "between backward() and optimizer.step()" in error],
        "second_save_written": Path(f"{root}/overlap-1").exists()}

    # a load in the first window: refused before anything loads (it used to load, over
    # parameters the backward had just stepped, where the plain step() comes after it)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Net())
    opt = overlapkit.overlap_ddp(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    model(torch.randn(4, 8)).square().mean().backward()
    before = [p.detach().clone() for p in model.parameters()], opt.state_dict()
    try:
        checkpoint.load(f"{root}/overlap-0", model, opt)
        results["first_window_load"] = "loaded"
    except CheckpointError as error:
        results["first_window_load"] = str(error)
    results["first_window_load_changed_nothing"] = all(
        torch.equal(a, b) for a, b in zip(before[0], model.parameters(), strict=True)
    ) and str(opt.state_dict()) == str(before[1])
    opt.step()
    opt.zero_grad()

    path = Path(root) / "swap"
    checkpoint.save(path, model)
    real_replace = saving.os.replace
    renames = []

    def second_rename_refused(src: Any, dst: Any) -> None:
        renames.append(dst)
        if len(renames) == 2:
            raise PermissionError("refused by the file system")
        real_replace(src, dst)

    if rank == 0:  # only rank 0 renames; the others learn of its failure
        saving.os.replace = second_rename_refused  # type: ignore[assignment]
    try:
        checkpoint.save(path, model)
        results["swap_error"] = None
    except CheckpointError as exc:
        results["swap_error"] = str(exc)
    finally:
        saving.os.replace = real_replace  # type: ignore[assignment]
    results["previous_intact"] = (path / ".metadata").is_file()
    return results


def resume_from_before_the_first_step(rank: int, world_size: int, directory: str
                                      ) -> dict[str, Any]:
    """Save a fresh model + AdamW (no step yet), train 2 steps on; load that checkpoint
    into another model and fresh optimizer, train the same 2 steps: per wrapper, how
    many parameters have optimizer state after the load (0, as in the uninterrupted
    run) and how the resumed parameters compare with the uninterrupted ones."""
    from helpers import compare, values

    import overlapkit

    out: dict[str, Any] = {}
    for kind in ("ddp", "fsdp2", "fsdp1"):
        model, opt = build(kind)
        overlapkit.checkpoint.save(f"{directory}/{kind}", model, opt)
        train(model, opt, 2)
        resumed, resumed_opt = build(kind, seed=3)
        overlapkit.checkpoint.load(f"{directory}/{kind}", resumed, resumed_opt)
        out[f"{kind}/state after load"] = len(resumed_opt.state)
        train(resumed, resumed_opt, 2)
        out[f"{kind}/resumed"] = compare(values(model), values(resumed))
    return out
