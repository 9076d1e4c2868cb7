"""Host wrapper of the chain kernel (:mod:`ctapipelining.kernels.chain`): the stages that
share a GPU, run by one persistent kernel from one combined tile order.

A :class:`ChainLaunch` is bound once (at plan time) with each stage's shape, hooks and state
buffers; a call gives each stage's operands and launches. Like
:class:`~ctapipelining.gemm.GemmLaunch`, after the first launch of a specialisation it
launches through :class:`~ctapipelining.launcher.RawLaunch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import deps
from .epilogue import OFF, PLAIN, Epilogue
from .gemm import (
    NormStats,
    SignalHook,
    TailBuffers,
    WaitHook,
    _cdiv,
    check_wait,
    descriptor,
    launch_constexprs,
    residual_key,
    signal_bundle,
    sums_args,
    tail_bundle,
    tma_blocks,
    wait_bundle,
)
from .kernels.chain import MAX_STAGES, Stage, chain_kernel
from .kernels.gemm import GemmConfig
from .launcher import RawLaunch, addresses, launch_hooks, on_stream
from .operands import check_arch, interpreting


def chain_tail_split(M: int, shapes: list[tuple[int, int]], config: GemmConfig, num_ctas: int) -> deps.TailSplit | None:
    """The split tail of a chain kernel over stages of ``(K, N)`` ``shapes`` on ``M`` rows (None:
    none): with ``config.split_tail``, :func:`ctapipelining.deps.last_stage_tail` of the combined
    order (:meth:`ctapipelining.pipeline.Pipeline.sequential` runs the last stage with it)."""
    if not config.split_tail:
        return None
    tiles = [_cdiv(M, config.block_m) * _cdiv(n, config.block_n) for _, n in shapes]
    k_tiles = _cdiv(shapes[-1][0], config.block_k)
    return deps.last_stage_tail(tiles, num_ctas, k_tiles, 1 if interpreting() else deps.TAIL_MIN_SLICE_K)


@dataclass
class ChainStage:
    """One stage of a :class:`ChainLaunch`: ``[M, K] @ [K, N]``, its input link ``wait`` (a
    link inside the kernel: static; the first stage's may come from another GPU), its output
    link ``signal`` (the last stage's may go to another GPU; the others' feed the next stage
    here), its error word ``err`` (needed with ``wait``, and by the last stage), its per-tile stamps ``trace``, its
    index ``stage`` in the chain, its ``epilogue`` (:class:`~ctapipelining.epilogue.Epilogue`;
    with a residual, each call passes it as the stage's fourth operand), the partial sums of
    squares its RMSNorm reads (``norm_sums``, left by the stage before; None: a pass over its
    A before the launch) and those its epilogue leaves for the next stage's (``out_sums``)."""

    N: int
    K: int
    wait: WaitHook | None = None
    signal: SignalHook | None = None
    err: torch.Tensor | None = None
    trace: torch.Tensor | None = None
    stage: int = 0
    epilogue: Epilogue | None = None
    norm_sums: torch.Tensor | None = None
    out_sums: torch.Tensor | None = None


class ChainLaunch:
    """One launch of the chain kernel over ``stages`` (1 to :data:`MAX_STAGES`) on ``M`` rows,
    bound once: ``num_ctas`` persistent CTAs claim tiles from ``ticket`` (int64 [1], only
    growing: :attr:`claims_per_run` a run) in the combined order; ``epoch`` holds the runs before
    this one (the launch runs the next; the caller bumps it after the launch), whose count
    every stage's signals and waits use, and places the run's claims. ``queue``: the links to
    other GPUs (the first stage's wait, the last stage's signal) follow the workqueue policy."""

    def __init__(
        self,
        M: int,
        stages: list[ChainStage],
        config: GemmConfig,
        num_ctas: int,
        device: torch.device,
        *,
        ticket: torch.Tensor,
        epoch: torch.Tensor,
        queue: bool = False,
        timeout_ns: int = 1_000_000_000,
    ):
        check_arch(device)
        if not 1 <= len(stages) <= MAX_STAGES:
            raise ValueError(f"a chain kernel runs 1 to {MAX_STAGES} stages, got {len(stages)}")
        for i, st in enumerate(stages):
            prev = stages[i - 1] if i else None
            prev_cols = prev and (prev.N if prev.epilogue is None else prev.epilogue.out_cols(prev.N))
            if i and st.K != prev_cols:
                raise ValueError(f"stage {st.stage} has K={st.K} but the stage before it outputs {prev_cols} columns")
            if i and st.wait is None:
                raise ValueError(f"stage {st.stage} reads the stage before it in this kernel: it needs its wait")
            if i < len(stages) - 1 and st.signal is None:
                raise ValueError(f"stage {st.stage} feeds the stage after it in this kernel: it needs its signal")
            inner_wait = st.wait is not None and i > 0
            inner_signal = st.signal is not None and i < len(stages) - 1
            if inner_wait and st.wait.queue or inner_signal and st.signal.queue:
                raise ValueError("the links inside a chain kernel wait on counters (static), not on a ring")
            outer = (st.wait if i == 0 else None, st.signal if i == len(stages) - 1 else None)
            if any(h is not None and h.queue != queue for h in outer):
                raise ValueError(f"stage {st.stage}: its link to another GPU does not follow queue={queue}")
            check_wait(st.wait, st.err, st.K)
            if st.epilogue is not None:
                st.epilogue.check_tiles(st.N, config.block_n)
            if st.trace is not None and interpreting():
                raise ValueError("trace mode reads %globaltimer and needs a GPU (not the Triton interpreter)")
        self.M, self.stages, self.config, self.num_ctas, self.queue = M, stages, config, num_ctas, queue
        if not isinstance(num_ctas, int) or num_ctas < 1:
            raise ValueError(f"num_ctas must be an int >= 1, got {num_ctas!r}")
        for name, t in (("ticket", ticket), ("epoch", epoch)):
            if t.shape != (1,) or t.dtype != torch.int64 or t.device != device:
                raise ValueError(
                    f"the {name} must be an int64 tensor [1] on {device}, got {t.dtype} {tuple(t.shape)} on {t.device}"
                )
        if stages[-1].err is None:
            raise ValueError(
                "the last stage needs its error word (a chain kernel reports an inconsistent ticket there)"
            )
        self.ticket = ticket
        self.positions = sum(_cdiv(M, config.block_m) * _cdiv(st.N, config.block_n) for st in stages)
        self.split = chain_tail_split(M, [(st.K, st.N) for st in stages], config, num_ctas)
        if self.split is not None and len(stages) == 1 and stages[0].wait is not None and queue:
            self.split = None  # a ring's tiles come in readiness order: nothing to split at the end
        self.tail = None if self.split is None else TailBuffers.create(self.split, config, device)
        self.order = torch.from_numpy(self._order_codes(num_ctas)).to(device)
        tail = None if self.tail is None else tail_bundle(self.tail)
        claims = self.positions if self.split is None else self.positions - self.split.tiles + self.split.items
        # how far a run moves the ticket: every CTA claims one more than an even share
        self.claims_per_run = num_ctas * (_cdiv(claims, num_ctas) + 1)
        # each stage's epilogue: what it is, its norm's statistics (a pass over the first stage's
        # A; a later stage's come from the stage before) and where its rows' sums of squares go
        self.epilogues = [st.epilogue or (PLAIN if st.out_sums is not None else None) for st in stages]
        self.stats, self._epi_args = [], []
        for st, epi in zip(stages, self.epilogues):
            stats = None if epi is None else NormStats.create(epi, M, st.K, device, st.norm_sums)
            args = {} if stats is None else stats.args()
            if st.out_sums is not None:
                args |= sums_args(st.out_sums, M, _cdiv(st.N, config.block_n), None, "out_sums", "out")
            if stats is not None and stats.own and st is not stages[0]:
                raise ValueError(
                    f"stage {st.stage} normalises rows the stage before it writes in this kernel: it needs the "
                    "partial sums that stage leaves (norm_sums)"
                )
            self.stats.append(stats)
            self._epi_args.append(args)
        self.residual = [epi is not None and epi.residual for epi in self.epilogues]
        self._stage_args = [
            (
                st.N,
                _cdiv(st.K, config.block_k),
                wait_bundle(st.wait, config),
                signal_bundle(st.signal),
                st.err,
                st.trace,
                st.stage,
            )  # fmt: skip
            for st in stages
        ]
        bundle = self._stages_bundle([None] * len(stages))
        self._state = (ticket, self.order, epoch, timeout_ns)
        self._bundle, self._addresses = (bundle, tail), (addresses(bundle), addresses(tail))
        self._state_addresses = addresses(self._state)
        self._constexprs = launch_constexprs(config, queue)
        self._trailing = tuple(self._constexprs.values())
        self._blocks = [tma_blocks(config, epi is not None and epi.gated) for epi in self.epilogues]
        # (TMA store of the last stage, its row stride, dtype, residuals' strides) -> (kernel, RawLaunch)
        self._compiled = {}

    def _stages_bundle(self, residuals: list) -> tuple:
        """The stages' bundles (:class:`~ctapipelining.kernels.chain.Stage`), each epilogue with
        its residual of this call (``residuals[i]``: None where it has none)."""
        return tuple(
            Stage(*args, OFF if epi is None else epi.bundle(**epi_args, residual=res))
            for args, epi, epi_args, res in zip(self._stage_args, self.epilogues, self._epi_args, residuals)
        )

    def _order_codes(self, lag: int | None):
        """The combined order's codes (:func:`ctapipelining.deps.chain_order`) with ``lag``."""
        cfg = self.config
        num_ns = [_cdiv(st.N, cfg.block_n) for st in self.stages]
        ring_first = self.queue and self.stages[0].wait is not None
        return deps.chain_order(_cdiv(self.M, cfg.block_m), num_ns, cfg.group_m, lag, self.split, ring_first)

    def set_order(self, lag: int | None) -> None:
        """Rewrite the combined order in place: stages interleaved with ``lag`` positions (bound:
        one round of the grid), or stage after stage (``lag=None``, what the benchmarks set the
        interleaved order against). In place, so a launch or graph that points at it runs the
        new order; not while a launch is running."""
        self.order.copy_(torch.from_numpy(self._order_codes(lag)))

    def __call__(self, ops: list[tuple], stream: int | None = None, compile_only: bool = False):
        """Launch on ``stream`` (raw handle on the kernel's GPU, that of the first stage's weights;
        default its current stream)
        with ``ops[i] = (a, b, c)`` of stage ``i`` (``a`` ``[m, K]``, ``b`` ``[K, N]``, ``c``
        ``[m, N]``, already checked, ``m <= M``; only the last ``c`` may have padded rows, and
        only it may be a caller's tensor whose rows past ``m`` are not written). Returns
        Triton's compiled kernel. ``compile_only``: compile this specialisation (if it is not
        yet) and launch nothing."""
        c = ops[-1][2]  # on a peer GPU when the last stage writes across
        device = ops[0][1].device  # the kernel's GPU: where its first stage's weights are
        key, residuals = self._key(ops)
        tma_store, stride = key[:2]
        got = self._compiled.get(key)
        if compile_only and (got is not None or interpreting()):
            return got and got[0]
        if stream is None and not interpreting():
            stream = torch._C._cuda_getCurrentRawStream(device.index)
        if self.stats[0] is not None and not compile_only:  # the first stage's norm: a pass over its A first
            self.stats[0](ops[0][0], stream)
        if got is not None and got[1] is not None and not launch_hooks():
            kernel, raw = got
            raw(self.num_ctas, stream, *self.raw_args(raw.tensor_map, ops, residuals))
            return kernel
        descs = []
        for i in range(MAX_STAGES):
            if i < len(ops):
                a, b, ci = ops[i][:3]
                a_block, b_block, c_block = self._blocks[i]
                last_plain = i == len(ops) - 1 and not tma_store
                descs += [
                    descriptor(a, a_block),
                    descriptor(b, b_block),
                    None if last_plain else descriptor(ci, c_block),
                ]
            else:
                descs += [None, None, None]
        bundle = self._bundle if not any(self.residual) else (self._stages_bundle(residuals), self._bundle[1])
        args = (*descs, *bundle, self.M, None if tma_store else c, c.shape[0], stride, *self._state)
        if compile_only:
            kernel = chain_kernel.warmup(
                *args, grid=(self.num_ctas,), **self._constexprs, num_stages=self.config.num_stages,
                num_warps=self.config.num_warps,
            )  # fmt: skip
            self._compiled[key] = (kernel, RawLaunch.of(kernel))
            return kernel
        with on_stream(stream, device):
            kernel = chain_kernel[(self.num_ctas,)](
                *args, **self._constexprs, num_stages=self.config.num_stages, num_warps=self.config.num_warps
            )
        if not interpreting() and got is None:
            self._compiled[key] = (kernel, RawLaunch.of(kernel))
        return kernel

    def _key(self, ops: list[tuple]) -> tuple[tuple, list]:
        """The specialisation a launch on ``ops`` compiles (:attr:`_compiled`'s key: a TMA store of
        the last stage, its row stride, the dtype, the residuals'), and each stage's residual."""
        c = ops[-1][2]
        residuals = [op[3] if len(op) > 3 else None for op in ops]
        if [r is not None for r in residuals] != self.residual:
            raise ValueError("a residual goes with each stage whose epilogue adds one, and only there")
        stride = c.stride(0)
        return (stride == c.shape[1], stride, c.dtype, *(residual_key(r) for r in residuals)), residuals

    def bound(self, ops: list[tuple]) -> tuple | None:
        """``(compiled kernel, raw launch, its arguments)`` for a launch on ``ops`` (already
        checked) once their specialisation is compiled and launches raw, where nothing launches
        before the kernel (no norm pass of its own over the first stage's A); else None. The
        arguments hold addresses and tensor maps, no tensor."""
        if self.stats[0] is not None and self.stats[0].own:
            return None
        key, residuals = self._key(ops)
        got = self._compiled.get(key)
        if got is None or got[1] is None:
            return None
        return got[0], got[1], self.raw_args(got[1].tensor_map, ops, residuals)

    def raw_args(self, tensor_map, ops: list[tuple], residuals: list | None = None) -> tuple:
        """The kernel's arguments as the compiled launcher takes them (see
        :meth:`ctapipelining.gemm.GemmLaunch.raw_args`): the descriptors of the stages present,
        numbered in order, expanded by ``tensor_map``; the bound buffers as addresses (each
        epilogue with its ``residuals[i]`` of this call)."""
        c = ops[-1][2]
        tma_store = c.stride(0) == c.shape[1]
        args, slot = [], 0
        for i in range(MAX_STAGES):
            if i >= len(ops):
                args += (None, None, None)
                continue
            a, b, ci = ops[i][:3]
            a_block, b_block, c_block = self._blocks[i]
            args += tensor_map(slot, a, a_block)
            args += tensor_map(slot + 1, b, b_block)
            slot += 2
            if i == len(ops) - 1 and not tma_store:
                args.append(None)
            else:
                args += tensor_map(slot, ci, c_block)
                slot += 1
        bundle = self._addresses
        if any(self.residual):
            bundle = (addresses(self._stages_bundle(residuals)), bundle[1])
        return (
            *args, *bundle, self.M, None if tma_store else c.data_ptr(), c.shape[0], c.stride(0),
            *self._state_addresses, *self._trailing,
        )  # fmt: skip

    @property
    def raw(self) -> bool:
        """Whether every specialisation compiled so far launches through :class:`RawLaunch`."""
        return bool(self._compiled) and all(raw is not None for _, raw in self._compiled.values())
