"""Micro-batching: the input split along M into chunks, each GPU one layer (a GEMM, or a fused
MLP block), chunk ``i`` of layer ``s + 1`` overlapping chunk ``i + 1`` of layer ``s``.

Each device has a compute stream and a copy stream. PyTorch's cross-device ``copy_``
synchronises the *current* streams of both devices, so every copy runs with the two copy
streams current: no compute stream is ever chained behind another GPU's copies. The whole
schedule is captured in one CUDA graph (as the paper does) when ``graph=True``; if the capture
fails the schedule runs eagerly and :attr:`graphed` says so.

``gemm="ours"`` runs each chunk through this library's plain GEMM
(:func:`ctapipelining.gemm.matmul`) instead of cuBLAS: a fair baseline uses the faster GEMM.
With CPU tensors (the Triton interpreter) it runs one chunk after another, no streams: a check
of its logic.
"""

from __future__ import annotations

import torch

from .checks import check_count, check_matrices
from .graphs import order_devices, try_capture

GEMMS = ("cublas", "ours")


class MicroBatch:
    """Chunked pipeline over ``stages``, stage ``s`` on its own device. A stage is a weight
    ``W_s`` (a GEMM: ``torch.matmul`` with ``gemm="cublas"``, :func:`ctapipelining.gemm.matmul`
    with ``gemm="ours"``) or a fused MLP block (:class:`ctapipelining.nn.FusedMLP`, on the
    device of its weights: the stack's own fused kernels, run on each chunk by
    :meth:`~ctapipelining.nn.FusedMLP.run`)."""

    def __init__(self, stages: list, M: int, chunk: int, graph: bool = True, gemm: str = "cublas"):
        if not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
        if gemm not in GEMMS:
            raise ValueError(f"gemm must be one of {GEMMS}, got {gemm!r}")
        if not stages:
            raise ValueError("micro-batching needs at least one stage")
        check_count(M, "M")
        if gemm == "ours":
            from ..gemm import matmul

            mm = lambda a, b, out: matmul(a, b, out=out)  # noqa: E731
        else:
            mm = lambda a, b, out: torch.matmul(a, b, out=out)  # noqa: E731
        from ..nn import FusedMLP

        blocks = [isinstance(st, FusedMLP) for st in stages]
        if not all(blocks) and not all(isinstance(st, torch.Tensor) for st in stages):
            raise TypeError("stages are all weights (tensors) or all fused MLP blocks (ctapipelining.nn.FusedMLP)")
        if all(blocks) and gemm != "cublas":
            raise ValueError("fused blocks run their own kernels: leave gemm at its default")
        if all(blocks):  # (fn(rows, out, r), device, input and output columns, dtype) per stage
            # (each block's intermediate in a buffer of its own: a capture's allocations on another
            # GPU's stream would not be the graph's)
            self._h = [torch.empty(M, st.w_out.shape[0], dtype=st.w_out.dtype, device=st.w_out.device) for st in stages]
            specs = [
                (lambda a, out, r, s=s, st=st: st.run(a, out, h=self._h[s][r]), st.w_out.device, st.hidden, st.hidden,
                 st.w_out.dtype)
                for s, st in enumerate(stages)
            ]  # fmt: skip
        else:
            check_matrices(stages, "stage", chained=False)  # (their columns: checked below, blocks' too)
            specs = [(lambda a, out, r, w=w: mm(a, w, out), w.device, *w.shape, w.dtype) for w in stages]
        for s in range(1, len(specs)):
            if specs[s][2] != specs[s - 1][3]:
                raise ValueError(f"stage {s} takes {specs[s][2]} columns; stage {s - 1} gives {specs[s - 1][3]}")
        self.stages, self.M, self.chunk, self.gemm = stages, M, chunk, gemm
        self._fns = [spec[0] for spec in specs]
        devs = self.devices = [spec[1] for spec in specs]
        self.on_gpu = devs[0].type == "cuda"
        self.x = torch.empty(M, specs[0][2], dtype=specs[0][4], device=devs[0])
        self.outs = [torch.empty(M, n, dtype=dt, device=d) for _, d, _, n, dt in specs]
        self.ins = [self.x] + [torch.empty(M, k, dtype=dt, device=d) for _, d, k, _, dt in specs[1:]]
        self.rows = [slice(i, min(i + chunk, M)) for i in range(0, M, chunk)]
        self.graph, self.graphed, self.graph_error = None, False, ""
        if not self.on_gpu:
            return
        self.compute = [torch.cuda.Stream(d) for d in devs]
        self.copy = [torch.cuda.Stream(d) for d in devs]
        self._schedule()  # warm-up: kernels compiled, cuBLAS handles and workspaces made before any capture
        torch.cuda.synchronize(devs[0])
        if graph:
            self.graph, self.graph_error = try_capture(self._schedule, devs)
            self.graphed = self.graph is not None

    def _schedule(self) -> None:
        n = len(self._fns)
        if not self.on_gpu:  # one chunk after another
            for r in self.rows:
                for s, fn in enumerate(self._fns):
                    fn(self.ins[s][r], self.outs[s][r], r)
                    if s + 1 < n:
                        self.ins[s + 1][r].copy_(self.outs[s][r])
            return
        caller = torch.cuda.current_stream(self.devices[0])
        start = caller.record_event()
        for st in self.compute + self.copy:
            st.wait_event(start)
        for r in self.rows:
            for s, fn in enumerate(self._fns):
                comp = self.compute[s]
                with torch.cuda.device(self.devices[s]), torch.cuda.stream(comp):
                    if s:
                        comp.wait_stream(self.copy[s])
                    fn(self.ins[s][r], self.outs[s][r], r)
                if s + 1 < n:
                    src, dst = self.copy[s], self.copy[s + 1]
                    src.wait_stream(comp)
                    # the copy runs on one of the two current streams; on one device (stages
                    # sharing a GPU) that is dst's, which must also follow this chunk's GEMM
                    dst.wait_stream(comp)
                    with torch.cuda.stream(src), torch.cuda.stream(dst):
                        self.ins[s + 1][r].copy_(self.outs[s][r], non_blocking=True)
        for st in self.compute + self.copy:
            caller.wait_stream(st)

    def __call__(self) -> torch.Tensor:
        """One call on :attr:`x`: the last stage's output. Ordered after the work queued so far on
        every stage device's current stream, and before what each queues next."""
        others = order_devices(self.devices) if self.on_gpu else None
        if self.graph is not None:
            self.graph.replay()
        else:
            self._schedule()
        if others:
            others()
        return self.outs[-1]
