"""Where a split tail's time goes, and fix-ups that may cost less (diagnostic).

usage: python3 benchmarks/tail_probe.py OUT_DIR [REPS]

``X[M, 8192] @ W[8192, 8192]`` bf16 at M = 640 and 768, 128 x 256 x 64 tiles, 3 stages, 8 warps,
groups of 8 (the plain GEMM's configuration there), each line a CUDA graph of 10 calls, timed by
the bench's harness (shuffled turns, paired against ``lib``, the library's ``matmul``):

* ``notail``: the full rounds only (wrong result: the time of the rounds before the tail);
* ``compute``: the tail's slices computed, each stored straight into C (wrong result);
* ``store``: slices computed and their partials stored, the last slice stores its own (wrong);
* ``lib``: the library's fix-up (reads every partial, whole tiles, in slice order);
* ``regs``: the same, its own slice from registers;
* ``chunk``: the last slice reads the partials in 32-row chunks, all slices of a chunk at once,
  and stores C chunk by chunk;
* ``sk``: the tail's K-steps shared evenly by every CTA (one stream-K wave), each tile's
  segments summed in order by its last, chunked as ``chunk`` (16 rows);
* ``*_claim``: tail items claimed from a ticket by CTAs as they finish their full rounds;
* ``cublas``.

The correct modes are checked bitwise against ``lib`` first.
"""

import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from ctapipelining.gemm import descriptor, matmul, num_sms
from ctapipelining.kernels.gemm import GemmConfig, tile_of_position
from ctapipelining.timing import Method, environment, median_ci, time_interleaved

MODES = {"notail": 0, "compute": 1, "store": 2, "lib": 3, "regs": 4, "chunk": 5, "sk": 6}


