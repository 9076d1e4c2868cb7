"""Device side of a GEMM's fused epilogue: what a transformer block does around its GEMMs,
applied to the fp32 accumulator tile before it is stored, so it costs no pass over memory.

:class:`Epilogue` is one kernel argument bundle (None: off, and the kernel is the plain GEMM).
Its fields are None when unused (the kernel never compares the bundle itself with None: Triton
3.6 cannot when it holds None fields; ``Epilogue(None, ..., None)`` is the epilogue that does
nothing, the plain GEMM's). In the order applied to tile ``acc`` of ``C = A @ B``:

1. ``row_scale`` (not None): each row scaled by its entry, the RMSNorm of A's rows folded in.
   The norm's weight is folded into B on the host (``B' = diag(g) @ B``); :func:`rms_rows`
   computes each row's ``rsqrt(mean(a ** 2) + eps)`` before the GEMM, one read of A (at the
   Llama-70B MLP's first GEMM, M = 4096: a sum of squares inside the K loop, from the A tiles
   it loads, made the GEMM 1.30x as long; ``benchmarks/results/2026-12-01-h200-mlp/``). It rounds
   differently from normalising first: ``x`` is not rounded to bf16 after the norm, and
   ``g * B`` is rounded once, at fold time, instead of ``g * x_normed`` in every call.
2. ``ACTIVATION`` (a ``@triton.jit`` function of one fp32 tile, or None). With ``GATED``, B's
   columns come in pairs (gate, up), so each output tile holds both halves of its columns:
   output column ``j = ACTIVATION(acc[:, 2j]) * acc[:, 2j + 1]``, a tile half as wide as the
   GEMM's (:func:`ctapipelining.epilogue.interleave`).
3. ``bias`` (not None): a row vector of the output's columns, added.
4. ``residual`` (not None): a matrix of the output's shape (row stride ``stride_res``), added.

Users pass their own activation: any ``@triton.jit`` function of one tensor, e.g.
:func:`silu` and :func:`gelu` below.
"""

from typing import NamedTuple

import triton
import triton.language as tl


class Epilogue(NamedTuple):
    """A GEMM's epilogue (module docstring). UPPER_CASE fields are ``tl.constexpr``."""

    row_scale: object  # *fp32 [rows]: each row's scale (None: none)
    bias: object  # *T [N out]: added to each row (None: none)
    residual: object  # *T [rows, N out]: added (None: none)
    stride_res: object  # the residual's row stride
    ACTIVATION: object  # a @triton.jit function of an fp32 tile (None: none)
    GATED: object  # True: B's columns are (gate, up) pairs, ACTIVATION(gate) * up, a half-width tile (None: not)


@triton.jit
def silu(x):
    """``x * sigmoid(x)`` (Llama's MLP, gated)."""
    return x / (1.0 + tl.exp(-x))


@triton.jit
def gelu(x):
    """The tanh approximation of GELU (GPT-2's MLP)."""
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))


@triton.jit
def rms_rows(a_ptr, out_ptr, rows, cols, stride, eps, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``out[r] = rsqrt(mean(a[r, :] ** 2) + eps)`` (fp32) for ``BLOCK_R`` rows a program."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c0 in range(0, cols, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        mask = (r[:, None] < rows) & (c[None, :] < cols)
        a = tl.load(a_ptr + r[:, None].to(tl.int64) * stride + c[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += tl.sum(a * a, axis=1)
    tl.store(out_ptr + r, tl.rsqrt(acc / cols + eps), mask=r < rows)


@triton.jit
def apply(epi, acc, pm, pn, rows, n_out, BLOCK_M: tl.constexpr):
    """The epilogue ``epi`` on tile ``(pm, pn)``'s accumulator ``acc`` (``rows`` x ``n_out``:
    the output's extent, for masks). Returns the tile to store (half as wide with ``GATED``;
    ``acc`` itself with nothing to do)."""
    offs_m = (pm * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    if epi.row_scale is not None:
        acc = acc * tl.load(epi.row_scale + offs_m, mask=offs_m < rows, other=0.0)[:, None]
    if epi.GATED is not None:
        gate, up = tl.split(tl.reshape(acc, (acc.shape[0], acc.shape[1] // 2, 2)))
        acc = epi.ACTIVATION(gate) * up
    elif epi.ACTIVATION is not None:
        acc = epi.ACTIVATION(acc)
    OUT_N: tl.constexpr = acc.shape[1]
    cols = pn * OUT_N + tl.arange(0, OUT_N)
    if epi.bias is not None:
        acc += tl.load(epi.bias + cols, mask=cols < n_out, other=0.0).to(tl.float32)[None, :]
    if epi.residual is not None:
        mask = (offs_m[:, None] < rows) & (cols[None, :] < n_out)
        res = tl.load(epi.residual + offs_m[:, None] * epi.stride_res + cols[None, :], mask=mask, other=0.0)
        acc += res.to(tl.float32)
    return acc
