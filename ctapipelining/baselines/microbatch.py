"""Micro-batching: the input split along M into chunks, each GPU one layer, chunk ``i`` of
layer ``s + 1`` overlapping chunk ``i + 1`` of layer ``s``.

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

GEMMS = ("cublas", "ours")


class MicroBatch:
    """Chunked pipeline of GEMMs over ``weights`` (``W_s`` on its own device): ``torch.matmul``
    (``gemm="cublas"``) or :func:`ctapipelining.gemm.matmul` (``gemm="ours"``)."""

    def __init__(self, weights: list[torch.Tensor], M: int, chunk: int, graph: bool = True, gemm: str = "cublas"):
        if not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
        if gemm not in GEMMS:
            raise ValueError(f"gemm must be one of {GEMMS}, got {gemm!r}")
        if gemm == "ours":
            from ..gemm import matmul

            self._mm = lambda a, b, out: matmul(a, b, out=out)
        else:
            self._mm = lambda a, b, out: torch.matmul(a, b, out=out)
        self.weights, self.M, self.chunk, self.gemm = weights, M, chunk, gemm
        devs = [w.device for w in weights]
        self.on_gpu = devs[0].type == "cuda"
        self.x = torch.empty(M, weights[0].shape[0], dtype=weights[0].dtype, device=devs[0])
        self.outs = [torch.empty(M, w.shape[1], dtype=w.dtype, device=w.device) for w in weights]
        self.ins = [self.x] + [torch.empty(M, w.shape[0], dtype=w.dtype, device=w.device) for w in weights[1:]]
        self.rows = [slice(i, min(i + chunk, M)) for i in range(0, M, chunk)]
        self.graph, self.graphed, self.graph_error = None, False, ""
        if not self.on_gpu:
            return
        self.compute = [torch.cuda.Stream(d) for d in devs]
        self.copy = [torch.cuda.Stream(d) for d in devs]
        self._schedule()  # warm-up: kernels compiled, cuBLAS handles and workspaces made before any capture
        torch.cuda.synchronize(devs[0])
        if graph:
            try:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.device(devs[0]), torch.cuda.graph(g):
                    self._schedule()
                self.graph, self.graphed = g, True
            except Exception as e:  # record why, run eagerly
                self.graph_error = f"{type(e).__name__}: {e}"
                for d in devs:
                    torch.cuda.synchronize(d)

    def _schedule(self) -> None:
        n = len(self.weights)
        if not self.on_gpu:  # one chunk after another
            for r in self.rows:
                for s, w in enumerate(self.weights):
                    self._mm(self.ins[s][r], w, self.outs[s][r])
                    if s + 1 < n:
                        self.ins[s + 1][r].copy_(self.outs[s][r])
            return
        caller = torch.cuda.current_stream(self.weights[0].device)
        start = caller.record_event()
        for st in self.compute + self.copy:
            st.wait_event(start)
        for r in self.rows:
            for s, w in enumerate(self.weights):
                comp = self.compute[s]
                with torch.cuda.device(w.device), torch.cuda.stream(comp):
                    if s:
                        comp.wait_stream(self.copy[s])
                    self._mm(self.ins[s][r], w, self.outs[s][r])
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
        if self.graph is not None:
            self.graph.replay()
        else:
            self._schedule()
        return self.outs[-1]
