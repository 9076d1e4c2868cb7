"""Compile the GEMM's hook variants for Hopper (sm_90) without a GPU and count, in the PTX,
what each hook adds. ``python -m ctapipelining.kernels.compile_check`` prints a JSON report.

Used by the CPU tests (run with ``TRITON_INTERPRET`` unset: the interpreter replaces jit
functions) to show that with both hooks off the kernel has none of the protocol's
instructions, and by the device script next to the registers and spills the GPU reports.
"""

import json
import re

import triton
from triton.backends.compiler import GPUTarget

from .gemm import gemm_kernel

PATTERNS = {
    "wgmma": r"wgmma\.mma_async",
    "tma_load": r"cp\.async\.bulk\.tensor",
    "ld_acquire_sys": r"ld\.acquire\.sys",
    "atom_sys": r"atom\.[a-z_.]*sys",
    "globaltimer": r"%globaltimer",
    "fence_proxy_async": r"fence\.proxy\.async",
    "bar_sync": r"\bbar\.sync|\bbarrier\.sync",
    "tma_store": r"cp\.async\.bulk\.tensor\.[0-9]d\.global\.shared",
    "bulk_wait_complete": r"cp\.async\.bulk\.wait_group [0-9]",
    "atom_gpu": r"atom\.[a-z_.]*gpu",
    "ld_cg": r"ld\.global\.cg",
    "vote": r"bar\.red\.and\.pred",
}
VARIANTS = {  # name: (WAIT_INPUT, SIGNAL_OUTPUT, QUEUE)
    "plain": (False, False, False),
    "wait_static": (True, False, False),
    "wait_workqueue": (True, False, True),
    "signal_static": (False, True, False),
    "signal_workqueue": (False, True, True),
    "wait_signal_workqueue": (True, True, True),
    "wait_signal_static": (True, True, False),  # a middle stage of a chain of 3 or more
}
TMA_STORE_VARIANTS = ("plain", "signal_static", "signal_workqueue", "wait_workqueue")
TRACE_VARIANTS = ("plain", "wait_workqueue")


def compile_variant(wait: bool, signal: bool, queue: bool, block=(128, 256, 64), num_warps=8, num_stages=3, **options):
    bm, bn, bk = block
    sig = {}
    for n in gemm_kernel.arg_names:
        if n == "c_desc":
            sig[n] = f"tensordesc<bf16[{bm}, {bn}]>"
        elif n == "a_desc":
            sig[n] = f"tensordesc<bf16[{bm}, {bk}]>"
        elif n == "b_desc":
            sig[n] = f"tensordesc<bf16[{bk}, {bn}]>"
        elif n == "c_ptr":
            sig[n] = "*bf16"
        elif n in ("trace_ptr", "epoch_ptr", "err_ptr", "in_counters", "in_slots", "in_head", "out_counters",
                   "out_slots", "out_tail"):  # fmt: skip
            sig[n] = "*i64"  # protocol state
        elif n == "tail_ws":
            sig[n] = "*fp32"
        elif n in (
            "M",
            "N",
            "k_tiles",
            "stride_cm",
            "consumer_tiles",
            "stage",
            "timeout_ns",
            "tail_first",
            "tail_splits",
            "part_cols",
            "part_block",
        ):
            sig[n] = "i32"
        elif n.isupper():
            sig[n] = "constexpr"
        else:
            sig[n] = "*i32"
    const = dict(
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=1,
        NUM_CTAS=132,
        WAIT_INPUT=wait,
        SIGNAL_OUTPUT=signal,
        QUEUE=queue,
        SIGNAL_WHEN=0,
        PUSH_BLOCK=32,
        MAX_SIGNALS=1,
        INTERPRET=False,
        TMA_STORE=False,
        FLATTEN=False,
        WARP_SPECIALIZE=False,
        SPLIT_TAIL=False,
        TRACE=False,
        WAIT_PARTS=1,
        WAIT_AHEAD=0,
    ) | {k.upper(): v for k, v in options.items()}
    src = triton.compiler.ASTSource(fn=gemm_kernel, signature=sig, constexprs=const)
    return triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages)
    )


def report() -> dict:
    out = {}
    builds = [(name, flags, {}) for name, flags in VARIANTS.items()]
    builds += [(name + "+tma_store", VARIANTS[name], {"tma_store": True}) for name in TMA_STORE_VARIANTS]
    builds += [(name + "+trace", VARIANTS[name], {"trace": True}) for name in TRACE_VARIANTS]
    builds += [
        (name + "+in_loop", VARIANTS[name], {"signal_when": 2}) for name in ("signal_static", "wait_signal_static")
    ]
    builds += [("signal_static+tma_store+in_loop", VARIANTS["signal_static"], {"signal_when": 2, "tma_store": True})]
    builds += [("signal_static+tma_store+next_tile", VARIANTS["signal_static"], {"signal_when": 1, "tma_store": True})]
    builds += [("plain+split_tail", VARIANTS["plain"], {"split_tail": True})]
    builds += [("plain+tma_store+split_tail", VARIANTS["plain"], {"split_tail": True, "tma_store": True})]
    builds += [("signal_static+in_loop+split_tail", VARIANTS["signal_static"], {"signal_when": 2, "split_tail": True})]
    builds += [("wait_static+split_tail", VARIANTS["wait_static"], {"split_tail": True})]
    builds += [("wait_static+parts", VARIANTS["wait_static"], {"wait_parts": 4, "wait_ahead": 3})]
    builds += [
        (
            "wait_static+parts+flatten+tma_store",
            VARIANTS["wait_static"],
            {"wait_parts": 4, "wait_ahead": 3, "flatten": True, "tma_store": True},
        )
    ]
    builds += [("wait_static+flatten+tma_store", VARIANTS["wait_static"], {"flatten": True, "tma_store": True})]
    for name, flags, options in builds:
        k = compile_variant(*flags, **options)
        ptx = k.asm["ptx"]
        out[name] = {p: len(re.findall(rx, ptx)) for p, rx in PATTERNS.items()} | {"smem": k.metadata.shared}
    return out


if __name__ == "__main__":
    print(json.dumps(report(), indent=1))
