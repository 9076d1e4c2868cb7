"""Host side of a GEMM's fused epilogue (:mod:`ctapipelining.kernels.epilogue`): RMSNorm of
A's rows, an activation (gated or not), bias and residual, applied to each accumulator tile
before it is stored.

:class:`Epilogue` says what a GEMM does after its K loop; :func:`interleave` lays out a gated
MLP's gate and up weights so that one output tile holds both halves of its columns;
:func:`fold_rms_weight` folds an RMSNorm's weight into the weight that reads its output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .kernels import epilogue as device
from .kernels.epilogue import gelu, silu

__all__ = ["Epilogue", "fold_rms_weight", "gelu", "interleave", "silu"]


@dataclass(frozen=True, eq=False)
class Epilogue:
    """What a GEMM ``C = A @ B`` does to each output tile before storing it, in this order:

    * ``rms_eps``: scale each row by ``rsqrt(mean(A_row ** 2) + rms_eps)`` (an RMSNorm of A
      whose weight is folded into B: :func:`fold_rms_weight`), the scales computed by a pass
      over A before the GEMM (:func:`ctapipelining.kernels.epilogue.rms_rows`);
    * ``activation``: a ``@triton.jit`` function of one fp32 tile (:func:`silu`,
      :func:`gelu`, or your own); with ``gated``, B's columns are (gate, up) pairs
      (:func:`interleave`) and output column ``j`` is ``activation(gate_j) * up_j``: C has
      half of B's columns;
    * ``bias``: a vector of C's columns, added;
    * ``residual``: each call passes a matrix of C's shape, added (a block's input).

    Bound at plan time; compared by identity (a launch compiled for one epilogue is not reused
    for another)."""

    activation: object = None
    gated: bool = False
    rms_eps: float | None = None
    bias: torch.Tensor | None = None
    residual: bool = False

    def __post_init__(self):
        jit = (triton.runtime.JITFunction, InterpretedFunction)  # the interpreter's @triton.jit
        if self.activation is not None and not isinstance(self.activation, jit):
            raise TypeError(f"activation must be a @triton.jit function, got {type(self.activation).__name__}")
        if self.gated and self.activation is None:
            raise ValueError("a gated epilogue needs its activation (e.g. silu for Llama's MLP)")
        if self.rms_eps is not None and not (isinstance(self.rms_eps, float) and self.rms_eps > 0):
            raise ValueError(f"rms_eps must be a float > 0, got {self.rms_eps!r}")
        if self.bias is not None and (
            not isinstance(self.bias, torch.Tensor) or self.bias.dim() != 1 or self.bias.stride(0) != 1
        ):
            raise ValueError("bias must be a contiguous 1-D tensor of the output's columns")

    def out_cols(self, N: int) -> int:
        """C's columns for a GEMM with ``N`` columns of B."""
        return N // 2 if self.gated else N

    def check(self, N: int, dtype: torch.dtype, device: torch.device, block_n: int) -> None:
        """Raise a clear error if this epilogue cannot close a GEMM with ``N`` columns of B."""
        if self.gated and (N % 16 or block_n % 2):
            raise ValueError(
                f"a gated epilogue halves B's {N} columns, (gate, up) pairs: it needs a multiple of 16 "
                "(an output row of whole 16-byte units)"
            )
        if self.bias is not None:
            n_out = self.out_cols(N)
            if self.bias.shape != (n_out,) or self.bias.dtype != dtype or self.bias.device != device:
                raise ValueError(
                    f"bias must be a [{n_out}] {dtype} tensor on {device}, got "
                    f"{tuple(self.bias.shape)} {self.bias.dtype} on {self.bias.device}"
                )

    def bundle(self, row_scale: torch.Tensor | None, residual: torch.Tensor | None) -> device.Epilogue:
        """The kernel's argument bundle: the rows' scales (with ``rms_eps``), this call's ``residual``."""
        return device.Epilogue(
            row_scale,
            self.bias,
            residual,
            residual.stride(0) if residual is not None else 0,
            None if self.activation is None else tl.constexpr(self.activation),
            tl.constexpr(True) if self.gated else None,
        )


OFF = device.Epilogue(None, None, None, None, None, None)  # the kernel's bundle without one


def interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``[K, I]`` gate and up weights (``x @ gate``) as one ``[K, 2I]`` weight whose columns
    ``2j, 2j + 1`` are ``gate[:, j], up[:, j]``: a gated epilogue then finds both halves of each
    output column in one tile."""
    if gate.shape != up.shape or gate.dim() != 2:
        raise ValueError(f"gate and up must be [K, I] of one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    return torch.stack([gate, up], dim=2).reshape(gate.shape[0], 2 * gate.shape[1]).contiguous()


def fold_rms_weight(norm_weight: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``diag(norm_weight) @ w`` ([K] and [K, N]), computed in fp32 and rounded once: the weight
    a GEMM with an ``rms_eps`` epilogue reads in place of ``w``."""
    if norm_weight.shape != (w.shape[0],):
        raise ValueError(f"norm weight {tuple(norm_weight.shape)} does not match w's {w.shape[0]} rows")
    return (norm_weight.float()[:, None] * w.float()).to(w.dtype).contiguous()
