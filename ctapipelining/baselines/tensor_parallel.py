"""Megatron tensor parallelism for a 2-layer MLP ``x @ A @ B`` on ``g`` GPUs: ``A`` split by
columns, ``B`` by rows, the partial outputs summed by an NCCL all-reduce
(:class:`TensorParallel`); and for a stack of fused Llama MLP blocks, each block split that way
(:class:`TensorParallelBlocks`).

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

from .checks import check_chunks, check_count, check_devices, check_matrices
from .graphs import order_devices, try_capture


def reduce_parts(parts: list[torch.Tensor], streams: list | None, comm: list | None) -> None:
    """Sum ``parts`` (one per GPU) into every one: NCCL on the communication streams ``comm``,
    each after its GPU's ``streams`` so far; on the CPU (``streams`` None) a sum in float32."""
    if streams is None:
        total = sum(p.float() for p in parts).to(parts[0].dtype)
        for p in parts:
            p.copy_(total)
        return
    import torch.cuda.nccl as nccl

    for c, st in zip(comm, streams):
        c.wait_stream(st)
    nccl.all_reduce(parts, streams=comm)


class TensorParallel:
    def __init__(self, A: torch.Tensor, B: torch.Tensor, devices: list, M: int, chunks: int = 1, graph: bool = False):
        check_matrices([A, B])
        resolved = check_devices(devices)
        check_count(M, "M")
        g = len(resolved)
        if A.shape[1] % g:
            raise ValueError(f"A {tuple(A.shape)} / B {tuple(B.shape)} cannot be split over {g} GPUs")
        check_chunks(chunks, M)
        cols = A.shape[1] // g
        self.devices = resolved
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
            self.graph, self.graph_error = try_capture(lambda: self._run(True), self.devices)
            self.graphed = self.graph is not None

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
        reduce_parts(
            [o[rows] for o in self.out], self.streams if self.on_gpu else None, self.comm if self.on_gpu else None
        )

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


