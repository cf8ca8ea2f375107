"""The stream-ordering contract of the side streams, pinned without a GPU: a recording
stand-in for the stream API (``SideStream(params, api=...)``) logs what waits on what,
on tensors of the ``meta`` device playing the accelerator's.

1. a bucket step waits for its comm future *on the side stream*, never on the compute
   stream (which would queue backward behind every allreduce);
2. the compute stream waits for the side stream before DDP's finalize and before
   anything reads parameters or state again (``synchronize``);
3. a parameter step waits for the compute stream first; freed gradients are recorded on
   the side stream of their own device only; CPU parameters step inline.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from torch import nn

from overlapkit.overlap.core.generic import GenericOverlapEngine
from overlapkit.overlap.core.side_stream import SideStream, StreamAPI
from overlapkit.overlap.ddp.bucket_stepper import BucketStepper
from overlapkit.overlap.rules.clipping import GradClipping

LOG: list[str] = []


class RecordingStream:
    """Logs ``wait_stream`` calls and entering/leaving its context."""

    active: ClassVar[list[str]] = []

    def __init__(self, name: str) -> None:
        self.name = name

    def wait_stream(self, other: RecordingStream) -> None:
        LOG.append(f"{self.name} waits {other.name}")

    def __enter__(self) -> None:
        RecordingStream.active.append(self.name)
        LOG.append(f"enter {self.name}")

    def __exit__(self, *exc: Any) -> None:
        RecordingStream.active.pop()
        LOG.append(f"leave {self.name}")


class RecordingAPI(StreamAPI):
    """The meta device as the accelerator: one compute stream, side streams on demand."""

    def __init__(self) -> None:
        self.compute = RecordingStream("compute")

    def accelerator_type(self) -> str | None:
        return "meta"

    def stream_device_types(self) -> tuple[str, ...]:
        return ("meta",)

    def new_stream(self, device: torch.device) -> RecordingStream:
        return RecordingStream(f"side:{device.type}")

    def current_stream(self, device: torch.device) -> RecordingStream:
        return self.compute

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        LOG.append(f"record {tuple(tensor.shape)} on {stream.name}")


class RecordingFuture:
    """A completed comm future that logs on which stream it is waited for."""

    def __init__(self, value: torch.Tensor) -> None:
        self._value = value

    def wait(self) -> torch.Tensor:
        where = RecordingStream.active[-1] if RecordingStream.active else "compute"
        LOG.append(f"future waited on {where}")
        return self._value

    def value(self) -> torch.Tensor:
        return self._value

    def done(self) -> bool:
        return True


class Bucket:
    """The three things the stepper reads of DDP's GradBucket."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self._params = params
        self._buffer = torch.zeros(sum(p.numel() for p in params), device="meta")

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return 0


@contextmanager
def recording() -> Iterator[list[str]]:
    LOG.clear()
    yield LOG


def test_a_bucket_step_waits_for_its_future_on_the_side_stream_only() -> None:
    params = [nn.Parameter(torch.zeros(3, device="meta"))]
    side = SideStream(params, api=RecordingAPI())
    engine = GenericOverlapEngine(torch.optim.SGD(params, lr=0.1))
    stepper = BucketStepper(engine, None, None, track_usage=False, step_thread="backward",
                            grads_are_bucket_views=False, clipping=GradClipping(),
                            side_stream=side)
    bucket = Bucket(params)
    with recording() as log:
        stepper._step_bucket(bucket, RecordingFuture(bucket.buffer()))  # type: ignore[arg-type]
        assert log == ["enter side:meta", "future waited on side:meta", "leave side:meta"]
        assert "compute waits" not in " ".join(log)
    with recording() as log:
        stepper.synchronize()  # what runs before DDP's finalize
        assert log == ["compute waits side:meta"]


def test_a_parameter_step_waits_for_compute_and_records_freed_gradients() -> None:
    meta = nn.Parameter(torch.zeros(2, device="meta"))
    side = SideStream([meta], api=RecordingAPI())
    grad_here = torch.zeros(2, device="meta")
    grad_elsewhere = torch.zeros(5)  # another device: not this stream's to record
    with recording() as log:
        with side.running([meta], freed=(grad_here, grad_elsewhere)):
            LOG.append("step")
        assert log == ["side:meta waits compute", "enter side:meta", "step",
                       "leave side:meta", "record (2,) on side:meta"]


def test_parameters_on_a_device_without_a_side_stream_step_inline() -> None:
    meta = nn.Parameter(torch.zeros(2, device="meta"))
    cpu = nn.Parameter(torch.zeros(2))
    side = SideStream([meta, cpu], api=RecordingAPI())
    assert list(side.streams) == [torch.device("meta")]  # one stream per device
    with recording() as log:
        with side.running([cpu], freed=(cpu,)):
            LOG.append("step")
        assert log == ["step"]


def test_on_cpu_there_is_no_side_stream() -> None:
    side = SideStream([nn.Parameter(torch.zeros(2))])
    assert not side.active
    side.join()  # no-op
