"""What the window's per-step bookkeeping costs: the marks taken at the end of each
stepping backward and the checks at ``step()``, in microseconds per step.

One process, no process group, 200 x ``Linear(64, 64)`` (400 parameters, the
``optimizer_in_backward`` row of ``overlapkit bench --only engine_overhead``), Adam:

- ``FirstWindow.mark`` with every gradient freed (``optimizer_in_backward``) and with
  every gradient kept (``overlap_ddp``);
- ``refuse_changed_gradients`` (what ``step()`` checks: settings, state, values changed
  in place, gradients changed) over unchanged marks.

Best of 7 rounds of 200 calls (``timeit``), so that other processes on the cores
change the figure least. Compare two trees with ``PYTHONPATH``:

    PYTHONPATH=$PWD python benchmarks/window_marks.py
"""

from __future__ import annotations

import timeit
from collections.abc import Callable

import torch
from torch import nn

from overlapkit.overlap.core.late_changes import refuse_changed_gradients
from overlapkit.overlap.core.window import FirstWindow

CALLS, ROUNDS = 200, 7


def _best_us(call: Callable[[], object]) -> float:
    return min(timeit.repeat(call, number=CALLS, repeat=ROUNDS)) / CALLS * 1e6


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(200)])
    params = list(model.parameters())
    names = {id(p): name for name, p in model.named_parameters()}
    optimizer = torch.optim.Adam(params)
    marks = FirstWindow(optimizer=optimizer)
    rows = [("mark, gradients freed", _best_us(lambda: marks.mark(params)))]
    marks.mark_settings()
    marks.mark_state()
    rows.append(("refuse_changed_gradients, gradients freed",
                 _best_us(lambda: refuse_changed_gradients(marks, names, params, "x"))))
    model(torch.randn(8, 64)).square().mean().backward()
    rows.append(("mark, gradients kept", _best_us(lambda: marks.mark(params))))
    rows.append(("refuse_changed_gradients, gradients kept",
                 _best_us(lambda: refuse_changed_gradients(marks, names, params, "x"))))
    marks.release_state()
    print(f"{len(params)} parameters, best of {ROUNDS} x {CALLS} calls, us per call")
    for label, micros in rows:
        print(f"  {label:45s} {micros:8.1f}")


if __name__ == "__main__":
    main()
