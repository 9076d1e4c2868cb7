"""One GEMM per GPU, a copy between GPUs: the chain with no overlap at all."""

from __future__ import annotations

import torch


class Sequential:
    """``x @ W_0 @ W_1 ...`` with ``W_s`` on its own device; each GEMM waits for the copy."""

    def __init__(self, weights: list[torch.Tensor], M: int):
        self.weights = weights
        self.x = torch.empty(M, weights[0].shape[0], dtype=weights[0].dtype, device=weights[0].device)
        self.outs = [torch.empty(M, w.shape[1], dtype=w.dtype, device=w.device) for w in weights]
        self.ins = [self.x] + [torch.empty(M, w.shape[0], dtype=w.dtype, device=w.device) for w in weights[1:]]

    def __call__(self) -> torch.Tensor:
        for s, w in enumerate(self.weights):
            if s:
                self.ins[s].copy_(self.outs[s - 1])  # syncs both devices' current streams
            with torch.cuda.device(w.device):
                torch.matmul(self.ins[s], w, out=self.outs[s])
        return self.outs[-1]
