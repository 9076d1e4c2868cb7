"""Compile the GEMM's hook variants for Hopper (sm_90) without a GPU and count, in the PTX,
what each hook adds. ``python -m ctapipelining.kernels.compile_check`` prints a JSON report.

Used by the CPU tests (run with ``TRITON_INTERPRET`` unset: the interpreter replaces jit
functions) to show that with both hooks off the kernel has none of the protocol's
instructions, and by the device script next to the registers and spills the GPU reports.
"""

import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget

from .chain import MAX_STAGES, Stage, chain_kernel
from .epilogue import NORM_GPU_ROWS, NORM_MAX_COLS, NORM_WARPS, Epilogue, gelu, norm_rows, silu
from .gemm import Tail, gemm_kernel
from .sync import Signal, Wait

PATTERNS = {
    "wgmma": r"wgmma\.mma_async",
    "tma_load": r"cp\.async\.bulk\.tensor",
    "ld_acquire_sys": r"ld\.acquire\.sys",
    "atom_sys": r"atom\.[a-z_.]*sys",
    "globaltimer": r"%globaltimer",
    "fence_proxy_async": r"fence\.proxy\.async",
    "bar_sync": r"\bbar\.sync|\bbarrier\.sync",
    "tma_store": r"cp\.async\.bulk\.tensor\.[0-9]d\.global\.shared",
    "tma_reduce": r"cp\.reduce\.async\.bulk\.tensor",
    "bulk_wait_complete": r"cp\.async\.bulk\.wait_group [0-9]",
    "atom_gpu": r"atom\.[a-z_.]*gpu",
    "ld_cg": r"ld\.global\.cg",
    "vote": r"bar\.red\.and\.pred",
    "st_shared_b16": r"st\.shared\.b16",  # a tile stored into shared memory an element at a time
    "stmatrix": r"stmatrix\.sync",
    "tanh_approx": r"tanh\.approx\.f32",  # the special-function unit's tanh (an activation's)
    "ex2_approx": r"ex2\.approx",
}
VARIANTS = {  # name: (wait, signal, queue)
    "plain": (False, False, False),
    "wait_static": (True, False, False),
    "wait_workqueue": (True, False, True),
    "signal_static": (False, True, False),
    "signal_workqueue": (False, True, True),
    "wait_signal_workqueue": (True, True, True),
    "wait_signal_static": (True, True, False),  # a middle stage of a chain of 3 or more
}
ORDINARY_STORE_VARIANTS = ("plain", "signal_static", "signal_workqueue", "wait_static")
TRACE_VARIANTS = ("plain", "wait_workqueue")


def _bundle(cls, types: dict, constexprs: dict, index, const: dict):
    """A bundle's signature (its fields' types; constexpr fields recorded in ``const`` by path:
    ``index`` is the bundle's own, an int or a tuple for a nested one)."""
    path = index if isinstance(index, tuple) else (index,)
    for i, name in enumerate(cls._fields):
        if name in constexprs:
            const[(*path, i)] = constexprs[name]
    return cls(*(("constexpr" if name in constexprs else types[name]) for name in cls._fields))


WAIT_TYPES = dict(counters="*i64", counter_of_tile="*i32", need="*i32", slots="*i64", head="*i64",
                  part_cols="i32", part_block="i32")  # fmt: skip
SIGNAL_TYPES = dict(counters="*i64", signal_ptr="*i32", signal_counters="*i32", need="*i32", push_ptr="*i32",
                    push_tiles="*i32", slots="*i64", tail="*i64", consumer_tiles="i32")  # fmt: skip


def _compile(kernel, sig: dict, const: dict, num_warps: int, num_stages: int):
    """Compile ``kernel`` for sm_90 with the argument types ``sig`` (its constexpr parameters,
    those after ``timeout_ns``, filled in) and the constexpr values ``const``."""
    names = kernel.arg_names
    for n in names[names.index("timeout_ns") + 1 :]:
        sig[n] = "constexpr"
    assert set(sig) == set(names), set(names) ^ set(sig)
    src = triton.compiler.ASTSource(fn=kernel, signature={n: sig[n] for n in names}, constexprs=const)
    return triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages)
    )


