"""A CUDA graph of raw kernel launches, captured and launched through the CUDA driver API.

:class:`StreamGraph` records what a function launches on a stream of its own (stream capture in
thread-local mode: other threads go on using the GPU, and nothing runs while it records) and
replays it on any stream of the device with one ``cuGraphLaunch``: one launch's host time where
the launches took one each, and no gap between kernels while the host queues the next. It exists
beside ``torch.cuda.CUDAGraph`` for launches that are raw already (Triton's compiled launchers,
:mod:`ctapipelining.launcher`): a capture here involves neither PyTorch's caching allocator nor
its random-number generators, whose capture state ``torch.cuda.CUDAGraph`` shares with every
thread of the process (an RNG call in another thread during such a capture raises, and a capture
that fails can leave the generator in capture). The function captured must only launch (no
allocation, copy or synchronisation); whatever memory its launches touch must outlive the
graph's replays.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable

import torch

_THREAD_LOCAL = 1  # CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING
_CAPTURE_LOCK = threading.Lock()  # one capture at a time on the capture streams
# a capture stream per device index, created here and handed to nobody else (a stream of
# PyTorch's pool is handed out again: another thread's work queued on it during a capture would
# be captured, not run)
_STREAMS: dict[int, int] = {}
_UNFREED: list[ctypes.c_void_p] = []  # executable graphs released during a capture, freed at the next graph


class CaptureError(RuntimeError):
    """A stream capture or a graph launch failed (a failed capture launched nothing and left the
    stream out of capture)."""


@functools.lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL:
    """The CUDA driver library (the one PyTorch and Triton loaded), with argument types set."""
    lib = ctypes.CDLL("libcuda.so.1")
    p, u64 = ctypes.c_void_p, ctypes.c_ulonglong
    for name, args in (
        ("cuStreamCreate", [ctypes.POINTER(p), ctypes.c_uint]),
        ("cuStreamBeginCapture_v2", [p, ctypes.c_int]),
        ("cuStreamEndCapture", [p, ctypes.POINTER(p)]),
        ("cuGraphInstantiateWithFlags", [ctypes.POINTER(p), p, u64]),
        ("cuGraphUpload", [p, p]),
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
    """What ``launch(stream)`` launches, captured once on a capture stream of the current device
    (``launch`` gets that stream's raw ``CUstream`` handle) and uploaded on ``stream`` (raw handle:
    where it is to run); :meth:`replay` launches it on any stream of that device. Raises
    :class:`CaptureError` where the capture fails (the stream is then out of capture) and
    raises it too where ``launch`` raises an ``Exception`` (chained to it), after ending the
    capture; anything else (``KeyboardInterrupt``) is raised as it is, after ending it too."""

    def __init__(self, launch: Callable[[int], object], stream: int):
        lib, index = _driver(), torch.cuda.current_device()
        graph, self._exec = ctypes.c_void_p(), ctypes.c_void_p()
        with _CAPTURE_LOCK:
            while _UNFREED:
                lib.cuGraphExecDestroy(_UNFREED.pop())
            if index not in _STREAMS:  # (in the current context: the device's primary one, PyTorch's)
                created = ctypes.c_void_p()
                _check(lib.cuStreamCreate(ctypes.byref(created), _NON_BLOCKING), "cuStreamCreate")
                _STREAMS[index] = created.value
            capturing = _STREAMS[index]
            try:  # (the capture begins inside: an interrupt as it returns still ends it)
                _check(lib.cuStreamBeginCapture_v2(capturing, _THREAD_LOCAL), "cuStreamBeginCapture")
                launch(capturing)
            except BaseException as e:  # the stream leaves capture whatever happened in it (ending a
                # capture that never began only returns an error)
                if not lib.cuStreamEndCapture(capturing, ctypes.byref(graph)) and graph.value:
                    lib.cuGraphDestroy(graph)
                if isinstance(e, Exception) and not isinstance(e, CaptureError):
                    raise CaptureError(f"a launch failed in capture: {type(e).__name__}: {e}") from e
                raise
            ended = lib.cuStreamEndCapture(capturing, ctypes.byref(graph))
        try:
            _check(ended, "cuStreamEndCapture")
            _check(lib.cuGraphInstantiateWithFlags(ctypes.byref(self._exec), graph, 0), "cuGraphInstantiate")
            # (its first launch would upload it: the first replay then takes no longer than the next)
            _check(lib.cuGraphUpload(self._exec, stream), "cuGraphUpload")
            self._launch = lib.cuGraphLaunch  # (what replay calls, looked up once)
        finally:
            if graph.value:
                lib.cuGraphDestroy(graph)

    def replay(self, stream: int) -> None:
        """Launch the captured work on ``stream`` (raw handle), after what is queued there."""
        rc = self._launch(self._exec, stream)
        if rc:
            _check(rc, "cuGraphLaunch")

    def __del__(self):  # an executable graph still running is freed once it completes
        exe = getattr(self, "_exec", None)
        if exe is None or not exe.value:
            return
        try:
            if torch.cuda.is_current_stream_capturing():  # (a caller's own capture: freed later)
                _UNFREED.append(exe)
            else:
                _driver().cuGraphExecDestroy(exe)
        except Exception:  # the interpreter is shutting down: the driver frees it with the context
            pass
