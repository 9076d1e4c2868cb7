"""Host side of a GEMM's fused epilogue (:mod:`ctapipelining.kernels.epilogue`): an RMSNorm
or LayerNorm of A's rows, bias, an activation (gated or not) and residual, applied to each
accumulator tile before it is stored.

:class:`Epilogue` says what a GEMM does after its K loop; :func:`interleave` lays out a gated
MLP's gate and up weights so that one output tile holds both halves of its columns;
:func:`fold_rms_weight` and :func:`fold_layer_norm` fold a norm's weight (and bias) into the
weight (and bias) that reads its output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .kernels import epilogue as device
from .kernels.epilogue import GATE_RUN, gelu, silu

__all__ = ["Epilogue", "column_sums", "fold_layer_norm", "fold_rms_weight", "gelu", "interleave", "silu"]


@dataclass(frozen=True, eq=False)
class Epilogue:
    """What a GEMM ``C = A @ B`` does to each output tile before storing it, in this order:

    * ``rms_eps``: scale each row by ``rsqrt(mean(A_row ** 2) + rms_eps)`` (an RMSNorm of A
      whose weight is folded into B: :func:`fold_rms_weight`); or ``layer_norm_eps`` with
      ``col_sum``: ``(acc - mean(A_row) * col_sum) * rsqrt(var(A_row) + layer_norm_eps)`` (a
      LayerNorm of A whose weight is folded into B and whose bias into ``bias``, ``col_sum``
      being B's column sums: :func:`fold_layer_norm`). The rows' statistics come from a pass over
      A before the GEMM (:func:`ctapipelining.kernels.epilogue.norm_rows`);
    * ``bias``: a vector of the GEMM's columns (B's), added;
    * ``activation``: a ``@triton.jit`` function of one fp32 tile (:func:`silu`,
      :func:`gelu`, or your own); with ``gated``, B's columns are runs of gate and up columns
      (:func:`interleave`) and output column ``j`` is ``activation(gate_j) * up_j``: C has
      half of B's columns;
    * ``residual``: each call passes a matrix of C's shape, added (a block's input).

    Bound at plan time; compared by identity (a launch compiled for one epilogue is not reused
    for another)."""

    activation: object = None
    gated: bool = False
    rms_eps: float | None = None
    bias: torch.Tensor | None = None
    residual: bool = False
    layer_norm_eps: float | None = None
    col_sum: torch.Tensor | None = None

    def __post_init__(self):
        jit = (triton.runtime.JITFunction, InterpretedFunction)  # the interpreter's @triton.jit
        if self.activation is not None and not isinstance(self.activation, jit):
            raise TypeError(f"activation must be a @triton.jit function, got {type(self.activation).__name__}")
        if self.gated and self.activation is None:
            raise ValueError("a gated epilogue needs its activation (e.g. silu for Llama's MLP)")
        for name in ("rms_eps", "layer_norm_eps"):
            eps = getattr(self, name)
            if eps is not None and not (isinstance(eps, float) and eps > 0):
                raise ValueError(f"{name} must be a float > 0, got {eps!r}")
        if self.rms_eps is not None and self.layer_norm_eps is not None:
            raise ValueError("one norm per GEMM: rms_eps or layer_norm_eps, not both")
        if (self.layer_norm_eps is None) != (self.col_sum is None):
            raise ValueError("a LayerNorm epilogue needs B's column sums: pass layer_norm_eps and col_sum together")
        if self.col_sum is not None and (
            not isinstance(self.col_sum, torch.Tensor) or self.col_sum.dtype != torch.float32
            or self.col_sum.dim() != 1 or self.col_sum.stride(0) != 1
        ):  # fmt: skip
            raise ValueError("col_sum must be a contiguous 1-D float32 tensor of B's columns (fold_layer_norm)")
        if self.bias is not None and (
            not isinstance(self.bias, torch.Tensor) or self.bias.dim() != 1 or self.bias.stride(0) != 1
        ):
            raise ValueError("bias must be a contiguous 1-D tensor of the GEMM's columns")

    @property
    def norm_eps(self) -> float | None:
        """The norm's epsilon (None: no norm)."""
        return self.rms_eps if self.rms_eps is not None else self.layer_norm_eps

    @property
    def norm_kind(self) -> str | None:
        """``"rms"``, ``"layer"`` or None: which partial sums of its input rows the norm reads
        (the sums of squares; also the sums)."""
        if self.norm_eps is None:
            return None
        return "rms" if self.rms_eps is not None else "layer"

    def out_cols(self, N: int) -> int:
        """C's columns for a GEMM with ``N`` columns of B."""
        return N // 2 if self.gated else N

    def check_tiles(self, N: int, block_n: int) -> None:
        """Raise a clear error if this epilogue cannot close a GEMM with ``N`` columns of B in
        tiles ``block_n`` wide (a gated tile holds whole runs of gate and up columns)."""
        if self.gated and (N % 16 or block_n % (2 * GATE_RUN.value)):
            raise ValueError(
                f"a gated epilogue halves B's {N} columns, runs of {GATE_RUN.value} gate and up columns "
                f"(interleave): it needs a multiple of 16 columns and tiles a multiple of {2 * GATE_RUN.value} "
                f"wide, got {block_n}"
            )

    def check(self, N: int, dtype: torch.dtype, device: torch.device, block_n: int) -> None:
        """Raise a clear error if this epilogue cannot close a GEMM with ``N`` columns of B in
        tiles ``block_n`` wide."""
        self.check_tiles(N, block_n)
        if self.bias is not None:
            if self.bias.shape != (N,) or self.bias.dtype != dtype or self.bias.device != device:
                raise ValueError(
                    f"bias must be a [{N}] {dtype} tensor (B's columns) on {device}, got "
                    f"{tuple(self.bias.shape)} {self.bias.dtype} on {self.bias.device}"
                )
        if self.col_sum is not None and (self.col_sum.shape != (N,) or self.col_sum.device != device):
            raise ValueError(
                f"col_sum must be B's [{N}] column sums on {device}, got {tuple(self.col_sum.shape)} "
                f"on {self.col_sum.device}"
            )

    def bundle(
        self,
        *,
        row_sq: torch.Tensor | None = None,
        row_sum: torch.Tensor | None = None,
        part_cols: int = 0,
        norm_cols: int = 0,
        row_scale: torch.Tensor | None = None,
        row_shift: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        sq_out: torch.Tensor | None = None,
        sum_out: torch.Tensor | None = None,
        accumulate: bool = False,
    ) -> device.Epilogue:
        """The kernel's argument bundle: the norm's statistics, as the rows' partial sums of
        squares ``row_sq`` (``[rows, parts]``, over ``norm_cols`` columns; with a LayerNorm also
        their partial sums ``row_sum``, the squares about each part's mean, the parts
        ``part_cols`` wide) or, for a LayerNorm, each row's ``row_scale`` and
        ``row_shift``; this call's ``residual`` (or ``accumulate``: C holds it, and each tile is
        added onto C); and where the stored rows' sums of squares (``sq_out``) and sums
        (``sum_out``) go, for a next stage's norm (None: nowhere)."""
        partial = self.norm_eps is not None and row_sq is not None
        if self.rms_eps is not None and row_sq is None:
            raise ValueError("an RMSNorm epilogue needs its rows' sums of squares (row_sq)")
        if self.layer_norm_eps is not None and (row_sum is None if partial else row_scale is None):
            raise ValueError(
                "a LayerNorm epilogue needs its rows' sums with their sums of squares, or scales and shifts"
            )
        return device.Epilogue(
            row_sq if partial else None,
            tl.constexpr(row_sq.shape[1]) if partial else None,
            norm_cols if partial else None,
            self.norm_eps if partial else None,
            row_scale if self.layer_norm_eps is not None and not partial else None,
            row_shift if self.layer_norm_eps is not None and not partial else None,
            self.col_sum,
            self.bias,
            residual,
            residual.stride(0) if residual is not None else None,
            residual.shape[0] if residual is not None else None,
            sq_out,
            sq_out.shape[1] if sq_out is not None else None,
            row_sum if partial and self.layer_norm_eps is not None else None,
            sum_out,
            part_cols if partial and self.layer_norm_eps is not None else None,
            None if self.activation is None else tl.constexpr(self.activation),
            tl.constexpr(True) if self.gated else None,
            tl.constexpr(True) if accumulate else None,
        )


