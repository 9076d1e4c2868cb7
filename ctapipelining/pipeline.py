"""A chain of GEMM stages across devices, CTA-pipelined.

``Pipeline([A, B, ...])`` puts stage ``s`` (``y_s = y_{s-1} @ W_s``) on the device of ``W_s``.
A call launches every stage at once, each GPU's stages on a stream of that GPU; stage ``s``
writes its tiles into stage ``s + 1``'s input buffer on the next GPU and signals them there, and
stage ``s + 1``'s persistent CTAs start each tile as soon as its input rows have landed.

State lives in one object per input height ``M`` (:class:`~ctapipelining.plan.Plan`): the intermediate buffers,
each link's scoreboard and ring, each stage's epoch and error word, and the launch records a
call runs (every kernel bound once, so a call only launches). Counters only grow, so
back-to-back calls need no reset, and a call can be captured in a CUDA graph:
:meth:`Pipeline.capture` returns a :class:`GraphedCall` that keeps the graph together with
everything it points to.

Prefill (``prefill_rows=R``): the second GPU computes the first ``R`` rows of the first layer
itself, from a copy of ``x[:R]`` and a replica of ``W_0``, before its consumer kernel starts.
Those rows are the consumer's first tiles, so it has work while the producer's first round is
still running, and the producer has ``R`` rows less to write across NVLink. Both GEMMs bump
the same counters (the replica's tiles signal the consumer's scoreboard locally).

Drain (``drain_rows=D``, two stages): the first GPU computes the last ``D`` rows of the whole
chain itself, after its producer kernel: those rows of layer 1 into a local buffer, then of
layer 2 with a replica of ``W_1``, written into the output on the second GPU. The consumer runs
rows ``[0, M - D)`` only. Why: a two-stage chain has two idle ends. The second GPU waits about
one round for the producer's first row-blocks (what a prefill fills), and the first GPU idles
while the consumer computes the rows of the producer's last round (what a drain fills). With
both, each GPU has about half the chain's work and neither waits for the other at the ends.
``ends="balanced"`` sizes both for each input height (:func:`ctapipelining.deps.balanced_ends`).

Ordering and threads: every stage's stream first waits for the current stream of every
stage's device and for the end of the previous call on every stage's stream, and those current
streams then wait for every stage. So ``x``, ``out`` and the result are ordered with whatever
the caller does on any of the devices (the caching allocator included), and a producer of one
call never overwrites a buffer or ring slot that a consumer of the call before still reads,
whichever streams or threads the two calls came from. On one GPU without loopback, an eager
call (like a graph replay) queues its work on the caller's current stream itself: the same
ordering with fewer host calls. Calls and graph replays hold a lock, so
a ``Pipeline`` may be called from several threads (they take turns on the host). Inside a CUDA
graph that the user captures, the user orders the captured calls.

Errors are asynchronous, like CUDA's own: a call does not synchronise (unless ``check=True``),
and a timed-out wait surfaces as :class:`PipelineTimeout` at a later call, once the call that
timed out has finished, or at :meth:`Pipeline.check_errors` (which waits). A result is known
good only then. No error is lost: error words are sticky until read. Host waits are bounded
too: a device that does not finish within ``host_timeout_s`` raises :class:`PipelineHung`,
after which the pipeline refuses further calls. The caller's own work is timed apart (the host
waits for each call's start, then its end: :mod:`ctapipelining.inflight`): what it queued before
a call that has not finished within ``host_timeout_s`` raises ``TimeoutError`` and leaves the
pipeline usable (check again once it is done); what it queued after the last call is not
waited for.

Stages may share a GPU (on one GPU, every stage). Consecutive stages on one GPU with the same
configuration run at the same time in one chain kernel (:mod:`ctapipelining.kernels.chain`; at most
:data:`~ctapipelining.kernels.chain.MAX_STAGES` each, further ones in further chain kernels one
after the other on the GPU's one stream): its CTAs claim tiles in one combined order, so a
consumer tile fills the SMs its producer leaves idle, and the links between those stages wait on
counters in the GPU's own memory. With ``loopback=True`` each stage is a kernel of its own
instead, on an equal share of the SMs, all resident at once, signalling through the same
system-scope code path as across GPUs, so the cross-GPU protocol runs and is tested on one GPU.
Nothing else may hold a loopback's SMs while a call runs, or a waiting consumer could keep its
producer from being scheduled (its waits then time out cleanly); a chain kernel has no such
need.

On one GPU our own GEMMs one after another, each in its configuration measured for its row count
(:func:`~ctapipelining.gemm.matmul`), are as fast as the chain kernel or faster: the plain GEMM's
narrow tiles and split tails already leave few SMs idle, and claiming tiles from the ticket costs
more than the round of tiles the combined order saves (the chain kernel in its best configuration
per height takes 1.01-1.17x our GEMMs one after another at 128-16384 rows, paired, the interval
including 1 at 1024 rows only,
``benchmarks/results/2026-12-01-h200-configs/run11-parts/shared_gpu.json``). So a pipeline whose
stages all share one device, built without a configuration (nor epilogues, ends, a segment, a
trace, an SM budget or loopback), runs a call as plain GEMMs one after another
(:attr:`Pipeline.one_after_another`): ours, or cuBLAS's at the row counts where cuBLAS measured
faster than every configuration of ours (:func:`~ctapipelining.serial.stage_gemm`: 193-384 and
513-768 rows on an H200); ``always_pipelined=True`` keeps the chain kernel. Stages on several GPUs
always pipeline.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import numbers
import statistics
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from . import deps, fabric
from .chain import ChainLaunch, ChainStage, chain_tail_split
from .epilogue import Epilogue
from .errors import PipelineHung, PipelineTimeout, failed_call, messages
from .gemm import (
    GemmLaunch,
    TailBuffers,
    captures_owned_by,
    capturing_on,
    config_table,
    launch_grid,
    new_capture_owner,
    num_sms,
    tail_split,
)
from .inflight import CALLERS_EARLIER, InFlight
from .kernels.chain import MAX_STAGES
from .kernels.gemm import (
    ENDS_CONFIG,
    PIPELINE_CONFIG,
    TRACE_FIELDS,
    GemmConfig,
    fits_loaded_residual,
)
from .kernels.sync import ERR_FIELDS
from .launcher import bound_stream
from .operands import (
    bindable,
    check_arch,
    check_dense,
    check_out,
    check_tensor,
    check_weight,
    overlaps,
    signature,
    span,
    tma_ready,
    untracked,
)
from .plan import Launch, Link, Plan, Segment, SignalLists, i64_zeros, link_dependency, sums_to
from .serial import BoundGemms, stage_gemm
from .tables import PIPELINE_TABLE, pick_config
from .timing import Method, time_interleaved

# tune_ends tries the rule's prefill (deps.balanced_ends) times each of these, and no ends at all,
# and leaves the rule's ends only for a candidate faster by more than TUNE_MARGIN: it times calls
# back to back, which ranks candidates within ~1% of each other differently from the interleaved
# bench (benchmarks/results/2026-11-30-h200x2-ends/)
TUNE_FACTORS = (0.5, 1.0, 1.5, 2.0)
TUNE_MARGIN = 0.02


def faster_by(medians: dict, default, margin: float):
    """The key of ``medians`` with the smallest value if it is below ``default``'s by more than
    the fraction ``margin``, else ``default`` (which must be a key)."""
    best = min(medians, key=medians.get)
    return best if medians[best] < (1 - margin) * medians[default] else default


CALLERS_STREAM = "the caller's stream"  # a host wait's name for the caller's current stream
_CALLERS_WORK = {  # running out there raises TimeoutError, saying why the host waits for it
    CALLERS_STREAM: "a call of this pipeline was captured in a graph of yours, whose replays run there: the host "
    "waits for them",
    CALLERS_EARLIER: "the caller's own work, queued on its stream before the call: check again once it is done",
}


MAX_PLANS = 8  # plans kept per Pipeline (least recently used go first; captured ones stay)
MAX_BOUND_CALLS = 8  # eager calls' bound GEMMs kept per Pipeline (Pipeline._bound_call), the most recently used
ROW_BUCKETS = 4  # plan heights per octave of input rows (deps.bucket_rows): 8 plans for 2049-8192


@dataclass(eq=False)
class GraphedCall:
    """One call of a :class:`Pipeline` on ``M`` rows, captured in a CUDA graph
    (:meth:`Pipeline.capture`): the lowest-latency way to run it again and again.

    It holds everything the graph's addresses point to, so none of it can be freed while the
    graph lives: the pipeline, its plan for ``M`` (pinned: never evicted; None where the call
    runs the stages one after another, :attr:`Pipeline.one_after_another`), the static input
    ``x`` ``[M, K_0]`` on stage 0's device and the output ``out`` ``[M, N_last]`` on the last
    stage's device. Each replay overwrites ``out``. A replay is ordered like an eager call: it
    waits for the current stream of every stage's device and for the pipeline's previous call
    or replay, and those streams wait for it, so the caller may fill ``x`` and read ``out`` on
    its own streams (a fill of ``x`` by hand must come after the previous replay: on the stream
    it was issued from, or one that waited for it; ``graphed(x)`` orders its copy itself).
    Replays do not read the error words: call :meth:`check_errors`. Replayed from another
    stream than the capture's, its ``x`` and ``out`` are freed (with it) only after that
    replay ends.
    """

    pipeline: Pipeline
    plan: Plan | None  # None: a call that runs the stages one after another (no waits, no error words)
    graph: torch.cuda.CUDAGraph
    x: torch.Tensor
    out: torch.Tensor
    # the stream each of x and out was allocated on (the capture's current streams; raw handles)
    _homes: tuple = field(default=(), init=False, repr=False)

    def __post_init__(self):
        home = [torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0 for t in (self.x, self.out)]
        self._homes = tuple(home)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Copy ``x`` (the shape, dtype and device of :attr:`x`) in, replay, return :attr:`out`."""
        if not isinstance(x, torch.Tensor) or x.shape != self.x.shape or x.dtype != self.x.dtype:
            raise ValueError(
                f"this graph was captured for x {tuple(self.x.shape)} {self.x.dtype}, "
                f"got {getattr(x, 'shape', type(x))} {getattr(x, 'dtype', '')}"
            )
        if x.device != self.x.device:
            raise ValueError(f"x is on {x.device}; the graph reads its input on {self.x.device}")
        return self._replay(x if x.data_ptr() != self.x.data_ptr() else None)

    def replay(self) -> torch.Tensor:
        """Run the captured call on whatever :attr:`x` holds now; returns :attr:`out`. Errors
        are not read here (that synchronises): call :meth:`check_errors` now and then."""
        return self._replay(None)

    def _replay(self, src: torch.Tensor | None) -> torch.Tensor:
        """:meth:`replay`, ``src`` first copied into :attr:`x` once the previous call (which may
        still read :attr:`x`) is behind the stream that copies."""
        pipe = self.pipeline
        with pipe._lock:
            pipe._usable()
            if pipe._capturing(every_device=True):  # its waits on events recorded outside would break it
                raise RuntimeError("a GraphedCall replays outside captures: capture pipe(x, out=...) itself instead")
            pipe.check_weights()  # a weight's storage swapped: the graph would read freed memory
            if self.plan is not None and self.plan.stale:  # a failed eager call left it so
                pipe.reset(self.plan)
            if pipe._replicas:
                pipe._refresh_replicas()
            callers = pipe._current_streams()
            first = callers[0]
            # the previous call's end, unless every caller stream waited for it already (as in an eager call)
            waits = [] if [c.cuda_stream for c in callers] == pipe._after_done else pipe._done
            for ev in [c.record_event() for c in callers[1:]] + waits:
                first.wait_event(ev)
            here = torch.cuda.current_device() == first.device.index
            with contextlib.nullcontext() if here else torch.cuda.device(first.device):
                start = pipe._in_flight.record([first])
                if src is not None:  # on the stream the graph replays on (the current one)
                    self.x.copy_(untracked(src))
                self.graph.replay()
                done = pipe._in_flight.end_on(first, start)
            for c in callers[1:]:
                c.wait_event(done[0])
            pipe._done = done
            pipe._after_done = [c.cuda_stream for c in callers]
            for t, home in zip((self.x, self.out), self._homes):  # freed later: not before this replay ends
                c = callers[pipe._device_indices.index(t.device.index)]
                if c.cuda_stream != home:
                    t.record_stream(c)
        return self.out

    def check_errors(self) -> None:
        """Raise :class:`PipelineTimeout` if a replay timed out (see :meth:`Pipeline.check_errors`);
        a graph of stages one after another only waits for its replays (bounded)."""
        if self.plan is None:
            with self.pipeline._lock:
                self.pipeline._wait()
            return
        self.pipeline.check_errors(self.plan)

    def __repr__(self) -> str:  # not the tensors' contents (a copy from the GPU)
        devices = ", ".join(str(d) for d in self.pipeline.devices)
        return f"GraphedCall(x={list(self.x.shape)} -> out={list(self.out.shape)}, {self.x.dtype}, on {devices})"


