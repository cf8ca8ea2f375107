"""Where optimizer steps run during backward: side streams on an accelerator, inline on
CPU, through the same code path.

The ordering follows PyTorch's own ``_apply_optimizer_in_backward`` DDP hook
(``torch/distributed/algorithms/ddp_comm_hooks/optimizer_overlap_hooks.py``):

- a **bucket** step waits for its allreduce *on the side stream*
  (``with side: future.wait()``): on NCCL a future completes when the allreduce is
  enqueued, and waiting on it makes the *current* stream wait for the allreduce, so
  waiting on the compute stream would queue every later backward kernel behind every
  allreduce. Only the side stream waits.
- a **parameter** step (plain module, FSDP2) reads a gradient the compute stream has
  just produced, so the side stream first waits for the compute stream.
- at the end of backward — and before anything reads parameters or optimizer state
  again: DDP's finalize copies, the next forward, ``step``, ``zero_grad``,
  ``state_dict`` — the compute stream waits for the side streams (:meth:`join`). A
  backward that raised has no end-of-backward callback, so the overlapped optimizer
  joins again at the next forward and in each of those calls.
- gradients freed right after their step are ``record_stream``-ed on the side stream,
  each on its own device, so the caching allocator does not hand their memory out
  before the side stream has read them.

One side stream per accelerator device the parameters live on; parameters elsewhere
(CPU, or a device type without streams that support ``record_stream``) step inline.
On CPU there is no stream: torch 2.13's ``torch.Stream`` on CPU raises "cpu backend
doesn't support events" on ``wait_stream`` (measured), which is why torch's own
``_apply_optim_in_backward_hook`` fails there. The stream calls go through
:class:`StreamAPI`, so the ordering is pinned by tests without a GPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["STREAM_DEVICE_TYPES", "SideStream", "StreamAPI"]

#: device types whose streams support ``Tensor.record_stream`` (not MPS)
STREAM_DEVICE_TYPES = ("cuda", "xpu")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    # A DTensor (FSDP2's sharded gradient) is recorded through its local shard.
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


class StreamAPI:
    """The stream operations :class:`SideStream` uses, on ``torch.accelerator``."""

    def accelerator_type(self) -> str | None:
        """The accelerator's device type, or None without one."""
        if not torch.accelerator.is_available():
            return None
        accelerator = torch.accelerator.current_accelerator()
        return None if accelerator is None else accelerator.type

    def stream_device_types(self) -> tuple[str, ...]:
        """Device types whose streams support ``Tensor.record_stream``."""
        return STREAM_DEVICE_TYPES

    def new_stream(self, device: torch.device) -> Any:
        return torch.Stream(device=device)

    def current_stream(self, device: torch.device) -> Any:
        return torch.accelerator.current_stream(device)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)


class SideStream:
    """Side streams for the steps of ``params`` during backward, one per accelerator
    device among their devices; steps of parameters elsewhere run inline.

    :param params: the parameters stepped (their devices decide the streams).
    :param api: the stream operations (tests pass a recording stand-in).
    """

    def __init__(self, params: Iterable[torch.Tensor], api: StreamAPI | None = None) -> None:
        self.api = api or StreamAPI()
        accelerator = self.api.accelerator_type()
        self.streams: dict[torch.device, Any] = {}
        if accelerator in self.api.stream_device_types():
            for device in {_local(p).device for p in params}:
                if device.type == accelerator:
                    self.streams[device] = self.api.new_stream(device)

    @property
    def active(self) -> bool:
        """Whether any step runs on a side stream (an accelerator), not inline."""
        return bool(self.streams)

    def stream_for(self, tensors: Iterable[torch.Tensor]) -> tuple[torch.device, Any] | None:
        """The side stream of the device of ``tensors`` (the first one's), or None."""
        for tensor in tensors:
            device = _local(tensor).device
            stream = self.streams.get(device)
            return None if stream is None else (device, stream)
        return None

    @contextmanager
    def running(self, params: Iterable[torch.Tensor], *, after_compute: bool = True,
                freed: Iterable[torch.Tensor] = ()) -> Iterator[None]:
        """Run the body on the side stream of ``params``' device; inline elsewhere.

        :param after_compute: make the side stream wait for what the compute stream
            has enqueued so far (a gradient it just produced). A bucket step passes
            False and waits for its comm future inside the body instead.
        :param freed: tensors made on the compute stream that the body reads and that
            will be freed right after (gradients): recorded on the side stream, each
            only if it lives on that stream's device.
        """
        params = list(params)
        found = self.stream_for(params)
        if found is None:
            yield
            return
        device, stream = found
        if after_compute:
            stream.wait_stream(self.api.current_stream(device))
        with stream:
            yield
        for tensor in freed:
            local = _local(tensor)
            if local.device == device:
                self.api.record_stream(local, stream)

    def join(self) -> None:
        """Make each device's current stream wait for the steps enqueued on its side
        stream so far. Nothing to do inline. Cheap to call again."""
        for device, stream in self.streams.items():
            self.api.current_stream(device).wait_stream(stream)
