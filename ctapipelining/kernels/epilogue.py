"""Device side of a GEMM's fused epilogue: what a transformer block does around its GEMMs,
applied to the fp32 accumulator tile before it is stored, so it costs no pass over memory.

:class:`Epilogue` is one kernel argument bundle (None: off, and the kernel is the plain GEMM).
Its fields are None when unused (the kernel never compares the bundle itself with None: Triton
3.6 cannot when it holds None fields; ``Epilogue(None, ..., None)`` is the epilogue that does
nothing, the plain GEMM's). In the order applied to tile ``acc`` of ``C = A @ B``:

1. ``rms_eps`` (not None): RMSNorm of A's rows folded in. The norm's weight is folded into B
   on the host (``B' = diag(g) @ B``); the K loop sums the squares of the A tiles it already
   loads, and the tile's rows are scaled by ``rsqrt(sum / k_size + rms_eps)``. It rounds
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

    rms_eps: object  # fp32: the RMSNorm's epsilon (None: no norm)
    k_size: object  # A's columns: what the squares are averaged over
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
def row_sumsq(a):
    """Each row's sum of squares of an A tile (fp32)."""
    af = a.to(tl.float32)
    return tl.sum(af * af, axis=1)


@triton.jit
def rms_scale(epi, acc, sumsq):
    """Step 1 (after the K loop, which summed ``sumsq``): the rows scaled by their RMSNorm."""
    if epi.rms_eps is not None:
        acc = acc * tl.rsqrt(sumsq / epi.k_size + epi.rms_eps)[:, None]
    return acc


@triton.jit
def apply(epi, acc, pm, pn, rows, n_out, BLOCK_M: tl.constexpr):
    """Steps 2-4 of the epilogue ``epi`` on tile ``(pm, pn)``'s accumulator ``acc`` (``rows``
    x ``n_out``: the output's extent, for masks). Returns the tile to store (half as wide
    with ``GATED``; ``acc`` itself with nothing to do)."""
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
        offs_m = (pm * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (offs_m[:, None] < rows) & (cols[None, :] < n_out)
        res = tl.load(epi.residual + offs_m[:, None] * epi.stride_res + cols[None, :], mask=mask, other=0.0)
        acc += res.to(tl.float32)
    return acc