@triton.jit
def _mma(a_desc, b_desc, pm, pn, k0, k1, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(k0, k1):
        a = a_desc.load([pm * BLOCK_M, ki * BLOCK_K])
        b = b_desc.load([ki * BLOCK_K, pn * BLOCK_N])
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _fixup(partials, count, c_ptr, pm, pn, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           CHUNK: tl.constexpr, MAX_PARTS: tl.constexpr):
    """Sum ``count`` partial tiles from ``partials`` in order, CHUNK rows at a time, all partials of a
    chunk loaded at once, and store C chunk by chunk."""
    TILE: tl.constexpr = BLOCK_M * BLOCK_N
    rows = tl.arange(0, CHUNK)
    cols = tl.arange(0, BLOCK_N)
    coffs = rows[:, None] * BLOCK_N + cols[None, :]
    for r in tl.static_range(BLOCK_M // CHUNK):
        total = tl.zeros((CHUNK, BLOCK_N), dtype=tl.float32)
        for p in tl.static_range(MAX_PARTS):  # masked, not branched: every load of a chunk in flight at once
            total += tl.load(
                partials + p * TILE + r * CHUNK * BLOCK_N + coffs, mask=(coffs >= 0) & (p < count), other=0.0,
                cache_modifier=".cg",
            )
        grow = (pm * BLOCK_M + r * CHUNK + rows).to(tl.int64)
        gcol = pn * BLOCK_N + cols
        mask = (grow[:, None] < M) & (gcol[None, :] < N)
        tl.store(c_ptr + grow[:, None] * N + gcol[None, :], total.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sk_tail(
    a_desc, b_desc, c_ptr, ws, counters, item, M, N, k_tiles, first, num_m, num_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_CTAS: tl.constexpr, CHUNK: tl.constexpr, MAX_SEG: tl.constexpr,
):  # fmt: skip
    """The tail's K-steps shared evenly by all NUM_CTAS CTAs (one stream-K wave): item ``item``
    runs steps [item * S // P, (item + 1) * S // P) of the tail's S steps, tile after tile. The
    segment of tile j run by item c has workspace slot j + c (unique); tile j's segments are
    items c_lo..c_hi, so its partials lie in slots j + c_lo .. j + c_hi, summed in that order."""
    TILE: tl.constexpr = BLOCK_M * BLOCK_N
    P = NUM_CTAS
    S = (num_m * num_n - first) * k_tiles
    start = item * S // P
    end = (item + 1) * S // P
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    for _seg in range(2):
        if start < end:
            j = start // k_tiles
            s1 = tl.minimum(end, (j + 1) * k_tiles)
            tile = tile_of_position(first + j, num_m, num_n, GROUP_M)
            pm = tile // num_n
            pn = tile % num_n
            acc = _mma(a_desc, b_desc, pm, pn, start - j * k_tiles, s1 - j * k_tiles, BLOCK_M, BLOCK_N, BLOCK_K)
            c_lo = ((j * k_tiles + 1) * P + S - 1) // S - 1
            c_hi = ((j + 1) * k_tiles * P + S - 1) // S - 1
            n = c_hi - c_lo + 1
            partials = ws + (j + c_lo).to(tl.int64) * TILE
            tl.store(ws + (j + item).to(tl.int64) * TILE + offs, acc)
            tl.debug_barrier()
            arrived = tl.atomic_add(counters + j, 1, sem="acq_rel", scope="gpu") + 1
            if arrived == n:
                tl.atomic_xchg(counters + j, 0, sem="relaxed", scope="gpu")
                tl.debug_barrier()
                _fixup(partials, n, c_ptr, pm, pn, M, N, BLOCK_M, BLOCK_N, CHUNK, MAX_SEG)
            start = s1


@triton.jit
def probe_kernel(
    a_desc, b_desc, c_desc, c_ptr, ws, counters, ticket, M, N, k_tiles, first,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_CTAS: tl.constexpr, SPLITS: tl.constexpr, MODE: tl.constexpr, CLAIM: tl.constexpr,
    CHUNK: tl.constexpr, MAX_SEG: tl.constexpr,
):  # fmt: skip
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_m * num_n
    for pos in tl.range(tl.program_id(0), first, NUM_CTAS, flatten=True):
        tile = tile_of_position(pos, num_m, num_n, GROUP_M)
        pm = tile // num_n
        pn = tile % num_n
        acc = _mma(a_desc, b_desc, pm, pn, 0, k_tiles, BLOCK_M, BLOCK_N, BLOCK_K)
        c_desc.store([pm * BLOCK_M, pn * BLOCK_N], acc.to(c_desc.dtype))
    if MODE != 0:
        item = tl.program_id(0)
        if CLAIM:
            item = tl.atomic_add(ticket, 1, sem="relaxed", scope="gpu")
            if item == NUM_CTAS - 1:
                tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")  # every CTA has claimed: rearm
        if MODE == 6:
            _sk_tail(
                a_desc, b_desc, c_ptr, ws, counters, item, M, N, k_tiles, first, num_m, num_n,
                BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_CTAS, CHUNK, MAX_SEG,
            )  # fmt: skip
        j = item // SPLITS
        if (first + j < num_tiles) & (MODE != 6):
            part = item % SPLITS
            tile = tile_of_position(first + j, num_m, num_n, GROUP_M)
            pm = tile // num_n
            pn = tile % num_n
            k0, k1 = part * k_tiles // SPLITS, (part + 1) * k_tiles // SPLITS
            acc = _mma(a_desc, b_desc, pm, pn, k0, k1, BLOCK_M, BLOCK_N, BLOCK_K)
            if MODE == 1:
                c_desc.store([pm * BLOCK_M, pn * BLOCK_N], acc.to(c_desc.dtype))
            else:
                TILE: tl.constexpr = BLOCK_M * BLOCK_N
                offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
                partials = ws + (j * SPLITS).to(tl.int64) * TILE
                tl.store(partials + part * TILE + offs, acc)
                tl.debug_barrier()
                arrived = tl.atomic_add(counters + j, 1, sem="acq_rel", scope="gpu") + 1
                if arrived == SPLITS:
                    tl.atomic_xchg(counters + j, 0, sem="relaxed", scope="gpu")
                    tl.debug_barrier()
                    if MODE == 2:
                        c_desc.store([pm * BLOCK_M, pn * BLOCK_N], acc.to(c_desc.dtype))
                    elif MODE == 3:
                        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                        for p in range(SPLITS):
                            total += tl.load(partials + p * TILE + offs, cache_modifier=".cg")
                        c_desc.store([pm * BLOCK_M, pn * BLOCK_N], total.to(c_desc.dtype))
                    elif MODE == 4:
                        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                        for p in range(SPLITS):
                            if p == part:
                                total += acc
                            else:
                                total += tl.load(partials + p * TILE + offs, cache_modifier=".cg")
                        c_desc.store([pm * BLOCK_M, pn * BLOCK_N], total.to(c_desc.dtype))
                    else:
                        _fixup(partials, SPLITS, c_ptr, pm, pn, M, N, BLOCK_M, BLOCK_N, CHUNK, SPLITS)


class Probe:
    """One probe configuration's launch on fixed buffers."""

    def __init__(self, x, w, out, mode: str, claim: bool, cfg: GemmConfig, min_slice_k: int = 16):
        self.x, self.w, self.out, self.cfg = x, w, out, cfg
        M, K = x.shape
        N = w.shape[1]
        self.M, self.N, self.k_tiles = M, N, triton.cdiv(K, cfg.block_k)
        tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
        self.ctas = min(num_sms(x.device), tiles)
        tail = tiles % self.ctas
        self.first = tiles - tail
        self.splits = min(self.ctas // tail, self.k_tiles // min_slice_k)
        self.chunk = 16 if mode == "sk" else 32
        steps = tail * self.k_tiles // self.ctas  # stream-K: the fewest steps an item runs
        self.max_seg = triton.cdiv(self.k_tiles, steps) + 1
        slots = tail + self.ctas - 1 if mode == "sk" else tail * self.splits
        dev = x.device
        self.ws = torch.empty(slots, cfg.block_m * cfg.block_n, dtype=torch.float32, device=dev)
        self.counters = torch.zeros(tail, dtype=torch.int32, device=dev)
        self.ticket = torch.zeros(1, dtype=torch.int32, device=dev)
        self.mode, self.claim = MODES[mode], claim
        bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
        self.descs = (descriptor(x, [bm, bk]), descriptor(w, [bk, bn]), descriptor(out, [bm, bn]))

    def __call__(self):
        cfg = self.cfg
        probe_kernel[(self.ctas,)](
            *self.descs, self.out, self.ws, self.counters, self.ticket, self.M, self.N, self.k_tiles, self.first,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            NUM_CTAS=self.ctas, SPLITS=self.splits, MODE=self.mode, CLAIM=self.claim,
            CHUNK=min(self.chunk, cfg.block_m), MAX_SEG=self.max_seg,
            num_stages=cfg.num_stages, num_warps=cfg.num_warps,
        )  # fmt: skip
        return self.out


def graph_of(fn, calls: int):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g.replay


def main():
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = GemmConfig(128, 256, 64, group_m=8, num_stages=3, num_warps=8, split_tail=True)
    torch.manual_seed(0)
    w = (torch.randn(8192, 8192, device="cuda") * 8192**-0.5).bfloat16()
    report = {"environment": environment(), "command": " ".join(sys.argv), "reps": reps, "rows": {}}
    lines = ["compute", "store", "lib", "regs", "chunk", "sk"]
    for M in (640, 768):
        x = torch.randn(M, 8192, device="cuda").bfloat16()
        ref = matmul(x, w, config=cfg)
        outs, methods = {}, {}
        for name in ["notail", *lines]:
            for claim in (False, True):
                if claim and name in ("notail", "compute", "store"):
                    continue
                key = name + ("_claim" if claim else "")
                outs[key] = torch.empty_like(ref)
                probe = Probe(x, w, outs[key], name, claim, cfg)
                probe()
                probe()  # a second launch on rearmed counters
                torch.cuda.synchronize()
                methods[key] = probe
        checks = {k: torch.equal(outs[k], ref) for k in outs if k.split("_")[0] in ("lib", "regs", "chunk")}
        for k in ("sk", "sk_claim"):
            checks[k + "_max_rel_err"] = float((outs[k].float() - ref.float()).abs().max() / ref.float().abs().max())
        print(M, "splits", methods["lib"].splits, "bitwise equal to matmul:", checks, flush=True)
        lib_out = torch.empty_like(ref)
        runs = {k: graph_of(m, 10) for k, m in methods.items()}
        runs["matmul"] = graph_of(lambda: matmul(x, w, out=lib_out, config=cfg), 10)  # noqa: B023 (captured now)
        runs["cublas"] = graph_of(lambda: torch.mm(x, w), 10)  # noqa: B023
        times = time_interleaved([Method(k, r) for k, r in runs.items()], [0], reps, 3)
        med = {k: statistics.median(v) / 10 for k, v in times.items()}
        pairs = {}
        for k in times:
            if k != "matmul":
                m, lo, hi = median_ci([a / b for a, b in zip(times[k], times["matmul"])])
                pairs[f"{k}/matmul"] = {"median": m, "ci95": [lo, hi]}
        m, lo, hi = median_ci([a / b for a, b in zip(times["matmul"], times["cublas"])])
        pairs["matmul/cublas"] = {"median": m, "ci95": [lo, hi]}
        for k in ("regs", "chunk", "chunk_claim", "lib_claim", "regs_claim", "sk", "sk_claim"):
            m, lo, hi = median_ci([a / b for a, b in zip(times[k], times["cublas"])])
            pairs[f"{k}/cublas"] = {"median": m, "ci95": [lo, hi]}
        report["rows"][M] = {"splits": methods["lib"].splits, "checks": checks, "ms_per_call": med, "pairs": pairs}
        for k, v in med.items():
            print(f"  {M} {k:14s} {v * 1e3:8.1f} us")
        for k, v in pairs.items():
            print(f"  {M} {k:20s} {v['median']:.3f} [{v['ci95'][0]:.3f}, {v['ci95'][1]:.3f}]", flush=True)
    (out_dir / "tail_probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