OFF = device.Epilogue(*(None,) * len(device.Epilogue._fields))  # the kernel's bundle without one
PLAIN = Epilogue()  # an epilogue that changes nothing (a stage that only stores its rows' sums of squares)


def interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``[K, I]`` gate and up weights (``x @ gate``) as one ``[K, 2I]`` weight whose columns come
    in runs of ``R`` = :data:`~ctapipelining.kernels.epilogue.GATE_RUN` (8): gate columns ``jR``
    to ``jR + R - 1``, then up's same columns. A gated epilogue then finds both halves of each
    output column in one tile (any tile width that is a multiple of ``2R``), each thread's in its
    own registers. ``I`` must be a multiple of ``R``."""
    if gate.shape != up.shape or gate.dim() != 2:
        raise ValueError(f"gate and up must be [K, I] of one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    K, inter = gate.shape
    R = GATE_RUN.value
    if inter % R:
        raise ValueError(f"a gated MLP's {inter} intermediate columns must be a multiple of {R} (runs of gate and up)")
    runs = [t.reshape(K, inter // R, R) for t in (gate, up)]
    return torch.stack(runs, dim=2).reshape(K, 2 * inter).contiguous()


def fold_rms_weight(norm_weight: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``diag(norm_weight) @ w`` ([K] and [K, N]), computed in fp32 and rounded once: the weight
    a GEMM with an ``rms_eps`` epilogue reads in place of ``w``."""
    if norm_weight.shape != (w.shape[0],):
        raise ValueError(f"norm weight {tuple(norm_weight.shape)} does not match w's {w.shape[0]} rows")
    return (norm_weight.float()[:, None] * w.float()).to(w.dtype).contiguous()


