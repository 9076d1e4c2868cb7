"""Megatron tensor parallelism for a 2-layer MLP ``x @ A @ B`` on ``g`` GPUs: ``A`` split by
columns, ``B`` by rows, the partial outputs summed by an NCCL all-reduce.

Single process, one stream per GPU, through ``torch.cuda.nccl.all_reduce`` (NCCL's
single-process multi-GPU group call): it measures the same collective as one process per GPU
without a launcher, and times every method with the same host harness.
"""

from __future__ import annotations

import torch
import torch.cuda.nccl as nccl


class TensorParallel:
    def __init__(self, A: torch.Tensor, B: torch.Tensor, devices: list[int], M: int):
        g = len(devices)
        if A.shape[1] % g or B.shape[0] != A.shape[1]:
            raise ValueError(f"A {tuple(A.shape)} / B {tuple(B.shape)} cannot be split over {g} GPUs")
        cols = A.shape[1] // g
        self.devices = devices
        self.A = [A[:, i * cols : (i + 1) * cols].contiguous().to(f"cuda:{d}") for i, d in enumerate(devices)]
        self.B = [B[i * cols : (i + 1) * cols].contiguous().to(f"cuda:{d}") for i, d in enumerate(devices)]
        # the input is replicated on every GPU (the usual TP setting)
        self.x = [torch.empty(M, A.shape[0], dtype=A.dtype, device=f"cuda:{d}") for d in devices]
        self.h = [torch.empty(M, cols, dtype=A.dtype, device=f"cuda:{d}") for d in devices]
        self.out = [torch.empty(M, B.shape[1], dtype=A.dtype, device=f"cuda:{d}") for d in devices]
        self.streams = [torch.cuda.Stream(f"cuda:{d}") for d in devices]

    def compute(self) -> None:
        for i, d in enumerate(self.devices):
            with torch.cuda.device(d), torch.cuda.stream(self.streams[i]):
                torch.matmul(self.x[i], self.A[i], out=self.h[i])
                torch.matmul(self.h[i], self.B[i], out=self.out[i])

    def __call__(self, all_reduce: bool = True) -> torch.Tensor:
        self.compute()
        if all_reduce and len(self.devices) > 1:
            nccl.all_reduce(self.out, streams=self.streams)
        return self.out[0]
