"""Device ordering for the engine's writes: a signal that the kernels queued so far on the KV cache's
device have run (a CUDA event recorded on the current stream, polled, never synchronised)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def ready_signal(device: torch.device | None) -> Callable[[], bool] | None:
    """A poll that turns true once the work queued on device's current stream before this call has
    completed (what writes a layer's KV when its attention op returns on the CPU); None for host
    memory, whose KV is in place when the op returns."""
    if device is None or device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event.query
