"""Memory that one GPU writes and another reads, in one process: peer access.

A producer stage writes its output tiles, bumps counters and pushes ring slots directly in
the consumer GPU's memory. That needs CUDA peer access from the producer's device to the
consumer's. PyTorch has no public call to enable it (it enables it as a side effect of a
cross-device copy), so :func:`enable_peer_access` calls ``cudaDeviceEnablePeerAccess`` of the
CUDA runtime that PyTorch already loaded, and says clearly when the hardware cannot do it.
"""

from __future__ import annotations

import ctypes
import functools

import torch

_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled


class PeerAccessError(RuntimeError):
    """Two GPUs of a chain cannot reach each other's memory."""


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


_enabled: set[tuple[int, int]] = set()  # pairs enabled in this process (it lasts as long as the process)


def enable_peer_access(devices: list[int]) -> None:
    """Let each device write into the memory of the next one (a chain's links).

    Pairs already enabled are skipped without a CUDA call, so a GEMM into a peer's memory can
    be captured in a CUDA graph once it has run outside one (``cudaDeviceEnablePeerAccess`` is
    not allowed during capture). Raises :class:`PeerAccessError` naming the pair when the
    hardware or driver cannot.
    """
    for src, dst in zip(devices, devices[1:]):
        if src == dst or (src, dst) in _enabled:
            continue
        if torch.cuda.is_current_stream_capturing():
            raise PeerAccessError(
                f"peer access cuda:{src} -> cuda:{dst} cannot be enabled during CUDA-graph capture: "
                "run the call once before capturing it"
            )
        if not torch.cuda.can_device_access_peer(src, dst):
            raise PeerAccessError(
                f"cuda:{src} cannot access cuda:{dst}'s memory (no P2P over NVLink/PCIe between them): "
                "CTA-pipelining needs peer access between consecutive stages"
            )
        _enable_one(src, dst)
        _enabled.add((src, dst))
