"""Persistent TMA GEMM with CTA-pipelining hooks, and its configurations.

``C[M, N] = A[M, K] @ B[K, N]`` (bf16/fp16 in and out, fp32 accumulate). A and B are read
with TMA descriptors (out-of-bounds rows and columns read as zero, so no size needs to divide
a block); C is written with masked stores through a plain pointer, which may point into
another GPU's memory.

Each CTA loops over tiles (persistent). Two constexpr hooks wrap the unchanged compute body
(:func:`_mma_tile`):

* ``WAIT_INPUT`` (prologue): choose the next tile by policy and wait until its input rows are
  written: ``QUEUE`` claims ring positions in readiness order, otherwise the CTA walks the
  tile order and waits on each tile's counter;
* ``SIGNAL_OUTPUT`` (epilogue): publish the stored tile to the next stage's scoreboard and,
  under ``QUEUE``, push newly ready consumer tiles.

With both hooks off the branches vanish at compile time and the kernel is the plain
persistent GEMM.
"""

from dataclasses import dataclass

import triton
import triton.language as tl

from .sync import claim, fence_proxy_async, signal_tile, wait_counter, wait_slot


@dataclass(frozen=True)
class GemmConfig:
    """One tile configuration (``num_stages``: TMA pipeline depth; ``group_m``: row-blocks
    per group of the tile order, 1 = row-major)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 1
    num_stages: int = 3
    num_warps: int = 8

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        return self.num_stages * (self.block_m + self.block_n) * self.block_k * elem_bytes


SMEM_LIMIT = 227 * 1024  # Hopper, per CTA

CONFIGS = [
    GemmConfig(128, 256, 64, 1, 3, 8),
    GemmConfig(128, 256, 64, 4, 3, 8),
    GemmConfig(128, 256, 64, 8, 3, 8),
    GemmConfig(128, 128, 64, 1, 4, 8),
    GemmConfig(128, 128, 64, 8, 4, 4),
    GemmConfig(64, 128, 64, 1, 4, 4),
]


def get_configs(elem_bytes: int = 2) -> list[GemmConfig]:
    """The configurations that fit in shared memory."""
    return [c for c in CONFIGS if c.smem_bytes(elem_bytes) <= SMEM_LIMIT]


@triton.jit
def tile_of_position(pos, num_m, num_n, GROUP_M: tl.constexpr):
    """Row-major tile id at position ``pos`` of the grouped order (== deps.grouped_tile)."""
    per_group = GROUP_M * num_n
    first_m = (pos // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pm = first_m + (pos % per_group) % size_m
    pn = (pos % per_group) // size_m
    return pm * num_n + pn


@triton.jit
def _mma_tile(a_desc, b_desc, pm, pn, k_tiles, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The compute body: one output tile, fp32 accumulator."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(k_tiles):
        a = a_desc.load([pm * BLOCK_M, ki * BLOCK_K])
        b = b_desc.load([ki * BLOCK_K, pn * BLOCK_N])
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _store_tile(c_ptr, acc, pm, pn, M, N, stride_cm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_m = (pm * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["stage", "timeout_ns", "consumer_tiles"])
def gemm_kernel(
    a_desc,
    b_desc,
    c_ptr,
    # wait-for-input hook: this stage's scoreboard and ring (local memory)
    in_counters,
    in_counter_of_tile,
    in_need,
    in_slots,
    in_head,
    # signal-output hook: the next stage's scoreboard and ring (its GPU's memory)
    out_counters,
    out_signal_ptr,
    out_signal_counters,
    out_need,
    out_push_ptr,
    out_push_tiles,
    out_slots,
    out_tail,
    epoch_ptr,
    err_ptr,
    M,
    N,
    k_tiles,
    stride_cm,
    consumer_tiles,
    stage,
    timeout_ns,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_CTAS: tl.constexpr,
    WAIT_INPUT: tl.constexpr,
    SIGNAL_OUTPUT: tl.constexpr,
    QUEUE: tl.constexpr,
    PUSH_BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_m * num_n
    epoch = 0
    if WAIT_INPUT or SIGNAL_OUTPUT:
        epoch = tl.load(epoch_ptr)
    if WAIT_INPUT and QUEUE:
        pos = claim(in_head, epoch, num_tiles, NUM_CTAS)
    else:
        pos = tl.program_id(0)
    while pos < num_tiles:
        ok = True
        if WAIT_INPUT and QUEUE:
            tile, ok = wait_slot(in_slots, pos, epoch, num_tiles, err_ptr, stage, timeout_ns, INTERPRET)
        else:
            tile = tile_of_position(pos, num_m, num_n, GROUP_M)
            if WAIT_INPUT:
                ok = wait_counter(
                    in_counters, in_counter_of_tile, in_need, tile, epoch, err_ptr, stage, timeout_ns, INTERPRET
                )
        if ok:
            if WAIT_INPUT:
                fence_proxy_async(INTERPRET)
            pm = tile // num_n
            pn = tile % num_n
            acc = _mma_tile(a_desc, b_desc, pm, pn, k_tiles, BLOCK_M, BLOCK_N, BLOCK_K)
            _store_tile(c_ptr, acc, pm, pn, M, N, stride_cm, BLOCK_M, BLOCK_N)
            if SIGNAL_OUTPUT:
                signal_tile(
                    tile,
                    epoch,
                    out_counters,
                    out_signal_ptr,
                    out_signal_counters,
                    out_need,
                    out_push_ptr,
                    out_push_tiles,
                    out_slots,
                    out_tail,
                    consumer_tiles,
                    QUEUE,
                    PUSH_BLOCK,
                )
            if WAIT_INPUT and QUEUE:
                pos = claim(in_head, epoch, num_tiles, NUM_CTAS)
            else:
                pos += NUM_CTAS
        else:
            pos = num_tiles  # timed out: recorded in err_ptr; leave so the GPU never hangs
