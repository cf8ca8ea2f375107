"""What does not run under torchft is refused before anything changes, naming what to
use: overlap_ddp and post_local_sgd on torchft's DDP, and local_sgd's bad arguments.
In one process: a real Lighthouse and real Managers (replica groups of one rank)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch

pytest.importorskip("torchft")

import overlapkit
import overlapkit.ft
from overlapkit.errors import ConfigurationError, UnsupportedModelError


@pytest.fixture(scope="module")
def lighthouse() -> Iterator[str]:
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1)
    yield server.address()
    server.shutdown()


@pytest.fixture
def make_manager(lighthouse: str) -> Iterator[Any]:
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    built: list[Any] = []

    def make(*, use_async_quorum: bool = False) -> Any:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        manager = Manager(
            pg=ProcessGroupGloo(), min_replica_size=1, use_async_quorum=use_async_quorum,
            load_state_dict=None, state_dict=None, store_addr="127.0.0.1",
            store_port=store.port, rank=0, world_size=1, lighthouse_addr=lighthouse,
            replica_id=f"refusals_{len(built)}", timeout=timedelta(seconds=5),
        )
        built.append((manager, store))
        return manager

    yield make
    for manager, _ in built:
        manager.shutdown(wait=False)


def _hooks(model: torch.nn.Module) -> list[Any]:
    return [(p._post_accumulate_grad_hooks, p._backward_hooks) for p in model.parameters()]


def test_overlap_ddp_refuses_torchfts_ddp_before_anything_changes(make_manager: Any) -> None:
    from torchft.ddp import DistributedDataParallel

    ddp = DistributedDataParallel(make_manager(), torch.nn.Linear(4, 2))
    before = _hooks(ddp)
    with pytest.raises(UnsupportedModelError) as refused:
        overlapkit.overlap_ddp(ddp, torch.optim.SGD, lr=0.1)
    message = str(refused.value)
    assert "should_commit" in message and "OptimizerWrapper" in message
    assert "overlapkit.ft.local_sgd" in message and "Nothing was changed" in message
    assert _hooks(ddp) == before


def test_post_local_sgd_refuses_torchfts_ddp_naming_overlapkit_ft_local_sgd(
    make_manager: Any,
) -> None:
    from torchft.ddp import DistributedDataParallel

    ddp = DistributedDataParallel(make_manager(), torch.nn.Linear(4, 2))
    with pytest.raises(UnsupportedModelError, match=r"overlapkit\.ft\.local_sgd"):
        overlapkit.post_local_sgd(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1),
                                  period=2, warmup_steps=0)


def test_local_sgd_refuses_an_asynchronous_quorum_before_registering_anything(
    make_manager: Any,
) -> None:
    manager = make_manager(use_async_quorum=True)
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ConfigurationError, match="use_async_quorum=False"):
        overlapkit.ft.local_sgd(manager, model, torch.optim.SGD(model.parameters(), lr=0.1),
                                period=2)
    assert manager._user_state_dicts == {}


def test_local_sgd_refuses_what_is_not_a_torchft_manager() -> None:
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ConfigurationError, match=r"torchft\.Manager"):
        overlapkit.ft.local_sgd(object(), model, torch.optim.SGD(model.parameters(), lr=0.1),
                                period=2)


@pytest.mark.parametrize(("options", "match"), [
    ({"averager": "hierarchical"}, "'periodic' or 'diloco'"),
    ({"process_group": None}, "remove process_group"),
    ({"period": 0}, "period must be"),
    ({"averager": "diloco", "period": 4, "fragments": 2, "fragment_sync_delay": 2},
     r"fragment_sync_delay must be an integer in \[0, 2\)"),
    ({"averager": "diloco", "fragment_update_alpha": 1.5},
     r"fragment_update_alpha must be a number in \[0, 1\]"),
])
def test_local_sgd_refuses_bad_options_before_registering_anything(
    make_manager: Any, options: dict[str, Any], match: str
) -> None:
    manager = make_manager()
    model = torch.nn.Linear(4, 2)
    arguments = {"period": 2, **options}
    with pytest.raises(ConfigurationError, match=match):
        overlapkit.ft.local_sgd(manager, model, torch.optim.SGD(model.parameters(), lr=0.1),
                                **arguments)
    assert manager._user_state_dicts == {}


def test_local_sgd_refuses_an_optimizer_over_parameters_outside_the_model(
    make_manager: Any,
) -> None:
    model, other = torch.nn.Linear(4, 2), torch.nn.Linear(2, 2)
    optim = torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1)
    with pytest.raises(ConfigurationError, match="2 of the optimizer's parameters"):
        overlapkit.ft.local_sgd(make_manager(), model, optim, period=2)


def test_a_second_local_sgd_optimizer_on_one_manager_is_refused(make_manager: Any) -> None:
    manager = make_manager()
    model = torch.nn.Linear(4, 2)
    first = overlapkit.ft.local_sgd(manager, model,
                                    torch.optim.SGD(model.parameters(), lr=0.1), period=2)
    assert isinstance(first, overlapkit.ft.FaultTolerantLocalSGD)
    with pytest.raises(ConfigurationError, match="one Manager per optimizer"):
        overlapkit.ft.local_sgd(manager, model, torch.optim.SGD(model.parameters(), lr=0.1),
                                period=2)


def test_a_quorum_that_cannot_form_is_a_quorum_error_and_the_step_is_not_counted() -> None:
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.coordination import LighthouseServer

    from overlapkit.errors import QuorumError

    # a quorum of at least 2 replica groups, and only this one: it never forms
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(), min_replica_size=1, use_async_quorum=False,
        load_state_dict=None, state_dict=None, store_addr="127.0.0.1",
        store_port=store.port, rank=0, world_size=1, lighthouse_addr=lighthouse.address(),
        replica_id="gone", timeout=timedelta(seconds=2),
        quorum_timeout=timedelta(seconds=2), connect_timeout=timedelta(seconds=2),
    )
    try:
        model = torch.nn.Linear(4, 2)
        optim = overlapkit.ft.local_sgd(manager, model,
                                        torch.optim.SGD(model.parameters(), lr=0.1), period=2)
        model(torch.ones(1, 4)).sum().backward()
        with pytest.raises(QuorumError, match="Lighthouse"):
            optim.step()  # step 0 averages (torch's schedule)
        assert optim.averager.step == 0 and optim.commits == 0
    finally:
        manager.shutdown(wait=False)
        lighthouse.shutdown()
