"""Memory that one GPU writes and another reads: peer access in one process, a symmetric heap
across processes.

A producer stage writes its output tiles, bumps counters and pushes ring slots directly in
the consumer GPU's memory. The bumps and pushes are atomics, so the pair of GPUs must do
atomics natively (:func:`native_peer_atomics`: NVLink does, most PCIe links do not).

- One process driving every GPU: that needs CUDA peer access from the producer's device to the
  consumer's. PyTorch has no public call to enable it (it enables it as a side effect of a
  cross-device copy), so :func:`enable_peer_access` calls ``cudaDeviceEnablePeerAccess`` of the
  CUDA runtime that PyTorch already loaded, and says clearly when the hardware cannot do it.
- One process per GPU (:mod:`ctapipelining.distributed`): each rank allocates one
  :class:`Heap`, the same size on every rank, and addresses every rank's heap from its own
  GPU. On GPUs it is PyTorch symmetric memory (``empty`` + ``rendezvous``, each peer's buffer
  through ``get_buffer``: peer pointers, so it works with NVLink multicast off); for
  CPU ranks under the Triton interpreter (the tests) it is a shared-memory file per rank that
  every rank maps.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled
_NATIVE_ATOMICS = 3  # cudaDevP2PAttrNativeAtomicSupported: all atomics native
_SOME_NATIVE_ATOMICS = 5  # cudaDevP2PAttrOnlyPartialNativeAtomicSupported (CUDA 13)


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


def native_peer_atomics(src: int, dst: int) -> bool | None:
    """Whether the atomics of ``src`` on ``dst``'s memory are performed by the hardware: True for
    all of them (NVLink), False for none (most PCIe links: a counter bumped across one may lose a
    bump), None when it cannot be told: only some are (``cuDeviceGetP2PAtomicCapabilities``
    would say which), no CUDA runtime was found in the process, or the query failed."""
    if src == dst:
        return True
    lib = _cudart()
    if lib is None:
        return None

    def attribute(attr: int) -> int | None:
        value = ctypes.c_int(0)
        rc = lib.cudaDeviceGetP2PAttribute(
            ctypes.byref(value), ctypes.c_int(attr), ctypes.c_int(src), ctypes.c_int(dst)
        )
        if rc != 0:  # an older runtime does not know the attribute: not an error of the pair
            lib.cudaGetLastError()
            return None
        return value.value

    every = attribute(_NATIVE_ATOMICS)
    if every is None:
        return None
    return True if every else (None if attribute(_SOME_NATIVE_ATOMICS) else False)


def atomics_error(src: int, dst: int) -> str | None:
    """Why a producer on ``src`` cannot signal a consumer on ``dst`` (None: it can, or it cannot
    be told). The signals are atomics on the consumer's memory, so the pair needs them native."""
    if native_peer_atomics(src, dst) is False:
        return (
            f"cuda:{src} cannot make atomic operations on cuda:{dst}'s memory (peer access without native "
            "atomics, as over most PCIe links): CTA-pipelining signals tiles with atomics and needs NVLink between "
            "consecutive stages' GPUs"
        )
    return None


_enabled: set[tuple[int, int]] = set()  # pairs enabled in this process (it lasts as long as the process)
_native: set[tuple[int, int]] = set()  # pairs whose atomics were checked


def enable_peer_access(devices: list[int], atomics: bool = True) -> None:
    """Let each device of ``devices`` read and write the memory of the next one in the list (one
    direction: a chain's links write forward; a stage that reads a residual on the GPU before
    it passes the pair the other way round). ``atomics``: the first device of a pair makes
    atomics on the other's memory (a producer signalling its consumer), which the pair must
    then do natively; False for plain reads and writes (a GEMM storing into a peer's memory, a
    residual read across).

    Pairs already enabled (and checked) are skipped without a CUDA call, so a GEMM into a peer's
    memory can be captured in a CUDA graph once it has run outside one
    (``cudaDeviceEnablePeerAccess`` is not allowed during capture). Raises
    :class:`PeerAccessError` naming the pair when the hardware or driver cannot, or, with
    ``atomics``, when the pair has peer access without native atomics (most PCIe links).
    """
    for src, dst in zip(devices, devices[1:]):
        if src == dst:
            continue
        new = (src, dst) not in _enabled
        if new:
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
        if atomics and (src, dst) not in _native:
            error = atomics_error(src, dst)
            if error:
                raise PeerAccessError(error)
            _native.add((src, dst))
        if new:
            _enable_one(src, dst)
            _enabled.add((src, dst))


SYMMETRIC_MEMORY_TORCH = "2.6"  # the first release with public symm_mem.empty and rendezvous


class SymmetricMemoryError(RuntimeError):
    """This PyTorch build cannot allocate memory that other ranks address."""


