"""A second backward through a graph kept with ``retain_graph=True`` on a DDP model,
under ``optimizer_in_backward`` with its first step learnt (``learn_first_step``, as
the integrations set up): DDP reduces once per forward, so that backward reduces
nothing. At 968cf42 it was refused as "the forward did not run through the
DistributedDataParallel model (the module it wraps was called, e.g.
model.module(batch))", which it had; the refusal now names the kept graph (2 gloo
ranks, ``tests/kept_graph_ddp_ranks.py``). The same loop not learnt is refused as it
starts (``tests/test_window.py``); ``overlap_ddp`` learnt takes it in the plain
order, bitwise."""

from __future__ import annotations

from kept_graph_ddp_ranks import run

from overlapkit.distributed import run_distributed


def test_a_second_backward_through_a_kept_graph_names_it_on_ddp() -> None:
    for found in run_distributed(run, 2, timeout=300):
        error = found["error"]
        assert error is not None and error["type"] == "ConfigurationError", found
        assert "retain_graph=True" in error["message"], error["message"]
        assert "model.module(batch)" not in error["message"], error["message"]
        assert found["unchanged"], found