class TensorParallelBlocks:
    """A stack of fused Llama MLP blocks (:class:`ctapipelining.nn.LlamaMLP`), each split over
    ``devices`` Megatron's way: GPU ``i`` holds the ``i``-th part of the gate/up columns (whole
    runs of gate and up columns, so its gated epilogue pairs them as the block's does) and the
    same part of the down weight's rows; each GPU runs the block's first GEMM with its norm and
    gated SiLU fused and its part of the down GEMM (the first GPU's adding the residual), then an
    NCCL all-reduce sums the partial outputs on every GPU: the next block's input, replicated.
    Each shard runs this library's fused GEMMs in the block's own configurations. The shards are
    copies made at construction: a later change of the blocks' weights needs a new instance.

    ``chunks > 1`` overlaps each block's all-reduce with its GEMMs, chunk by chunk (as
    :class:`TensorParallel` does); ``graph=True`` captures a call in one CUDA graph (eager,
    with :attr:`graph_error` saying why, if the capture fails). With CPU tensors the shards run
    one after another and the all-reduce is a sum. Fill every GPU's :attr:`x` (the input,
    replicated); a call returns the output on the first GPU."""

    def __init__(self, blocks: list, devices: list, M: int, chunks: int = 1, graph: bool = False):
        from ..epilogue import Epilogue
        from ..gemm import matmul
        from ..kernels.epilogue import GATE_RUN
        from ..nn import LlamaMLP

        if not blocks or not all(isinstance(b, LlamaMLP) for b in blocks):
            raise TypeError("TensorParallelBlocks takes a non-empty list of ctapipelining.nn.LlamaMLP blocks")
        resolved = check_devices(devices)
        g = len(resolved)
        if len({b.w_out.dtype for b in blocks}) != 1:
            raise ValueError("the blocks must share one dtype")
        check_count(M, "M")
        check_chunks(chunks, M)
        H, run = blocks[0].hidden, 2 * GATE_RUN.value
        for b in blocks:
            if b.hidden != H or b.intermediate % (g * run // 2):
                raise ValueError(
                    f"a block of hidden {b.hidden}, intermediate {b.intermediate} cannot be split over {g} GPUs "
                    f"(hidden {H} for all; each GPU's share of the intermediate a multiple of {run // 2})"
                )
        self.devices = resolved
        self.on_gpu = self.devices[0].type == "cuda"
        self._matmul = matmul
        dtype = blocks[0].w_out.dtype
        # per block, per GPU: (gate/up columns, down rows); the block's configurations per chunk's rows
        self.shards = []
        for b in blocks:
            b._follow_source()  # (laid out again first where its source module changed since)
            cols, rows = 2 * b.intermediate // g, b.intermediate // g
            self.shards.append(
                [
                    (
                        b.w_in[:, i * cols : (i + 1) * cols].contiguous().to(d),
                        b.w_out[i * rows : (i + 1) * rows].contiguous().to(d),
                    )
                    for i, d in enumerate(self.devices)
                ]
            )
        self._firsts = [b._epilogues()[0] for b in blocks]  # each block's norm and gated SiLU
        self._configs = [b.configs_for for b in blocks]  # (FusedMLP.configs_for: by the rows a call runs)
        # each GPU's intermediate, sized for the widest block's share (a capture's allocations on
        # another GPU's stream would not be the graph's)
        widest = max(b.intermediate for b in blocks) // g
        self._h = [torch.empty(M * widest, dtype=dtype, device=d) for d in self.devices]
        self.residual = Epilogue(residual=True)
        # the input, replicated, and each block's output (its partial sum, then the whole)
        self.x = [torch.empty(M, H, dtype=dtype, device=d) for d in self.devices]
        self.ys = [[torch.empty(M, H, dtype=dtype, device=d) for d in self.devices] for _ in blocks]
        self.M = M
        self.rows = [slice(M * c // chunks, M * (c + 1) // chunks) for c in range(chunks)]
        self.graph, self.graphed, self.graph_error = None, False, ""
        if not self.on_gpu:
            return
        self.streams = [torch.cuda.Stream(d) for d in self.devices]
        self.comm = [torch.cuda.Stream(d) for d in self.devices]
        self._run()  # warm-up (kernels compiled, NCCL communicators) before the capture
        for d in self.devices:
            torch.cuda.synchronize(d)
        if graph:
            self.graph, self.graph_error = try_capture(self._run, self.devices)
            self.graphed = self.graph is not None

    def _block(self, b: int, rows: slice) -> None:
        """Block ``b``'s GEMMs on every shard on ``rows``: its partial outputs, the first GPU's
        with the residual added."""
        inputs = self.x if b == 0 else self.ys[b - 1]
        for i, d in enumerate(self.devices):
            w_in, w_out = self.shards[b][i]
            in_cfg, out_cfg = self._configs[b](rows.stop - rows.start)
            with torch.cuda.device(d) if self.on_gpu else nullcontext():
                with torch.cuda.stream(self.streams[i]) if self.on_gpu else nullcontext():
                    x = inputs[i][rows]
                    h = self._h[i][: self.M * w_out.shape[0]].view(self.M, w_out.shape[0])[rows]
                    self._matmul(x, w_in, out=h, config=in_cfg, epilogue=self._firsts[b])
                    y = self.ys[b][i][rows]
                    if i == 0:
                        self._matmul(h, w_out, out=y, config=out_cfg, epilogue=self.residual, residual=x)
                    else:
                        self._matmul(h, w_out, out=y, config=out_cfg)

    def _run(self) -> None:
        gpus = self.streams if self.on_gpu else None
        if gpus:
            first = torch.cuda.current_stream(self.devices[0])
            start = first.record_event()
            for st in self.streams + self.comm:
                st.wait_event(start)
        reduced = [None] * len(self.rows)  # per chunk: each GPU's event after its last all-reduce
        for b in range(len(self.shards)):
            for c, rows in enumerate(self.rows):
                if gpus and reduced[c] is not None:  # this chunk's input: the block before, summed
                    for st, ev in zip(self.streams, reduced[c]):
                        st.wait_event(ev)
                self._block(b, rows)
                if len(self.devices) > 1:  # under the next chunk's GEMMs
                    reduce_parts([y[rows] for y in self.ys[b]], gpus, self.comm if gpus else None)
                    if gpus:
                        reduced[c] = [cm.record_event() for cm in self.comm]
        if gpus:
            for st in self.streams + self.comm:
                first.wait_stream(st)

    def __call__(self) -> torch.Tensor:
        """One call on :attr:`x`: the stack's output on the first GPU (every GPU's in
        ``ys[-1]``). Ordered after the work queued so far on every GPU's current stream, and
        before what each queues next."""
        join = order_devices(self.devices) if self.on_gpu else None
        if self.graph is not None:
            self.graph.replay()
        else:
            self._run()
        if join:
            join()
        return self.ys[-1][0]