@dataclass(eq=False)
class Heap:
    """One buffer per rank of a process group, the same size on each (``nbytes``), every one
    addressable from this rank: ``peers[r]`` is rank ``r``'s buffer as a ``uint8`` tensor on
    this rank's device (``peers[rank]`` is our own). :meth:`view` carves typed tensors out of
    it. ``keep`` holds what must live as long as the mappings (the symmetric-memory handle)."""

    rank: int
    nbytes: int
    peers: list[torch.Tensor]
    keep: list = field(default_factory=list, repr=False)

    @property
    def local(self) -> torch.Tensor:
        return self.peers[self.rank]

    def view(self, rank: int, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """``shape`` elements of ``dtype`` at byte ``offset`` of rank ``rank``'s buffer (a
        contiguous tensor aliasing it; ``offset`` a multiple of the element size)."""
        size = dtype.itemsize
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= rank < len(self.peers):
            raise ValueError(f"rank {rank} has no heap here (ranks 0-{len(self.peers) - 1})")
        if offset < 0 or offset % size or any(d < 0 for d in shape) or offset + numel * size > self.nbytes:
            raise ValueError(f"a {dtype} view of {shape} at byte {offset} does not fit a heap of {self.nbytes} bytes")
        return self.peers[rank][offset : offset + numel * size].view(dtype).view(shape)


def symmetric_memory():
    """PyTorch's symmetric-memory module, or a :class:`SymmetricMemoryError` naming the version
    it needs."""
    try:
        from torch.distributed import _symmetric_memory as symm_mem

        symm_mem.empty, symm_mem.rendezvous  # noqa: B018 (raises if absent)
    except (ImportError, AttributeError) as e:
        raise SymmetricMemoryError(
            f"one process per GPU needs PyTorch symmetric memory (torch >= {SYMMETRIC_MEMORY_TORCH} built with CUDA); "
            f"this is torch {torch.__version__}"
        ) from e
    return symm_mem


def _failure(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def symmetric_heap(nbytes: int, device: torch.device, group, meet: Callable) -> Heap:
    """A :class:`Heap` of PyTorch symmetric memory on ``device`` (collective over ``group``:
    every rank calls it, in the same order, with the same ``nbytes``). ``meet(step, payload,
    error)`` is the caller's labelled collective that raises any rank's error on every rank
    (three: allocate, map, view): a rank that cannot allocate (out of memory), map or view the
    heap makes every rank raise, instead of leaving the others in the rendezvous."""
    t, symm_mem, error = None, None, None
    try:
        symm_mem = symmetric_memory()
        t = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    except Exception as e:  # noqa: BLE001 (raised on every rank by meet)
        error = _failure(e)
    meet("allocate the heap", None, error)
    handle, offset, error = None, None, None
    try:
        handle = symm_mem.rendezvous(t, group)
        # the heap may start inside a segment of PyTorch's symmetric memory pool: a peer's copy
        # lies as far into that rank's segment (``get_buffer`` counts from the segment's start)
        offset = t.data_ptr() - handle.buffer_ptrs[handle.rank]
    except Exception as e:  # noqa: BLE001
        error = (
            f"symmetric-memory rendezvous failed on {device} ({_failure(e)}): the ranks' GPUs must reach each "
            "other's memory (peer access over NVLink, one host)"
        )
    offsets = meet("map the heap", offset, error)
    peers, error = None, None
    try:
        peers = [handle.get_buffer(r, (nbytes,), torch.uint8, offsets[r]) for r in range(len(offsets))]
        if peers[handle.rank].data_ptr() != t.data_ptr():
            raise RuntimeError(f"this rank's heap is at {t.data_ptr():#x}, its symmetric-memory view at "
                               f"{peers[handle.rank].data_ptr():#x}")  # fmt: skip
        peers[handle.rank] = t
    except Exception as e:  # noqa: BLE001
        error = f"viewing the ranks' heaps failed on {device}: {_failure(e)}"
    meet("view the heaps", None, error)
    return Heap(handle.rank, nbytes, peers, keep=[handle, t])


def shared_heap(nbytes: int, group, meet: Callable) -> Heap:
    """A :class:`Heap` of CPU memory (collective; ``meet`` as for :func:`symmetric_heap`): a
    shared-memory file per rank that every rank maps, for CPU ranks under the Triton
    interpreter. The files are unlinked once every rank has mapped them (the mappings stay)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world == 1:
        return Heap(0, nbytes, [torch.zeros(nbytes, dtype=torch.uint8)])
    root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(root, f"ctapipelining-{uuid.uuid4().hex}-{rank}")
    own, error = None, None
    try:  # the file goes whatever happens (a rank that fails fails every rank's meet)
        try:
            own = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        except Exception as e:  # noqa: BLE001
            error = _failure(e)
        paths = meet("create the heap", path, error)
        peers, error = None, None
        try:
            peers = [own if r == rank else torch.from_file(p, shared=True, size=nbytes, dtype=torch.uint8)
                     for r, p in enumerate(paths)]  # fmt: skip
        except Exception as e:  # noqa: BLE001
            error = _failure(e)
        meet("map the heap", None, error)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return Heap(rank, nbytes, peers)
