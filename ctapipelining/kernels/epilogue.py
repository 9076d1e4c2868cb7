"""Device side of a GEMM's fused epilogue: what a transformer block does around its GEMMs,
applied to the fp32 accumulator tile before it is stored, so it costs no pass over memory.

:class:`Epilogue` is one kernel argument bundle (None: off, and the kernel is the plain GEMM).
Its fields are None when unused (the kernel never compares the bundle itself with None: Triton
3.6 cannot when it holds None fields; ``Epilogue(None, ..., None)`` is the epilogue that does
nothing, the plain GEMM's). In the order applied to tile ``acc`` of ``C = A @ B``:

1. The norm of A's rows, folded in. The norm's weight is folded into B on the host
   (``B' = diag(g) @ B``), so what is left is a per-row scale (and shift):
   - RMSNorm, ``row_sq`` (not None): each row's sum of squares, in ``SQ_PARTS`` partial sums
     (``[rows, SQ_PARTS]``, fp32; a constexpr, so the sums unroll: a loop in the epilogue would
     keep the compiler from flattening the persistent loop, whose next tile's loads then no
     longer overlap this tile's last steps), and ``acc * rsqrt(sum / norm_cols + norm_eps)``. The partial
     sums come from a pass over A before the GEMM (:func:`norm_rows`, one part), or, in a
     pipeline, from the stage that wrote A: its epilogue stores each output tile's rows' sums
     of squares (``sq_out``, below), one part per column-block, so the next block's norm costs
     no pass over memory (at the Llama-70B MLP's first GEMM, M = 4096, a sum of squares inside
     the K loop, from the A tiles it loads, made the GEMM 1.30x as long;
     ``benchmarks/results/2026-12-01-h200-mlp/``). The GEMM starts once the pass has completed:
     started during it (a programmatic dependent launch, its epilogue waiting for the pass) it
     gained nothing at the Llama-8B block's 1024 rows and made the Llama-70B gate/up GEMM 1.15x
     as long (``benchmarks/results/2026-12-05-h100-norm-pass-overlap/``);
   - LayerNorm: ``row_shift = mean(a)``, ``row_scale = rsqrt(var(a) + eps)`` (from
     :func:`norm_rows`, which centres before squaring), ``(acc - row_shift * col_sum) * row_scale``
     with ``col_sum`` B's column sums: ``(a - mean) @ B`` without forming ``a - mean``. In a
     pipeline the stage that wrote A leaves each row's partial sums (``row_sum``) beside its
     sums of squares about each part's own mean (``row_sq``), which Chan's formula combines:
     ``M2 = sum(M2_j) + sum(n_j * (mean_j - mean) ** 2)``, no cancellation where a row's mean is
     large next to its spread. The subtraction cancels:
     where a row's mean is large next to its spread, ``acc`` and ``row_shift * col_sum`` are
     close, and the fp32 accumulator's rounding of ``acc`` (a relative 2^-24 of
     ``|mean| * |col_sum|``) is what is left of the result's error.
   Both round differently from normalising first: ``x`` is not rounded to bf16 after the norm, and
   ``g * B`` is rounded once, at fold time, instead of ``g * x_normed`` in every call.
2. ``bias`` (not None): a row vector of the GEMM's columns, added (before the activation, as in
   ``act(x @ W + b)``; a LayerNorm's bias folds into it: ``beta @ B + b``).
3. ``ACTIVATION`` (a ``@triton.jit`` function of one fp32 tile, or None). With ``GATED``, B's
   columns come in runs of :data:`GATE_RUN` gate columns then as many up columns
   (:func:`ctapipelining.epilogue.interleave`), so each output tile holds both halves of its
   columns: a tile half as wide as the GEMM's, ``ACTIVATION(gate) * up``. Runs of 8 keep the
   split in registers and leave each thread adjacent output columns, so the tile is stored as
   the plain GEMM's is (bf16 pairs, ``stmatrix``); (gate, up) pairs would leave each thread one
   column of a pair, stored 16 bits at a time.
4. ``residual`` (not None): a matrix of the output's shape (row stride ``stride_res``, ``res_rows``
   rows: those past it add zeros), added. Or, with ``ACCUMULATE``, C already holds the residual
   and the tile is added onto it by a TMA reduce-add (``cp.reduce.async.bulk.tensor .add``) in
   place of its store: no residual tile in registers or shared memory, so the GEMM keeps the
   plain GEMM's tiles (C's dtype rounds twice: the tile, then the sum, as ``x + f(x)`` in bf16
   does).
5. ``sq_out`` (not None): after the tile is rounded to C's dtype, each of its rows' sum of
   squares is stored at ``sq_out[row, pn]`` (``[rows, out_parts]``, fp32; columns past the
   output's add nothing), and with ``sum_out`` each row's sum, the squares then taken about the
   tile's own row mean: the ``row_sq`` (and ``row_sum``) of a next stage that normalises this
   output.

Users pass their own activation: any ``@triton.jit`` function of one tensor, e.g.
:func:`silu` and :func:`gelu` below.
"""