def compile_norm(center: bool, copy: bool = False, cols: int = 4096):
    """Compile :func:`~ctapipelining.kernels.epilogue.norm_rows` (the norm's statistics pass) for
    sm_90 on bf16 rows of ``cols`` columns: a LayerNorm's (``center``) or an RMSNorm's, storing a
    copy of the rows (``copy``) or not."""
    sig = dict(a_ptr="*bf16", scale_ptr="*fp32", shift_ptr="*fp32", copy_ptr="*bf16" if copy else "constexpr",
               rows="i32", cols="i32", stride="i32", copy_stride="i32", eps="fp32", CENTER="constexpr",
               BLOCK_R="constexpr", BLOCK_C="constexpr")  # fmt: skip
    const = dict(CENTER=center, BLOCK_R=NORM_GPU_ROWS, BLOCK_C=min(triton.next_power_of_2(cols), NORM_MAX_COLS))
    if not copy:
        const["copy_ptr"] = None
    src = triton.compiler.ASTSource(fn=norm_rows, signature=sig, constexprs=const)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=NORM_WARPS))


def compile_variant(
    wait: bool, signal: bool, queue: bool, block=(128, 256, 64), num_warps=8, num_stages=3, *,
    tma_store: bool = True, trace: bool = False, split_tail: bool = False, wait_parts: int = 1,
    epilogue: str | None = None,
):  # fmt: skip
    """Compile one variant of :func:`gemm_kernel` for sm_90; a hook that is off is ``None``.
    ``epilogue``: ``"gated_rms"`` (Llama's first GEMM: RMSNorm folded, SiLU-gated) or
    ``"bias_residual"`` (a GELU, a bias and a residual)."""
    bm, bn, bk = block
    names = gemm_kernel.arg_names
    sig, const = {}, {}

    def off(name):
        sig[name], const[name] = "constexpr", None

    sig["a_desc"] = f"tensordesc<bf16[{bm}, {bk}]>"
    sig["b_desc"] = f"tensordesc<bf16[{bk}, {bn}]>"
    if tma_store:
        sig["c_desc"] = f"tensordesc<bf16[{bm}, {bn // 2 if _gated(epilogue) else bn}]>"
        off("c_ptr")
    else:
        off("c_desc")
        sig["c_ptr"] = "*bf16"
    for n in ("M", "N", "k_tiles", "c_rows", "stride_cm", "stage"):
        sig[n] = "i32"
    sig["timeout_ns"] = "i64"
    if wait:
        ahead = num_stages if wait_parts > 1 else 0
        sig["wait"] = _bundle(Wait, WAIT_TYPES, dict(PARTS=wait_parts, AHEAD=ahead), names.index("wait"), const)
    else:
        off("wait")
    if signal:
        sig["signal"] = _bundle(Signal, SIGNAL_TYPES, dict(PUSH_BLOCK=32, MAX_SIGNALS=1), names.index("signal"), const)
    else:
        off("signal")
    if split_tail:
        sig["tail"] = Tail("*fp32", "*i32", "i32", "i32")
    else:
        off("tail")
    sig["epi"] = _epilogue_sig(epilogue, names.index("epi"), const)
    if wait or signal:
        sig["epoch_ptr"] = "*i64"
    else:
        off("epoch_ptr")
    if wait:
        sig["err_ptr"] = "*i64"
    else:
        off("err_ptr")
    if trace:
        sig["trace_ptr"] = "*i64"
    else:
        off("trace_ptr")
    const |= dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, NUM_CTAS=132, QUEUE=queue, INTERPRET=False)
    return _compile(gemm_kernel, sig, const, num_warps, num_stages)


