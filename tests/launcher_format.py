"""Check, without a GPU, that :meth:`GemmLaunch.raw_args` and :meth:`ChainLaunch.raw_args` fit
the argument format of the launcher Triton builds for each kernel variant, each slot holding what
the kernel's parameter of that place names (sizes, strides, descriptors) (run by
``test_launcher.py`` in a process without the interpreter; prints ``ok`` per variant or
raises)."""

import dataclasses
import re

import torch
from triton.backends.nvidia.driver import make_launcher

from ctapipelining.chain import ChainLaunch, ChainStage
from ctapipelining.epilogue import Epilogue, gelu, silu
from ctapipelining.gemm import GemmLaunch, SignalHook, WaitHook
from ctapipelining.kernels.chain import chain_kernel
from ctapipelining.kernels.compile_check import compile_chain, compile_norm, compile_variant
from ctapipelining.kernels.epilogue import norm_rows
from ctapipelining.kernels.gemm import PIPELINE_CONFIG, gemm_kernel


def launcher_format(kernel) -> tuple[str, dict[int, str]]:
    """The argument format (``PyArg_ParseTuple``) of Triton's launcher for ``kernel``, after
    its 13 base arguments, as :class:`triton.backends.nvidia.driver.CudaLauncher` builds it,
    and the role of each object slot by its index among the flattened arguments: ``"ptr"`` (a
    device pointer: it must be an address) or ``"tma"`` (a tensor map); other object slots are
    constexprs."""
    src = kernel.src
    arg_idx = lambda x: (src.fn.arg_names.index(x),) if isinstance(x, str) else x  # noqa: E731
    constants = {arg_idx(k): v for k, v in src.constants.items()}
    c_src = make_launcher(constants, dict(src.signature), getattr(kernel.metadata, "tensordesc_meta", None))
    roles = {int(i): "ptr" for i in re.findall(r"getPointer\(_arg(\d+),", c_src)}
    roles |= {int(i): "tma" for i in re.findall(r"getTmaDesc\(_arg(\d+)\)", c_src)}
    return re.search(r'PyArg_ParseTuple\(args, "([^"]*)"', c_src).group(1)[13:], roles


def tokens(fmt: str) -> list:
    """``"iO(iL)O"`` -> ``["i", "O", ["i", "L"], "O"]``."""
    out, stack = [], []
    for ch in fmt:
        if ch == "(":
            stack.append(out)
            out = []
        elif ch == ")":
            inner, out = out, stack.pop()
            out.append(inner)
        else:
            out.append(ch)
    return out


class TensorMap:
    """What the fake ``tensor_map`` puts where a CUDA tensor map goes."""


def check(args, fmt, roles, where="", pos=None) -> None:
    """``args`` fit ``fmt`` (counts, tuples, integers) and each object slot holds what its role
    needs: an address for a pointer, a tensor map for a descriptor, never a tensor elsewhere."""
    pos = [0] if pos is None else pos  # index among the flattened arguments
    if len(args) != len(fmt):
        raise AssertionError(f"{where}: {len(args)} arguments for a format of {len(fmt)}: {fmt}")
    for i, (a, f) in enumerate(zip(args, fmt)):
        if isinstance(f, list):
            if not isinstance(a, tuple):
                raise AssertionError(f"{where}[{i}]: a tuple expected, got {a!r}")
            check(a, f, roles, f"{where}[{i}]", pos)
            continue
        role = roles.get(pos[0])
        pos[0] += 1
        if f in "ilLKI" and not (isinstance(a, int) and not isinstance(a, bool)):
            raise AssertionError(f"{where}[{i}]: an integer expected ({f}), got {a!r}")
        if role == "ptr" and not (isinstance(a, int) and not isinstance(a, bool)):
            raise AssertionError(f"{where}[{i}]: a device pointer's address expected, got {a!r}")
        if role == "tma" and not isinstance(a, TensorMap):
            raise AssertionError(f"{where}[{i}]: a tensor map expected, got {a!r}")
        if role is None and f == "O" and isinstance(a, (torch.Tensor, TensorMap)):
            raise AssertionError(f"{where}[{i}]: a constexpr slot holds {type(a).__name__}")


