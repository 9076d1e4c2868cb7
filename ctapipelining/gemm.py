"""Host wrapper of the persistent GEMM (:mod:`ctapipelining.kernels.gemm`).

:func:`matmul` is the plain GEMM (both hooks off). A pipeline stage is a :class:`GemmLaunch`
bound at plan time, with a :class:`WaitHook` (its own scoreboard) and/or a :class:`SignalHook`
(the next stage's); :func:`launch_gemm` builds and runs one in a call (tests). Inputs are
checked (:mod:`ctapipelining.operands`) before anything is launched. A chain's stages run one
after another as plain GEMMs in :mod:`ctapipelining.serial`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import threading
import weakref
from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import deps, fabric
from .epilogue import OFF, PLAIN, Epilogue
from .kernels.epilogue import NORM_GPU_ROWS, NORM_INTERPRET_ROWS, NORM_MAX_COLS, NORM_WARPS, norm_rows
from .kernels.gemm import (
    EPILOGUE_CONFIG,
    PLAIN_CONFIG,
    RESIDUAL_CONFIG,
    GemmConfig,
    Tail,
    fits_loaded_residual,
    gemm_kernel,
)
from .kernels.sync import Signal, Wait
from .launcher import RawLaunch, addresses, launch_hooks, on_stream
from .operands import (
    bindable,
    check_arch,
    check_operands,
    check_out,
    check_tensor,
    interpreting,
    overlaps,
    same_view,
    signature,
    untracked,
)
from .tables import GEMM_TABLE, pick_config, table_rows


def _cdiv(a: int, b: int) -> int:
    """``ceil(a / b)``; plain Python: ``triton.cdiv`` costs ~1.5 us a call on the host, and a
    launch computes several."""
    return -(-a // b)


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: a few CTAs, run one after another
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclass
class WaitHook:
    """This stage's scoreboard (in its own memory): wait on counters, or on the ring.

    ``parts > 1`` (``static``): each tile's input rows are counted in ``parts`` pieces of the
    producer's ``part_cols`` column-blocks of ``part_block`` columns (counter
    ``counter_of_tile[t] + q``; :func:`ctapipelining.deps.build_dependency`)."""

    counters: torch.Tensor
    counter_of_tile: torch.Tensor
    need: torch.Tensor
    slots: torch.Tensor
    head: torch.Tensor
    queue: bool
    parts: int = 1
    part_cols: int = 1
    part_block: int = 1


@dataclass
class SignalHook:
    """The next stage's scoreboard (in its memory) and this stage's CSR lists (in ours)."""

    counters: torch.Tensor
    signal_ptr: torch.Tensor
    signal_counters: torch.Tensor
    need: torch.Tensor
    push_ptr: torch.Tensor
    push_tiles: torch.Tensor
    slots: torch.Tensor
    tail: torch.Tensor
    consumer_tiles: int
    push_block: int
    max_signals: int
    queue: bool


def check_wait(wait: WaitHook | None, err: torch.Tensor | None, K: int) -> None:
    """Raise a clear error for a wait hook a launch with inner dimension ``K`` cannot take."""
    if wait is None:
        return
    if err is None:
        raise ValueError("a waiting launch needs its stage's error word")
    if wait.parts > 1 and wait.queue:
        raise ValueError("a workqueue consumer runs whole tiles in readiness order and cannot wait in parts")
    if wait.parts > 1 and (wait.part_cols < wait.parts or wait.part_cols * wait.part_block < K):
        raise ValueError(
            f"{wait.parts} parts of {wait.part_cols} producer column-blocks of {wait.part_block} do not cover K={K}"
        )


def wait_bundle(w: WaitHook | None, config: GemmConfig) -> Wait | None:
    """The kernel's :class:`~ctapipelining.kernels.sync.Wait` bundle of ``w`` (None: off)."""
    if w is None:
        return None
    return Wait(
        w.counters, w.counter_of_tile, w.need, w.slots, w.head, w.part_cols, w.part_block,
        tl.constexpr(w.parts), tl.constexpr(config.num_stages if w.parts > 1 else 0),
    )  # fmt: skip


def signal_bundle(sg: SignalHook | None) -> Signal | None:
    """The kernel's :class:`~ctapipelining.kernels.sync.Signal` bundle of ``sg`` (None: off)."""
    if sg is None:
        return None
    return Signal(
        sg.counters, sg.signal_ptr, sg.signal_counters, sg.need, sg.push_ptr, sg.push_tiles, sg.slots,
        sg.tail, sg.consumer_tiles, tl.constexpr(sg.push_block), tl.constexpr(sg.max_signals),
    )  # fmt: skip


@dataclass
class TailBuffers:
    """A split tail's state (:class:`ctapipelining.deps.TailSplit`), on the GEMM's device:
    ``workspace`` fp32 ``[tiles * splits, BLOCK_M * BLOCK_N]`` partial tiles and ``counters``
    int32 ``[tiles]`` arrivals, zero between launches (the last slice of a tile rearms its
    counter; an owner zeroes them after a launch that timed out). ``shared``: the stream's
    buffers these are views of (:meth:`on_stream`), kept alive here."""

    split: deps.TailSplit
    workspace: torch.Tensor
    counters: torch.Tensor
    shared: _StreamTail | None = field(default=None, repr=False)

    @classmethod
    def create(cls, split: deps.TailSplit, config: GemmConfig, device: torch.device) -> TailBuffers:
        ws = torch.empty(split.items, config.block_m * config.block_n, dtype=torch.float32, device=device)
        return cls(split, ws, torch.zeros(split.tiles, dtype=torch.int32, device=device))

    @classmethod
    def on_stream(cls, split: deps.TailSplit, config: GemmConfig, device: torch.device, stream: int) -> TailBuffers:
        """Views of buffers that every launch built by this call on ``stream`` of ``device``
        shares: launches on one stream run one after another, and each one's last slices leave
        its counters at zero for the next (launches without waits: they never time out). The
        buffers grow to the largest tail asked for; launches bound before keep the smaller ones
        they view. Held weakly here: they go with the last launch that views them."""
        key = (device, stream)
        size = split.items * config.block_m * config.block_n
        held = _STREAM_TAILS.get(key)
        if held is None or held.workspace.numel() < size or held.counters.numel() < split.tiles:
            old = (0, 0) if held is None else (held.workspace.numel(), held.counters.numel())
            held = _StreamTail(
                torch.empty(max(size, old[0]), dtype=torch.float32, device=device),
                torch.zeros(max(split.tiles, old[1]), dtype=torch.int32, device=device),
            )
            _STREAM_TAILS[key] = held
        ws = held.workspace[:size].view(split.items, config.block_m * config.block_n)
        return cls(split, ws, held.counters[: split.tiles], held)