from typing import NamedTuple

import triton
import triton.language as tl


class Epilogue(NamedTuple):
    """A GEMM's epilogue (module docstring). UPPER_CASE fields are ``tl.constexpr``."""

    row_sq: object  # *fp32 [rows, SQ_PARTS]: each row's partial sums of squares, RMSNorm (None: none)
    SQ_PARTS: object  # row_sq's row stride (its partial sums per row), a constexpr
    norm_cols: object  # the columns the sums of squares run over (A's: the GEMM's K)
    norm_eps: object  # the RMSNorm's epsilon
    row_scale: object  # *fp32 [rows]: each row's scale, LayerNorm (None: none)
    row_shift: object  # *fp32 [rows]: each row's mean, times col_sum subtracted before the scale (None: none)
    col_sum: object  # *fp32 [N]: B's column sums (with row_shift)
    bias: object  # *T [N]: added to each row of the GEMM's columns (None: none)
    residual: object  # *T [rows, N out]: added (None: none)
    stride_res: object  # the residual's row stride
    res_rows: object  # the residual's rows (a call may have fewer rows than the GEMM's tile grid)
    sq_out: object  # *fp32 [rows, out_parts]: the stored tile's rows' sums of squares, column pn (None: none)
    out_parts: object  # sq_out's row stride
    row_sum: object  # *fp32 [rows, SQ_PARTS]: each row's partial sums; with row_sq a LayerNorm (None: none)
    sum_out: object  # *fp32 [rows, out_parts]: the stored tile's rows' sums, column pn (None: none)
    part_cols: object  # with row_sum: the columns of each part but the last (the producer's tile width)
    ACTIVATION: object  # a @triton.jit function of an fp32 tile (None: none)
    GATED: object  # True: B's columns in runs of gate and up, ACTIVATION(gate) * up, a half-width tile (None: not)
    ACCUMULATE: object  # True: C holds the residual; the tile is added onto it (TMA reduce-add) (None: stored)


INTERPRETED: tl.constexpr = tl.constexpr(triton.knobs.runtime.interpret)  # as Triton decided for these functions


@triton.jit
def tanh(x):
    """``tanh`` of an fp32 tile. On a GPU the special-function unit's one instruction
    (``tanh.approx.f32``, relative error below 2^-10.9), where ``exp`` and a division would take
    two: the epilogue of a gated GEMM is bound by that unit (16 results a clock per SM)."""
    if INTERPRETED:  # no inline PTX in the interpreter
        return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0
    else:
        return tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;", "=f,f", [x.to(tl.float32)], dtype=tl.float32, is_pure=True, pack=1
        )


@triton.jit
def silu(x):
    """``x * sigmoid(x)`` (Llama's MLP, gated), as ``x * (1 + tanh(x / 2)) / 2``: one
    special-function instruction an element (:func:`tanh`). Its error is absolute, at most
    ``|x| * 2^-11.9`` on a GPU: far below the bf16 rounding of outputs of order 1; where x is very
    negative and the output near 0 it is a larger share of that output (``tests/test_gpu.py``)."""
    return x * (0.5 + 0.5 * tanh(0.5 * x))


@triton.jit
def gelu(x):
    """The tanh approximation of GELU (GPT-2's MLP), through :func:`tanh` (the same error as
    :func:`silu`'s)."""
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + tanh(inner))


