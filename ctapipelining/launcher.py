"""A compiled Triton kernel launched with the least host work (:class:`RawLaunch`).

Triton's launch (``kernel[grid](...)``, or the compiled kernel's ``run``) binds and
specialises the arguments, looks the kernel up in its cache, encodes a CUDA tensor map for
every host tensor descriptor, and asks the driver about every tensor pointer
(``cuPointerGetAttribute``), on every call: more host time than the launch itself. A
:class:`RawLaunch` calls the compiled launcher's C entry point directly, with tensor maps
encoded once per distinct tensor (:meth:`RawLaunch.tensor_map`) and pointers given as
integers (:func:`addresses`): what is left per call is building the argument tuple and
``cuLaunchKernel``.

It relies on how Triton 3.6's CUDA backend builds its launcher (the C ``launch`` function
wrapped by a closure that expands tensor descriptors); :meth:`RawLaunch.of` returns None for
any other shape of launcher, and the caller then uses Triton's own path.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import NamedTuple

import torch
from triton import knobs

try:
    from triton.backends.nvidia.driver import make_tensordesc_arg
except ImportError:  # no CUDA backend: RawLaunch.of returns None
    make_tensordesc_arg = None

MAX_TENSOR_MAPS = 64  # encoded tensor maps kept per launch (cleared when full)


def on_stream(handle: int | None, device: torch.device):
    """A context in which the raw CUDA stream ``handle`` on ``device`` (None: the current one)
    is torch's current stream, for work that goes where torch's current stream is (Triton's own
    launch path, torch's ops). The null handle is the default stream:
    ``torch.cuda.ExternalStream(0)`` would be a new stream from PyTorch's pool (it reads a
    null pointer as none given), which does not wait for the caller's work. ``device`` is also
    the current device there: Triton's path launches on the current device's current stream
    (``torch.cuda.stream`` switches the device too)."""
    if device.type != "cuda":
        return nullcontext()
    if handle is None or handle == torch._C._cuda_getCurrentRawStream(device.index):
        return nullcontext() if device.index == torch.cuda.current_device() else torch.cuda.device(device)
    if handle == 0:
        return torch.cuda.stream(torch.cuda.default_stream(device))
    return torch.cuda.stream(torch.cuda.ExternalStream(handle, device=device))


def launch_hooks() -> bool:
    """Whether a profiler's launch hooks are set (Triton's own launch path calls them; a raw
    launch would not)."""
    return bool(knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls)


def bound_stream(index: int) -> int | None:
    """The raw handle of CUDA device ``index``'s current stream, where work bound by an earlier
    call (its launches' arguments, or a graph of them) may be launched there as it is: ``index``
    is the current device, its current stream is not being captured, and no profiler's launch
    hooks are set (Triton's own path calls them; a bound launch would not). Else None. (It reads
    ``torch._C``: ``torch.cuda``'s wrappers cost more host time, on paths that save it.)"""
    if index != torch._C._cuda_getDevice() or torch._C._cuda_isCurrentStreamCapturing() or launch_hooks():
        return None
    return torch._C._cuda_getCurrentRawStream(index)


def addresses(bundle):
    """``bundle`` (a kernel argument: a tensor, a (named) tuple of them, or anything else) with
    every tensor replaced by its address: the launcher then passes the integer as the pointer
    without asking the driver about it. Only for tensors that stay where they are (a plan's
    buffers) and are kept alive elsewhere."""
    if isinstance(bundle, torch.Tensor):
        return bundle.data_ptr()
    if isinstance(bundle, tuple):
        fields = (addresses(x) for x in bundle)
        return bundle._make(fields) if hasattr(bundle, "_fields") else tuple(fields)
    return bundle


class RawLaunch:
    """Launches one compiled kernel (one specialisation) on a 1-D grid.

    ``launch(grid, stream, *args)`` takes the kernel's arguments as Triton's launcher does
    after its own expansion: each host tensor descriptor as the list :meth:`tensor_map`
    returns (spliced in), constexpr arguments as any placeholder."""

    def __init__(self, kernel, c_launch, desc_meta: list):
        run = kernel.run
        self._launch = c_launch
        self._mid = (kernel.function, run.launch_cooperative_grid, run.launch_pdl, None, None, kernel.packed_metadata)
        self._meta = desc_meta
        self._maps: dict[tuple, list] = {}

    @classmethod
    def of(cls, kernel) -> RawLaunch | None:
        """The raw launch of Triton's compiled ``kernel``, or None where its launcher is not the
        one this module knows (then use ``kernel.run``)."""
        run = getattr(kernel, "run", None)
        launch = getattr(run, "launch", None)
        if make_tensordesc_arg is None or launch is None:
            return None
        if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
            return None  # the kernel needs scratch memory allocated per launch
        meta = getattr(kernel.metadata, "tensordesc_meta", None)
        code = getattr(launch, "__code__", None)
        if code is None:  # no descriptor arguments: the C function itself
            return cls(kernel, launch, [])
        cells = dict(zip(code.co_freevars, launch.__closure__ or ()))
        if "launcher" not in cells or not meta or None in meta:
            return None  # descriptors passed as pointers (no TMA): Triton's own expansion
        return cls(kernel, cells["launcher"].cell_contents, list(meta))

    def tensor_map(self, slot: int, t: torch.Tensor, block: list[int]) -> list:
        """The launcher's arguments for a tensor descriptor of ``t`` with ``block`` (the
        kernel's ``slot``-th descriptor argument): a CUDA tensor map and the shape and strides.
        A tensor map depends only on the address, shape, strides and element type, so it is kept
        for the next call with the same."""
        key = (slot, t.data_ptr(), *t.shape, t.stride(0), t.dtype)
        got = self._maps.get(key)
        if got is None:
            if len(self._maps) >= MAX_TENSOR_MAPS:
                self._maps.clear()
            got = self._maps[key] = make_tensordesc_arg(_Desc(t, t.shape, t.stride(), block, "zero"), self._meta[slot])
        return got

    def __call__(self, grid: int, stream: int, *args) -> None:
        self._launch(grid, 1, 1, stream, *self._mid, None, None, None, *args)


class _Desc(NamedTuple):
    """What :func:`make_tensordesc_arg` reads of a host tensor descriptor."""

    base: torch.Tensor
    shape: tuple
    strides: tuple
    block_shape: list
    padding: str