@dataclass(eq=False, repr=False)
class _StreamTail:
    """The split-tail buffers the plain launches on one stream share (:meth:`TailBuffers.on_stream`)."""

    workspace: torch.Tensor  # fp32, flat
    counters: torch.Tensor  # int32, zero between launches


_STREAM_TAILS: weakref.WeakValueDictionary[tuple, _StreamTail] = weakref.WeakValueDictionary()


def tail_bundle(tail: TailBuffers) -> Tail:
    """The kernel's :class:`~ctapipelining.kernels.gemm.Tail` bundle of ``tail``."""
    return Tail(tail.workspace, tail.counters, tail.split.first_pos, tail.split.splits)


@functools.cache
def config_table(name: str = GEMM_TABLE) -> tuple[tuple[int, GemmConfig], ...]:
    """A measured configuration table (:mod:`ctapipelining.tables`), ``(rows, config)`` by
    increasing rows: by default the plain GEMM's (the fastest of ``benchmarks/configs.py``'s
    candidates at each row count, X[M, 8192] @ [8192, 8192] bf16 on one H200; each row names its
    GPU), or ``name``'s (a
    pipeline's, :data:`~ctapipelining.tables.PIPELINE_TABLE`)."""
    return tuple((rows, GemmConfig(**fields)) for rows, fields in table_rows(name))


def plain_config(M: int) -> GemmConfig:
    """The plain GEMM's configuration for ``M`` rows (what :func:`matmul` runs without one): the
    table's row for the smallest row count ``>= M``, the last row's beyond it. Few rows take
    narrow tiles (64 x 128 up to 128 rows: 128 CTAs busy where 128 x 256 tiles keep 32, twice as
    fast; then 64 x 256 up to 384, but 128 x 128 on a 6-stage load pipeline at 193-256);
    from 385 rows on, 128 x 256 tiles, with a split tail or without
    (whichever measured faster at that row count: they differ by noise there). Measured at
    N = K = 8192 and used for every width: the choice follows the tiles a row count leaves, most
    of all. Under the interpreter, always ``PLAIN_CONFIG`` (its sizes are small)."""
    return PLAIN_CONFIG if interpreting() else pick_config(config_table(), M)


def tail_split(M: int, N: int, K: int, config: GemmConfig, num_ctas: int):
    """The :class:`~ctapipelining.deps.TailSplit` a launch on ``num_ctas`` CTAs uses (None: no
    split): the partial last round after full ones with ``config.split_tail``, a lone one (fewer
    tiles than CTAs) with ``config.split_k`` (a ``workqueue`` consumer can run neither: its order
    is dynamic; :meth:`ctapipelining.pipeline.Pipeline.stage_config` turns them off there). Each
    slice has at least :data:`~ctapipelining.deps.TAIL_MIN_SLICE_K` K-steps; under the
    interpreter, whose sizes are small, any number."""
    tiles = _cdiv(M, config.block_m) * _cdiv(N, config.block_n)
    if not (config.split_k if tiles < num_ctas else config.split_tail):
        return None
    min_k = 1 if interpreting() else deps.TAIL_MIN_SLICE_K
    return deps.split_tail(tiles, num_ctas, _cdiv(K, config.block_k), min_k)


def residual_key(residual: torch.Tensor | None):
    """What a compiled kernel is specialised on in a residual: Triton compiles its row stride and
    rows (integers inside the epilogue's bundle) as constants when they equal 1, and assumes 16-byte
    multiples when they divide by 16; a kernel compiled for one is not reused for the other."""
    if residual is None:
        return None
    return tuple((n, n == 1, n % 16 == 0) if i == 0 else (n == 1, n % 16 == 0)
                 for i, n in enumerate((residual.stride(0), residual.shape[0])))  # fmt: skip


def check_sums(sums: torch.Tensor, rows: int, parts: int, device: torch.device | None, name: str) -> torch.Tensor:
    """``sums`` must be a contiguous fp32 ``[>= rows, parts]`` tensor on ``device`` (None: any; a
    producer writes them into its consumer's GPU): rows' partial sums of squares
    (:class:`~ctapipelining.kernels.epilogue.Epilogue`'s ``row_sq``)."""
    if not (
        isinstance(sums, torch.Tensor) and sums.dtype == torch.float32 and sums.dim() == 2 and sums.is_contiguous()
        and sums.shape[0] >= rows and sums.shape[1] == parts and (device is None or sums.device == device)
    ):  # fmt: skip
        raise ValueError(
            f"{name} must be a contiguous float32 [{rows}, {parts}] tensor on {device}, got "
            f"{getattr(sums, 'dtype', type(sums).__name__)} {tuple(getattr(sums, 'shape', ()))}"
        )
    return sums


def sums_args(sums, rows: int, parts: int, device: torch.device | None, name: str, prefix: str) -> dict:
    """Rows' partial sums as epilogue-bundle arguments: ``sums`` is the sums of squares (an
    RMSNorm's) or a pair ``(sums of squares, sums)`` (a LayerNorm's), each checked
    (:func:`check_sums`); ``prefix``: ``"row"`` for what a norm reads, ``"out"`` for what an
    epilogue stores."""
    if isinstance(sums, tuple) and len(sums) != 2:
        raise ValueError(f"{name}: a LayerNorm's partial sums are a pair (sums of squares, sums), got {len(sums)}")
    sq, total = sums if isinstance(sums, tuple) else (sums, None)
    if isinstance(sums, tuple) and total is None:
        raise ValueError(f"{name}: a LayerNorm's partial sums need the sums beside the sums of squares")
    keys = ("row_sq", "row_sum") if prefix == "row" else ("sq_out", "sum_out")
    out = {keys[0]: check_sums(sq, rows, parts, device, name)}
    if total is not None:
        out[keys[1]] = check_sums(total, rows, parts, device, name)
    return out


