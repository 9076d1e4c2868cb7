"""What a :class:`~ctapipelining.pipeline.Pipeline` allocates and binds once per input height.

A :class:`Plan` holds one height's buffers, each link's scoreboard and ring (:class:`Link`, with
the producer's CSR lists, :class:`SignalLists`), each stage's epoch and error word, and the
:class:`Launch` records a call runs in stream order: every kernel bound once, so a call only
launches. A :class:`Segment` says where a pipeline sits in a longer chain run by other processes
(:mod:`ctapipelining.distributed`). The dependency arrays come from :mod:`ctapipelining.deps`;
this module turns them into device tensors and kernel hooks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import triton

from . import deps
from .chain import ChainLaunch
from .gemm import GemmLaunch, SignalHook, TailBuffers, WaitHook
from .kernels.gemm import GemmConfig
from .launcher import launch_hooks
from .operands import untracked


def int32_on(arr, device) -> torch.Tensor:
    return torch.as_tensor(arr, dtype=torch.int32).to(device)


def i64_zeros(n: int, device) -> torch.Tensor:
    """Protocol state: int64 zeros (counters, slots, head, tail, epochs, error words)."""
    return torch.zeros(n, dtype=torch.int64, device=device)


@dataclass
class SignalLists:
    """A producer's read-only CSR lists (:class:`ctapipelining.deps.Dependency`), on the device
    of the GEMM that signals with them."""

    signal_ptr: torch.Tensor
    signal_counters: torch.Tensor
    need: torch.Tensor
    push_ptr: torch.Tensor
    push_tiles: torch.Tensor

    @classmethod
    def create(cls, dep: deps.Dependency, device: torch.device) -> SignalLists:
        arrays = (dep.signal_ptr, dep.signal_counters, dep.need, dep.push_ptr, dep.push_tiles)
        return cls(*(int32_on(a, device) for a in arrays))


@dataclass
class Link:
    """Scoreboard and ring of stage ``s`` (consumer memory) and stage ``s - 1``'s CSR lists
    (producer memory; a prefill GEMM on the consumer's device gets a copy there), for one ``M``."""

    dep: deps.Dependency
    counters: torch.Tensor
    counter_of_tile: torch.Tensor
    need_consumer: torch.Tensor
    slots: torch.Tensor
    head: torch.Tensor
    tail: torch.Tensor
    lists: SignalLists
    local_lists: SignalLists | None = None
    # where stage s - 1 leaves its rows' partial sums for stage s's norm (consumer memory): the
    # sums of squares, or (sums of squares, sums) for a LayerNorm; None: stage s has no norm.
    # Set for a link between segments (their heap); inside a pipeline, Plan.sums holds them
    sums: object = None

    @classmethod
    def create(cls, dep: deps.Dependency, producer: torch.device, consumer: torch.device) -> Link:
        return cls(
            dep=dep,
            counters=i64_zeros(dep.num_counters, consumer),
            counter_of_tile=int32_on(dep.counter_of_tile, consumer),
            need_consumer=int32_on(dep.need, consumer),
            slots=i64_zeros(dep.consumer.num_tiles, consumer),
            head=i64_zeros(1, consumer),
            tail=i64_zeros(1, consumer),
            lists=SignalLists.create(dep, producer),
        )

    def state(self) -> list[torch.Tensor]:
        """The tensors that only grow (zeroed by a reset)."""
        return [self.counters, self.slots, self.head, self.tail]

    def wait_hook(self, queue: bool) -> WaitHook:
        d = self.dep
        return WaitHook(
            self.counters, self.counter_of_tile, self.need_consumer, self.slots, self.head, queue,
            d.parts, d.producer.num_n, d.producer.block_n,
        )  # fmt: skip

    def signal_hook(self, queue: bool, first_tile: int = 0, local: bool = False) -> SignalHook:
        """The producer's hook; ``first_tile``: the producer tile id of the launch's tile 0
        (a launch on rows ``[r, M)`` numbers its tiles from 0); ``local``: the CSR lists on the
        consumer's device (a prefill GEMM there)."""
        lists = self.local_lists if local else self.lists
        return SignalHook(
            self.counters,
            lists.signal_ptr[first_tile:],
            lists.signal_counters,
            lists.need,
            lists.push_ptr,
            lists.push_tiles,
            self.slots,
            self.tail,
            self.dep.consumer.num_tiles,
            triton.next_power_of_2(self.dep.max_push),
            self.dep.max_signals,
            queue,
        )


Rows = tuple  # ("x" | "out", first row, end row): rows of the call's own input or output
MAX_BOUND = 8  # bound launches a Launch keeps, the most recently used: a serving loop's few buffers


@dataclass(eq=False)
class Launch:
    """One kernel of a call, bound at plan time: a stage's GEMM, a chain kernel over the
    stages that share a GPU, or a prefill or drain GEMM. Its operands (``ops``: ``(a, b, c)``
    per stage it runs) are plan buffers or :data:`Rows` of the call's ``x`` / ``out``."""

    stream: int  # the stage whose stream (and device) runs it
    gemm: GemmLaunch | ChainLaunch
    ops: list[tuple]
    stages: tuple[int, ...] = ()  # the chain's stages it runs (none: a prefill or drain GEMM)
    # (ops: (a, b, c) per stage, and the residual as a fourth where the stage's epilogue adds one)
    copy_x: tuple[torch.Tensor, int] | None = None  # (buffer, rows): copy x[:rows] there first
    # (x's and out's address, rows and row stride) -> (kernel, raw launch, its arguments): the
    # launches of the last calls, bound (:meth:`run`)
    _bound: OrderedDict = field(default_factory=OrderedDict, init=False, repr=False, compare=False)

    def run(self, x: torch.Tensor, out: torch.Tensor, stream: int | None, compile_only: bool = False):
        """Launch on ``stream`` (raw handle; None: the current one), which is also current
        (``compile_only``: compile the kernel for these operands and launch nothing).

        A launch whose kernel is compiled and launches raw with nothing before it (no copy of
        ``x``, no norm pass) is bound once per ``x`` and ``out`` (their addresses, rows and row
        strides are all a call changes in its arguments; dtypes and widths are the pipeline's,
        checked by the caller, and the weights' storage is the pipeline's own for its life): a
        later call on the same goes straight to the launch, without views, descriptors or
        specialisation lookups."""
        key = None
        if stream is not None and not compile_only and self.copy_x is None and not launch_hooks():
            key = (x.data_ptr(), x.shape[0], x.stride(0), out.data_ptr(), out.shape[0], out.stride(0))
            got = self._bound.get(key)
            if got is not None:
                self._bound.move_to_end(key)
                kernel, raw, args = got
                raw(self.gemm.num_ctas, stream, *args)
                return kernel
        if self.copy_x is not None and not compile_only:
            buf, rows = self.copy_x
            buf.copy_(untracked(x[:rows]))
        ops = [tuple(_rows(t, x, out) for t in op) for op in self.ops]
        if isinstance(self.gemm, ChainLaunch):
            kernel = self.gemm(ops, stream, compile_only=compile_only)
            bound = None if key is None else self.gemm.bound(ops)
        else:
            a, b, c, *residual = ops[0]
            kernel = self.gemm(a, b, c, stream, residual=residual[0] if residual else None, compile_only=compile_only)
            bound = None if key is None or residual else self.gemm.bound(a, b, c)
        if bound is not None:
            self._bound[key] = bound
            if len(self._bound) > MAX_BOUND:
                self._bound.popitem(last=False)
        return kernel


def sums_to(sums, device: torch.device):
    """Partial sums (a tensor, a pair of them, or None) on ``device``."""
    if sums is None:
        return None
    return tuple(t.to(device) for t in sums) if isinstance(sums, tuple) else sums.to(device)


def _rows(src, x, out) -> torch.Tensor:
    """A plan buffer (or a weight), or rows ``[lo, hi)`` of ``x`` / ``out`` (fewer when the call
    has fewer rows than its plan: a bucketed plan; the launch reads zeros past them and writes
    nothing)."""
    if not isinstance(src, tuple):
        return src
    name, lo, hi = src
    t = x if name == "x" else out
    return t if lo == 0 and hi >= t.shape[0] else t[lo:hi]


def link_dependency(
    producer: deps.TileGrid, consumer: deps.TileGrid, consumer_k: int, queue: bool, config: GemmConfig
) -> deps.Dependency:
    """The dependency arrays of a link: a consumer that waits on a ring (``queue``) waits for
    whole row-blocks; one that waits on counters does so in ``config.wait_parts`` parts (at most
    the producer's column-blocks). Both ends of a link build it with this one rule."""
    parts = 1 if queue else min(config.wait_parts, producer.num_n)
    return deps.build_dependency(producer, consumer, "gemm", consumer_k=consumer_k, parts=parts)


@dataclass(frozen=True)
class Segment:
    """Where a :class:`~ctapipelining.pipeline.Pipeline` sits in a longer chain whose other stages run in other
    launches (another process: :mod:`ctapipelining.distributed`). Its stages are stages
    ``first_stage, first_stage + 1, ...`` of the chain. ``links(M)`` gives, for a plan of ``M``
    rows, the :class:`Link` into its first stage (scoreboard and ring in this segment's memory,
    filled by the previous segment; None for the chain's first stage) and the link out of its
    last (the next segment's scoreboard and ring, as addressed from here; None for the chain's
    last stage); both with :func:`link_dependency`, waited on and signalled under the
    pipeline's policy; a link into a stage that normalises its input also carries the partial
    sums its producer leaves (:attr:`Link.sums`). ``where`` names the place in errors (e.g.
    ``"rank 1"``). ``out_norm``: the norm of the next segment's first stage (``"rms"``,
    ``"layer"``; None: none or no next segment), whose rows' partial sums this segment's last
    stage leaves."""

    first_stage: int
    links: Callable[[int], tuple[Link | None, Link | None]]
    where: str = ""
    out_norm: str | None = None


@dataclass(eq=False)
class Plan:
    """Everything one input height ``M`` needs, allocated and bound once, reused by every call:
    buffers, scoreboards, and the :class:`Launch` records a call runs, in stream order."""

    M: int
    inputs: list[torch.Tensor | None]  # inputs[s]: stage s's A operand (None for stage 0: the caller's x)
    links: list[Link]  # links[s - 1]: stage s-1 -> stage s
    epochs: list[torch.Tensor]  # int64 [1] per stage, on its device (the stages of a chain kernel share one)
    errors: list[torch.Tensor]  # int64 [len(ERR_FIELDS)] per stage, on its device
    traces: list[torch.Tensor | None]  # per stage [tiles, 5] int64 %globaltimer stamps (trace mode)
    tails: list[TailBuffers | None]  # per launch with a split tail: partials and arrival counters
    num_ctas: list[int]
    tickets: list[torch.Tensor] = field(default_factory=list)  # int64 [1] per chain kernel: positions claimed
    # per stage: its input rows' partial sums of squares (and sums, for a LayerNorm), from the stage before
    sums: list = field(default_factory=list)
    launches: list[Launch] = field(default_factory=list)
    epoch: int = 0  # calls launched since the last reset (graph replays not counted)
    prefill_rows: int = 0  # rows of stage 1's input computed on stage 1's GPU (see Pipeline)
    prefill_x: torch.Tensor | None = None  # [prefill_rows, K_0] on stage 1's device
    drain_rows: int = 0  # last rows of the chain computed on stage 0's GPU (see Pipeline)
    drain_h: torch.Tensor | None = None  # [drain_rows, N_0] on stage 0's device: the drain's layer 1
    inbound: Link | None = None  # a segment's link from the previous segment (its scoreboard is ours)
    pinned: bool = False  # a CUDA graph points at these buffers: never evicted
    stale: bool = False  # a launch failed part way: reset before the next call
    err_host: list[torch.Tensor] = field(default_factory=list)  # pinned copies of the error words
    configs: list[GemmConfig] = field(default_factory=list)  # each stage's (Pipeline.plan_configs)

    @property
    def err_flags(self):
        """The host copies' flags (a read of pinned memory, no copy)."""
        return (view[0] for view in self._err_views)

    def __post_init__(self):
        self._err_views = [e.numpy() for e in self.err_host]

    def ends(self, stream: int) -> list[GemmLaunch]:
        """The prefill (``stream`` 1) or drain (``stream`` 0) GEMMs of this plan."""
        return [lc.gemm for lc in self.launches if not lc.stages and lc.stream == stream]

    def state(self) -> list[torch.Tensor]:
        tails = [t.counters for t in self.tails if t is not None]  # partial after a timeout
        links = [t for link in self.links + ([self.inbound] if self.inbound else []) for t in link.state()]
        return links + self.epochs + self.errors + self.tickets + tails