def by_name(args, names) -> dict:
    """The kernel's parameters ``names`` with the raw arguments each takes: a descriptor (a
    parameter named ``*_desc`` or one letter and a digit) its tensor map with the shape and
    strides after it (5 slots), or None (1); any other parameter 1 slot."""
    at, i = {}, 0
    for n in names:
        desc = n.endswith("_desc") or re.fullmatch(r"[abc]\d", n)
        width = 5 if desc and isinstance(args[i], TensorMap) else 1
        at[n], i = (args[i : i + width] if width > 1 else args[i]), i + width
    assert i == len(args), (i, len(args))
    return at


def i64(n):
    return torch.zeros(n, dtype=torch.int64)


def i32(n):
    return torch.zeros(n, dtype=torch.int32)


def main():
    M, N, K, ctas = 640, 8192, 8192, 132  # 160 tiles on 132 CTAs: a partial last round
    dev = torch.device("cpu")
    wait = WaitHook(i64(8), i32(160), i32(8), i64(160), i64(1), False, parts=4, part_cols=32, part_block=256)
    signal = SignalHook(i64(8), i32(161), i32(160), i32(8), i32(9), i32(8), i64(160), i64(1), 160, 32, 1, False)
    queue = dict(queue=True, parts=1, part_cols=1, part_block=1)
    hooks = dict(epoch=i64(1), err=i64(8))
    cfg = PIPELINE_CONFIG
    variants = [  # (compile_variant flags and options, GemmLaunch config and hooks, tma store)
        ((False, False, False), {}, cfg, {}, True),
        ((False, False, False), {"tma_store": False, "split_tail": True}, dataclasses.replace(cfg, split_tail=True),
         {}, False),
        ((True, True, False), {"wait_parts": 4, "trace": True}, cfg,
         dict(wait=wait, signal=signal, trace=i64(160 * 5), **hooks), True),
        ((True, True, True), {}, cfg,
         dict(wait=dataclasses.replace(wait, **queue), signal=dataclasses.replace(signal, queue=True), **hooks), True),
        ((False, True, False), {"split_tail": True, "tma_store": False}, dataclasses.replace(cfg, split_tail=True),
         dict(signal=signal, epoch=hooks["epoch"]), False),
    ]  # fmt: skip
    fake_map = lambda slot, t, block: [TensorMap(), *t.shape, *t.stride()]  # noqa: E731
    for flags, options, config, launch_hooks, tma_store in variants:
        fmt, roles = launcher_format(compile_variant(*flags, **options))
        fmt = tokens(fmt)
        launch = GemmLaunch(M, N, K, config, ctas, dev, **launch_hooks)
        assert (launch.tail is not None) == options.get("split_tail", False)
        a, b = torch.zeros(M, K, dtype=torch.bfloat16), torch.zeros(K, N, dtype=torch.bfloat16)
        c = torch.zeros(M, N + (0 if tma_store else 64), dtype=torch.bfloat16)[:, :N]
        args = launch.raw_args(fake_map, a, b, c)
        check(args, fmt, roles, str((flags, options)))
        at = by_name(args, gemm_kernel.arg_names)  # each slot holds what it names
        assert (at["M"], at["N"], at["k_tiles"]) == (M, N, K // config.block_k), at
        assert (at["c_rows"], at["stride_cm"]) == (M, c.stride(0)), at
        assert (at["c_desc"] is None) == (at["c_ptr"] is not None) == (not tma_store), at
        assert list(at["a_desc"][1:]) == [M, K, K, 1] and list(at["b_desc"][1:]) == [K, N, N, 1], at
        print("ok", flags, options)
    # fused epilogues: the residual is a call's own tensor, the gated output half as wide
    plain = dataclasses.replace(cfg, split_tail=False)
    a, b = torch.zeros(M, K, dtype=torch.bfloat16), torch.zeros(K, N, dtype=torch.bfloat16)
    for name, epi, n_out in (
        ("gated_rms", Epilogue(silu, gated=True, rms_eps=1e-5), N // 2),
        ("bias_residual", Epilogue(gelu, bias=torch.zeros(N, dtype=torch.bfloat16), residual=True), N),
        ("accumulate", Epilogue(residual=True), N),
    ):
        fmt, roles = launcher_format(compile_variant(False, False, False, epilogue=name))
        # bias_residual: the residual the epilogue loads; accumulate: the one added onto C by TMA
        launch = GemmLaunch(M, N, K, plain, ctas, dev, epilogue=epi, add_residual=name == "accumulate")
        c = torch.zeros(M, n_out, dtype=torch.bfloat16)
        residual = torch.zeros(M, n_out, dtype=torch.bfloat16) if epi.residual else None
        check(launch.raw_args(fake_map, a, b, c, residual), tokens(fmt), roles, name)
        print("ok", name)
    # the norm's statistics pass before a GEMM whose epilogue normalises (an RMSNorm's, a LayerNorm's)
    # (each also storing a copy of the rows: a block's residual)
    for epi in (Epilogue(rms_eps=1e-5), Epilogue(layer_norm_eps=1e-5, col_sum=torch.zeros(N))):
        stats = GemmLaunch(M, N, K, plain, ctas, dev, epilogue=epi).stats
        center = epi.layer_norm_eps is not None
        # the constants a GPU launch takes are those compiled here (one row a program)
        names = norm_rows.arg_names
        constants = compile_norm(center, False, K).src.constants.items()
        compiled = {names[i[0]]: v for i, v in constants if names[i[0]].isupper()}
        assert stats._constexprs(K) == compiled, (stats._constexprs(K), compiled)
        for copy in (None, torch.zeros(M, K + 8, dtype=a.dtype)[:, :K]):
            fmt, roles = launcher_format(compile_norm(center, copy is not None, K))
            args = stats.raw_args(a, copy)
            check(args, tokens(fmt), roles, f"norm pass {epi} copy={copy is not None}")
            at = {n: args[i] for i, n in enumerate(norm_rows.arg_names)}  # each slot holds what it names
            assert (at["rows"], at["cols"], at["stride"]) == (M, K, a.stride(0)), at
            assert at["copy_stride"] == (0 if copy is None else K + 8) and at["BLOCK_R"] == 1, at
            print("ok norm pass", "layer" if epi.layer_norm_eps is not None else "rms", "copy" * (copy is not None))
    # chain kernels: (compile_chain flags and options, stages, outer links by ring)
    inner_wait, inner_signal = dict(wait=wait, err=i64(8)), dict(signal=signal)
    outer_wait = dict(wait=dataclasses.replace(wait, **queue), err=i64(8))
    outer_signal = dict(signal=dataclasses.replace(signal, queue=True))
    chains = [
        ((2, False, False, False), {}, [dict(inner_signal), dict(inner_wait)], False),
        ((2, False, False, False), {"tma_store": False}, [dict(inner_signal), dict(inner_wait)], False),
        ((2, True, True, True), {}, [outer_wait | inner_signal, inner_wait | outer_signal], True),
        ((4, False, False, False), {}, [inner_signal, inner_wait | inner_signal, inner_wait | inner_signal,
                                        inner_wait], False),
        ((2, False, False, False), {"split_tail": True}, [dict(inner_signal), dict(inner_wait)], False),
    ]  # fmt: skip
    for flags, options, hooks, queue_links in chains:
        fmt, roles = launcher_format(compile_chain(*flags, **options))
        fmt = tokens(fmt)
        stages = [ChainStage(N, K, stage=i, **({"err": i64(8)} | h)) for i, h in enumerate(hooks)]
        chain_cfg = dataclasses.replace(cfg, split_tail=options.get("split_tail", False))
        launch = ChainLaunch(M, stages, chain_cfg, ctas, dev, ticket=i64(1), epoch=i64(1), queue=queue_links)
        assert (launch.tail is not None) == options.get("split_tail", False)  # 320 tiles on 132 CTAs: 56 left
        tma_store = options.get("tma_store", True)
        ops = []
        for i in range(len(stages)):
            a, b = torch.zeros(M, K, dtype=torch.bfloat16), torch.zeros(K, N, dtype=torch.bfloat16)
            last = i == len(stages) - 1
            c = torch.zeros(M, N + (0 if tma_store or not last else 64), dtype=torch.bfloat16)[:, :N]
            ops.append((a, b, c))
        args = launch.raw_args(fake_map, ops)
        check(args, fmt, roles, str((flags, options)))
        at = by_name(args, chain_kernel.arg_names)
        assert (at["M"], at["c_rows"], at["stride_cm"]) == (M, M, ops[-1][2].stride(0)), at
        assert [at[f"a{i}"] is None for i in range(4)] == [i >= len(stages) for i in range(4)], at
        print("ok chain", flags, options)


if __name__ == "__main__":
    main()
