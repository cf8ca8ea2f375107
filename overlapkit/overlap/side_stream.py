"""Where optimizer steps run during backward: a side stream on an accelerator, inline
on CPU, through the same code path.

On an accelerator (``torch.accelerator.is_available()``, the parameters on it) each
step is enqueued on one side stream that first waits for everything the current
stream has enqueued so far (the gradient is ready), and at the end of backward the
current stream waits for the side stream, so the next forward sees the stepped
parameters. On CPU there is no stream: torch 2.13's ``torch.Stream`` on CPU raises
"cpu backend doesn't support events" on ``wait_stream`` and ``record_event``
(measured), which is why torch's own ``_apply_optim_in_backward_hook`` fails there.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["SideStream"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    # A DTensor (FSDP2's sharded gradient) is recorded through its local shard.
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


class SideStream:
    """A side stream for steps during backward on ``device``, or none (inline).

    :param device: the device of the parameters stepped.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream: torch.Stream | None = None
        accelerator = (torch.accelerator.current_accelerator()
                       if torch.accelerator.is_available() else None)
        if accelerator is not None and device.type == accelerator.type:
            self.stream = torch.Stream(device=device)

    @property
    def active(self) -> bool:
        """Whether steps run on a side stream (an accelerator), not inline."""
        return self.stream is not None

    @contextmanager
    def running(self, freed: Iterable[torch.Tensor] = ()) -> Iterator[None]:
        """Run the body on the side stream, after what the current stream has
        enqueued so far; inline on CPU.

        :param freed: tensors made on the current stream that the body reads and that
            will be freed right after (gradients): recorded on the side stream, so the
            caching allocator does not hand their memory out again before the side
            stream has read them.
        """
        stream = self.stream
        if stream is None:
            yield
            return
        stream.wait_stream(torch.accelerator.current_stream(self.device))
        with stream:
            yield
        for tensor in freed:
            _local(tensor).record_stream(stream)

    def join(self) -> None:
        """Make the current stream wait for every step enqueued so far (at the end of
        backward). Nothing to do inline."""
        if self.stream is not None:
            torch.accelerator.current_stream(self.device).wait_stream(self.stream)
