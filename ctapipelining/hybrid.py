"""CTA-pipelining combined with tensor parallelism: a 2-layer MLP on ``2 * t`` GPUs.

``y = x @ A @ B`` with ``A`` split by columns over stage 1's ``t`` GPUs and ``B`` by rows over
stage 2's ``t`` GPUs (Megatron's split). Shard ``j`` of the hidden activation,
``x @ A[:, j]``, is needed only by stage 2's GPU ``j`` (which multiplies it by ``B[j, :]``), so
each shard pair is an independent CTA-pipelined chain ``stage1[j] -> stage2[j]``; the partial
outputs are then summed by one all-reduce inside stage 2's group. Against pure TP on all
``2 t`` GPUs, the all-reduce spans ``t`` GPUs instead of ``2 t`` and each GEMM keeps twice the
width (the paper's section on combining the two; :func:`ctapipelining.sim.simulate_hybrid` is
its model).

On the GPU the all-reduce is NCCL's (one process, ``torch.cuda.nccl``). Under the Triton
interpreter every shard runs on the CPU and the partial outputs are summed in float32.
"""

from __future__ import annotations

import torch

from .kernels.gemm import GemmConfig
from .pipeline import Pipeline


class HybridMLP:
    """``x @ A @ B`` as ``t`` CTA-pipelined shard chains plus an all-reduce.

    Parameters
    ----------
    A : ``[K, N]``, B : ``[N, K2]`` (bf16/fp16; any device: shards are copied to their GPUs).
    stage1, stage2 : ``t`` devices each (``stage1[j]`` computes ``x @ A[:, j]`` and writes it
        into ``stage2[j]``); all ``2 t`` distinct on GPUs.
    """

    def __init__(
        self,
        A: torch.Tensor,
        B: torch.Tensor,
        stage1: list,
        stage2: list,
        policy: str = "static",
        config: GemmConfig | None = None,
        timeout_s: float = 1.0,
    ):
        t = len(stage1)
        if t < 1 or len(stage2) != t:
            raise ValueError(f"stage1 and stage2 need the same number (>= 1) of devices, got {stage1} and {stage2}")
        if A.dim() != 2 or B.dim() != 2 or A.shape[1] != B.shape[0]:
            raise ValueError(f"A {tuple(A.shape)} and B {tuple(B.shape)} do not chain")
        if A.shape[1] % t:
            raise ValueError(f"A's {A.shape[1]} columns do not split over {t} GPUs")
        devs = [torch.device(d) for d in list(stage1) + list(stage2)]
        if devs[0].type == "cuda" and len({d.index for d in devs}) != len(devs):
            raise ValueError(f"the {2 * t} devices of a hybrid must be distinct GPUs, got {[str(d) for d in devs]}")
        cols = A.shape[1] // t
        self.stage1, self.stage2 = devs[:t], devs[t:]
        self.shards = [
            Pipeline(
                [
                    A[:, j * cols : (j + 1) * cols].contiguous().to(self.stage1[j]),
                    B[j * cols : (j + 1) * cols].contiguous().to(self.stage2[j]),
                ],
                policy=policy,
                config=config,
                timeout_s=timeout_s,
            )
            for j in range(t)
        ]

    @property
    def tp(self) -> int:
        return len(self.shards)

    def __call__(self, x: torch.Tensor | list[torch.Tensor], all_reduce: bool = True, check: bool = True):
        """``x``: ``[M, K]`` (copied to every stage-1 device) or one replica per stage-1 device.
        Returns the summed output on ``stage2[0]`` (with ``all_reduce``, every stage-2 device
        holds it), or the list of partial outputs without."""
        xs = list(x) if isinstance(x, (list, tuple)) else [x.to(d) for d in self.stage1]
        if len(xs) != self.tp:
            raise ValueError(f"{len(xs)} input replicas for {self.tp} stage-1 devices")
        parts = [shard(xj, check=check) for shard, xj in zip(self.shards, xs)]
        if not all_reduce or self.tp == 1:
            return parts if not all_reduce else parts[0]
        if parts[0].device.type == "cuda":
            import torch.cuda.nccl as nccl

            nccl.all_reduce(parts)
            return parts[0]
        total = sum(p.float() for p in parts)
        return total.to(parts[0].dtype)
