"""Memory that one GPU writes and another reads, in one process: peer access, and copy
engines gated by memory flags.

A producer stage writes its output tiles, bumps counters and pushes ring slots directly in
the consumer GPU's memory. That needs CUDA peer access from the producer's device to the
consumer's. PyTorch has no public call to enable it (it enables it as a side effect of a
cross-device copy), so :func:`enable_peer_access` calls ``cudaDeviceEnablePeerAccess`` of the
CUDA runtime that PyTorch already loaded, and says clearly when the hardware cannot do it.

The copy transport moves finished rows with a copy engine instead of the producer's SMs:
:func:`wait_flag` (``cuStreamWaitValue32``) holds a stream until a flag in device memory is
set, :func:`copy_async` (``cudaMemcpyAsync``) and :func:`write_flag`
(``cuStreamWriteValue32``) follow in stream order. All three can be captured in a CUDA graph.
They are driver calls through ``ctypes``: a few microseconds each, against ~10 us for a
``Tensor.copy_`` of a slice.
"""

from __future__ import annotations

import ctypes
import functools

import torch

_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled


_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the (unified) addresses
_WAIT_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ


class PeerAccessError(RuntimeError):
    """Two GPUs of a chain cannot reach each other's memory."""


class StreamOpError(RuntimeError):
    """A stream memory operation or copy could not be enqueued."""


@functools.lru_cache(maxsize=1)
def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library loaded in this process (PyTorch's), or None."""
    torch.cuda.init()
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    except OSError:
        paths = set()
    for p in sorted(paths):
        if p.startswith("/"):
            try:
                lib = ctypes.CDLL(p)
                lib.cudaDeviceEnablePeerAccess  # noqa: B018  (raises if absent)
                return lib
            except (OSError, AttributeError):
                continue
    return None


@functools.lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL:
    """The CUDA driver with the stream memory operations (v2 API, on by default since 11.7)."""
    torch.cuda.init()
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        for name in ("cuStreamWaitValue32_v2", "cuStreamWriteValue32_v2"):
            fn = getattr(lib, name)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int
    except (OSError, AttributeError) as e:
        raise StreamOpError(f"the CUDA driver has no stream memory operations ({e}); use transport='store'") from e
    return lib


def _runtime() -> ctypes.CDLL:
    lib = _cudart()
    if lib is None:
        raise StreamOpError("could not find the CUDA runtime PyTorch loaded; use transport='store'")
    lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.cudaMemcpyAsync.restype = ctypes.c_int
    return lib


def _check(rc: int, what: str) -> None:
    if rc:
        raise StreamOpError(f"{what} failed with CUDA error {rc}")


def wait_flag(stream: torch.cuda.Stream, flags: torch.Tensor, index: int, value: int = 1) -> None:
    """Hold ``stream`` until ``flags[index] >= value`` (int32, device memory)."""
    ptr = flags.data_ptr() + index * flags.element_size()
    _check(_driver().cuStreamWaitValue32_v2(stream.cuda_stream, ptr, value, _WAIT_GEQ), "cuStreamWaitValue32")


def write_flag(stream: torch.cuda.Stream, flags: torch.Tensor, index: int, value: int) -> None:
    """Set ``flags[index] = value`` in stream order (after everything before it completed)."""
    ptr = flags.data_ptr() + index * flags.element_size()
    _check(_driver().cuStreamWriteValue32_v2(stream.cuda_stream, ptr, value, 0), "cuStreamWriteValue32")


def copy_async(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """Copy contiguous ``src`` into contiguous ``dst`` (same size, any two peer GPUs) on ``stream``."""
    if not (dst.is_contiguous() and src.is_contiguous()) or dst.nbytes != src.nbytes:
        raise ValueError(f"copy_async needs contiguous tensors of equal size, got {dst.shape} and {src.shape}")
    rc = _runtime().cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), dst.nbytes, _MEMCPY_DEFAULT, stream.cuda_stream)
    _check(rc, "cudaMemcpyAsync")


def _enable_one(src: int, dst: int) -> None:
    lib = _cudart()
    if lib is None:
        # Fallback: PyTorch enables peer access (at::cuda::get_p2p_access) on a P2P copy.
        torch.empty(1, device=f"cuda:{dst}").copy_(torch.empty(1, device=f"cuda:{src}"))
        torch.cuda.synchronize(src)
        return
    with torch.cuda.device(src):
        rc = lib.cudaDeviceEnablePeerAccess(ctypes.c_int(dst), ctypes.c_uint(0))
    if rc not in (0, _ALREADY_ENABLED):
        lib.cudaGetLastError()  # clear the sticky-free error so later calls are not confused
        raise PeerAccessError(f"cudaDeviceEnablePeerAccess(cuda:{src} -> cuda:{dst}) failed with CUDA error {rc}")
    if rc == _ALREADY_ENABLED:
        lib.cudaGetLastError()


def enable_peer_access(devices: list[int]) -> None:
    """Let each device write into the memory of the next one (a chain's links).

    Raises :class:`PeerAccessError` naming the pair when the hardware or driver cannot.
    """
    for src, dst in zip(devices, devices[1:]):
        if src == dst:
            continue
        if not torch.cuda.can_device_access_peer(src, dst):
            raise PeerAccessError(
                f"cuda:{src} cannot access cuda:{dst}'s memory (no P2P over NVLink/PCIe between them): "
                "CTA-pipelining needs peer access between consecutive stages"
            )
        _enable_one(src, dst)
