"""A CUDA graph of raw kernel launches, captured and launched through the CUDA driver API.

:class:`StreamGraph` records what a function launches on one stream (stream capture in
thread-local mode: other threads go on using the GPU, and nothing is executed while it records)
and replays it with one ``cuGraphLaunch``. It exists beside ``torch.cuda.CUDAGraph`` for
launches that are raw already (Triton's compiled launchers, :mod:`ctapipelining.launcher`):
a capture here involves neither PyTorch's caching allocator nor its random-number generators,
whose capture state ``torch.cuda.CUDAGraph`` shares with every thread of the process (an RNG
call in another thread during such a capture raises, and a capture that fails can leave the
generator in capture). The function captured must only launch (no allocation, copy or
synchronisation); whatever memory its launches touch must outlive the graph's replays.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

_THREAD_LOCAL = 1  # CU_STREAM_CAPTURE_MODE_THREAD_LOCAL


class CaptureError(RuntimeError):
    """A stream capture failed (nothing was launched; the stream is out of capture again)."""


@functools.lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL:
    """The CUDA driver library (the one PyTorch and Triton loaded), with argument types set."""
    lib = ctypes.CDLL("libcuda.so.1")
    p, u64 = ctypes.c_void_p, ctypes.c_ulonglong
    for name, args in (
        ("cuStreamBeginCapture_v2", [p, ctypes.c_int]),
        ("cuStreamEndCapture", [p, ctypes.POINTER(p)]),
        ("cuGraphInstantiateWithFlags", [ctypes.POINTER(p), p, u64]),
        ("cuGraphLaunch", [p, p]),
        ("cuGraphDestroy", [p]),
        ("cuGraphExecDestroy", [p]),
        ("cuGetErrorString", [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]),
    ):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def _check(rc: int, what: str) -> None:
    if rc:
        text = ctypes.c_char_p()
        _driver().cuGetErrorString(rc, ctypes.byref(text))
        raise CaptureError(f"{what} failed: CUDA error {rc} ({(text.value or b'?').decode()})")


class StreamGraph:
    """What ``launch(stream)`` launches on ``stream`` (a raw ``CUstream`` handle, of the current
    device; not the legacy default stream), captured once; :meth:`replay` launches it on any
    stream of that device. Raises :class:`CaptureError` where the capture fails (the stream is
    then out of capture) and re-raises what ``launch`` raised, after ending the capture."""

    def __init__(self, launch: Callable[[int], object], stream: int):
        lib = _driver()
        _check(lib.cuStreamBeginCapture_v2(stream, _THREAD_LOCAL), "cuStreamBeginCapture")
        graph = ctypes.c_void_p()
        try:
            launch(stream)
        except BaseException:  # the stream leaves capture whatever happened in it
            if not lib.cuStreamEndCapture(stream, ctypes.byref(graph)) and graph.value:
                lib.cuGraphDestroy(graph)
            raise
        ended = lib.cuStreamEndCapture(stream, ctypes.byref(graph))
        try:
            _check(ended, "cuStreamEndCapture")
            self._exec = ctypes.c_void_p()
            _check(lib.cuGraphInstantiateWithFlags(ctypes.byref(self._exec), graph, 0), "cuGraphInstantiate")
        finally:
            if graph.value:
                lib.cuGraphDestroy(graph)

    def replay(self, stream: int) -> None:
        """Launch the captured work on ``stream`` (raw handle), after what is queued there."""
        _check(_driver().cuGraphLaunch(self._exec, stream), "cuGraphLaunch")

    def __del__(self):  # an executable graph still running is freed once it completes
        exe = getattr(self, "_exec", None)
        if exe is not None and exe.value:
            _driver().cuGraphExecDestroy(exe)
