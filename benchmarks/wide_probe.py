"""Tiles of composite width: can they remove the partial wave at 256-768 rows? (diagnostic)

usage: python3 benchmarks/wide_probe.py OUT_DIR [REPS]

``X[M, 8192] @ W[8192, 8192]`` bf16. A tile of ``BN1 + BN2`` columns (each a power of two) is
two accumulators over one A tile, so a tile's width need not be a power of two and the tile count
can sit just under a multiple of the SM count (640 rows: 5 x 26 tiles of 128 x 320 are one round
of 1.25 tiles' work where 128 x 256 tiles take 1.21 rounds of work in two rounds). Each line a CUDA
graph of 10 calls, shuffled turns, paired against cuBLAS; the library's ``matmul`` beside it.
Results are checked against ``matmul`` (max abs difference; whole-tile sums run in the same order).
"""

import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ctapipelining.gemm import matmul, num_sms
from ctapipelining.kernels.gemm import tile_of_position
from ctapipelining.timing import Method, environment, median_ci, time_interleaved


@triton.jit
def wide_kernel(
    a_desc, b1_desc, b2_desc, c1_desc, c2_desc, c_ptr, M, N, K,
    BLOCK_M: tl.constexpr, BN1: tl.constexpr, BN2: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_CTAS: tl.constexpr, TMA_STORE: tl.constexpr,
    GRID_N: tl.constexpr, DOT1: tl.constexpr, DOT2: tl.constexpr,
):  # fmt: skip
    """Tiles of ``BLOCK_M x GRID_N`` (grid), computed as ``BN1`` + ``BN2`` columns (``DOT1`` /
    ``DOT2`` off: that part skipped, for timing what each part costs; a wider compute than the
    grid overlaps the next tile and is for timing only)."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, GRID_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for pos in tl.range(tl.program_id(0), num_m * num_n, NUM_CTAS, flatten=True):
        tile = tile_of_position(pos, num_m, num_n, GROUP_M)
        pm = tile // num_n
        pn = tile % num_n
        acc1 = tl.zeros((BLOCK_M, BN1), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BN2), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([pm * BLOCK_M, ki * BLOCK_K])
            if DOT1:
                b1 = b1_desc.load([ki * BLOCK_K, pn * GRID_N])
                acc1 = tl.dot(a, b1, acc1)
            if DOT2:
                b2 = b2_desc.load([ki * BLOCK_K, pn * GRID_N + BN1])
                acc2 = tl.dot(a, b2, acc2)
        if TMA_STORE:
            c1_desc.store([pm * BLOCK_M, pn * GRID_N], acc1.to(c1_desc.dtype))
            c2_desc.store([pm * BLOCK_M, pn * GRID_N + BN1], acc2.to(c2_desc.dtype))
        else:
            rows = (pm * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
            cols1 = pn * GRID_N + tl.arange(0, BN1)
            cols2 = pn * GRID_N + BN1 + tl.arange(0, BN2)
            tl.store(
                c_ptr + rows[:, None] * N + cols1[None, :],
                acc1.to(c_ptr.dtype.element_ty),
                mask=(rows[:, None] < M) & (cols1[None, :] < N),
            )
            tl.store(
                c_ptr + rows[:, None] * N + cols2[None, :],
                acc2.to(c_ptr.dtype.element_ty),
                mask=(rows[:, None] < M) & (cols2[None, :] < N),
            )


@triton.jit
def tall_kernel(
    a1_desc, a2_desc, b_desc, c1_desc, c2_desc, c_ptr, M, N, K,
    BM1: tl.constexpr, BM2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_CTAS: tl.constexpr, TMA_STORE: tl.constexpr,
):  # fmt: skip
    """Tiles of ``BM1 + BM2`` rows x ``BLOCK_N``: two accumulators over one B tile (cuBLAS's
    320 x 128 at 640 rows)."""
    BLOCK_M: tl.constexpr = BM1 + BM2
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for pos in tl.range(tl.program_id(0), num_m * num_n, NUM_CTAS, flatten=True):
        tile = tile_of_position(pos, num_m, num_n, GROUP_M)
        pm = tile // num_n
        pn = tile % num_n
        acc1 = tl.zeros((BM1, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((BM2, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            b = b_desc.load([ki * BLOCK_K, pn * BLOCK_N])
            a1 = a1_desc.load([pm * BLOCK_M, ki * BLOCK_K])
            a2 = a2_desc.load([pm * BLOCK_M + BM1, ki * BLOCK_K])
            acc1 = tl.dot(a1, b, acc1)
            acc2 = tl.dot(a2, b, acc2)
        if TMA_STORE:
            c1_desc.store([pm * BLOCK_M, pn * BLOCK_N], acc1.to(c1_desc.dtype))
            c2_desc.store([pm * BLOCK_M + BM1, pn * BLOCK_N], acc2.to(c2_desc.dtype))
        else:
            cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)
            rows1 = (pm * BLOCK_M + tl.arange(0, BM1)).to(tl.int64)
            rows2 = (pm * BLOCK_M + BM1 + tl.arange(0, BM2)).to(tl.int64)
            tl.store(
                c_ptr + rows1[:, None] * N + cols[None, :],
                acc1.to(c_ptr.dtype.element_ty),
                mask=(rows1[:, None] < M) & (cols[None, :] < N),
            )
            tl.store(
                c_ptr + rows2[:, None] * N + cols[None, :],
                acc2.to(c_ptr.dtype.element_ty),
                mask=(rows2[:, None] < M) & (cols[None, :] < N),
            )


class Wide:
    """One launch of ``wide_kernel`` (``tall``: of ``tall_kernel``, ``bm`` + ``bm2`` rows) on
    fixed operands (descriptors built once)."""

    def __init__(self, x, w, out, spec, group_m=8):
        M, K = x.shape
        N = w.shape[1]
        bm, bn1, bn2, bk, st, wp = (spec[k] for k in ("bm", "bn1", "bn2", "bk", "stages", "warps"))
        desc = TensorDescriptor.from_tensor
        if spec.get("bm2"):
            bm2 = spec["bm2"]
            self.kernel = tall_kernel
            tiles = triton.cdiv(M, bm + bm2) * triton.cdiv(N, bn1)
            self.args = (desc(x, [bm, bk]), desc(x, [bm2, bk]), desc(w, [bk, bn1]), desc(out, [bm, bn1]),
                         desc(out, [bm2, bn1]), out, M, N, K)  # fmt: skip
            self.meta = dict(BM1=bm, BM2=bm2, BLOCK_N=bn1, BLOCK_K=bk, GROUP_M=group_m, TMA_STORE=spec.get("tma", True))
        else:
            grid_n = spec.get("grid_n", bn1 + bn2)
            self.kernel = wide_kernel
            tiles = triton.cdiv(M, bm) * triton.cdiv(N, grid_n)
            self.args = (desc(x, [bm, bk]), desc(w, [bk, bn1]), desc(w, [bk, bn2]), desc(out, [bm, bn1]),
                         desc(out, [bm, bn2]), out, M, N, K)  # fmt: skip
            self.meta = dict(
                BLOCK_M=bm, BN1=bn1, BN2=bn2, BLOCK_K=bk, GROUP_M=group_m, TMA_STORE=spec.get("tma", True),
                GRID_N=grid_n, DOT1=spec.get("dot1", True), DOT2=spec.get("dot2", True),
            )  # fmt: skip
        self.ctas = min(tiles, num_sms(x.device))
        self.meta.update(NUM_CTAS=self.ctas, num_stages=st, num_warps=wp)
        self.tiles = tiles
        self.exact = spec.get("exact", True)

    def __call__(self):
        return self.kernel[(self.ctas,)](*self.args, **self.meta)


def spec(bm, bn1, bn2, stages, warps, bk=64, **kw):
    return dict(bm=bm, bn1=bn1, bn2=bn2, bk=bk, stages=stages, warps=warps, **kw)


# name: spec, per row count; "exact": False for the timing-only parts (a part skipped or wider)
CANDIDATES = {
    384: {
        "128x128+64_s4_w8": spec(128, 128, 64, 4, 8),
        "128x128+64_s4_w8_only128": spec(128, 128, 64, 4, 8, dot2=False, exact=False),
        "128x128+64_s4_w8_only64": spec(128, 128, 64, 4, 8, dot1=False, exact=False),
        "128x256_on192grid_s3_w8": spec(128, 256, 64, 3, 8, dot2=False, grid_n=192, exact=False),
        "128x128_on192grid_s4_w8": spec(128, 128, 64, 4, 8, dot2=False, grid_n=192, exact=False),
        "128x128+64_k32_s6_w8": spec(128, 128, 64, 6, 8, bk=32),
        "128x128+64_k128_s2_w8": spec(128, 128, 64, 2, 8, bk=128),
    },
    640: {
        "128x256+64_s3_w8_ptr": spec(128, 256, 64, 3, 8, tma=False),
        "128x256+64_s3_w8_ptr_only256": spec(128, 256, 64, 3, 8, tma=False, dot2=False, exact=False),
        "256+64x128_k32_s4_w8": spec(256, 128, 0, 4, 8, bk=32, bm2=64),
        "256+64x128_k32_s5_w8": spec(256, 128, 0, 5, 8, bk=32, bm2=64),
        "128+64x256_s3_w8_ptr": spec(128, 256, 0, 3, 8, bm2=64, tma=False),
    },
}


def graph_of(fn, calls):
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
    torch.manual_seed(0)
    w = (torch.randn(8192, 8192, device="cuda") * 8192**-0.5).bfloat16()
    report = {"environment": environment(), "command": " ".join(sys.argv), "reps": reps, "rows": {}}
    for M, cands in CANDIDATES.items():
        x = torch.randn(M, 8192, device="cuda").bfloat16()
        ref = matmul(x, w)
        runs, info = {}, {}
        for name, sp in cands.items():
            out = torch.empty_like(ref)
            try:
                probe = Wide(x, w, out, sp)
                kernel = probe()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 (a candidate that does not compile is reported)
                info[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                print(M, name, info[name], flush=True)
                continue
            info[name] = {
                "tiles": probe.tiles, "ctas": probe.ctas, "regs": kernel.n_regs, "spills": kernel.n_spills,
                "max_abs_diff_vs_matmul": float((out.float() - ref.float()).abs().max()),
                "bitwise_matmul": bool(torch.equal(out, ref)), "exact": probe.exact,
            }  # fmt: skip
            print(M, name, info[name], flush=True)
            runs[name] = graph_of(probe, 10)
        lib_out = torch.empty_like(ref)
        runs["matmul"] = graph_of(lambda: matmul(x, w, out=lib_out), 10)  # noqa: B023 (captured now)
        runs["cublas"] = graph_of(lambda: torch.mm(x, w), 10)  # noqa: B023
        times = time_interleaved([Method(k, r) for k, r in runs.items()], [0], reps, 3)
        med = {k: statistics.median(v) / 10 for k, v in times.items()}
        pairs = {}
        for k in times:
            if k != "cublas":
                m, lo, hi = median_ci([a / b for a, b in zip(times[k], times["cublas"])])
                pairs[f"{k}/cublas"] = {"median": m, "ci95": [lo, hi]}
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            torch.mm(x, w)
            torch.cuda.synchronize()
        kernels = sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
        print(M, "cuBLAS kernels:", kernels, flush=True)
        report["rows"][M] = {"candidates": info, "ms_per_call": med, "pairs": pairs, "cublas_kernels": kernels}
        for k, v in med.items():
            print(f"  {M} {k:24s} {v * 1e3:8.1f} us")
        for k, v in pairs.items():
            print(f"  {M} {k:30s} {v['median']:.3f} [{v['ci95'][0]:.3f}, {v['ci95'][1]:.3f}]", flush=True)
    (out_dir / "wide_probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