@dataclass(eq=False)
class NormStats:
    """A norm epilogue's row statistics for a GEMM on ``[M, K]`` rows. ``own``: a pass over A
    before each launch fills them (an RMSNorm's sums of squares, one part; a LayerNorm's scale
    and shift); else the stage that wrote A leaves its rows' partial sums of squares ``row_sq``
    (and, for a LayerNorm, sums ``row_sum``) ``[M, parts]``."""

    epilogue: Epilogue
    K: int
    row_sq: torch.Tensor | None = None
    row_sum: torch.Tensor | None = None
    row_scale: torch.Tensor | None = None
    row_shift: torch.Tensor | None = None
    own: bool = True
    _compiled: dict = field(default_factory=dict, repr=False)  # specialisation -> the pass's RawLaunch

    @classmethod
    def create(cls, epilogue: Epilogue, M: int, K: int, device: torch.device, sums=None) -> NormStats | None:
        """The statistics ``epilogue`` needs (None: no norm); ``sums``: the partial sums a
        producer leaves, the sums of squares for an RMSNorm, ``(sums of squares, sums)`` for a
        LayerNorm."""
        if epilogue.norm_eps is None:
            if sums is not None:
                raise ValueError("norm_sums feed a norm epilogue (rms_eps or layer_norm_eps), and this one has none")
            return None
        if sums is not None:
            layer = epilogue.layer_norm_eps is not None
            if layer != isinstance(sums, tuple):
                what = "(sums of squares, sums)" if layer else "the sums of squares alone"
                raise ValueError(f"norm_sums of a {'LayerNorm' if layer else 'RMSNorm'} are {what}")
            parts = (sums[0] if layer else sums).shape[1]
            return cls(epilogue, K, **sums_args(sums, M, parts, device, "norm_sums", "row"), own=False)
        f32 = dict(dtype=torch.float32, device=device)
        if epilogue.rms_eps is not None:  # zeros: rows past a call's (a bucketed plan) keep a finite scale
            return cls(epilogue, K, row_sq=torch.zeros(M, 1, **f32))
        return cls(epilogue, K, row_scale=torch.zeros(M, **f32), row_shift=torch.zeros(M, **f32))

    def args(self) -> dict:
        """The epilogue bundle's statistics (:meth:`~ctapipelining.epilogue.Epilogue.bundle`). A
        LayerNorm's parts are its producer's output tiles: a power of two wide (all but the last),
        so ``K`` and their count give the width."""
        part_cols = 0 if self.row_sum is None else triton.next_power_of_2(_cdiv(self.K, self.row_sum.shape[1]))
        return dict(
            row_sq=self.row_sq, row_sum=self.row_sum, part_cols=part_cols, norm_cols=self.K,
            row_scale=self.row_scale, row_shift=self.row_shift,
        )  # fmt: skip

    def __call__(self, a: torch.Tensor, stream: int | None, copy: torch.Tensor | None = None) -> tuple | None:
        """The pass over ``a``'s rows (:func:`~ctapipelining.kernels.epilogue.norm_rows`,
        :meth:`_rows_per_program` rows a program) on ``stream``, where the statistics are this
        launch's own; ``copy`` (checked by the caller): the rows are also stored there. Returns
        what it launched as ``(RawLaunch, grid, arguments)`` triples (none: no pass), for a
        caller to launch again on the same operands, or None where it went through Triton's
        path."""
        if not self.own:
            if copy is not None:
                raise ValueError("a copy of the rows is made by a norm's own pass; a producer left these statistics")
            return ()
        rows, cols = a.shape
        held = self._statistics()[0].shape[0]
        if rows > held:
            raise ValueError(f"a has {rows} rows; this launch's row statistics hold {held}")
        if rows == 0:
            return ()
        # what Triton specialises the compiled pass on (rows is not specialised; BLOCK_R is fixed per
        # process: one GPU launch's rows a program, or the interpreter's, which compiles nothing)
        key = (a.dtype, a.data_ptr() % 16 == 0, cols, a.stride(0)) + (
            () if copy is None else (copy.dtype, copy.data_ptr() % 16 == 0, copy.stride(0))
        )
        raw = self._compiled.get(key)
        if raw is not None and not launch_hooks():
            if stream is None:
                stream = torch._C._cuda_getCurrentRawStream(a.device.index)
            grid, args = _cdiv(rows, self._rows_per_program()), self.raw_args(a, copy)
            raw(grid, stream, *args)
            return ((raw, grid, args),)
        scale, shift = self._statistics()
        with on_stream(stream, a.device):
            kernel = norm_rows[(_cdiv(rows, self._rows_per_program()),)](
                a, scale, shift, copy, rows, cols, a.stride(0), 0 if copy is None else copy.stride(0),
                self.epilogue.norm_eps, **self._constexprs(cols), num_warps=NORM_WARPS,
            )  # fmt: skip
        if not interpreting():  # later launches of this specialisation: raw (None: Triton's path)
            self._compiled[key] = RawLaunch.of(kernel)
        return None

    def _statistics(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the pass stores: an RMSNorm's sums of squares (and again, unused, as the shift),
        or a LayerNorm's scale and shift."""
        scale = self.row_sq if self.row_sq is not None else self.row_scale
        return scale, self.row_shift if self.row_shift is not None else scale

    @staticmethod
    def _rows_per_program() -> int:
        """One row a program on a GPU (every row's load in flight); many under the interpreter,
        which runs the programs one after another."""
        return NORM_INTERPRET_ROWS if interpreting() else NORM_GPU_ROWS

    def _constexprs(self, cols: int) -> dict:
        return dict(
            CENTER=self.row_shift is not None, BLOCK_R=self._rows_per_program(),
            BLOCK_C=min(triton.next_power_of_2(cols), NORM_MAX_COLS),
        )  # fmt: skip

    def raw_args(self, a: torch.Tensor, copy: torch.Tensor | None = None) -> tuple:
        """The pass's arguments on ``a`` (and ``copy``) as its compiled launcher takes them:
        pointers as addresses, then the constexprs."""
        scale, shift = self._statistics()
        return (
            a.data_ptr(), scale.data_ptr(), shift.data_ptr(), None if copy is None else copy.data_ptr(), *a.shape,
            a.stride(0), 0 if copy is None else copy.stride(0), self.epilogue.norm_eps,
            *self._constexprs(a.shape[1]).values(),
        )  # fmt: skip


def launch_constexprs(config: GemmConfig, queue: bool, num_ctas: int | None = None) -> dict:
    """A kernel's trailing ``tl.constexpr`` arguments, in signature order (``NUM_CTAS``: the GEMM
    kernel's; a chain kernel counts its grid itself)."""
    out = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m)
    if num_ctas is not None:
        out["NUM_CTAS"] = num_ctas
    return out | dict(QUEUE=queue, INTERPRET=interpreting())