def is_seconds(v) -> bool:
    """Whether ``v`` is a positive number of seconds (below a million; a bool is not one)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1e6


def check_seconds(v, name: str, optional: bool = False) -> None:
    """Refuse, by name, a timeout that is not a positive number of seconds (:func:`is_seconds`)
    of at least a nanosecond (0 ns: a wait that looks once); None passes where ``optional``."""
    if v is None and optional:
        return
    if not is_seconds(v):
        raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
    if int(v * 1e9) < 1:
        raise ValueError(f"{name} must be at least a nanosecond, got {v!r}")


def check_row_buckets(row_buckets) -> None:
    """Refuse, by name, a ``row_buckets`` that is not 0 or a power of two."""
    if not isinstance(row_buckets, int) or isinstance(row_buckets, bool) or row_buckets < 0 or (
        row_buckets & (row_buckets - 1)
    ):  # fmt: skip
        raise ValueError(f"row_buckets must be 0 or a power of two, got {row_buckets!r}")


def _real(v) -> bool:
    """Whether ``v`` is a real number (Python's or NumPy's; not a bool)."""
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def plan_rows(M) -> int:
    """``M``, a plan's row count as a caller gives it (an int >= 1: numpy's and a 0-d tensor's
    too), or a clear error (a bool is not one)."""
    integral = isinstance(M, int) or hasattr(M, "__index__") and not isinstance(M, torch.Tensor)
    if isinstance(M, torch.Tensor):  # a 0-d tensor of integers
        integral = M.dim() == 0 and not M.is_floating_point() and not M.is_complex() and M.dtype != torch.bool
    if isinstance(M, bool) or not integral:
        raise TypeError(f"M must be an int number of rows, got {type(M).__name__}")
    M = M.__index__()
    if M < 1:
        raise ValueError(f"M must be at least 1 row, got {M}")
    return M


class Pipeline:
    """A chain ``x @ W_0 @ W_1 @ ...`` with stage ``s`` on ``W_s``'s device.

    Parameters
    ----------
    weights : list of ``[K_s, N_s]`` tensors, bf16 or fp16, row-major, ``N_s == K_{s+1}``,
        on CUDA devices, each holding a contiguous range of stages (consecutive devices need
        peer access; see ``loopback`` for stages that share one). Under the Triton interpreter
        they may all be CPU tensors; the kernels then run one after another. Their values may
        change in place between calls; their storage is the pipeline's for its life (a call
        after ``w.data = ...`` or ``w.set_(...)`` raises: the plans' launches are bound to it).
    policy : ``"static"`` (each consumer CTA walks the tile order and waits on each tile's
        counter; the default: faster than ``"workqueue"`` at every size measured on 2x H200,
        benchmarks/results/2026-11-30-h200x2-ends/) or
        ``"workqueue"`` (consumers run tiles in the order they became ready, the paper's policy).
    config : tile configuration of every stage (:class:`GemmConfig`), or a list of one per stage
        (sharing ``block_m``: the links count row-blocks; only consecutive stages of one
        configuration share a chain kernel). Default: chosen per plan height
        (:meth:`plan_configs`: a measured table); with ends, prefill or drain rows
        :data:`ENDS_CONFIG`. Its ``wait_parts`` is capped at the producer's column-blocks; a
        ``workqueue`` consumer runs whole tiles once they are ready, so it waits for whole
        row-blocks (one part).
    epilogues : one :class:`~ctapipelining.epilogue.Epilogue` (or None) per stage, applied to
        each of its output tiles (a transformer block's norm, bias, activation, residual; a
        gated one halves the stage's columns: the next weight has that many rows). In a chain:
        a residual adds the input of the stage before (the block's input), read where it lives:
        on another GPU, each tile's rows across NVLink once its own input rows have come (they
        came to that GPU first); the norm of a later stage's input takes the rows' sums of squares (and sums,
        for a LayerNorm) that the stage before stores with its tiles (no pass over memory), the
        first stage's a pass over ``x`` (a segment's first stage: the sums the previous segment
        leaves through its link). With a split tail, the CTA that sums a tail tile's
        K-slices applies the epilogue to the whole tile (and stores its rows' sums for a next
        stage's norm) before it signals it. Not with prefill or drain rows.
    timeout_s : how long a CTA waits for an input before it gives up and reports.
    host_timeout_s : how long a host wait (a check, a reset) waits for each call in flight's
        start, then its end, each counted from the one before: an end that does not come raises
        :class:`PipelineHung` (the pipeline refuses further calls), a start ``TimeoutError``
        (the caller's work queued before the call); the caller's work after the last call is
        not waited for. More than ``timeout_s`` (a GPU whose stages run as several
        kernels one after another may wait ``timeout_s`` in each: give it that many); default
        ``max(10, 10 * timeout_s)``.
    max_plans : plan heights whose plans (buffers, scoreboards, bound launches) are kept; the
        least recently used is freed first, never one a captured graph points at.
    sm_budget : the most SMs the pipeline's kernels hold on each GPU at once (default: all), so
        that kernels that must run beside it (a collective, attention) find SMs free. In
        loopback the stages on a GPU share its budget equally.
    loopback : ``True``: each stage that shares a device is a kernel of its own on an equal
        share of its SMs, through the cross-GPU code path (how the GPU tests exercise it on one
        GPU); ``False``: consecutive stages on one device run in one chain kernel (measured
        0.72-0.84x the loopback at 640-2048 rows on one H200,
        benchmarks/results/2026-12-01-h200-chain/), or, with nothing else that fixes how they
        run, one after another (:attr:`one_after_another`). Default: ``False`` on CUDA devices,
        ``True`` for CPU tensors under the interpreter (each stage then runs as on a device of
        its own; ``False`` runs the chain kernel there too, or the stages one after another).
    row_buckets : plan heights per octave of input rows (:func:`ctapipelining.deps.bucket_rows`):
        a call on ``M`` rows runs the plan for :meth:`rows_for` ``(M)`` rows, which reads zeros
        past ``M`` and writes only ``M`` rows, so a serving loop whose row count varies builds
        a few plans (4 per octave: 8 for 2049-8192 rows) and computes at most a quarter
        more rows. 0: one plan per exact height. With prefill or drain rows, plans are per
        exact height.
    trace : record per-tile ``%globaltimer`` stamps of every stage (GPU only; see
        :mod:`ctapipelining.trace` and :meth:`traces`). Off, the kernels carry no stamps.
    prefill_rows : the second GPU computes this many first rows of the first layer itself (see
        the module docstring; a multiple of ``config.block_m``; at least one row-block is left
        to the producer, so fewer for small inputs). It keeps a replica of ``W_0`` on that GPU.
        Not with ``trace``.
    drain_rows : the first GPU computes this many last rows of the whole chain itself, after
        its producer (see the module docstring; two stages only; a multiple of
        ``config.block_m``; at least one row-block is left to the pipelined stages). It keeps
        a replica of ``W_1`` on that GPU. Not with ``trace``.
    ends : ``"balanced"`` (two stages): both of the above, sized for each input height by
        :func:`ctapipelining.deps.balanced_ends` (on 2x H200 at K = N = 8192 about 0.8x the
        chain without them at M = 2048 and 0.95x at 8192-16384,
        benchmarks/results/2026-11-30-h200x2-ends/), with split tails
        (default config :data:`ENDS_CONFIG`). Costs a replica of each weight on the other GPU.
        A replica follows in-place changes of its weight that PyTorch counts (``w.mul_(2)``,
        ``w.copy_(...)``: the tensor's version moves); a change it does not count (through
        ``w.data``, or by another library writing the memory) needs :meth:`refresh_replicas`.
        Not with explicit ``prefill_rows`` / ``drain_rows``.
    segment : this pipeline runs a part of a longer chain (:class:`Segment`): its first stage
        waits on the previous part's link, its last signals the next part's. Set by
        :class:`ctapipelining.distributed.DistributedPipeline`; calls then go through it.
    always_pipelined : ``True``: every call runs the pipeline, also where its stages share one
        device and nothing else fixes how they run, where a call otherwise runs them one after
        another (:attr:`one_after_another`; for tests and measurements of the chain kernel).
        Default ``False``.
    """

    def __init__(
        self,
        weights: list[torch.Tensor],
        *,
        policy: str = "static",
        config: GemmConfig | None = None,
        timeout_s: float = 1.0,
        trace: bool = False,
        prefill_rows: int = 0,
        drain_rows: int = 0,
        ends: str | None = None,
        host_timeout_s: float | None = None,
        max_plans: int = MAX_PLANS,
        row_buckets: int = ROW_BUCKETS,
        sm_budget: int | None = None,
        loopback: bool | None = None,
        segment: Segment | None = None,
        epilogues: list[Epilogue | None] | None = None,
        always_pipelined: bool = False,
    ):
        if not isinstance(weights, (list, tuple)) or not weights:
            raise ValueError("Pipeline needs a non-empty list of weight matrices")
        self.policy = deps.get_policy(policy)
        if ends not in (None, "balanced"):
            raise ValueError(f"ends must be None or 'balanced', got {ends!r}")
        if not isinstance(always_pipelined, bool):
            raise ValueError(f"always_pipelined must be True or False, got {always_pipelined!r}")
        if ends and (prefill_rows or drain_rows):
            raise ValueError("ends='balanced' sizes prefill_rows and drain_rows itself: pass one or the other")
        has_ends = bool(ends or prefill_rows or drain_rows)  # rows run from the other GPU's replica
        if ends and trace:
            raise ValueError("trace mode does not stamp the prefill and drain GEMMs: use ends=None to trace")
        if ends and len(weights) != 2:
            raise ValueError(f"ends='balanced' needs a chain of exactly two stages, got {len(weights)}")
        if segment is not None and has_ends:
            raise ValueError("a segment of a longer chain has no prefill or drain rows")
        self.segment = segment
        self.ends = ends
        configs = config if isinstance(config, (list, tuple)) else [config] * len(weights)
        if len(configs) != len(weights) or not all(c is None or isinstance(c, GemmConfig) for c in configs):
            raise ValueError(f"config must be a GemmConfig or a list of one per stage ({len(weights)}), got {config!r}")
        self.configs = [c or (ENDS_CONFIG if has_ends else PIPELINE_CONFIG) for c in configs]
        self.config = self.configs[0]
        if len({c.block_m for c in self.configs}) > 1:
            raise ValueError(f"the stages' configurations must share block_m, got {[c.block_m for c in self.configs]}")
        if ends and len(set(self.configs)) > 1:
            raise ValueError("ends='balanced' runs both stages' rows with one configuration: pass one config")
        epilogues = [None] * len(weights) if epilogues is None else list(epilogues)
        if len(epilogues) != len(weights) or not all(e is None or isinstance(e, Epilogue) for e in epilogues):
            raise ValueError(f"epilogues must be a list of one Epilogue or None per stage ({len(weights)})")
        if any(epilogues) and has_ends:
            raise ValueError("epilogues and prefill or drain rows do not go together: pass one or the other")
        # chosen per plan height (plan_configs), where nothing else fixes the tiles
        self._per_height = config is None and not (has_ends or any(epilogues) or segment)
        self.epilogues = epilogues
        check_seconds(timeout_s, "timeout_s")
        check_seconds(host_timeout_s, "host_timeout_s", optional=True)
        self.timeout_ns = int(timeout_s * 1e9)
        self.host_timeout_s = max(10.0, 10 * timeout_s) if host_timeout_s is None else float(host_timeout_s)
        if self.host_timeout_s <= timeout_s:  # else a wait that ends in time would read as a hang
            raise ValueError(f"host_timeout_s={host_timeout_s} must exceed timeout_s={timeout_s}")
        if not isinstance(max_plans, int) or isinstance(max_plans, bool) or max_plans < 1:
            raise ValueError(f"max_plans must be an int >= 1, got {max_plans!r}")
        self.max_plans = max_plans
        check_row_buckets(row_buckets)
        # the ends' rows are cut from the call's own rows: their plans are per exact height
        self.row_buckets = 0 if has_ends else row_buckets
        self.trace = trace
        if sm_budget is not None and (not isinstance(sm_budget, int) or isinstance(sm_budget, bool) or sm_budget < 1):
            raise ValueError(f"sm_budget must be None or an int >= 1, got {sm_budget!r}")
        self.sm_budget = sm_budget
        self.weights = list(weights)
        for s, w in enumerate(self.weights):
            check_weight(w, f"stage {s} weight")
        # each stage's output columns (half of its weight's with a gated epilogue)
        self.out_cols = [w.shape[1] if e is None else e.out_cols(w.shape[1]) for w, e in zip(self.weights, epilogues)]
        for s in range(1, len(self.weights)):
            if self.weights[s].shape[0] != self.out_cols[s - 1]:
                raise ValueError(
                    f"stage {s} weight is {tuple(self.weights[s].shape)} but stage {s - 1} outputs "
                    f"{self.out_cols[s - 1]} columns"
                )
            if self.weights[s].dtype != self.weights[0].dtype:
                raise TypeError(f"stage {s} weight is {self.weights[s].dtype}, stage 0 is {self.weights[0].dtype}")
        for name, rows in (("prefill_rows", prefill_rows), ("drain_rows", drain_rows)):
            if not isinstance(rows, int) or rows < 0 or rows % self.config.block_m:
                raise ValueError(f"{name} must be a multiple of block_m={self.config.block_m} (>= 0), got {rows!r}")
            if rows and trace:
                raise ValueError(f"trace mode does not stamp the {name[:-5]} GEMMs: use {name}=0 to trace")
        if prefill_rows and len(self.weights) < 2:
            raise ValueError("prefill_rows needs a second stage to prefill")
        if drain_rows and len(self.weights) != 2:
            raise ValueError(f"drain_rows needs a chain of exactly two stages, got {len(self.weights)}")
        self.prefill_rows, self.drain_rows = prefill_rows, drain_rows
        self.devices = [w.device for w in self.weights]
        self._check_epilogues()
        # what the launches are bound to: the weights and the epilogues' vectors (bias, column
        # sums), by address; an out must overlap none of them (check_output), and none may move
        # (check_weights)
        self._bound_tensors = self.weights + [
            t for e in self.epilogues if e is not None for t in (e.bias, e.col_sum) if t is not None
        ]
        self._weight_spans = [(t.device, *span(t)) for t in self._bound_tensors]
        self._weight_layouts = [signature(t) for t in self._bound_tensors]
        self.distinct_devices = list(dict.fromkeys(self.devices))
        self.on_gpu = self.devices[0].type == "cuda"
        if loopback is not None and not isinstance(loopback, bool):
            raise ValueError(f"loopback must be None, True or False, got {loopback!r}")
        self.loopback = (not self.on_gpu) if loopback is None else loopback
        # the stages each kernel runs: consecutive stages on one device share a chain kernel (at
        # most MAX_STAGES each), unless in loopback, where each stage is a kernel of its own
        self.groups: list[list[int]] = []
        for s, d in enumerate(self.devices):
            last = self.groups[-1] if self.groups else None
            joins = self.devices[last[-1]] == d and self.configs[last[-1]] == self.configs[s] if last else False
            if joins and not self.loopback and len(last) < MAX_STAGES:
                last.append(s)
            else:
                self.groups.append([s])
        self._group_of = [g for g in self.groups for _ in g]
        shared = len(self.distinct_devices) < len(self.devices) if self.on_gpu else len(self.groups) < len(self.devices)
        if shared and has_ends:
            raise ValueError("prefill and drain rows fill a second GPU's idle time: they need the stages on two GPUs")
        if self.on_gpu and self.loopback and sm_budget is not None:
            for d in self.distinct_devices:
                stages = self.devices.count(d)
                if sm_budget < stages:
                    raise ValueError(f"sm_budget={sm_budget} leaves no SM to one of the {stages} stages on {d}")
        if self.on_gpu:
            if any(d.type != "cuda" for d in self.devices):
                raise ValueError(f"the stages must all be on CUDA devices, got {[str(d) for d in self.devices]}")
            for d in self.distinct_devices:
                check_arch(d)
            for s, d in enumerate(self.devices[1:], 1):
                if self.devices.index(d) != s and self.devices[s - 1] != d:
                    raise ValueError(
                        f"each GPU must hold a contiguous range of stages, got {[str(d) for d in self.devices]}"
                    )
            fabric.enable_peer_access([d.index for d in self.devices])
            for s, epi in enumerate(self.epilogues):  # a residual read on the GPU before: the other way
                if epi is not None and epi.residual and self.devices[s] != self.devices[s - 1]:
                    fabric.enable_peer_access([self.devices[s].index, self.devices[s - 1].index], atomics=False)
            # a stream per stage; outside loopback one per device, so that the chain kernels of a
            # GPU with more than MAX_STAGES stages run one after the other, each on the whole GPU
            own = {d: torch.cuda.Stream(d) for d in self.distinct_devices}
            self.streams = [torch.cuda.Stream(d) if self.loopback else own[d] for d in self.devices]
            self._raw_streams = [st.cuda_stream for st in self.streams]
            self._device_indices = [d.index for d in self.distinct_devices]
            self._kernel_streams = list(dict.fromkeys(self.streams))  # each once: a call joins back from them
            # capture() captures on a stream of its own, on stage 0's device
            self._capture_stream = torch.cuda.Stream(self.devices[0])
        self._capture_owner = new_capture_owner()  # captured GEMMs' buffers: this pipeline's alone
        # one GPU and one kernel stream (no loopback): an eager call queues its work on the caller's
        # stream itself, as a graph replay does (_launch_direct)
        self._direct = self.on_gpu and len(self.distinct_devices) == 1 and not self.loopback and segment is None
        self.always_pipelined = always_pipelined
        # every stage on one device, nothing that asks for the pipeline there (MLPStack reads it too)
        self.free_on_one_device = (
            not always_pipelined and len(self.distinct_devices) == 1 and not self.loopback and not trace
            and sm_budget is None and segment is None
        )  # fmt: skip
        # the prefill GEMM's weight on stage 1's device, the drain's second on stage 0's: replicas,
        # refreshed when their source changes in place (its version counter moves)
        self._replicas: list[list] = []  # [source, replica, source version at the copy]
        self.prefill_weight = self._replica(self.weights[0], self.devices[1]) if prefill_rows or ends else None
        self.drain_weight = self._replica(self.weights[1], self.devices[0]) if drain_rows or ends else None
        self._plans: collections.OrderedDict[int, Plan] = collections.OrderedDict()
        self.tuned_ends: dict[int, tuple[int, int]] = {}  # M -> (R, D) chosen by tune_ends
        self.tuning: dict[int, dict[tuple[int, int], float]] = {}  # M -> median ms of each candidate
        self._lock = threading.RLock()  # one call (or replay) at a time on the host
        self._done: list = []  # events: the end of the last call on every stage's stream
        # one-after-another eager calls' GEMMs, bound per (signature of x, of out, stream): _bound_call
        self._bound_calls: collections.OrderedDict = collections.OrderedDict()
        # every unfinished call's start (on the caller's streams) and end (on the kernels'), with
        # which host waits tell the caller's work from the pipeline's (_wait)
        self._in_flight = InFlight()
        self._after_done: list[int] = []  # per device, the current stream (raw handle) that waited for them
        self._pending: dict[Plan, list] = {}  # plan -> its last eager call's end events, words unread
        self._broken: str | None = None  # why this pipeline refuses calls (a device did not finish)
        # a call was captured in a graph of the caller's own: its replays run on the caller's
        # streams unseen (no end recorded), so host waits also wait for those streams (_wait)
        self._in_callers_graphs = False
        self._capturing_own = False  # capture() or tune_ends() captures (their replays record an end, or sync)

    def _check_epilogues(self) -> None:
        """Each stage's epilogue fits its GEMM and its place in the chain (docstring)."""
        first = self.segment.first_stage if self.segment is not None else 0  # stages as the chain numbers them
        for s, (epi, w) in enumerate(zip(self.epilogues, self.weights)):
            if epi is None:
                continue
            epi.check(w.shape[1], w.dtype, w.device, self.configs[s].block_n)
            if epi.residual and s == 0:
                raise ValueError(
                    f"a residual is the input of the stage before: stage {first} has none"
                    + (" in this segment (keep a block's GEMMs in one segment)" if self._inbound else "")
                )
            if epi.residual and self.out_cols[s] != self.weights[s - 1].shape[0]:
                raise ValueError(
                    f"stage {first + s}'s residual (stage {first + s - 1}'s input, {self.weights[s - 1].shape[0]} "
                    f"columns) does not match its {self.out_cols[s]} output columns"
                )
            if epi.residual and w.device.type == "cuda" and not fits_loaded_residual(self.configs[s]):
                raise ValueError(
                    f"stage {first + s} loads its residual tile in its epilogue, and {self.configs[s]} leaves no "
                    "shared memory for it: use kernels.gemm.RESIDUAL_CONFIG's tiles"
                )

    def _norm_sums(self, s: int) -> bool:
        """Whether stage ``s`` normalises its input with the partial sums the stage before leaves
        (stage ``s - 1``, or for a segment's stage 0 the previous segment's last)."""
        return (s > 0 or self._inbound) and self.epilogues[s] is not None and self.epilogues[s].norm_eps is not None

    def _sums_parts(self, s: int) -> int:
        """The partial sums of squares per row that stage ``s - 1`` leaves for stage ``s``."""
        return -(-self.weights[s - 1].shape[1] // self.configs[s - 1].block_n)

    @property
    def _inbound(self) -> bool:
        """Whether stage 0 waits on a previous segment's link."""
        return self.segment is not None and self.segment.first_stage > 0

    def where(self, s: int) -> str:
        """Stage ``s`` as errors name it: its number in the chain and where it runs."""
        return f"{self._stage_name(s)} on {self.devices[s]}"

    def _stage_name(self, s: int) -> str:
        """Stage ``s`` by its number in the chain (and a segment's place), for a message that
        names its device after it (:meth:`where`)."""
        seg = self.segment
        if seg is None:
            return f"stage {s}"
        return f"stage {seg.first_stage + s}" + (f" ({seg.where})" if seg.where else "")

    def _replica(self, w: torch.Tensor, device: torch.device) -> torch.Tensor:
        copy = untracked(w).to(device, copy=True)
        self._replicas.append([w, copy, w._version])
        return copy

    def refresh_replicas(self) -> None:
        """Copy every weight into its replica again (after a change PyTorch does not count, such
        as one through ``w.data``); ordered on the current streams like a call."""
        with self._lock:
            self._refresh_replicas(force=True)

    def _refresh_replicas(self, force: bool = False) -> None:
        """Copy each weight whose replica is out of date (changed in place since) again, after
        the previous call (which may still read the replica) on the caller's streams."""
        stale = [rec for rec in self._replicas if force or rec[0]._version != rec[2]]
        if stale and self._capturing():
            raise RuntimeError(
                "a weight changed in place since its replica was made: call the pipeline once outside "
                "the CUDA-graph capture to refresh it"
            )
        if stale and self.on_gpu:  # (the copies run on their source's and wait for their target's stream)
            callers = self._current_streams()
            self._after_last_call(callers)
            self._after_done = [c.cuda_stream for c in callers]
        for rec in stale:
            w, copy, _ = rec
            copy.copy_(untracked(w))
            rec[2] = w._version

    @classmethod
    def on_devices(cls, weights: list[torch.Tensor], devices: list[int] | None = None, **kw) -> Pipeline:
        """Place ``weights[s]`` on ``devices[s]`` (default ``0, 1, ...``) and build the chain."""
        n = len(weights)
        devices = list(range(n)) if devices is None else list(devices)
        if len(devices) != n:
            raise ValueError(f"{n} stages but {len(devices)} devices")
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if max(devices) >= have:
            raise RuntimeError(
                f"a chain of {n} stages on devices {devices} needs {max(devices) + 1} GPUs; found {have}"
            )
        with torch.no_grad():  # a weight moved records no graph; one already there is the weight itself
            placed = [w.to(f"cuda:{d}") for w, d in zip(weights, devices)]
        return cls(placed, **kw)

    def plan_configs(self, M: int) -> list[GemmConfig]:
        """Each stage's configuration in the plan of ``M`` rows (a plan height): the
        constructor's, or, built without one (``config=None``; and without ends, prefill or
        drain rows, epilogues or a segment), the measured table's row for ``M``
        (:data:`PIPELINE_TABLE`, :func:`~ctapipelining.gemm.pick_config`): the fastest of
        ``benchmarks/configs.py``'s candidates for two 8192-wide stages in one chain kernel on one
        H200 at each plan height (``benchmarks/results/2026-12-01-h200-configs/run11-parts/``).
        Few rows take narrow tiles (64 x 128 up to 128 rows, 128 x 128 up to 256: more CTAs busy),
        taller plans 128 x 256 tiles, with the last partial round split along K where that is
        faster by more than 1% (at 128 and 640 rows), and a consumer in the same kernel as its
        producer waits as the row says: for whole row-blocks at 256-16384 rows but 640 (the
        combined order places its input rows about a round before it, so parts would mostly add
        waits: 0.6-1.0% faster from 1024 to 16384 rows,
        ``benchmarks/results/2026-12-01-h200-chain/overhead/``). A consumer whose producer is
        another kernel (another GPU, a loopback) waits in :data:`PIPELINE_CONFIG`'s parts, where
        waiting in parts measured a gain (``benchmarks/results/2026-11-30-h200x2-parts/``); its
        other fields are the row's, measured on one GPU."""
        if self._per_height:
            cfg = pick_config(config_table(PIPELINE_TABLE), M)
            across = dataclasses.replace(cfg, wait_parts=PIPELINE_CONFIG.wait_parts)
            return [across if s and not self._same_kernel(s - 1, s) else cfg for s in range(len(self.weights))]
        return self.configs

    @property
    def one_after_another(self) -> bool:
        """Whether a call runs the stages one after another as plain GEMMs
        (:func:`~ctapipelining.serial.stage_gemm`: ours in its configuration for the call's rows,
        or cuBLAS's where it measured faster)
        rather than pipelined: with every stage on one device and nothing that fixes how they
        run (no configuration, epilogues, ends, segment, trace, SM budget or loopback, and not
        ``always_pipelined``), since on one GPU that is faster (module docstring). Such a call
        has no waits, so nothing of it can time out, and builds no plan."""
        return self.free_on_one_device and self._per_height

    def _one_after_another(self, x: torch.Tensor, out: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The stages on ``x`` one after another, each a plain GEMM (the last into ``out``):
        their outputs, the last one last. Captured, with launches of this pipeline's own (their
        split tails' buffers: graphs of another pipeline, whose replays this one does not order,
        never share them)."""
        ys, last = [x], len(self.weights) - 1
        with captures_owned_by(self._capture_owner):
            for s, w in enumerate(self.weights):
                ys.append(stage_gemm(ys[-1], w, out=out if s == last else None))
        return ys[1:]

    def _call_one_after_another(self, x: torch.Tensor, out: torch.Tensor | None, capturing: bool) -> torch.Tensor:
        """:meth:`_one_after_another` as a checked call (``capturing``: into a CUDA graph),
        ordered as every call is (see the module docstring): on the caller's current stream,
        after the previous call's end when that was issued from another stream; its own end
        recorded for the next call. An eager call then binds its launches to its operands'
        signatures, for :meth:`_bound_call`."""
        index = self._device_indices[0] if self.on_gpu else None
        if self.on_gpu and torch.cuda.current_device() != index:
            with torch.cuda.device(index):
                return self._call_one_after_another(x, out, capturing)
        if not self.on_gpu or capturing:  # (a captured call: the graph's replay keeps the order)
            return self._one_after_another(x, out)[-1]
        caller = self._caller_after_last_call()
        start = self._in_flight.record([caller])
        try:
            ys = self._one_after_another(x, out)
        finally:  # what was queued stays ordered before the next call, also if a GEMM failed to launch
            self._end_call_on(caller, start)
        bound = BoundGemms.of([x, *ys], self.weights, caller.cuda_stream) if self._bindable(x, out) else None
        if bound is not None:
            self._bound_calls[signature(x), None if out is None else signature(out), caller.cuda_stream] = bound
            while len(self._bound_calls) > MAX_BOUND_CALLS:
                self._bound_calls.popitem(last=False)
        return ys[-1]

    @staticmethod
    def _bindable(x, out) -> bool:
        """Whether a call on ``x`` and ``out`` may bind its GEMMs or launch bound ones (each
        :func:`~ctapipelining.operands.bindable`)."""
        return bindable(x) and (out is None or bindable(out))

    def _bound_call(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor | None:
        """An eager call of :attr:`one_after_another` whose operands have the signatures
        (:func:`~ctapipelining.operands.signature`) of an earlier checked call's on the same stream:
        it launches the GEMMs bound then (:class:`~ctapipelining.serial.BoundGemms`) without the
        checks they passed (the weights' layouts are checked by the caller), ordered as
        :meth:`_call_one_after_another` orders a call. None where there is no such call, or
        operands it does not bind (:meth:`_bindable`), a capture, another current device or a
        profiler's launch hooks: the checked path then."""
        stream = bound_stream(self._device_indices[0]) if self._bindable(x, out) else None
        if stream is None:
            return None
        key = (signature(x), None if out is None else signature(out), stream)
        bound = self._bound_calls.get(key)
        if bound is None:
            return None
        self._bound_calls.move_to_end(key)
        caller = self._caller_after_last_call()
        start = self._in_flight.record([caller])
        try:
            return bound(x, self.weights, out, stream)
        finally:
            self._end_call_on(caller, start)

    def stage_config(self, s: int, configs: list[GemmConfig] | None = None) -> GemmConfig:
        """The configuration stage ``s`` runs (of ``configs``: a plan's, :meth:`plan_configs`;
        default the constructor's), without a split tail for a
        ``workqueue`` consumer (it runs whole tiles in readiness order) and for a chain
        kernel's stages but its last (the tail of the combined order lies in the last stage:
        :func:`ctapipelining.chain.chain_tail_split`), and without ``split_k`` for either (a
        chain kernel's rounds are its combined order's). The sequential GEMMs with these
        configurations (and a chain kernel's tail split, :func:`ctapipelining.chain.chain_tail_split`:
        the last stage run alone with this configuration splits its own tail, not the chain's) give
        bitwise the chain's result."""
        consumer = s > 0 or self._inbound
        queue_consumer = consumer and self.policy.uses_queue and not self._same_kernel(s - 1, s)
        group = self._group_of[s]
        cfg = (configs or self.configs)[s]
        off = {}
        if cfg.split_tail and (queue_consumer or len(group) > 1 and s != group[-1]):
            off["split_tail"] = False
        if cfg.split_k and (queue_consumer or len(group) > 1):
            off["split_k"] = False
        return dataclasses.replace(cfg, **off) if off else cfg

    def sequential(self, x: torch.Tensor) -> torch.Tensor:
        """The same GEMMs one after another, each with its stage's configuration in the plan for
        ``x``'s rows (with :attr:`one_after_another`, what a call runs: each GEMM as
        :func:`~ctapipelining.serial.stage_gemm` runs it for ``x``'s rows), no pipelining: what a
        call must equal bitwise (a reference for tests and benchmarks)."""
        return self._sequential(x)[0]

    def _sequential(self, x: torch.Tensor, sums=None) -> tuple[torch.Tensor, object]:
        """:meth:`sequential`, and for a segment: ``sums``, the partial sums of ``x``'s rows that
        the previous segment's last stage leaves (for stage 0's norm); returns the result and
        the partial sums the last stage leaves for the next segment's norm (or None)."""
        self.check_input(x)
        if self.one_after_another:  # what a call runs then
            return self._one_after_another(x)[-1], None
        rows, M = x.shape[0], self.rows_for(x.shape[0])
        if M > rows:  # the plan's height, rows past x's zeros (a split tail depends on the height)
            x = torch.cat([x, x.new_zeros(M - rows, x.shape[1])])
        R, D = self.ends_for(M)
        configs = self.plan_configs(M)
        y, prev = x, None
        # with epilogues, or partial sums to leave for the next segment's norm: no ends (checked)
        fused = any(self.epilogues) or (self.segment is not None and self.segment.out_norm is not None)
        for s, w in enumerate(self.weights):
            if fused:
                y, sums = y.to(w.device), sums_to(sums, w.device)
                prev = None if prev is None else prev.to(w.device)  # a residual from the GPU before
                out_sums = self._out_sums(s, M, w.device)
                y, prev = self._gemm(y, w, s, False, configs, residual=prev, sums=sums, out_sums=out_sums), y
                sums = out_sums
                continue
            # cut as the pipeline cuts the rows: the prefill [0, R), the drain [M - D, M) (whose
            # GEMMs run stage 0's configuration), the pipelined rest
            cuts = sorted({0, M} | ({R, M - D} if s == 0 else {M - D} if s == 1 else set()))
            y = y.to(w.device)
            y = torch.cat([self._gemm(y[a:b], w, s, a == M - D, configs) for a, b in zip(cuts, cuts[1:])])
        return y[:rows], (sums if fused else None)

    def _out_sums(self, s: int, M: int, device: torch.device | None = None):
        """The rows' partial sums stage ``s`` leaves for stage ``s + 1``'s norm (on ``device``,
        default stage ``s + 1``'s): the sums of squares for an RMSNorm, ``(sums of squares,
        sums)`` for a LayerNorm; or None."""
        if s + 1 < len(self.weights):
            norm = self._norm_sums(s + 1) and self.epilogues[s + 1].norm_kind
        else:  # the next segment's first stage's (its plan's link carries them; see _build_plan)
            norm = self.segment.out_norm if self.segment is not None else None
        if not norm:
            return None
        device = device or self.devices[min(s + 1, len(self.weights) - 1)]
        sums = [torch.zeros(M, self._sums_parts(s + 1), dtype=torch.float32, device=device) for _ in "ab"]
        return tuple(sums) if norm == "layer" else sums[0]

    def _gemm(
        self, a: torch.Tensor, w: torch.Tensor, s: int, drain: bool, configs: list[GemmConfig],
        residual: torch.Tensor | None = None,
        sums: torch.Tensor | None = None, out_sums: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """``a @ w`` alone, as stage ``s`` (or, ``drain``, a drain GEMM on stage 0's GPU) runs
        it in a call: its configuration (of the plan's ``configs``) and its grid (a split tail
        depends on the grid); with stage ``s``'s epilogue, its ``residual`` and the partial sums
        of squares of its input (``sums``) and where its output's go (``out_sums``)."""
        stream = 0 if drain else s
        (rows, K), N = a.shape, w.shape[1]
        epi = None if drain else self.epilogues[s]
        c = torch.empty(rows, N if epi is None else epi.out_cols(N), dtype=w.dtype, device=w.device)
        cfg, split = self.stage_config(stream, configs), None
        group = self._group_of[s]
        if not drain and len(group) > 1 and cfg.split_tail:  # a chain kernel's last stage: its tail split
            shapes = [tuple(self.weights[t].shape) for t in group]
            split = chain_tail_split(rows, shapes, cfg, self._chain_grid(group, rows, configs[group[0]]))
            if split is None:
                cfg = dataclasses.replace(cfg, split_tail=False)
        grid = self._grid(stream, rows, N, K, cfg)  # (a chain's tail: on its share, whatever cfg's own split)
        if split is not None:
            grid = max(grid, split.items)
        launch = GemmLaunch(
            rows, N, K, cfg, grid, w.device, split=split, epilogue=epi, norm_sums=sums if self._norm_sums(s) else None,
            out_sums=out_sums,
        )  # fmt: skip
        with torch.cuda.device(w.device) if self.on_gpu else contextlib.nullcontext():
            launch(a, w, c, residual=residual if epi is not None and epi.residual else None)
        return c

    def ends_for(self, M: int) -> tuple[int, int]:
        """``(R, D)``: the rows the second GPU prefills and the first GPU drains in a call on
        ``M`` rows: what :meth:`tune_ends` chose, else ``prefill_rows`` and ``drain_rows`` (or
        :func:`ctapipelining.deps.balanced_ends`), cut by :meth:`_cut_ends`."""
        if M in self.tuned_ends:
            return self.tuned_ends[M]
        R, D = self._rule_ends(M) if self.ends == "balanced" else (self.prefill_rows, self.drain_rows)
        return self._cut_ends(M, R, D)

    def _rule_ends(self, M: int) -> tuple[int, int]:
        """:func:`ctapipelining.deps.balanced_ends` for this chain on ``M`` rows (not cut)."""
        cfg, (n0, n1) = self.config, (w.shape[1] for w in self.weights)
        return deps.balanced_ends(M, n0, n1, cfg.block_m, cfg.block_n, num_sms(self.devices[0]))

    def _cut_ends(self, M: int, R: int, D: int) -> tuple[int, int]:
        """``R`` and ``D`` cut so that the producer keeps at least one row (the drain first)."""
        bm = self.config.block_m
        D = max(0, min(D, (M - 1) // bm * bm))
        return max(0, min(R, (M - D - 1) // bm * bm)), D

    def end_candidates(self, M: int, factors=TUNE_FACTORS) -> list[tuple[int, int]]:
        """What :meth:`tune_ends` tries on ``M`` rows: no ends at all, and the rule's drain with
        the rule's prefill times each of ``factors`` (numbers >= 0; rounded down to row-blocks),
        each cut as a call would cut it, and the rule's ends (what a candidate must beat), without
        repeats."""
        if self.ends != "balanced":
            raise ValueError(
                "tune_ends and end_candidates need Pipeline(ends='balanced') (it keeps the weight replicas)"
            )
        M = plan_rows(M)
        factors = None if isinstance(factors, (str, numbers.Number)) else tuple(factors)
        if factors is None or not all(_real(f) and 0 <= f < float("inf") for f in factors):
            raise ValueError("factors must be a sequence of finite numbers >= 0 (the rule's prefill times each)")
        bm, (R, D) = self.config.block_m, self._rule_ends(M)
        cands = [(0, 0)] + [self._cut_ends(M, int(R * f) // bm * bm, D) for f in factors] + [self._cut_ends(M, R, D)]
        return list(dict.fromkeys(cands))

    def tune_ends(
        self, M: int, reps: int = 30, warmup: int = 10, factors=TUNE_FACTORS, margin: float = TUNE_MARGIN
    ) -> tuple[int, int]:
        """Time the chain on ``M`` rows with each of :meth:`end_candidates` and keep the fastest
        for ``M`` if it beats the rule's ends by more than ``margin`` (else the rule's): later
        calls on ``M`` rows use it. Why: the best prefill depends on the two GPUs' own speeds
        under load, which differ from machine to machine
        (benchmarks/results/2026-11-30-h200x2-ends/).

        Each candidate is captured in a CUDA graph and replayed ``warmup`` times, then ``reps``
        times timed, on random input, all candidates taking turns in a shuffled order
        (:func:`ctapipelining.timing.time_interleaved`). These are calls back to back, both GPUs
        at their power cap all the time, so the medians run above a call's time in the bench
        (where GPU 1 idles while single-GPU methods run), and the best prefill there can differ
        (see :data:`TUNE_MARGIN`). The medians are kept in :attr:`tuning` ``[M]``. GPU only,
        ``ends="balanced"`` only, and before the first call on ``M`` rows (a graph captured
        earlier points at that plan). Returns ``(prefill_rows, drain_rows)``.
        """
        for name, v, least in (("reps", reps, 1), ("warmup", warmup, 0)):
            if not isinstance(v, int) or isinstance(v, bool) or v < least:
                raise ValueError(f"{name} must be an int >= {least}, got {v!r}")
        if not (_real(margin) and 0 <= margin < 1):
            raise ValueError(f"margin must be a fraction in [0, 1), got {margin!r}")
        M = plan_rows(M)
        with self._lock:  # the candidates' launches share the pipeline's streams and events
            cands = self.end_candidates(M, factors)  # refuses a pipeline without ends="balanced"
            if not self.on_gpu:
                raise RuntimeError("tune_ends times CUDA graphs: it needs the stages on GPUs")
            if M in self._plans:
                raise RuntimeError(f"tune_ends({M}) must come before the first call on {M} rows (it builds their plan)")
            w0 = self.weights[0]
            x = torch.randn(M, w0.shape[0], device=self.devices[0]).to(w0.dtype)
            out = torch.empty(M, self.out_cols[-1], dtype=w0.dtype, device=self.devices[-1])
            plans, graphs, methods = {}, [], []
            for cand in cands:
                plan = plans[cand] = self._build_plan(M, *cand)
                self._launch(plan, x, out)  # compiles; checked below
                self.check_errors(plan)
                self._wait()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.device(self.devices[0]), torch.cuda.graph(g):
                    self._launch(plan, x, out)
                graphs.append(g)
                methods.append(Method(f"{cand[0]},{cand[1]}", g.replay))
            times = time_interleaved(methods, [d.index for d in self.devices], reps, warmup)
            for plan in plans.values():
                self.check_errors(plan)
            medians = {cand: statistics.median(times[m.name]) for cand, m in zip(plans, methods)}
            del graphs, methods, g  # before the plans they point at
            rule = self._cut_ends(M, *self._rule_ends(M))  # (one of the candidates)
            best = faster_by(medians, rule, margin)
            self.reset(plans[best])  # its replays advanced the device's epochs, not the plan's count
            plans[best].pinned = False  # its graphs are gone
            self.tuning[M] = medians
            self.tuned_ends[M] = best
            self._keep(M, plans[best])
            return best

    # -- state -------------------------------------------------------------------------------
    def rows_for(self, M: int) -> int:
        """The height of the plan that serves inputs of ``M`` rows (see ``row_buckets``)."""
        return deps.bucket_rows(M, self.config.block_m, self.row_buckets)

    def plan(self, M: int) -> Plan:
        """The plan that serves inputs of ``M`` rows, of :meth:`rows_for` ``(M)`` rows (built on
        first use; the :attr:`max_plans` most recently used are kept)."""
        B = self.rows_for(plan_rows(M))
        with self._lock:
            plan = self._plans.get(B)
            if plan is None:
                plan = self._keep(B, self._build_plan(B, *self.ends_for(B)))
            self._plans.move_to_end(B)
            return plan

    def _keep(self, M: int, plan: Plan) -> Plan:
        """Keep ``plan`` for ``M`` rows; free the least recently used unpinned plans beyond
        :attr:`max_plans`, once the devices are done with them (bounded wait: where the caller's
        work queued before a call in flight does not finish in time, the call raises
        ``TimeoutError``, the plan kept, the others freed at the next new plan instead)."""
        self._plans[M] = plan
        evict = [m for m, p in self._plans.items() if not p.pinned and m != M][
            : max(0, len(self._plans) - self.max_plans)
        ]
        if evict and self._capturing():
            evict = []  # no waiting inside a capture: evict at a later call
        if evict:
            self._wait(callers=False)  # a call in flight may still use their buffers (no graph uses them)
            unread = [p for p in (self._plans.pop(m) for m in evict) if self._pending.pop(p, None) is not None]
            failed = [(p.M, self.error_messages(self._read(p.errors))) for p in unread]
            failed = [failed_call(M, msgs) for M, msgs in failed if msgs]
            if failed:  # their last calls' errors are not lost with them
                raise PipelineTimeout(". ".join(failed) + ". Those plans are freed; the next call starts clean.")
        return plan

    def _build_plan(self, M: int, R: int, D: int) -> Plan:
        """A plan for ``M`` rows whose second GPU prefills ``R`` and first GPU drains ``D``:
        buffers, scoreboards, and every launch of a call bound once."""
        ws, devs, n, epis = self.weights, self.devices, len(self.weights), self.epilogues
        configs = self.plan_configs(M)
        cfg = configs[0]
        P = M - D  # the rows the pipelined stages carry
        # each stage's output tiles (half as wide as its GEMM's with a gated epilogue)
        grids = [
            deps.TileGrid(P, self.out_cols[s], cfg.block_m, configs[s].block_n * self.out_cols[s] // w.shape[1])
            for s, w in enumerate(ws)
        ]
        links, inputs = [], [None]
        # link_queue[s]: the link into stage s waits on a ring (workqueue between kernels; a
        # link inside a chain kernel waits on counters, in parts)
        link_queue = [self.policy.uses_queue and not self._same_kernel(s - 1, s) for s in range(n)]
        for s in range(1, n):
            dep = link_dependency(grids[s - 1], grids[s], ws[s].shape[0], link_queue[s], configs[s])
            links.append(Link.create(dep, devs[s - 1], devs[s]))
            inputs.append(torch.empty(P, ws[s].shape[0], dtype=ws[0].dtype, device=devs[s]))
        if R:  # the prefill GEMM reads the CSR lists from its own device
            links[0].local_lists = SignalLists.create(links[0].dep, devs[1])
        # a segment's links to the segments before and after it (built by the caller)
        inbound, outbound = self.segment.links(M) if self.segment is not None else (None, None)
        queue = self.policy.uses_queue
        wait_in = inbound.wait_hook(queue) if inbound is not None else None
        signal_out = outbound.signal_hook(queue) if outbound is not None else None
        plan = Plan(
            M=M,
            inputs=inputs,
            links=links,
            # a run count per kernel: the stages of a chain kernel share one
            epochs=[t for g in self.groups for t in [i64_zeros(1, devs[g[0]])] * len(g)],
            errors=[i64_zeros(len(ERR_FIELDS), d) for d in devs],
            traces=[
                torch.full((g.num_tiles, TRACE_FIELDS.value), -1, dtype=torch.int64, device=d) if self.trace else None
                for g, d in zip(grids, devs)
            ],
            tails=[],
            num_ctas=[],
            prefill_rows=R,
            prefill_x=torch.empty(R, ws[0].shape[0], dtype=ws[0].dtype, device=devs[1]) if R else None,
            drain_rows=D,
            drain_h=torch.empty(D, ws[0].shape[1], dtype=ws[0].dtype, device=devs[0]) if D else None,
            err_host=[torch.zeros(len(ERR_FIELDS), dtype=torch.int64, pin_memory=self.on_gpu) for _ in devs],
            inbound=inbound,
            # stage 0's from the previous segment (its link), the others' from the stage before
            sums=[inbound.sums if inbound is not None else None] + [self._out_sums(s - 1, P) for s in range(1, n)],
            configs=configs,
        )

        def epilogue_of(s: int, lo: int = 0) -> tuple[dict, tuple]:
            """Stage ``s``'s epilogue as launch arguments, and its residual operand (or nothing)."""
            res = () if epis[s] is None or not epis[s].residual else (("x", lo, P) if s == 1 else inputs[s - 1][lo:P],)
            out_sums = plan.sums[s + 1] if s + 1 < n else (outbound.sums if outbound is not None else None)
            return dict(epilogue=epis[s], norm_sums=plan.sums[s], out_sums=out_sums), res

        def bind(stream, rows, w, s_cfg, a, c, stage=None, **hooks):
            """A launch on ``rows`` rows of ``w`` on stage ``stream``'s stream, its grid within that
            stage's share of its GPU; ``stage``: the stage it is (None: a prefill or drain GEMM)."""
            dev = devs[stream]
            ctas = self._grid(stream, rows, w.shape[1], w.shape[0], s_cfg)
            split = tail_split(rows, w.shape[1], w.shape[0], s_cfg, ctas)
            tail = None if split is None else TailBuffers.create(split, s_cfg, dev)
            plan.tails.append(tail)
            epi, res = epilogue_of(stage) if stage is not None else ({}, ())
            gemm = GemmLaunch(
                rows, w.shape[1], w.shape[0], s_cfg, ctas, dev, tail=tail, timeout_ns=self.timeout_ns,
                err=plan.errors[stream], stage=stream, **hooks, **epi,
            )  # fmt: skip
            plan.launches.append(Launch(stream, gemm, [(a, w, c, *res)], () if stage is None else (stage,)))
            return ctas

        def bind_chain(group):
            """One chain kernel over the stages of ``group`` (consecutive, on one GPU)."""
            dev = devs[group[0]]
            ctas = self._chain_grid(group, P, configs[group[0]])
            plan.tickets.append(i64_zeros(1, dev))
            stages = [
                ChainStage(
                    ws[s].shape[1],
                    ws[s].shape[0],
                    wait=links[s - 1].wait_hook(link_queue[s]) if s > 0 else wait_in,
                    signal=links[s].signal_hook(link_queue[s + 1]) if s < n - 1 else signal_out,
                    err=plan.errors[s],
                    trace=plan.traces[s],
                    stage=s,
                    **epilogue_of(s)[0],
                )  # fmt: skip
                for s in group
            ]
            gemm = ChainLaunch(
                P, stages, self.stage_config(group[-1], configs), ctas, dev, ticket=plan.tickets[-1],
                epoch=plan.epochs[group[0]], queue=queue, timeout_ns=self.timeout_ns,
            )  # fmt: skip
            plan.tails.append(gemm.tail)  # its split tail's arrival counters (reset after a timeout)
            ops = [
                (("x", 0, P) if s == 0 else inputs[s], ws[s], ("out", 0, P) if s == n - 1 else inputs[s + 1])
                + epilogue_of(s)[1]
                for s in group
            ]
            plan.launches.append(Launch(group[0], gemm, ops, tuple(group)))
            plan.num_ctas.extend([ctas] * len(group))

        first = R // cfg.block_m * links[0].dep.producer.num_n if R else 0  # producer tile of row R
        for group in self.groups:
            if len(group) > 1:
                bind_chain(group)
                continue
            s = group[0]
            if s == 1 and R:  # the prefill: rows [0, R) of stage 0 on stage 1's GPU, before the consumer
                # (a copy of x first: a GEMM reading x across NVLink with TMA is far slower,
                # benchmarks/results/2026-11-30-h200x2-ends/)
                bind(
                    1, R, self.prefill_weight, self.stage_config(0, configs), plan.prefill_x, inputs[1][:R],
                    signal=links[0].signal_hook(queue, local=True), epoch=plan.epochs[1],
                )  # fmt: skip
                plan.launches[-1].copy_x = (plan.prefill_x, R)
            lo = R if s == 0 else 0  # stage 0's producer owns rows [R, P)
            plan.num_ctas.append(
                bind(
                    s,
                    P - lo,
                    ws[s],
                    self.stage_config(s, configs),
                    ("x", lo, P) if s == 0 else inputs[s][lo:P],
                    ("out", lo, P) if s == n - 1 else inputs[s + 1][lo:P],
                    stage=s,
                    wait=links[s - 1].wait_hook(queue) if s > 0 else wait_in,
                    signal=links[s].signal_hook(queue, first if s == 0 else 0) if s < n - 1 else signal_out,
                    epoch=plan.epochs[s],
                    trace=plan.traces[s],
                )  # fmt: skip
            )
            if s == 0 and D:  # the drain, after the producer on its GPU: both layers of rows [P, M)
                bind(0, D, ws[0], self.stage_config(0, configs), ("x", P, M), plan.drain_h, epoch=plan.epochs[0])
                bind(
                    0, D, self.drain_weight, self.stage_config(0, configs), plan.drain_h, ("out", P, M),
                    epoch=plan.epochs[0],
                )  # fmt: skip
        return plan

    def _grid(self, s: int, rows: int, N: int, K: int, cfg: GemmConfig) -> int:
        """The persistent grid of a GEMM of ``rows`` x ``N`` outputs over ``K`` on stage ``s``'s
        stream, in ``cfg`` (the configuration it runs): :func:`~ctapipelining.gemm.launch_grid`
        on the stage's share of SMs, as :func:`~ctapipelining.gemm.matmul` on all of them."""
        return launch_grid(rows, N, K, cfg, self._sm_share(s))

    def _chain_grid(self, group: list[int], rows: int, cfg: GemmConfig) -> int:
        """The persistent grid of a chain kernel over the stages of ``group`` on ``rows`` rows, in
        ``cfg``'s tiles (its stages share one): a CTA per SM of its share, fewer when all its
        stages have fewer tiles."""
        tiles = sum(-(-rows // cfg.block_m) * -(-self.weights[s].shape[1] // cfg.block_n) for s in group)
        return max(1, min(self._sm_share(group[0]), tiles))

    def _sm_share(self, s: int) -> int:
        """The CTAs stage ``s`` may hold: its GPU's SMs (at most :attr:`sm_budget`); in loopback
        shared equally among the stages on it, so that every CTA of every stage there is resident
        at once. (A chain kernel runs every stage of the GPU in one grid; the interpreter runs one
        kernel after another: every stage has the whole CPU.)"""
        sharing = self.devices.count(self.devices[s]) if self.on_gpu and self.loopback else 1
        sms = num_sms(self.devices[s])
        return min(sms, self.sm_budget or sms) // sharing

    def _same_kernel(self, s: int, t: int) -> bool:
        """Whether stages ``s`` and ``t`` run in one chain kernel."""
        return s >= 0 and self._group_of[s] is self._group_of[t]

    def reset(self, plan: Plan | None = None) -> None:
        """Wait for the pipeline's work (bounded), then zero counters, rings, epochs, error
        words, chain kernels' tickets and split tails' arrival counters (on the pipeline's own
        streams, and wait for that: not behind the caller's later work)."""
        with self._lock:
            self._wait()
            plans = [plan] if plan else list(self._plans.values())
            for p in plans:
                for t in p.state():
                    with self._own_stream(t):
                        t.zero_()
            if self.on_gpu:  # the zeroing's end, on the streams it ran on (nothing of the caller's)
                self._wait_for(self._stage_ends())
            for p in plans:
                p.epoch = 0
                p.stale = False
            for p in [plan] if plan else list(self._pending):
                self._pending.pop(p, None)

    def _own_stream(self, t: torch.Tensor):
        """A context in which ``t``'s device's current stream is one of the pipeline's own (idle
        once :meth:`_wait` returned): a copy or fill of ``t`` there queues behind nothing of the
        caller's."""
        if not self.on_gpu or t.device not in self.devices:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.streams[self.devices.index(t.device)])

    def _read(self, tensors: list[torch.Tensor]) -> list[list[int]]:
        """The values of small device tensors (error words), after :meth:`_wait`."""
        return [t.tolist() for t in self._to_host(tensors)]

    def _to_host(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Host copies of device tensors (error words, stamps), after :meth:`_wait`: copied on the
        pipeline's own streams into pinned memory and waited for by event, at most
        :attr:`host_timeout_s` (a stage stream may be shared: torch hands streams out of a pool)."""
        if not self.on_gpu:
            return list(tensors)
        host, events = [], []
        for t in tensors:
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            with self._own_stream(t):
                h.copy_(t, non_blocking=True)
                events.append(("a copy to the host", t.device, torch.cuda.current_stream(t.device).record_event()))
            host.append(h)
        self._wait_for(events)
        return host

    def _wait(self, callers: bool = True) -> None:
        """Wait until the pipeline's work is done: every unfinished call's start and end in the
        order they were made (:mod:`ctapipelining.inflight`), then every stage's stream, each
        at most :attr:`host_timeout_s` after the one before it: a start that does not come in
        time is held up by the caller's own work queued before the call (``TimeoutError``), an
        end or a stage stream by the pipeline's (mark it unusable, raise :class:`PipelineHung`).
        Whatever the caller queued after the last call is not waited for, unless a call was
        captured in a graph of the caller's own (its replays run on the caller's streams and
        record no end): then the current stream of every device is waited for too."""
        if not self.on_gpu:
            return
        events = self._in_flight.events()
        events += self._stage_ends()
        if callers and self._in_callers_graphs:  # their replays: on the caller's streams, with no end of their own
            events += [(CALLERS_STREAM, d, torch.cuda.current_stream(d).record_event()) for d in self.distinct_devices]
        self._wait_for(events)

    def _stage_ends(self) -> list:
        """``(who, device, event)`` for :meth:`_wait_for`: an event recorded now on each stage's
        stream, named by its stage."""
        return [(self._stage_name(s), st.device, st.record_event()) for s, st in enumerate(self.streams)]

    def _wait_for(self, events: list) -> None:
        """Poll ``(who, device, event)`` in order until each event's ``query()`` is true, each at
        most :attr:`host_timeout_s` after the one before it; else raise ``TimeoutError`` for the
        caller's work, or mark the pipeline unusable and raise :class:`PipelineHung`."""
        deadline = time.monotonic() + self.host_timeout_s
        pause = 1e-5
        for who, device, ev in events:
            while not ev.query():
                if time.monotonic() > deadline and who in _CALLERS_WORK:
                    raise TimeoutError(  # the caller's own work (its graphs' replays, its kernels): not ours
                        f"{who} on {device} did not finish within host_timeout_s={self.host_timeout_s:g} s "
                        f"({_CALLERS_WORK[who]}; the pipeline stays usable)"
                    )
                if time.monotonic() > deadline:
                    self._broken = (
                        f"{who} on {device} did not finish within host_timeout_s={self.host_timeout_s:g} s "
                        "(a kernel still runs: the GPU may be unusable until it ends)"
                    )
                    raise PipelineHung(self._broken + "; this Pipeline refuses further calls")
                time.sleep(pause)
                pause = min(2 * pause, 1e-3)
            deadline = time.monotonic() + self.host_timeout_s  # the next event's bound starts here

    def _capturing(self, every_device: bool = False) -> bool:
        """Whether a call now is captured into a CUDA graph (no event queries, waits or
        cross-capture event waits are allowed then): whether the current stream of stage 0's
        device, which a call forks from and joins back to, is capturing. ``every_device``: also
        refuse a capture on another stage device's current stream (the call would run outside
        it, or fail inside it)."""
        if not self.on_gpu:
            return False
        here, first = torch.cuda.current_device(), self._device_indices[0]
        if here == first and (not every_device or len(self._device_indices) == 1):
            return torch.cuda.is_current_stream_capturing()
        devices = self._device_indices + ([here] if every_device and here not in self._device_indices else [])
        capturing = {index: capturing_on(index) for index in (devices if every_device else [first])}
        if every_device and any(c for i, c in capturing.items() if i != first) and not capturing[first]:
            raise RuntimeError(
                f"a capture on another device's stream than cuda:{first}'s: capture a call of this Pipeline on "
                f"the current stream of cuda:{first}, where its stage 0 runs (its call forks from and joins back to it)"
            )
        return capturing[first]

    def _usable(self) -> None:
        if self._broken:
            raise PipelineHung(f"this Pipeline is unusable: {self._broken}")

    # -- running -----------------------------------------------------------------------------
    def check_weights(self) -> None:
        """Refuse a call or replay after the storage or layout of a weight, or of an epilogue's
        bias or column sums, changed (``w.data = ...``, ``w.set_(...)``, ``w.t_()``): the plans'
        launches and graphs are bound to the old ones. Changes of the values in place are fine."""
        if [signature(t) for t in self._bound_tensors] != self._weight_layouts:
            raise RuntimeError(
                "a weight's or an epilogue's bias or column sums' storage or layout changed since this Pipeline "
                "was built (w.data = ..., w.set_, an in-place view op): its plans are bound to the old storage; "
                "build a new Pipeline (in-place updates of the values are fine)"
            )

    def check_input(self, x: torch.Tensor) -> None:
        w0 = self.weights[0]
        ready = tma_ready(x) and x.dtype == w0.dtype and x.device == self.devices[0]
        if ready and x.shape[1] == w0.shape[0] and x.shape[0]:
            return  # the common case, in a few attribute reads
        if isinstance(x, torch.Tensor):
            check_dense(x, "x")
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(f"x must be a 2-D tensor [M, {w0.shape[0]}], got {getattr(x, 'shape', type(x))}")
        if x.dtype != w0.dtype:
            raise TypeError(f"x is {x.dtype}; the chain's weights are {w0.dtype}")
        if x.device != self.devices[0]:
            raise ValueError(f"x is on {x.device}; stage 0 runs on {self.devices[0]}")
        if x.shape[1] != w0.shape[0]:
            raise ValueError(f"x is {tuple(x.shape)}; stage 0 weight is {tuple(w0.shape)}")
        if x.shape[0] == 0:
            raise ValueError("x has no rows")
        check_tensor(x, "x")  # the weights were checked once, at construction

    def check_output(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """``out`` must be a row-major ``[M, N_last]`` tensor on the last stage's device (rows
        may be padded: the last stage then writes them with ordinary stores instead of TMA)
        that shares no memory with ``x``, a weight or an epilogue's vector."""
        last = self.weights[-1]
        check_out(out, x.shape[0], self.out_cols[-1], last.dtype)
        if out.device != self.devices[-1]:
            raise ValueError(f"out is on {out.device}; the last stage writes on {self.devices[-1]}")
        o0, o1 = span(out)
        if overlaps(out, x) or any(d == out.device and o0 < hi and lo < o1 for d, lo, hi in self._weight_spans):
            raise ValueError(
                "out shares memory with x, a weight or an epilogue's bias or column sums: the chain would overwrite "
                "its own operands"
            )

    def __reduce__(self):
        raise TypeError(
            "a Pipeline holds GPU buffers, streams and launches bound to them: it cannot be pickled or copied; "
            "build another from the weights"
        )

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None, check: bool = False) -> torch.Tensor:
        """Run the chain on ``x`` ([M, K_0] on stage 0's device); returns ``[M, N_last]`` on the
        last stage's device (``out`` if given). Does not synchronise: a timeout of this call
        raises :class:`PipelineTimeout` at a later call or at :meth:`check_errors`; an earlier
        call's is raised here, before anything is launched. ``check=True`` waits for this call
        and checks it (the result is then known good). A call on a new plan height beyond
        ``max_plans`` waits for the calls in flight before it frees a plan (bounded, as
        :meth:`check_errors` waits). An eager call of :attr:`one_after_another` on an ``x``
        and ``out`` (or a new output) an earlier call from the same stream had launches the GEMMs
        bound then (:meth:`_bound_call`)."""
        if self.segment is not None:
            raise RuntimeError("this pipeline is a segment of a longer chain: call its DistributedPipeline")
        with self._lock:
            self._usable()
            self.check_weights()
            if self.one_after_another and self.on_gpu and not check:  # operands of an earlier eager call's
                y = self._bound_call(x, out)
                if y is not None:
                    return y
            self.check_input(x)
            if out is not None:
                self.check_output(out, x)
            capturing = self._capturing(every_device=True)
            if not capturing and self._pending:  # no event queries there
                self._raise_finished_errors()
            M, last = x.shape[0], self.weights[-1]
            if self.one_after_another:
                out = self._call_one_after_another(x, out, capturing)
                self._captured_by_caller(capturing)
                if check and not capturing:
                    self._wait()
                return out
            if capturing:  # no plan built (host copies) nor reset (waits) inside a capture
                held = self._plans.get(self.rows_for(M))
                if held is None or held.stale:
                    raise RuntimeError(
                        f"a call on {M} rows captured in a CUDA graph needs its plan built and clean: call the "
                        f"pipeline once on {M} rows outside the capture first"
                        + (" (a failed call left the plan inconsistent)" if held is not None else "")
                    )
            plan = self.plan(M)
            self._refresh_replicas()
            if out is None:
                out = torch.empty(M, self.out_cols[-1], dtype=last.dtype, device=self.devices[-1])
            self._launch(plan, x, out, capturing=capturing)
            self._captured_by_caller(capturing)
            if check and not capturing:
                self.check_errors(plan)
            return out

    def _captured_by_caller(self, capturing: bool) -> None:
        """After a call captured in a graph of the caller's own (not :meth:`capture`'s): its
        replays run on the caller's streams and record no end, so from now on host waits also
        wait for those streams (:meth:`_wait`)."""
        if capturing and not self._capturing_own:
            self._in_callers_graphs = True

    def capture(self, M: int, out: torch.Tensor | None = None) -> GraphedCall:
        """Capture one call on ``M`` rows in a CUDA graph, after an eager warm-up call (which
        compiles the kernels, builds the plan and checks it ran clean).

        Returns a :class:`GraphedCall`: ``y = graphed(x)`` copies ``x`` in and replays, or fill
        ``graphed.x`` yourself and ``graphed.replay()``. It keeps this pipeline, its plan, its
        static input and its output (``out``, or a new ``[M, N_last]`` tensor) alive as long as
        the graph (a call that runs the stages one after another has no plan). To capture the
        pipeline inside a larger graph of your own instead, call it with ``out=`` under your
        capture, after one call outside it (the plan for ``M``, where it pipelines, is then
        pinned too; keep the ``Pipeline`` alive as long as your graph).
        """
        if not self.on_gpu:
            raise RuntimeError("capture needs the stages on CUDA devices (CUDA graphs do not exist on the CPU)")
        if not isinstance(M, int) or M < 1:
            raise ValueError(f"M must be a positive int, got {M!r}")
        w0 = self.weights[0]
        x = torch.randn(M, w0.shape[0], device=self.devices[0]).to(w0.dtype)
        with self._lock:
            out = self(x, out=out, check=True)  # the warm-up call (checks out's shape, dtype and device too)
            self._wait()
            plan = None if self.one_after_another else self.plan(M)
            pinned = plan is not None and plan.pinned
            graph = torch.cuda.CUDAGraph()
            self._capturing_own = True  # its replays record their end (GraphedCall)
            try:
                with torch.cuda.device(self.devices[0]), torch.cuda.graph(graph, stream=self._capture_stream):
                    self(x, out=out)
            except BaseException:
                if plan is not None:  # no graph points at it
                    plan.pinned = pinned
                raise
            finally:
                self._capturing_own = False
            self._wait()
            return GraphedCall(self, plan, graph, x, out)

    def _launch(
        self,
        plan: Plan,
        x,
        out,
        only: list[int] | None = None,
        delay_cycles: dict[int, int] | None = None,
        advance_epoch: bool = True,
        capturing: bool | None = None,
    ):
        """Launch one call's kernels (the plan's launch records, each on its stage's stream).
        For tests and measurements: ``only`` launches a subset of the stages (a prefill with
        stage 1, a drain with stage 0, a chain kernel with its first stage, which names it; a
        call without the consumer leaves the ring's head behind the epoch under ``workqueue``:
        :meth:`reset` before the next full call); ``advance_epoch=False`` launches against the
        current epoch (e.g. the consumer of a run whose producer already ran alone; a chain
        kernel's ticket is then out of step and reported); ``delay_cycles`` sleeps before a
        stage. ``capturing``: :meth:`_capturing`'s answer where the caller has it. Returns
        Triton's compiled kernel of each launched stage (None for the others). A launch that
        fails part way marks the plan stale: the next call resets it first."""
        n = len(self.weights)
        if only is not None and any(not 0 <= s < n or s != self._group_of[s][0] for s in only):
            raise ValueError(
                f"stages {only}: not stages, or a chain kernel's later stage (they launch together, named by the first)"
            )
        if plan.stale:
            self.reset(plan)
        if capturing is None:
            capturing = self._capturing()
        pinned = plan.pinned
        if capturing:
            plan.pinned = True  # a graph now points at its buffers (unless the capture fails below)
        elif (
            self._direct and only is None and not delay_cycles and advance_epoch
            and torch.cuda.current_device() == self._device_indices[0]
        ):  # fmt: skip
            return self._launch_direct(plan, x, out)
        saved = self._current_streams()  # restored at the end: each stage's stream is made current
        # the streams a call forks from and joins back to: the current stream of every stage's
        # device, so that what the caller allocated or reads on any of them (x, out, the result)
        # is ordered with the stages; under capture only the capturing stream (stage 0's device)
        callers = saved[:1] if capturing else saved
        if capturing:  # events of their own, recorded into the graph
            forks = [c.record_event() for c in callers]
        else:  # the call's start (what runs before it on the callers is the caller's work)
            forks = self._in_flight.record(callers) if self.on_gpu else []
        # and the end of the previous call, unless every caller stream has waited for it already
        # (the fork points then follow it; torch's streams come from pools and are never freed,
        # so a handle names one stream; an external stream freed and another created under its
        # handle while the previous call still runs would fool this)
        after = capturing or [c.cuda_stream for c in callers] == self._after_done
        starts = forks + ([] if after else self._done)
        kernels = [None] * n
        done = []
        device = torch.cuda.current_device() if self.on_gpu else None
        try:
            for s in range(n):
                stream = None
                if self.on_gpu:  # torch's own ops below (epoch, copies) run on the current stream
                    st = self.streams[s]
                    torch.cuda.set_stream(st)
                    if s == 0 or st is not self.streams[s - 1]:
                        for ev in starts:
                            st.wait_event(ev)
                    stream = self._raw_streams[s]
                lead = s == self._group_of[s][0]  # the stages of a chain kernel share one epoch
                if lead and not advance_epoch:  # its launches read the last run's epoch again
                    plan.epochs[s].sub_(1)
                if only is None or s in only:
                    for launch in plan.launches:
                        if launch.stream != s:
                            continue
                        for t in launch.stages if delay_cycles else ():
                            if t in delay_cycles:
                                torch.cuda._sleep(delay_cycles[t])
                        kernel = launch.run(x, out, stream)
                        for t in launch.stages:
                            kernels[t] = kernel
                if lead:  # after the stream's launches, which run the epoch after it (kernels/sync.py)
                    plan.epochs[s].add_(1)
                waits = s > 0 or plan.inbound is not None  # else its word stays clear
                if self.on_gpu and waits and not capturing:
                    plan.err_host[s].copy_(plan.errors[s], non_blocking=True)
                if self.on_gpu:  # the caller's stream current again on this device: a later
                    # stage's copy from it (a prefill's x) must not queue behind this stage's kernel
                    torch.cuda.set_stream(saved[self._device_indices.index(self.devices[s].index)])
        except BaseException:
            plan.stale = True
            if capturing:  # the failed capture's graph is discarded
                plan.pinned = pinned
            if self.on_gpu and not capturing:  # what was queued stays ordered before the caller's next work
                joins = self._joined(callers, forks)
                self._done, self._after_done = joins, [c.cuda_stream for c in callers]
                self._pending[plan] = self._done  # (its error words' copies, where queued, end there)
            raise
        finally:
            for st in saved:
                torch.cuda.set_stream(st)
            if device is not None:
                torch.cuda.set_device(device)
        if self.on_gpu and capturing:  # after every stage's waits: a join recorded earlier would order them
            done = [st.record_event() for st in self._kernel_streams]
            for caller in callers:
                for ev in done:
                    caller.wait_event(ev)
        elif self.on_gpu:
            done = self._joined(callers, forks)
        if advance_epoch:
            plan.epoch += 1
        if not capturing:
            if self.on_gpu:
                self._done = done
                self._after_done = [c.cuda_stream for c in callers]
            self._pending[plan] = self._done
        return kernels

    def _joined(self, callers: list, forks: list) -> list:
        """The end of an eager call through the stage streams (an event on each kernel stream),
        recorded with its start ``forks`` (on ``callers``) as a call in flight; the callers wait
        for it."""
        joins = self._in_flight.record(self._kernel_streams)
        self._in_flight.add(
            [(c.device, ev) for c, ev in zip(callers, forks)],
            [(st.device, ev) for st, ev in zip(self._kernel_streams, joins)],
        )
        for caller in callers:
            for ev in joins:
                caller.wait_event(ev)
        return joins

    def _launch_direct(self, plan: Plan, x, out) -> list:
        """:meth:`_launch` of an eager call on one GPU with one kernel stream: every stream
        operation (the kernels, the epoch bumps, the error words' copies, the end's event) goes
        on the caller's current stream, in the order the general path queues them on the stage
        stream, without forking to that stream and joining back (fewer host calls before the
        first kernel). The same ordering: after the previous call's end when it was issued from
        another stream, before whatever the caller queues next."""
        caller = self._caller_after_last_call()
        stream = caller.cuda_stream
        kernels = [None] * len(self.weights)
        start = self._in_flight.record([caller])
        try:
            for s in range(len(self.weights)):
                for launch in plan.launches:
                    if launch.stream == s:
                        kernel = launch.run(x, out, stream)
                        for t in launch.stages:
                            kernels[t] = kernel
                if s == self._group_of[s][0]:  # after its launches (the stages of a chain kernel share one)
                    plan.epochs[s].add_(1)
                if s > 0 or plan.inbound is not None:  # else its word stays clear
                    plan.err_host[s].copy_(plan.errors[s], non_blocking=True)
        except BaseException:
            plan.stale = True
            self._end_call_on(caller, start)  # what was queued stays ordered before the caller's next work
            self._pending[plan] = self._done  # (its error words' copies, where queued, end there)
            raise
        self._end_call_on(caller, start)
        plan.epoch += 1
        self._pending[plan] = self._done
        return kernels

    def _caller_after_last_call(self) -> torch.cuda.Stream:
        """The current stream of stage 0's device (an eager call on one GPU queues its work there,
        :meth:`_launch_direct`, :meth:`_call_one_after_another`), made to wait for the previous
        call's end unless that call was issued from it."""
        caller = torch.cuda.current_stream(self._device_indices[0])
        self._after_last_call([caller])
        return caller

    def _after_last_call(self, callers: list) -> None:
        """Make the streams ``callers`` wait for the previous call's end, unless they are the
        streams that waited for it already."""
        if [c.cuda_stream for c in callers] != self._after_done:
            for c in callers:
                for ev in self._done:
                    c.wait_event(ev)

    def _end_call_on(self, caller: torch.cuda.Stream, start: list) -> None:
        """Record the end of a call queued on ``caller`` (whose start, recorded there after the
        previous call's end, is ``start``): a call in flight, which the next call orders itself
        after."""
        self._done, self._after_done = self._in_flight.end_on(caller, start), [caller.cuda_stream]

    def compile(self, plan: Plan, x: torch.Tensor, out: torch.Tensor) -> None:
        """Compile every kernel of ``plan`` for a call with operands like ``x`` and ``out`` (their
        dtype and ``out``'s row stride), launching nothing: the first call then launches at once.
        No-op under the interpreter."""
        with self._lock:
            for launch in plan.launches:
                with torch.cuda.device(self.devices[launch.stream]) if self.on_gpu else contextlib.nullcontext():
                    launch.run(x, out, None, compile_only=True)

    def _current_streams(self) -> list:
        """The current stream of every stage's device (none on the CPU)."""
        return [torch.cuda.current_stream(i) for i in self._device_indices] if self.on_gpu else []

    def traces(self, M: int) -> list[np.ndarray]:
        """The stamps of the last call with ``M`` rows, per stage ``[tiles, 5]`` (ns; see
        :mod:`ctapipelining.trace`)."""
        if not self.trace:
            raise RuntimeError("this pipeline was built without trace=True")
        with self._lock:
            if self.rows_for(M) not in self._plans:
                raise ValueError(f"no call on {M} rows yet: nothing traced")
            self._wait()
            return [t.numpy() for t in self._to_host(self.plan(M).traces)]

    def check_errors(self, plan: Plan | None = None) -> None:
        """Wait for the pipeline's work (bounded: :class:`PipelineHung`; the caller's work queued
        before a call in flight, bounded apart: ``TimeoutError``), then read the error words of
        ``plan`` (default: every plan); on a timeout reset that plan and raise
        :class:`PipelineTimeout` naming device, stage, CTA and tile."""
        with self._lock:
            self._wait()
            for p in [plan] if plan else list(self._plans.values()):
                self._pending.pop(p, None)
                self._raise_if_failed(p, self._read(p.errors))

    def _raise_finished_errors(self) -> None:
        """Raise an earlier call's timeout if that call has finished (never waits): its error
        words were copied to host memory at its end, behind the events it recorded."""
        for plan, events in list(self._pending.items()):
            if self.on_gpu:
                if not all(ev.query() for ev in events):
                    continue  # still running: read at a later call or check_errors
                failed = any(flag for flag in plan.err_flags)
            else:  # the interpreter ran it to the end
                failed = any(e[0] for e in plan.errors)
            if not failed:
                del self._pending[plan]
            else:  # the device's words (the host copy may be older), reset, raise (pending until then)
                self.check_errors(plan)

    def _raise_if_failed(self, plan: Plan, words: list[list[int]]) -> None:
        msgs = self.error_messages(words)
        if not msgs:
            return
        try:
            self.reset(plan)
        except TimeoutError as e:  # the caller's work: the next call resets the plan first
            plan.stale = True
            raise PipelineTimeout(failed_call(plan.M, msgs) + f". Not reset yet ({e}).") from e
        raise PipelineTimeout(failed_call(plan.M, msgs) + ". State reset; the next call starts clean.")

    def error_messages(self, words: list[list[int]]) -> list[str]:
        """What the error words ``words`` (one per stage, :data:`ERR_FIELDS`) say, one line per
        stage that failed (:func:`~ctapipelining.errors.messages`)."""
        return messages(words, self.where, self.timeout_ns)


__all__ = ["Pipeline", "PipelineTimeout", "PipelineHung", "GraphedCall"]