GATE_RUN: tl.constexpr = tl.constexpr(8)  # a gated B's columns: runs of this many gate columns, then as many up
NORM_WARPS = 8  # a program of :func:`norm_rows` reads one row on a GPU: many programs, their loads all in flight
NORM_MAX_COLS = 4096  # the widest step (columns) it reads at once
NORM_GPU_ROWS = 1  # rows a program of :func:`norm_rows` reads on a GPU
NORM_INTERPRET_ROWS = 32  # rows a program reads under the interpreter, which runs programs one by one


@triton.jit(do_not_specialize=["rows"])  # one compiled pass serves every row count (rows == 1 included)
def norm_rows(
    a_ptr, scale_ptr, shift_ptr, copy_ptr, rows, cols, stride, copy_stride, eps, CENTER: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Each row's norm statistics (fp32), ``BLOCK_R`` rows a program: ``CENTER`` (LayerNorm)
    ``shift[r] = mean(a[r])`` and ``scale[r] = rsqrt(mean((a[r] - shift[r]) ** 2) + eps)`` (two
    passes over the row: no cancellation in the variance); else (RMSNorm) ``scale[r]`` is the
    row's sum of squares (an epilogue's ``row_sq`` of one part). ``copy_ptr`` (None: none): the
    rows are also stored there (row stride ``copy_stride``), so a block whose residual is its
    input reads it once. On a GPU one row a program (``BLOCK_R`` 1), ``BLOCK_C`` columns a step
    (the whole row up to :data:`NORM_MAX_COLS`), so a pass has a load of every row in flight."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = r < rows
    base = a_ptr + r[:, None].to(tl.int64) * stride
    mean = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if CENTER:
        total = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
        for c0 in range(0, cols, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            mask = row_ok[:, None] & (c[None, :] < cols)
            total += tl.load(base + c[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(total, axis=1) / cols
        tl.store(shift_ptr + r, mean, mask=row_ok)
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for c0 in range(0, cols, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        mask = row_ok[:, None] & (c[None, :] < cols)
        v = tl.load(base + c[None, :], mask=mask, other=0.0)
        if copy_ptr is not None:
            tl.store(copy_ptr + r[:, None].to(tl.int64) * copy_stride + c[None, :], v, mask=mask)
        d = tl.where(mask, v.to(tl.float32) - mean[:, None], 0.0)
        acc += d * d
    sq = tl.sum(acc, axis=1)
    if CENTER:
        sq = tl.rsqrt(sq / cols + eps)
    tl.store(scale_ptr + r, sq, mask=row_ok)


@triton.jit
def rms_scale(epi, offs_m, rows):
    """``rsqrt(mean(a_row ** 2) + eps)`` of rows ``offs_m`` from their partial sums of squares;
    0 for rows past ``rows`` (a bucketed plan's, which nobody reads: kept finite)."""
    sq = tl.zeros(offs_m.shape, dtype=tl.float32)
    for j in tl.static_range(epi.SQ_PARTS):
        sq += tl.load(epi.row_sq + offs_m * epi.SQ_PARTS + j, mask=offs_m < rows, other=0.0)
    return tl.where(offs_m < rows, tl.rsqrt(sq / epi.norm_cols + epi.norm_eps), 0.0)


@triton.jit
def layer_norm_stats(epi, offs_m, rows):
    """Each row's mean and ``rsqrt(var + eps)`` from its parts' sums and sums of squares about
    their own means (Chan's formula: no cancellation); a scale of 0 for rows past ``rows``."""
    total = tl.zeros(offs_m.shape, dtype=tl.float32)
    for j in tl.static_range(epi.SQ_PARTS):
        total += tl.load(epi.row_sum + offs_m * epi.SQ_PARTS + j, mask=offs_m < rows, other=0.0)
    mean = total / epi.norm_cols
    m2 = tl.zeros(offs_m.shape, dtype=tl.float32)
    for j in tl.static_range(epi.SQ_PARTS):
        n = tl.minimum(epi.part_cols, epi.norm_cols - j * epi.part_cols).to(tl.float32)
        s = tl.load(epi.row_sum + offs_m * epi.SQ_PARTS + j, mask=offs_m < rows, other=0.0)
        d = s / n - mean
        m2 += tl.load(epi.row_sq + offs_m * epi.SQ_PARTS + j, mask=offs_m < rows, other=0.0) + n * d * d
    return mean, tl.where(offs_m < rows, tl.rsqrt(m2 / epi.norm_cols + epi.norm_eps), 0.0)  # rows past: 0


@triton.jit
def apply(epi, acc, pm, pn, rows, n_out, BLOCK_M: tl.constexpr):
    """The epilogue ``epi`` on tile ``(pm, pn)``'s accumulator ``acc`` (``rows`` x ``n_out``:
    the output's extent, for masks). Returns the tile to store (half as wide with ``GATED``;
    ``acc`` itself with nothing to do)."""
    offs_m = (pm * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    IN_N: tl.constexpr = acc.shape[1]
    n_in = n_out * 2 if epi.GATED is not None else n_out  # the GEMM's columns
    cols_in = pn * IN_N + tl.arange(0, IN_N)
    if epi.row_sum is not None:  # a LayerNorm from partial sums
        mean, rstd = layer_norm_stats(epi, offs_m, rows)
        acc -= mean[:, None] * tl.load(epi.col_sum + cols_in, mask=cols_in < n_in, other=0.0)[None, :]
        acc = acc * rstd[:, None]
    elif epi.row_sq is not None:
        acc = acc * rms_scale(epi, offs_m, rows)[:, None]
    if epi.row_shift is not None:
        shift = tl.load(epi.row_shift + offs_m, mask=offs_m < rows, other=0.0)
        acc -= shift[:, None] * tl.load(epi.col_sum + cols_in, mask=cols_in < n_in, other=0.0)[None, :]
    if epi.row_scale is not None:
        acc = acc * tl.load(epi.row_scale + offs_m, mask=offs_m < rows, other=0.0)[:, None]
    if epi.bias is not None:
        acc += tl.load(epi.bias + cols_in, mask=cols_in < n_in, other=0.0).to(tl.float32)[None, :]
    if epi.GATED is not None:
        runs = tl.reshape(acc, (acc.shape[0], acc.shape[1] // (2 * GATE_RUN), 2, GATE_RUN))
        runs = tl.permute(runs, (0, 1, 3, 2))  # [rows, run, column in run, (gate, up)]
        gate, up = tl.split(tl.reshape(runs, (acc.shape[0], acc.shape[1] // 2, 2)))
        acc = epi.ACTIVATION(gate) * up
    elif epi.ACTIVATION is not None:
        acc = epi.ACTIVATION(acc)
    OUT_N: tl.constexpr = acc.shape[1]
    cols = pn * OUT_N + tl.arange(0, OUT_N)
    if epi.residual is not None:
        mask = (offs_m[:, None] < tl.minimum(rows, epi.res_rows)) & (cols[None, :] < n_out)
        res = tl.load(epi.residual + offs_m[:, None] * epi.stride_res + cols[None, :], mask=mask, other=0.0)
        acc += res.to(tl.float32)
    return acc


@triton.jit
def store_sums(epi, stored, pm, pn, rows, n_out, BLOCK_M: tl.constexpr):
    """With ``sq_out``: the rows' sums of squares of the tile as ``stored`` (C's dtype; columns
    past ``n_out``, which the store clips, add nothing) into column ``pn`` of ``sq_out``."""
    if epi.sq_out is not None:
        offs_m = (pm * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        W: tl.constexpr = stored.shape[1]
        cols = pn * W + tl.arange(0, W)
        valid = cols[None, :] < n_out
        v = tl.where(valid, stored.to(tl.float32), 0.0)
        if epi.sum_out is not None:  # a LayerNorm's: the sum, and the squares about the tile's row mean
            s = tl.sum(v, axis=1)
            d = tl.where(valid, v - (s / tl.minimum(W, n_out - pn * W).to(tl.float32))[:, None], 0.0)
            tl.store(epi.sum_out + offs_m * epi.out_parts + pn, s, mask=offs_m < rows)
            tl.store(epi.sq_out + offs_m * epi.out_parts + pn, tl.sum(d * d, axis=1), mask=offs_m < rows)
        else:
            tl.store(epi.sq_out + offs_m * epi.out_parts + pn, tl.sum(v * v, axis=1), mask=offs_m < rows)