def column_sums(w: torch.Tensor) -> torch.Tensor:
    """The column sums of ``w`` ([K, N], as the GEMM multiplies it), summed in fp64, as fp32:
    a LayerNorm epilogue's ``col_sum``."""
    return w.double().sum(0).float().contiguous()


def fold_layer_norm(
    weight: torch.Tensor, bias: torch.Tensor | None, w: torch.Tensor, b: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A LayerNorm (``weight``, ``bias``: [K]) folded into the GEMM that reads its output
    (``w`` [K, N], its bias ``b`` [N]): returns ``(w', col_sum, b')`` for an epilogue
    ``Epilogue(layer_norm_eps=eps, col_sum=col_sum, bias=b')`` on ``A @ w'``:
    ``w' = diag(weight) @ w`` rounded once to ``w``'s dtype, ``col_sum`` its column sums in fp32
    (of the rounded ``w'``: what the GEMM multiplies), ``b' = bias @ w + b`` in ``w``'s dtype."""
    K, N = w.shape
    if weight.shape != (K,) or (bias is not None and bias.shape != (K,)) or (b is not None and b.shape != (N,)):
        raise ValueError(
            f"a LayerNorm of [{K}] into a [{K}, {N}] weight: got weight {tuple(weight.shape)}, "
            f"bias {None if bias is None else tuple(bias.shape)}, GEMM bias {None if b is None else tuple(b.shape)}"
        )
    folded = fold_rms_weight(weight, w)
    col_sum = column_sums(folded)
    shift = torch.zeros(N, dtype=torch.float64, device=w.device)
    if bias is not None:
        shift += bias.double() @ w.double()
    if b is not None:
        shift += b.double()
    return folded, col_sum, shift.to(w.dtype).contiguous()