def tma_blocks(config: GemmConfig, gated: bool = False) -> tuple[list[int], list[int], list[int]]:
    """The TMA block shapes of A, B and C for ``config``'s tiles (``gated``: C's tile is half
    as wide, :class:`~ctapipelining.epilogue.Epilogue`)."""
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    return [bm, bk], [bk, bn], [bm, bn // 2 if gated else bn]


def descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A TMA descriptor of ``t`` (already checked: 2-D, rows 16-byte aligned, contiguous last
    dimension): Triton's :class:`TensorDescriptor` without its own checks, which cost more host
    time than the launch."""
    d = object.__new__(TensorDescriptor)
    d.base, d.shape, d.strides, d.block_shape, d.padding = t, t.shape, t.stride(), block, "zero"
    return d


class GemmLaunch:
    """One launch of the GEMM kernel, bound once (at plan time): its shape, configuration,
    grid, hooks and state buffers, as the kernel's argument bundles. A call gives the operands
    and launches it.

    After its first launch (through Triton's ``kernel[grid](...)``, which compiles and
    specialises), it launches through :class:`~ctapipelining.launcher.RawLaunch`: the plan's
    buffers as addresses, tensor maps encoded once per tensor. The compiled kernel is
    specialised on the integers, the element type and the pointers' 16-byte alignment, so it
    is reused only for the same row stride of ``c``, store kind and dtype; plan-held buffers
    never move, and callers' tensors are checked for 16-byte alignment. Under the interpreter
    every launch goes through Triton's path. A call launched raw is remembered by its operands'
    signatures (the :data:`MAX_CALLS` most recently used): a later call with the same skips its
    checks and launches the arguments built then.

    ``epoch`` (int64 [1], with a hook): the stage's runs before this launch, which runs the
    next; the caller bumps it after the launch (:mod:`ctapipelining.kernels.sync`).
    ``split``: the split tail to run instead of the one the configuration and grid give (a
    chain kernel's last stage run alone: :meth:`ctapipelining.pipeline.Pipeline.sequential`).
    ``stream``: the one CUDA stream it may run on (raw handle; its buffers are that stream's:
    :meth:`TailBuffers.on_stream`); None: any.
    """

    def __init__(
        self,
        M: int,
        N: int,
        K: int,
        config: GemmConfig,
        num_ctas: int,
        device: torch.device,
        *,
        wait: WaitHook | None = None,
        signal: SignalHook | None = None,
        epoch: torch.Tensor | None = None,
        err: torch.Tensor | None = None,
        trace: torch.Tensor | None = None,
        tail: TailBuffers | None = None,
        split: deps.TailSplit | None = None,
        epilogue: Epilogue | None = None,
        norm_sums: torch.Tensor | None = None,
        out_sums: torch.Tensor | None = None,
        add_residual: bool = False,
        stage: int = 0,
        timeout_ns: int = 1_000_000_000,
        stream: int | None = None,
    ):
        check_arch(device)
        cfg = config
        if epilogue is None and out_sums is not None:
            epilogue = PLAIN  # only the stored rows' sums of squares
        if epilogue is not None:
            epilogue.check_tiles(N, cfg.block_n)
        if trace is not None and interpreting():
            raise ValueError("trace mode reads %globaltimer and needs a GPU (not the Triton interpreter)")
        if wait is not None and signal is not None and wait.queue != signal.queue:
            raise ValueError("a stage's input and output links must use the same policy")
        if (wait is not None or signal is not None) and epoch is None:
            raise ValueError("a launch with a hook needs its stage's epoch")
        check_wait(wait, err, K)
        if split is None:
            split = tail_split(M, N, K, cfg, num_ctas)
        else:
            split.check(_cdiv(M, cfg.block_m) * _cdiv(N, cfg.block_n), num_ctas, _cdiv(K, cfg.block_k))
        if split is not None and wait is not None and wait.queue:
            raise ValueError("a workqueue consumer runs tiles in readiness order and cannot split its tail")
        if split is not None and tail is None:
            tail = TailBuffers.create(split, cfg, device)
        elif split is not None and tail.split != split:
            raise ValueError(f"tail buffers are for {tail.split}, this launch splits {split}")
        elif split is not None and not (
            tail.workspace.shape == (split.items, cfg.block_m * cfg.block_n) and tail.workspace.dtype == torch.float32
            and tail.counters.shape == (split.tiles,) and tail.counters.dtype == torch.int32
        ):  # fmt: skip
            raise ValueError(f"tail buffers of {split} must be fp32 [{split.items}, {cfg.block_m * cfg.block_n}] "
                             f"and int32 [{split.tiles}]")  # fmt: skip
        self.M, self.N, self.K, self.config, self.num_ctas, self.tail = M, N, K, cfg, num_ctas, tail
        self.stream = stream
        self.epilogue = epilogue
        # add_residual: C starts as a copy of the residual and each tile is added onto C (TMA
        # reduce-add), so no residual tile takes registers or shared memory (a call whose C has
        # padded rows, stored without TMA, loads it instead); rounds differently from loading it
        if add_residual and not (epilogue is not None and epilogue.residual and wait is None and signal is None
                                 and out_sums is None and not interpreting()):  # fmt: skip
            raise ValueError("add_residual needs a plain GEMM on the GPU whose epilogue adds a residual")
        self.accumulate = add_residual
        # a norm's row statistics: a pass over A before each launch (plan-held: the kernel reads
        # them), unless a producer's epilogue leaves them (``norm_sums``)
        self.stats = None if epilogue is None else NormStats.create(epilogue, M, K, device, norm_sums)
        self._epi_args = {} if self.stats is None else self.stats.args()
        if out_sums is not None:
            self._epi_args |= sums_args(out_sums, M, _cdiv(N, cfg.block_n), None, "out_sums", "out")
        self.queue = (wait.queue if wait is not None else signal.queue) if wait or signal else False
        bundles = (
            wait_bundle(wait, cfg),
            signal_bundle(signal),
            None if split is None else tail_bundle(tail),
            # a call binds its residual
            OFF if epilogue is None else epilogue.bundle(**self._epi_args),
            epoch if wait is not None or signal is not None else None,
            err if wait is not None else None,
            trace,
            stage,
            timeout_ns,
        )  # fmt: skip
        self._sizes = (M, N, _cdiv(K, cfg.block_k))
        self._bundles = bundles
        self._addresses = tuple(addresses(b) for b in bundles)  # plan-held: they never move
        self._constexprs = launch_constexprs(cfg, self.queue, num_ctas)
        self._trailing = tuple(self._constexprs.values())  # the launcher takes them after the arguments
        self._blocks = tma_blocks(cfg, gated=epilogue is not None and epilogue.gated)
        self._compiled = {}  # (TMA store, row stride of c, dtype, residual's) -> (compiled kernel, its RawLaunch)
        # a call launched raw (:meth:`_call_key`) -> what it launched (kernel, RawLaunch, its
        # arguments, the norm pass's raw launches, whether C was first copied from the residual):
        # the arguments are a function of the key alone (tensor maps of one address, shape and
        # strides are the same), so a later call with that key skips to its launches
        self._calls: OrderedDict[tuple, tuple] = OrderedDict()
        self.lock = threading.Lock()  # a call's norm pass, residual copy and kernel, queued together

    @staticmethod
    def _key(a: torch.Tensor, c: torch.Tensor, residual: torch.Tensor | None) -> tuple:
        """The specialisation a call compiles (:attr:`_compiled`'s key): a TMA store (rows not
        padded), ``c``'s row stride, the dtype, the residual's (:func:`residual_key`)."""
        stride = c.stride(0)
        return stride == c.shape[1], stride, a.dtype, residual_key(residual)

    def _adds(self, c: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """Whether this call adds its tiles onto ``c`` holding the residual (:attr:`accumulate`, a
        TMA store into ``c`` on the residual's GPU), rather than loading the residual in the epilogue."""
        return self.accumulate and c.stride(0) == c.shape[1] and c.device == residual.device

    def _with_residual(self, bundles: tuple, residual: torch.Tensor | None, raw: bool, adds: bool) -> tuple:
        """``bundles`` (or their addresses, ``raw``) with this call's residual in the epilogue:
        loaded by the epilogue, or (``adds``) already in C."""
        if self.epilogue is None or not self.epilogue.residual:
            return bundles
        if adds:
            epi = self.epilogue.bundle(**self._epi_args, accumulate=True)
        else:
            epi = self.epilogue.bundle(**self._epi_args, residual=residual)
        return (*bundles[:3], addresses(epi) if raw else epi, *bundles[4:])

    @staticmethod
    def _call_key(a, b, c, residual, a_copy) -> tuple:
        """What a call's raw arguments (and its copy of the residual into ``c``, and its norm
        pass's arguments) are a function of, besides what the launch binds once: the operands'
        signatures (:func:`~ctapipelining.operands.signature`); :attr:`_calls`' key."""
        extra = tuple(None if t is None else signature(t) for t in (residual, a_copy))
        return (signature(a), signature(b), signature(c), *extra)

    def __call__(
        self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, stream: int | None = None,
        residual: torch.Tensor | None = None, compile_only: bool = False, a_copy: torch.Tensor | None = None,
    ):  # fmt: skip
        """Launch on ``stream`` (a raw CUDA stream handle on the current device; default the
        current stream of ``a``'s device): ``c = a @ b`` with this launch's hooks (operands already checked:
        ``a`` ``[m, K]``, ``b`` ``[K, N]``, ``c`` ``[m, N]`` row-major, rows may be padded;
        ``c`` may live on a peer GPU). ``m <= M``: the launch's tile grid covers ``M`` rows (a
        plan for a bucket of row counts); rows past ``m`` read as zeros and are not written.
        Returns Triton's compiled kernel (PTX, register and spill counts for inspection).
        ``residual``: what an epilogue with a residual adds (``c``'s shape, already checked; ``c``
        itself: ``c`` holds it already). ``a_copy`` (``a``'s shape, checked): the norm's pass over
        ``a`` also stores ``a`` there. ``compile_only``: compile this specialisation (if it is not
        yet) and launch nothing. A call queues its norm pass, its copy of the residual and its kernel
        under the launch's lock, so calls from threads that share the launch (and its stream) do
        not interleave them."""
        with self.lock:
            return self._call(a, b, c, stream, residual, compile_only, a_copy)

    def _call(self, a, b, c, stream, residual, compile_only, a_copy):
        if stream is None and a.is_cuda:
            stream = torch._C._cuda_getCurrentRawStream(a.device.index)
        if self.stream is not None and stream != self.stream:
            raise ValueError(f"this launch's buffers are CUDA stream {self.stream}'s; called on {stream}")
        call = None if compile_only or not a.is_cuda else self._call_key(a, b, c, residual, a_copy)
        hit = None if call is None else self._calls.get(call)
        if hit is not None and not launch_hooks():  # checked and launched raw before: its arguments again
            try:
                self._calls.move_to_end(call)
            except KeyError:  # another thread's call dropped it meanwhile
                pass
            kernel, raw, args, norm, copy = hit
            for pass_raw, grid, pass_args in norm:
                pass_raw(grid, stream, *pass_args)
            if copy:
                with on_stream(stream, a.device):
                    untracked(c).copy_(untracked(residual))
            raw(self.num_ctas, stream, *args)
            return kernel
        if (residual is not None) != (self.epilogue is not None and self.epilogue.residual):
            raise ValueError("a residual goes with an epilogue that adds one, and only there")
        if a_copy is not None and (self.stats is None or not self.stats.own):
            raise ValueError("a_copy is made by the norm's own pass over a: an epilogue with rms_eps or layer_norm_eps")
        adds = self._adds(c, residual)
        if adds and (residual.shape != c.shape or residual.dtype != c.dtype):
            raise ValueError(f"the residual must be C's shape and dtype, got {tuple(residual.shape)} {residual.dtype}")
        key = self._key(a, c, residual)
        tma_store = key[0]
        got = self._compiled.get(key)
        if compile_only and (got is not None or interpreting()):
            return got and got[0]
        norm = ()
        if self.stats is not None and not compile_only:  # the norm's row statistics first, on the same stream
            norm = self.stats(a, stream, a_copy)
        copy = adds and not compile_only and not same_view(residual, c)
        if copy:  # C starts as the residual, on the same stream
            with on_stream(stream, a.device):
                untracked(c).copy_(untracked(residual))
        if got is not None and got[1] is not None and not launch_hooks():
            kernel, raw = got
            args = self.raw_args(raw.tensor_map, a, b, c, residual)
            raw(self.num_ctas, stream, *args)
            if norm is not None:  # every launch of the call raw: keep its arguments
                self._calls[call] = (kernel, raw, args, norm, copy)
                if len(self._calls) > MAX_CALLS:
                    self._calls.popitem(last=False)  # the least recently used
            return kernel
        # the first launch of this specialisation (Triton compiles it), or a profiler's launch hooks
        # (Triton's path calls them): kernel[grid]
        a_block, b_block, c_block = self._blocks
        args = (
            descriptor(a, a_block), descriptor(b, b_block), descriptor(c, c_block) if tma_store else None,
            None if tma_store else c, *self._sizes, c.shape[0], c.stride(0),
            *self._with_residual(self._bundles, residual, False, adds),
        )  # fmt: skip
        if got is not None and got[1] is None and not launch_hooks():
            kernel = got[0]  # a launcher RawLaunch does not know: Triton's compiled launcher, no hooks
            kernel.run(
                self.num_ctas, 1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None,
                *args, *self._trailing,
            )  # fmt: skip
            return kernel
        cfg = self.config
        if compile_only:
            kernel = gemm_kernel.warmup(
                *args, grid=(self.num_ctas,), **self._constexprs, num_stages=cfg.num_stages, num_warps=cfg.num_warps
            )
            self._compiled[key] = (kernel, RawLaunch.of(kernel))
            return kernel
        with on_stream(stream, a.device):
            kernel = gemm_kernel[(self.num_ctas,)](
                *args, **self._constexprs, num_stages=cfg.num_stages, num_warps=cfg.num_warps
            )
        if not interpreting() and got is None:
            self._compiled[key] = (kernel, RawLaunch.of(kernel))
        return kernel

    def steps(self, a, b, c, residual=None, a_copy=None) -> tuple | None:
        """What a call on these operands launched raw, in order (its norm pass, then its kernel),
        as ``(RawLaunch, grid, arguments)`` steps for :meth:`relaunch`; None where no such call
        is remembered (:attr:`_calls`) or where it also copied the residual into ``c``."""
        hit = self._calls.get(self._call_key(a, b, c, residual, a_copy))
        if hit is None or hit[4]:
            return None
        _, raw, args, norm, _ = hit
        return (*norm, (raw, self.num_ctas, args))

    def relaunch(self, steps: tuple, stream: int) -> None:
        """Launch ``steps`` (:meth:`steps`) again on ``stream``, under the launch's lock (a
        norm pass and its kernel queued together, as :meth:`__call__` queues them)."""
        with self.lock:
            for raw, grid, args in steps:
                raw(grid, stream, *args)

    def raw_args(
        self, tensor_map, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple:
        """The kernel's arguments as the compiled launcher takes them: each tensor descriptor
        expanded by ``tensor_map(slot, tensor, block)`` (:meth:`RawLaunch.tensor_map`), the
        plan's buffers as addresses, then the trailing constexprs."""
        a_block, b_block, c_block = self._blocks
        tma_store = c.stride(0) == c.shape[1]
        return (
            *tensor_map(0, a, a_block), *tensor_map(1, b, b_block),
            *(tensor_map(2, c, c_block) if tma_store else (None,)), None if tma_store else c.data_ptr(),
            *self._sizes, c.shape[0], c.stride(0),
            *self._with_residual(self._addresses, residual, True, self._adds(c, residual)),
            *self._trailing,
        )  # fmt: skip

    @property
    def raw(self) -> bool:
        """Whether every specialisation compiled so far launches through :class:`RawLaunch`."""
        return bool(self._compiled) and all(raw is not None for _, raw in self._compiled.values())

    def bound(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple | None:
        """``(compiled kernel, raw launch, its arguments)`` for a launch without a residual or
        a norm pass of its own on these operands (already checked), once their specialisation is
        compiled and launches raw; else None. The arguments hold addresses and tensor maps, no
        tensor."""
        if (
            (self.stats is not None and self.stats.own)
            or self.accumulate
            or (self.epilogue is not None and self.epilogue.residual)
        ):
            return None
        got = self._compiled.get(self._key(a, c, None))
        if got is None or got[1] is None:
            return None
        return got[0], got[1], self.raw_args(got[1].tensor_map, a, b, c)


def launch_gemm(a, b, c, config: GemmConfig, num_ctas: int, **hooks):
    """Bind and launch once: ``GemmLaunch(M, N, K, config, num_ctas, a.device, **hooks)(a, b, c)``."""
    M, K = a.shape
    return GemmLaunch(M, b.shape[1], K, config, num_ctas, a.device, **hooks)(a, b, c)


def persistent_grid(tiles: int, ctas: int) -> int:
    """CTAs of a persistent GEMM of ``tiles`` tiles given ``ctas`` SMs: one per SM, fewer when
    there are fewer tiles."""
    return max(1, min(ctas, tiles))


def launch_grid(M: int, N: int, K: int, config: GemmConfig, ctas: int) -> int:
    """Persistent grid of an ``M x N x K`` GEMM given ``ctas`` SMs: :func:`persistent_grid`, or a
    CTA per K-slice where ``config`` splits a round of fewer tiles than SMs (``split_k``,
    :func:`tail_split`)."""
    grid = persistent_grid(_cdiv(M, config.block_m) * _cdiv(N, config.block_n), ctas)
    split = tail_split(M, N, K, config, ctas)
    return grid if split is None else max(grid, split.items)


def grid_size(M: int, N: int, K: int, config: GemmConfig, device: torch.device) -> int:
    """Persistent grid of the plain GEMM: :func:`launch_grid` on every SM of ``device``."""
    return launch_grid(M, N, K, config, num_sms(device))


_CAPTURED: set[GemmLaunch] = set()  # launches a CUDA graph captured: kept past the cache's eviction
# matmul's checked calls, least recently used first: (signature of a, b, out (None: a new one),
# config, stream) -> (the launch, weakly: it lives as long as plain_launch's cache or a graph
# keeps it; its raw launch; its arguments (out new each call: [(the last out's address, its
# arguments)], reused while the new out lands there, swapped whole); out's shape)
_BOUND: OrderedDict[tuple, tuple] = OrderedDict()
MAX_LAUNCHES = 512  # plain launches bound (plain_launch), the most recently used: a large model's blocks
MAX_BOUND = MAX_LAUNCHES
MAX_CALLS = 16  # calls' arguments a launch keeps (GemmLaunch._calls), the most recently used


@functools.lru_cache(maxsize=MAX_LAUNCHES)
def plain_launch(
    M: int, N: int, K: int, cfg: GemmConfig, device: torch.device, stream: int, epilogue: Epilogue | None,
    owner: int,
) -> GemmLaunch:  # fmt: skip
    """The plain GEMM's launch for one shape (and epilogue), bound once; a residual on the GPU is
    added onto the output by TMA (every argument positional and given: the cache keys on how
    they are passed). Per stream too: its split tail's buffers are the stream's
    (:meth:`TailBuffers.on_stream`: launches on one stream are ordered, so they may share them;
    two streams may not). ``owner`` 0: eager calls' launch; else a launch for CUDA-graph
    capture on ``stream``, with buffers apart from eager calls' (a graph may be replayed on any
    stream), shared by the graphs captured on that stream under the same owner that make the
    same call (:func:`launch_checked`, :func:`captures_owned_by`)."""
    add = epilogue is not None and epilogue.residual and not interpreting()
    num_ctas = grid_size(M, N, K, cfg, device)
    split = tail_split(M, N, K, cfg, num_ctas)
    tail = None if split is None or owner else TailBuffers.on_stream(split, cfg, device, stream)
    on = stream if device.type == "cuda" else None
    return GemmLaunch(
        M, N, K, cfg, num_ctas, device, split=split, tail=tail, epilogue=epilogue, add_residual=add, stream=on
    )


def capturing_on(index: int) -> bool:
    """Whether the current stream of CUDA device ``index`` is being captured into a graph."""
    if index == torch.cuda.current_device():
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(index):
        return torch.cuda.is_current_stream_capturing()


_CAPTURE_OWNER = contextvars.ContextVar("capture_owner", default=1)  # whose captured launches (0: none)
_OWNERS = itertools.count(2)


def new_capture_owner() -> int:
    """A capture owner no other has (:func:`captures_owned_by`)."""
    return next(_OWNERS)


@contextlib.contextmanager
def captures_owned_by(owner: int):
    """Within it, GEMMs captured in CUDA graphs bind launches of ``owner``'s
    (:func:`new_capture_owner`): their buffers (split tail, norm statistics) are shared only
    by the graphs captured on the same stream under the same owner that make the same call. Two
    graphs sharing them must not replay at the same time (on two streams): an owner whose
    replays are ordered (a :class:`~ctapipelining.pipeline.Pipeline`'s) keeps them apart from
    everyone else's. Outside it, captured calls on one stream share one owner's."""
    token = _CAPTURE_OWNER.set(owner)
    try:
        yield
    finally:
        _CAPTURE_OWNER.reset(token)


def launch_checked(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    config: GemmConfig,
    epilogue: Epilogue | None = None,
    residual: torch.Tensor | None = None,
    a_copy: torch.Tensor | None = None,
) -> GemmLaunch:
    """:func:`matmul`'s launch on the current stream of ``a``'s GPU, for operands already
    checked as :func:`matmul` checks them (by it, or by a caller that owns them: a fused block's
    own intermediate and output, new each call): CUDA tensors (not the interpreter's), ``M``
    and ``N`` above 0, dtypes and ``K`` matching, ``out`` on ``a``'s GPU or one it has peer
    access to, ``config`` able to close ``epilogue``. Returns the launch (bound once per
    shape, stream and epilogue, shared with :func:`matmul`'s calls)."""
    (M, K), N = a.shape, b.shape[1]
    index = a.device.index
    stream = torch._C._cuda_getCurrentRawStream(index)
    # the kernel launches in the current device's context (and its stream is the one captured, if any)
    with nullcontext() if index == torch.cuda.current_device() else torch.cuda.device(index):
        captured = torch.cuda.is_current_stream_capturing()
        launch = plain_launch(M, N, K, config, a.device, stream, epilogue, _CAPTURE_OWNER.get() if captured else 0)
        if captured:
            if launch in _CAPTURED and launch.tail is not None:
                # an earlier graph zeroed its arrival counters (their allocation's fill), but
                # this one may be replayed first: it zeroes them too
                launch.tail.counters.zero_()
            _CAPTURED.add(launch)  # a graph points at its buffers (split tail, norm statistics): never freed
        launch(a, b, out, stream, residual=residual, a_copy=a_copy)
    return launch


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor | None = None,
    config: GemmConfig | None = None,
    epilogue: Epilogue | None = None,
    residual: torch.Tensor | None = None,
    a_copy: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain persistent GEMM ``a @ b`` (both hooks off), with an optional fused ``epilogue``
    (:class:`~ctapipelining.epilogue.Epilogue`; ``residual``: the matrix it adds, of the
    output's shape, when it adds one). ``out`` (row-major, rows may be padded, not overlapping
    ``a``, ``b`` or ``residual``; or ``residual`` itself, then without padded rows: ``out +=
    ...`` in place) may be on a
    peer GPU (peer access is enabled here, or a
    :class:`~ctapipelining.fabric.PeerAccessError` says why not). With a split tail the epilogue
    applies to each tail tile once its K-slices are summed. A residual is copied into
    the output first (unless it is the output) and each tile added onto it (TMA reduce-add);
    into an output with padded rows, on another GPU, or under the interpreter, the epilogue loads it instead,
    on 128 x 128 tiles (``RESIDUAL_CONFIG``: its tile leaves no room for wider ones).
    ``a_copy`` (``a``'s shape and dtype, rows contiguous, overlapping no operand): with a norm
    epilogue, whose pass over ``a``'s rows reads them anyway, the pass also stores them there: a
    block whose residual is its input then reads it once (``y = x + f(x)``: ``h = matmul(x, w1,
    epilogue=norm, a_copy=y)``, then ``matmul(h, w2, out=y, epilogue=residual, residual=y)``).
    Such a pass may sum a row in another order than one without the copy (the compiler lays the
    row out to vectorise the store, by the copy's alignment): the result is then within a
    rounding of the call without it, not bitwise.
    Without an epilogue or a
    ``config``, the configuration measured fastest for its row count (:func:`plain_config`).
    Its launches, bound once
    per shape, configuration, epilogue and stream, are cached (:data:`MAX_LAUNCHES`, sharing
    their stream's split-tail buffers); a call captured in a CUDA graph binds a launch with
    buffers apart from eager calls' (shared by the graphs captured on one stream that make the
    same call, which must then not replay at the same time: capture on a stream of its own a
    graph that will, or see :func:`captures_owned_by`), kept for the life of the process, so the
    buffers the graph points at (split tail, norm statistics) are never freed. An eager call
    without an epilogue whose operands have the signature
    (:func:`~ctapipelining.operands.signature`) of an earlier checked call on the same stream
    skips the checks it passed and launches its bound arguments (:data:`MAX_BOUND` kept, the most
    recently used): the host time of an eager call is then little more than the launch's (with a
    new ``out``, its arguments are built again only where it lands elsewhere than the last)."""
    key = None
    plain = epilogue is None and residual is None and a_copy is None and (config is None or type(config) is GemmConfig)
    index = a.get_device() if bindable(a) else -1
    if (
        plain and index >= 0 and bindable(b) and (out is None or bindable(out))
        and not capturing_on(index)  # a capture binds a launch of its own (launch_checked)
    ):  # fmt: skip
        stream = torch._C._cuda_getCurrentRawStream(index)
        key = (signature(a), signature(b), None if out is None else signature(out), config, stream)
        hit = _BOUND.get(key)
        launch = hit and hit[0]()
        if launch is not None and not launch_hooks():  # (a profiler's hooks: Triton's path)
            try:
                _BOUND.move_to_end(key)
            except KeyError:  # another thread's call dropped it meanwhile
                pass
            _, raw, args, shape = hit
            if out is None:  # args: [(the last new out's address, its arguments)], read once
                out, (at, built) = torch.empty(shape, dtype=a.dtype, device=a.device), args[0]
                if out.data_ptr() != at:  # elsewhere than the last one (the caching allocator mostly reuses it)
                    built = launch.raw_args(raw.tensor_map, a, b, out)
                    args[0] = (out.data_ptr(), built)
                args = built
            with nullcontext() if index == torch.cuda.current_device() else torch.cuda.device(index):
                raw(launch.num_ctas, stream, *args)
            return out
    check_operands(a, b)
    if config is not None and not isinstance(config, GemmConfig):
        raise TypeError(f"config must be a ctapipelining.kernels.gemm.GemmConfig or None, got {type(config).__name__}")
    if epilogue is not None and not isinstance(epilogue, Epilogue):
        raise TypeError(f"epilogue must be a ctapipelining.epilogue.Epilogue, got {type(epilogue).__name__}")
    # a residual added onto C by TMA (an output without padded rows, on the GPU) leaves the plain
    # tiles room; one loaded by the epilogue needs narrower ones
    loads_residual = (
        epilogue is not None
        and epilogue.residual
        and (interpreting() or out is not None and (out.stride(0) != out.shape[1] or out.device != a.device))
    )
    if config is not None:
        cfg = config
    elif epilogue is None:
        cfg = plain_config(a.shape[0])  # per row count (measured)
    else:
        cfg = RESIDUAL_CONFIG if loads_residual else EPILOGUE_CONFIG
    if loads_residual and not interpreting() and not fits_loaded_residual(cfg):
        raise ValueError(
            f"this call's epilogue loads its residual tile (an out with padded rows or on another GPU), and {cfg} "
            "leaves no shared memory for it: use kernels.gemm.RESIDUAL_CONFIG (or no config)"
        )
    (M, K), N = a.shape, b.shape[1]
    n_out = N if epilogue is None else epilogue.out_cols(N)
    if epilogue is not None:
        epilogue.check(N, a.dtype, a.device, cfg.block_n)
    if (residual is not None) != (epilogue is not None and epilogue.residual):
        raise ValueError("pass residual exactly when the epilogue adds one (Epilogue(residual=True))")
    if residual is not None:
        check_tensor(residual, "matmul: residual")
        if residual.shape != (M, n_out) or residual.dtype != a.dtype or residual.device != a.device:
            raise ValueError(
                f"residual must be a [{M}, {n_out}] {a.dtype} tensor on {a.device}, got "
                f"{tuple(residual.shape)} {residual.dtype} on {residual.device}"
            )
    if out is None:
        out = torch.empty(M, n_out, dtype=a.dtype, device=a.device)
    check_out(out, M, n_out, a.dtype)
    vectors = [] if epilogue is None else [v[None, :] for v in (epilogue.bias, epilogue.col_sum) if v is not None]
    in_place = residual is not None and same_view(residual, out)  # out holds the residual already
    if overlaps(out, a, b, *([] if residual is None or in_place else [residual]), *vectors):
        raise ValueError("out overlaps an operand: the GEMM would read what it has already overwritten")
    if a_copy is not None:
        if epilogue is None or epilogue.norm_eps is None:
            raise ValueError("a_copy is made by a norm epilogue's pass over a's rows (rms_eps or layer_norm_eps)")
        check_out(a_copy, M, K, a.dtype, "a_copy")
        if a_copy.device != a.device:
            raise ValueError(f"a_copy must be on {a.device} (the norm's pass stores it), got {a_copy.device}")
        if overlaps(a_copy, a, b, out, *([] if residual is None else [residual]), *vectors):
            raise ValueError("a_copy overlaps an operand or the output: the pass would overwrite what the GEMM reads")
    if M == 0 or N == 0:
        return out
    if out.device != a.device:
        if out.device.type != "cuda" or a.device.type != "cuda":
            raise ValueError(f"out is on {out.device} but the GEMM runs on {a.device}")
        fabric.enable_peer_access([a.device.index, out.device.index], atomics=False)  # stores only
    if a.device.type != "cuda":  # the interpreter
        launch = plain_launch(M, N, K, cfg, a.device, 0, epilogue, 0)
        try:
            launch(a, b, out, residual=residual, a_copy=a_copy)
        except BaseException:  # stopped mid-kernel: the arrival counters it shares may be left counting
            if launch.tail is not None:
                launch.tail.counters.zero_()
            raise
        return out
    launch = launch_checked(a, b, out, cfg, epilogue, residual, a_copy)
    bound = None if key is None else launch.bound(a, b, out)
    if bound is not None:  # checked and compiled: later calls with this signature skip to the launch
        args = [(out.data_ptr(), bound[2])] if key[2] is None else bound[2]
        _BOUND[key] = (weakref.ref(launch), bound[1], args, out.shape)
        while len(_BOUND) > MAX_BOUND:
            _BOUND.popitem(last=False)
    return out