def compile_chain(
    stages: int, wait_first: bool, signal_last: bool, queue: bool, block=(128, 256, 64), num_warps=8, num_stages=3,
    *, tma_store: bool = True, wait_parts: int = 4, trace: bool = False, split_tail: bool = False,
    epilogues: tuple | None = None,
):  # fmt: skip
    """Compile :func:`~.chain.chain_kernel` over ``stages`` stages for sm_90 (``split_tail``: the
    last stage's tail split into K-slices; ``epilogues``: each stage's, a key of
    :data:`EPILOGUE_VARIANTS` or None): the first stage
    waiting on another GPU (``wait_first``), the last signalling one (``signal_last``), the
    links inside waiting in ``wait_parts`` parts; ``tma_store=False``: the last stage stores
    with ordinary stores."""
    bm, bn, bk = block
    names = chain_kernel.arg_names
    sig, const = {}, {}
    at = names.index("stages")
    for i in range(MAX_STAGES):
        gated = bool(epilogues) and i < stages and _gated(epilogues[i])
        for name, block_shape in (("a", (bm, bk)), ("b", (bk, bn)), ("c", (bm, bn // 2 if gated else bn))):
            arg = f"{name}{i}"
            if i < stages and not (name == "c" and i == stages - 1 and not tma_store):
                sig[arg] = f"tensordesc<bf16[{block_shape[0]}, {block_shape[1]}]>"
            else:
                sig[arg], const[arg] = "constexpr", None
    bundles = []
    for i in range(stages):
        waits = i > 0 or wait_first
        signals = i < stages - 1 or signal_last
        outer_queue = queue and (i == 0 if waits and i == 0 else False)
        parts = 1 if outer_queue else wait_parts
        wait = (
            _bundle(Wait, WAIT_TYPES, dict(PARTS=parts, AHEAD=num_stages if parts > 1 else 0), (at, i, 2), const)
            if waits else "constexpr"
        )  # fmt: skip
        signal = (
            _bundle(Signal, SIGNAL_TYPES, dict(PUSH_BLOCK=32, MAX_SIGNALS=1), (at, i, 3), const)
            if signals else "constexpr"
        )  # fmt: skip
        for field, on in ((2, waits), (3, signals), (5, trace)):
            if not on:
                const[(at, i, field)] = None
        epi = _epilogue_sig(epilogues[i] if epilogues else None, (at, i, 7), const)
        bundles.append(Stage("i32", "i32", wait, signal, "*i64", "*i64" if trace else "constexpr", "i32", epi))
    sig["stages"] = tuple(bundles)
    if split_tail:
        sig["tail"] = Tail("*fp32", "*i32", "i32", "i32")
    else:
        sig["tail"], const["tail"] = "constexpr", None
    sig |= dict(M="i32", c_rows="i32", stride_cm="i32", ticket="*i64", order="*i32", epoch_ptr="*i64", timeout_ns="i64")
    if tma_store:
        sig["c_ptr"], const["c_ptr"] = "constexpr", None
    else:
        sig["c_ptr"] = "*bf16"
    const |= dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=4, QUEUE=queue, INTERPRET=False)
    return _compile(chain_kernel, sig, const, num_warps, num_stages)


def ptxas_usage(kernel) -> dict | None:
    """Registers and spilled bytes of ``kernel``'s sm_90a PTX, from the ``ptxas`` that Triton
    ships (``ptxas -v``); None where there is none."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(kernel.asm["ptx"])
        r = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", src, "-o", os.devnull], capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spills = [int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", r.stderr)]
    if r.returncode or regs is None:
        raise RuntimeError(f"ptxas failed: {r.stderr[-2000:]}")
    return {"registers": int(regs.group(1)), "spill_bytes": sum(spills)}


def compile_norms() -> dict:
    """The norm's statistics pass (:func:`~.epilogue.norm_rows`) storing a copy of the rows (the
    variant with the most registers: the one without runs the same code less the store), for
    RMSNorm and LayerNorm rows: each one's registers and spills (:func:`ptxas_usage`). Its tile
    is the same for every width from :data:`~.epilogue.NORM_MAX_COLS` on."""
    return {f"{'layer' if center else 'rms'}_copy": ptxas_usage(compile_norm(center, True)) for center in (False, True)}


def unfenced_loads(ptx: str) -> int:
    """TMA loads that the PTX text reaches from an acquire (``ld.acquire.sys``) without a
    ``fence.proxy.async`` between: each would read what the acquire made visible to the generic
    proxy only, not to TMA. Text order: a check on the layout the compiler chose (software
    pipelining may move loads, never across the inline-PTX fence), not a proof over all paths."""
    bad, pending = 0, False
    for line in ptx.splitlines():
        if "ld.acquire.sys" in line:
            pending = True
        elif "fence.proxy.async" in line:
            pending = False
        elif re.search(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global", line) and pending:
            bad += 1
    return bad


def flattened(ttgir: str) -> bool:
    """Whether the persistent loop and the K loop are fused into one (``tl.range(...,
    flatten=True)``), so the next tile's loads are issued during this tile's last steps: the
    loops that carry an MMA accumulator lie in no other loop (``scf.for`` or ``scf.while``).
    A loop in the body (an epilogue's, a wait's spin) keeps the compiler from fusing them,
    which leaves the K loop inside the persistent one. (The printer closes a loop at the
    indentation of its first line.)"""
    open_loops, mma_loops = [], 0
    for line in ttgir.splitlines():
        indent = len(line) - len(line.lstrip())
        closes = line.lstrip().startswith("}") and "do {" not in line  # a while's condition ends "} do {"
        if open_loops and closes and indent == open_loops[-1]:
            open_loops.pop()
        if "scf.for" in line or "scf.while" in line:
            if "scf.for" in line and re.search(r"#mma\d*>", line):
                mma_loops += 1
                if open_loops:
                    return False
            open_loops.append(indent)
    return mma_loops > 0


def _summary(k) -> dict:
    ptx = k.asm["ptx"]
    counts = {p: len(re.findall(rx, ptx)) for p, rx in PATTERNS.items()}
    return counts | {
        "smem": k.metadata.shared,
        "unfenced_loads": unfenced_loads(ptx),
        "flattened": flattened(k.asm["ttgir"]),
    }


def report() -> dict:
    out = {}
    builds = [(name, flags, {}) for name, flags in VARIANTS.items()]
    builds += [(name + "+ordinary_store", VARIANTS[name], {"tma_store": False}) for name in ORDINARY_STORE_VARIANTS]
    builds += [(name + "+trace", VARIANTS[name], {"trace": True}) for name in TRACE_VARIANTS]
    builds += [(name + "+split_tail", VARIANTS[name], {"split_tail": True}) for name in ("plain", "signal_static")]
    builds += [("plain+ordinary_store+split_tail", VARIANTS["plain"], {"split_tail": True, "tma_store": False})]
    builds += [("wait_static+split_tail", VARIANTS["wait_static"], {"split_tail": True})]
    builds += [("wait_static+parts", VARIANTS["wait_static"], {"wait_parts": 4})]
    builds += [("wait_signal_static+parts", VARIANTS["wait_signal_static"], {"wait_parts": 4})]
    chains = {  # name: (stages, first stage waits on another GPU, last signals one, queue), options
        "chain2": ((2, False, False, False), {}),
        "chain2+ordinary_store": ((2, False, False, False), {"tma_store": False}),
        "chain2+outer_queue": ((2, True, True, True), {}),
        "chain4": ((4, False, False, False), {}),
        "chain2+split_tail": ((2, False, False, False), {"split_tail": True}),
        "chain2+signal+split_tail": ((2, False, True, False), {"split_tail": True}),
    }
    for name, (flags, options) in chains.items():
        out[name] = _summary(compile_chain(*flags, **options))
    for name, flags, options in builds:
        out[name] = _summary(compile_variant(*flags, **options))
    return out


# The epilogues of the MLP blocks' GEMMs: the fields each one sets (the others are None)
_RMS = dict(row_sq="*fp32", SQ_PARTS=1, norm_cols="i32", norm_eps="fp32")  # a norm pass's one part
EPILOGUE_VARIANTS = {
    "gated_rms": _RMS | dict(ACTIVATION=silu, GATED=True),  # Llama gate/up
    "gated_rms_sums": _RMS | dict(SQ_PARTS=32, ACTIVATION=silu, GATED=True),  # a stack's next gate/up: 32 parts
    "bias_residual": dict(
        bias="*bf16", residual="*bf16", stride_res="i32", res_rows="i32", ACTIVATION=gelu
    ),  # a down GEMM
    "layer_norm_bias": dict(row_scale="*fp32", row_shift="*fp32", col_sum="*fp32", bias="*bf16", ACTIVATION=gelu),
    "residual_sums": dict(
        residual="*bf16", stride_res="i32", res_rows="i32", sq_out="*fp32", out_parts="i32"
    ),  # a stack's down
    "accumulate": dict(ACCUMULATE=True),  # a block's down GEMM: each tile added onto C by TMA
    # a GPT stack's: a LayerNorm from the stage before's partial sums; a down GEMM leaving them
    "layer_norm_sums": dict(
        _RMS, SQ_PARTS=32, row_sum="*fp32", part_cols="i32", col_sum="*fp32", bias="*bf16", ACTIVATION=gelu
    ),
    "bias_residual_sums": dict(
        bias="*bf16",
        residual="*bf16",
        stride_res="i32",
        res_rows="i32",
        sq_out="*fp32",
        out_parts="i32",
        sum_out="*fp32",
    ),  # fmt: skip
}


def _gated(variant: str | None) -> bool:
    return variant is not None and bool(EPILOGUE_VARIANTS[variant].get("GATED"))


def _epilogue_sig(variant: str | None, at, const: dict) -> Epilogue:
    """The epilogue bundle's signature for ``variant`` (a key of :data:`EPILOGUE_VARIANTS`; None:
    every field None) at argument index ``at``, its constants into ``const``."""
    fields = {} if variant is None else EPILOGUE_VARIANTS[variant]
    types = [fields.get(f, "constexpr") if f.islower() else "constexpr" for f in Epilogue._fields]
    at = at if isinstance(at, tuple) else (at,)
    for i, f in enumerate(Epilogue._fields):
        if f.isupper():
            const[(*at, i)] = fields.get(f)
        elif types[i] == "constexpr":
            const[(*at, i)] = None
    return Epilogue(*types)


def stack_chain(*epilogues: str | None):
    """A chain kernel over stages with these :data:`EPILOGUE_VARIANTS` (None: none), in ``nn.STACK_CONFIG``'s
    tiles (128 x 128 x 64, four pipeline stages)."""
    return compile_chain(len(epilogues), False, False, False, (128, 128, 64), num_stages=4, epilogues=epilogues)


def compile_epilogues() -> dict:
    """The fused epilogues of :class:`ctapipelining.nn.LlamaMLP`'s two GEMMs, in its
    configurations (gate/up: 128 x 256 tiles, 3 stages, stored half as wide; down with its
    residual: 128 x 128, 4 stages), the residual one with 128 x 256 tiles and 3 stages, and
    :class:`ctapipelining.nn.GPTMLP`'s first (LayerNorm, bias, GELU; 128 x 256, 3 stages), and a
    chain kernel over a :class:`ctapipelining.nn.LlamaStack`'s two blocks in ``nn.STACK_CONFIG``:
    their summaries (``smem`` against :data:`~.gemm.SMEM_LIMIT`)."""
    return {
        "gated_rms": _summary(compile_variant(False, False, False, epilogue="gated_rms", num_stages=3)),
        # the blocks' GEMMs as they run by default (EPILOGUE_CONFIG): the summing CTA of a split tail's tile
        # applies the epilogue too
        "gated_rms+split_tail": _summary(
            compile_variant(False, False, False, epilogue="gated_rms", num_stages=3, split_tail=True)
        ),
        "accumulate+split_tail": _summary(
            compile_variant(False, False, False, epilogue="accumulate", num_stages=3, split_tail=True)
        ),
        "bias_residual": _summary(
            compile_variant(False, False, False, (128, 128, 64), epilogue="bias_residual", num_stages=4)
        ),
        "accumulate": _summary(compile_variant(False, False, False, epilogue="accumulate", num_stages=3)),
        "bias_residual_3_stages": _summary(
            compile_variant(False, False, False, epilogue="bias_residual", num_stages=3)
        ),
        "layer_norm_bias": _summary(compile_variant(False, False, False, epilogue="layer_norm_bias", num_stages=3)),
        # a LlamaStack's and a GPTStack's two blocks on one GPU: one chain kernel, nn.STACK_CONFIG
        "stack_chain": _summary(stack_chain("gated_rms", "residual_sums", "gated_rms_sums", "residual_sums")),
        "gpt_stack_chain": _summary(
            stack_chain("layer_norm_bias", "bias_residual_sums", "layer_norm_sums", "bias_residual")
        ),
        # a chain whose last stage's epilogue holds a jit function (bias, GELU, residual)
        "chain_activation_last": _summary(stack_chain(None, "bias_residual")),
        # kernels of their own whose stages link to another GPU or rank: a down GEMM that waits in
        # parts for its input from the GPU before and loads its residual (a block split over two
        # GPUs), a rank's first gate/up GEMM whose norm reads its link's sums, and a rank's last
        # down GEMM that signals the next rank and leaves the sums there
        "residual_waits_in_parts": _summary(
            compile_variant(True, False, False, (128, 128, 64), epilogue="residual_sums", num_stages=4, wait_parts=8)
        ),
        "gated_rms_sums_waits": _summary(
            compile_variant(True, False, False, epilogue="gated_rms_sums", num_stages=3, wait_parts=8)
        ),
        "residual_sums_signals": _summary(
            compile_variant(False, True, False, (128, 128, 64), epilogue="residual_sums", num_stages=4)
        ),
    }


def compile_probe():
    """Compile both sides of :func:`ctapipelining.kernels.probe.pingpong_kernel` for sm_90."""
    from .probe import pingpong_kernel

    sig = dict(local_flag="*i32", remote_flag="*i32", out="*i64", rounds="i32", timeout_ns="i64")
    return [
        _summary(_compile(pingpong_kernel, dict(sig), dict(SERVE=serve), num_warps=1, num_stages=1))
        for serve in (True, False)
    ]


if __name__ == "__main__":
    print(json.dumps(report(), indent=1))
