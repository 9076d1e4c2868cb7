"""Data parallelism over rows, with a replica of every weight on every GPU: each GPU runs the
whole chain on its share of the rows, and the rows are gathered on the last GPU.

The fair comparison for a pipeline that keeps weight replicas (``Pipeline(ends="balanced")``
holds one of each weight on the other GPU): with the same memory, every GPU could run the whole
chain on part of the input instead. Each GPU computes on its own stream; its output rows go to
the last GPU on a copy stream; the whole call is captured in one CUDA graph when ``graph=True``
(eager, with :attr:`graph_error` saying why, if the capture fails). With CPU tensors (the
Triton interpreter) the shares run one after another: a check of its logic.
"""

from __future__ import annotations

import torch

from .checks import check_count, check_devices, check_matrices
from .graphs import try_capture
from .microbatch import GEMMS


class DataParallel:
    """``x @ W_0 @ W_1 ...`` on ``devices`` (torch devices), rows split as evenly as whole
    ``row_align``-row blocks allow; ``gemm``: ``"cublas"`` or ``"ours"``. ``x`` is given on
    the first device (:attr:`x`) and scattered, the result gathered on the last (:attr:`out`),
    so every method of the bench reads and writes the same places. A device may be named more
    than once (the method on one GPU, for tests): each share runs on a stream of its own there,
    as on a GPU of its own."""

    def __init__(
        self,
        weights: list[torch.Tensor],
        devices: list[torch.device],
        M: int,
        graph: bool = True,
        gemm: str = "cublas",
        row_align: int = 128,
    ):
        if not weights or not devices:
            raise ValueError("DataParallel needs weights and devices")
        if gemm not in GEMMS:
            raise ValueError(f"gemm must be one of {GEMMS}, got {gemm!r}")
        check_matrices(weights)
        resolved = check_devices(devices, distinct=False)
        check_count(M, "M")
        check_count(row_align, "row_align")
        if gemm == "ours":
            from ..gemm import matmul

            self._mm = lambda a, b, out: matmul(a, b, out=out)
        else:
            self._mm = lambda a, b, out: torch.matmul(a, b, out=out)
        self.devices = resolved
        self.on_gpu = self.devices[0].type == "cuda"
        G, dt = len(self.devices), weights[0].dtype
        blocks = -(-M // row_align)
        cuts = [min(M, (blocks * g // G) * row_align) for g in range(G + 1)]
        self.rows = [slice(a, b) for a, b in zip(cuts, cuts[1:])]
        self.replicas = [[w.to(d) for w in weights] for d in self.devices]  # made once
        self.x = torch.empty(M, weights[0].shape[0], dtype=dt, device=self.devices[0])
        self.out = torch.empty(M, weights[-1].shape[1], dtype=dt, device=self.devices[-1])
        self.xs = [
            torch.empty(r.stop - r.start, weights[0].shape[0], dtype=dt, device=d)
            for r, d in zip(self.rows, self.devices)
        ]
        self.acts = [
            [torch.empty(r.stop - r.start, w.shape[1], dtype=dt, device=d) for w in weights]
            for r, d in zip(self.rows, self.devices)
        ]
        self.graph, self.graphed, self.graph_error = None, False, ""
        if not self.on_gpu:
            return
        self.streams = [torch.cuda.Stream(d) for d in self.devices]
        self.gather = torch.cuda.Stream(self.devices[-1])
        self._run()  # warm-up (compiles our GEMM, makes cuBLAS's handles) before any capture
        for d in self.devices:
            torch.cuda.synchronize(d)
        if graph:
            self.graph, self.graph_error = try_capture(self._run, self.devices)
            self.graphed = self.graph is not None

    def _run(self) -> None:
        G, last = len(self.devices), len(self.devices) - 1
        shares = [g for g in range(G) if self.rows[g].stop > self.rows[g].start]
        if not self.on_gpu:
            for g in shares:
                self.xs[g].copy_(self.x[self.rows[g]])
                self._chain(g)
                self.out[self.rows[g]].copy_(self.acts[g][-1])
            return
        # PyTorch's copy between devices orders itself after both devices' current streams as they
        # are when it is queued: so the scatters are queued before any GEMM, the gathers after all
        first = torch.cuda.current_stream(self.devices[0])
        start = first.record_event()
        for st in self.streams + [self.gather]:
            st.wait_event(start)
        for g in shares:  # scatter: x's rows to each GPU, on that GPU's stream
            with torch.cuda.stream(self.streams[0]), torch.cuda.stream(self.streams[g]):
                self.xs[g].copy_(self.x[self.rows[g]])
        for g in shares:
            with torch.cuda.device(self.devices[g]), torch.cuda.stream(self.streams[g]):
                self._chain(g)
        for g in shares:  # gather: each share's output rows to the last GPU, on its gather stream
            self.gather.wait_stream(self.streams[g])
            src = self.streams[g] if g != last else self.gather  # the source device's current stream
            with torch.cuda.stream(src), torch.cuda.stream(self.gather):
                self.out[self.rows[g]].copy_(self.acts[g][-1])
        for st in self.streams + [self.gather]:
            first.wait_stream(st)

    def _chain(self, g: int) -> None:
        a = self.xs[g]
        for w, h in zip(self.replicas[g], self.acts[g]):
            self._mm(a, w, h)
            a = h

    def __call__(self) -> torch.Tensor:
        if self.graph is not None:
            self.graph.replay()
        else:
            self._run()
        return self.out
