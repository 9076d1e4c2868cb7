"""Megatron tensor parallelism for a 2-layer MLP ``x @ A @ B`` on ``g`` GPUs: ``A`` split by
columns, ``B`` by rows, the partial outputs summed by an NCCL all-reduce.

Single process, one compute stream per GPU, through ``torch.cuda.nccl.all_reduce`` (NCCL's
single-process multi-GPU group call): it measures the same collective as one process per GPU
without a launcher, and times every method with the same host harness.

``chunks > 1`` overlaps the all-reduce with the GEMMs: the rows are cut into that many chunks,
and each chunk's all-reduce runs on a communication stream per GPU while the next chunk's
GEMMs run (the usual overlap of a single-process TP; PyTorch's fused matmul-reduce-scatter
over symmetric memory needs one process per GPU). ``graph=True`` captures a call in one CUDA
graph (eager, with :attr:`graph_error` saying why, if the capture fails). With CPU tensors the
shards run one after another and the all-reduce is a sum: a check of the split and the chunks.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch


def _device(d) -> torch.device:
    return torch.device(f"cuda:{d}") if isinstance(d, int) else torch.device(d)


class TensorParallel:
    def __init__(self, A: torch.Tensor, B: torch.Tensor, devices: list, M: int, chunks: int = 1, graph: bool = False):
        g = len(devices)
        if A.shape[1] % g or B.shape[0] != A.shape[1]:
            raise ValueError(f"A {tuple(A.shape)} / B {tuple(B.shape)} cannot be split over {g} GPUs")
        if not isinstance(chunks, int) or not 1 <= chunks <= M:
            raise ValueError(f"chunks must be an int in [1, M={M}], got {chunks!r}")
        cols = A.shape[1] // g
        self.devices = [_device(d) for d in devices]
        self.on_gpu = self.devices[0].type == "cuda"
        self.A = [A[:, i * cols : (i + 1) * cols].contiguous().to(d) for i, d in enumerate(self.devices)]
        self.B = [B[i * cols : (i + 1) * cols].contiguous().to(d) for i, d in enumerate(self.devices)]
        # the input is replicated on every GPU (the usual TP setting)
        self.x = [torch.empty(M, A.shape[0], dtype=A.dtype, device=d) for d in self.devices]
        self.h = [torch.empty(M, cols, dtype=A.dtype, device=d) for d in self.devices]
        self.out = [torch.empty(M, B.shape[1], dtype=A.dtype, device=d) for d in self.devices]
        self.rows = [slice(M * c // chunks, M * (c + 1) // chunks) for c in range(chunks)]
        self.graph, self.graphed, self.graph_error = None, False, ""
        if not self.on_gpu:
            return
        self.streams = [torch.cuda.Stream(d) for d in self.devices]
        self.comm = [torch.cuda.Stream(d) for d in self.devices]
        if graph:
            self._run(True)  # warm-up (cuBLAS handles, NCCL communicators) before the capture
            for d in self.devices:
                torch.cuda.synchronize(d)
            try:
                gr = torch.cuda.CUDAGraph()
                with torch.cuda.device(self.devices[0]), torch.cuda.graph(gr):
                    self._run(True)
                self.graph, self.graphed = gr, True
            except Exception as e:  # record why, run eagerly
                self.graph_error = f"{type(e).__name__}: {e}"
                for d in self.devices:
                    torch.cuda.synchronize(d)

    def compute(self, rows: slice = slice(None)) -> None:
        """Both GEMMs of every shard on ``rows`` (each GPU on its compute stream)."""
        for i, d in enumerate(self.devices):
            with torch.cuda.device(d) if self.on_gpu else nullcontext():
                with torch.cuda.stream(self.streams[i]) if self.on_gpu else nullcontext():
                    torch.matmul(self.x[i][rows], self.A[i], out=self.h[i][rows])
                    torch.matmul(self.h[i][rows], self.B[i], out=self.out[i][rows])

    def _all_reduce(self, rows: slice) -> None:
        """Sum the shards' outputs on ``rows`` into every GPU's (on the communication streams,
        after each GPU's compute so far)."""
        parts = [o[rows] for o in self.out]
        if not self.on_gpu:
            total = sum(p.float() for p in parts).to(parts[0].dtype)
            for p in parts:
                p.copy_(total)
            return
        import torch.cuda.nccl as nccl

        for c, st in zip(self.comm, self.streams):
            c.wait_stream(st)
        nccl.all_reduce(parts, streams=self.comm)

    def _run(self, all_reduce: bool) -> None:
        if self.on_gpu:
            first = torch.cuda.current_stream(self.devices[0])
            start = first.record_event()
            for st in self.streams + self.comm:
                st.wait_event(start)
        for rows in self.rows:
            self.compute(rows)
            if all_reduce and len(self.devices) > 1:
                self._all_reduce(rows)  # under the next chunk's GEMMs
        if self.on_gpu:
            for st in self.streams + self.comm:
                first.wait_stream(st)

    def __call__(self, all_reduce: bool = True) -> torch.Tensor:
        """One call: the output (summed, when ``all_reduce``) on the first GPU."""
        if all_reduce and self.graph is not None:
            self.graph.replay()
        else:
            self._run(all_reduce)
        return self.out[0]
