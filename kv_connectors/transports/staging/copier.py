"""Copiers that move bytes between the KV cache and the staging pool (host memmove, CUDA async memcpy)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from kv_connectors.errors import TransportError, TransportUnavailableError
from kv_connectors.transports.base import MemoryKind

_CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred from the pointers (unified addressing)

Pair = tuple[int, int, int]  # (dst_addr, src_addr, length)


class Copier(Protocol):
    """Copies between the KV cache and the pool; copy() may return before the bytes are there."""

    def copy(self, pairs: Sequence[Pair]) -> None:
        """Start copying each (dst_addr, src_addr, length)."""

    def synchronize(self) -> None:
        """Wait until every copy started so far has finished."""


class HostCopier:
    """Host memory on both sides: ctypes.memmove per pair, a single-thread memcpy on the calling thread."""

    def copy(self, pairs: Sequence[Pair]) -> None:
        move = ctypes.memmove
        for dst, src, n in pairs:
            move(dst, src, n)

    def synchronize(self) -> None:
        """Nothing to wait for: copy() is synchronous."""


def _load_cudart() -> ctypes.CDLL:
    """The libcudart torch loaded (same runtime as torch's streams), else one found by name."""
    import torch

    with open("/proc/self/maps") as maps:
        loaded = sorted({ln.split()[-1] for ln in maps if "libcudart" in ln and "/" in ln})
    major = (torch.version.cuda or "12").split(".")[0]
    for name in [*loaded, f"libcudart.so.{major}", "libcudart.so"]:
        try:
            lib = ctypes.CDLL(name)
            fn = lib.cudaMemcpyAsync
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        return lib
    raise TransportUnavailableError("CudaCopier: cannot find libcudart (cudaMemcpyAsync)")


class CudaCopier:
    """Device <-> pinned host copies: cudaMemcpyAsync (libcudart, as loaded by torch) on a private stream.

    copy() first orders the private stream after the work already queued on the device's current
    stream (the model's kernels that wrote the KV cache), then queues the copies and returns;
    synchronize() waits for the private stream only, so the compute stream is never stalled.
    """

    def __init__(self, device_id: int = 0) -> None:
        import torch

        if not torch.cuda.is_available():
            raise TransportUnavailableError("CudaCopier needs a CUDA build of torch and a visible GPU")
        self._torch = torch
        self._device = torch.device("cuda", device_id)
        self._stream = torch.cuda.Stream(device=self._device)
        self._lib = _load_cudart()

    def copy(self, pairs: Sequence[Pair]) -> None:
        if not pairs:
            return
        cuda = self._torch.cuda
        with cuda.device(self._device):
            self._stream.wait_stream(cuda.current_stream(self._device))
            stream = ctypes.c_void_p(self._stream.cuda_stream)
            memcpy = self._lib.cudaMemcpyAsync
            for dst, src, n in pairs:
                rc = memcpy(dst, src, n, _CUDA_MEMCPY_DEFAULT, stream)
                if rc != 0:
                    why = self._lib.cudaGetErrorString(rc).decode(errors="replace")
                    raise TransportError(f"cudaMemcpyAsync({dst:#x} <- {src:#x}, {n} bytes) failed: {rc} {why}")

    def synchronize(self) -> None:
        self._stream.synchronize()


class Copies:
    """The copier in use (given, or chosen by the KV memory's kind at register) and the bytes it moved."""

    def __init__(self, name: str, copier: Copier | None = None) -> None:
        self._name = name
        self._copier = copier
        self.bytes = 0  # bytes copied so far (between the KV cache and the pool, either way)

    def choose(self, kind: MemoryKind, device_id: int) -> None:
        """Pick the default copier for this KV memory, unless one was given."""
        if self._copier is None:
            self._copier = CudaCopier(device_id) if kind is MemoryKind.DEVICE else HostCopier()

    def copy(self, dst: np.ndarray, src: np.ndarray, length: np.ndarray) -> None:
        """Copy length[i] bytes src[i] -> dst[i] and wait; errors become TransportError."""
        assert self._copier is not None
        try:
            self._copier.copy(list(zip(dst.tolist(), src.tolist(), length.tolist())))
            self._copier.synchronize()
        except TransportError:
            raise
        except Exception as e:
            raise TransportError(f"staging {self._name}: copy failed: {type(e).__name__}: {e}") from e
        self.bytes += int(length.sum())
