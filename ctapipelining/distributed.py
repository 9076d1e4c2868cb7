"""One process per GPU: a chain whose stages run on the ranks of a process group (``torchrun``).

Serving and training engines run one process per GPU. Each rank builds a
:class:`DistributedPipeline` from the weights of *its* stages; the chain is those lists put end
to end in rank order (rank 0 holds the first stages, the last rank the last). Every rank calls
it the same way, once per call of the chain: the first rank with the input, the others with
its row count; the last rank gets the output.

How it maps onto the one-process design (:mod:`ctapipelining.pipeline`): the stages a rank runs
in one launch form a *segment*, an ordinary :class:`~ctapipelining.pipeline.Pipeline` (one chain
kernel, or more for many stages) whose first stage waits on the link from the previous segment
and whose last stage signals the link to the next. The kernels, dependency arrays, policies,
epochs and error words are the same. A rank runs one segment (``loopback=True``: one per
stage, each on an equal share of its GPU's SMs, so that every link of a chain on one GPU goes
through the cross-rank code path; the tests use it).

Memory (:class:`~ctapipelining.fabric.Heap`): what a producer writes on another segment's
rank (that segment's input rows, its scoreboard, its ring's slots and tail, a handshake flag,
and the partial sums of the rows where that segment's first stage normalises its input)
lives in one heap per rank and plan height, the same size on every rank (symmetric memory on
GPUs, addressed through peer pointers: no multicast; shared-memory files for CPU ranks under
the interpreter). Counters and rings are an ordinary part of the heap, not the symmetric
memory's signal pads: the pads are a few KB, and a ring holds a slot per tile. Every rank
computes every rank's layout (:func:`heap_layout`) from the chain's shapes, so a producer
knows where to write without asking.

Handshake (:mod:`ctapipelining.kernels.handshake`): nothing orders the ranks' streams, so each
segment brackets its call with a one-CTA *gate* (wait until the previous segment has started
this call, and the next has finished the one before; then say "started") and a *finish* ("no
longer reading my input"). A consumer's deadline therefore counts from when its producer's gate
runs, however late its rank started (compiling, descheduled; the host queues the segment's
kernels right after the gate, so a host stalled between the two for longer than ``timeout_s``
still times the consumer out), and a producer never overwrites an input its consumer still
reads. The gate's waits are bounded by ``start_timeout_s``.

Errors are collective: a call does not read the error words; :meth:`DistributedPipeline.check_errors`
(every rank calls it, or ``check=True`` on a call) gathers every rank's words, and if any stage
failed, every rank resets its state (epochs start again in step) and raises the same
:class:`~ctapipelining.pipeline.PipelineTimeout`, naming rank, stage and tile. A result is known
good only then. Host waits for this rank's GPU are bounded (``host_timeout_s``); a wait for a
peer rank in a host collective by the gloo group's timeout (``meet_timeout_s``; a gloo
``group``'s own).

Fused epilogues (``epilogues``: a transformer block's norm, activation, bias, residual) run as
in a one-process pipeline; a residual is read on its own rank, so a stage that adds one shares
a segment with the stage before it (a block's GEMMs stay on one rank).

Plan building, eviction and the error check are collective: every rank must make the same calls
(the same row counts, in the same order); building a plan checks that the ranks agree on its
height; calls on different row counts whose plans both exist show up as a start timeout.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import functools
import socket
import threading
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import deps, fabric, hostgroup
from .epilogue import Epilogue
from .errors import PipelineHung, PipelineTimeout
from .gemm import capturing_on, num_sms
from .inflight import InFlight
from .kernels.gemm import PIPELINE_CONFIG, GemmConfig
from .kernels.handshake import finish, gate
from .operands import check_out, check_weight, overlaps
from .pipeline import (
    CALLERS_STREAM,
    MAX_PLANS,
    ROW_BUCKETS,
    Pipeline,
    check_row_buckets,
    check_seconds,
    is_seconds,
    plan_rows,
)
from .plan import Link, Plan, Segment, SignalLists
from .plan import link_dependency as _link_dependency

ALIGN = 256  # bytes: every heap region starts on this boundary (TMA wants 16; a cache line is 128)
HANDSHAKE_WARPS = 1
# DistributedPipelines built in this process, per process group (the group object: a group made
# after the process group is initialised again counts anew; by name for a group object that takes
# no weak reference): each one's serial
_BUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BUILT_BY_NAME: dict[str, int] = {}


def _count_built(group, change: int) -> int:
    """The number of pipelines built on ``group`` in this process, moved by ``change``."""
    try:
        n = _BUILT[group] = _BUILT.get(group, 0) + change
    except TypeError:
        n = _BUILT_BY_NAME[group.group_name] = _BUILT_BY_NAME.get(group.group_name, 0) + change
    return n


@dataclass(frozen=True)
class Placement:
    """Which rank runs which stages, and in which launches (segments).

    ``shapes[s]``: stage ``s``'s weight ``(K_s, N_s)``; ``rank_of[s]``: its rank;
    ``segments[i]``: the stages segment ``i`` runs (consecutive, one rank), in chain order.
    With fused epilogues (:func:`stage_spec`): ``out_cols[s]``, its output columns (half of
    ``N_s`` with a gated epilogue), ``configs[s]``, its tiles, ``norms[s]``, the norm of its
    input (``"rms"``, ``"layer"`` or None), ``residuals[s]``, whether it adds one; empty:
    ``N_s``, :func:`heap_layout`'s configuration, no norms, no residuals."""

    shapes: tuple[tuple[int, int], ...]
    rank_of: tuple[int, ...]
    segments: tuple[tuple[int, ...], ...]
    out_cols: tuple[int, ...] = ()
    configs: tuple[GemmConfig, ...] = ()
    norms: tuple[str | None, ...] = ()
    residuals: tuple[bool, ...] = ()

    def cols(self, s: int) -> int:
        """Stage ``s``'s output columns."""
        return self.out_cols[s] if self.out_cols else self.shapes[s][1]

    def norm(self, s: int) -> str | None:
        """The norm of stage ``s``'s input (None: none, or past the chain's end)."""
        return self.norms[s] if self.norms and s < len(self.norms) else None

    @classmethod
    def of(cls, per_rank: list[list[tuple]], loopback: bool = False) -> Placement:
        """The chain made of each rank's stages (``per_rank[r]``: rank ``r``'s weight shapes
        ``(K, N)``, or :func:`stage_spec` tuples, in order)
        put end to end; one segment per rank (``loopback``: per stage). Raises a clear error for
        a rank without stages or shapes that do not chain."""
        world = len(per_rank)
        empty = [r for r, st in enumerate(per_rank) if not st]
        if empty:
            raise ValueError(
                f"world size {world} does not match the placement: rank(s) {empty} hold no stage (every rank of the "
                "group runs at least one stage of the chain)"
            )
        shapes, rank_of, segments, specs = [], [], [], []
        for r, stages in enumerate(per_rank):
            first = len(shapes)
            for k, (K, N, *spec) in enumerate(stages):
                cols = spec[0] if spec else N
                if shapes and K != (specs[-1][0] if specs else shapes[-1][1]):
                    where = f"rank {r}'s weight {k}" if k else f"rank {r}'s first weight"
                    raise ValueError(
                        f"{where} is [{K}, {N}] but the stage before it (on rank {rank_of[-1]}) outputs "
                        f"{specs[-1][0] if specs else shapes[-1][1]} columns"
                    )
                shapes.append((int(K), int(N)))
                rank_of.append(r)
                if spec:
                    specs.append((int(cols), *spec[1:]))
            mine = tuple(range(first, len(shapes)))
            segments.extend((s,) for s in mine) if loopback else segments.append(mine)
        if specs and len(specs) != len(shapes):
            raise ValueError("every rank describes its stages the same way (shapes, or stage_spec tuples)")
        out_cols, configs, norms, residuals = (tuple(col) for col in zip(*specs)) if specs else ((),) * 4
        return cls(tuple(shapes), tuple(rank_of), tuple(segments), out_cols, configs, norms, residuals)

    @property
    def num_stages(self) -> int:
        return len(self.shapes)

    def segments_of(self, rank: int) -> list[int]:
        """The segments rank ``rank`` runs, in chain order."""
        return [i for i, seg in enumerate(self.segments) if self.rank_of[seg[0]] == rank]

    def cross_links(self) -> list[int]:
        """The stages whose input comes from another segment (a link through a heap)."""
        return [seg[0] for seg in self.segments[1:]]


@dataclass(frozen=True)
class Region:
    """Where one buffer of a plan lives: ``rank``'s heap, byte ``offset``, ``shape``, ``dtype``."""

    rank: int
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class HeapLayout:
    """The heap regions of a plan of ``rows`` rows on every rank, and the links' dependency
    arrays. ``regions[(name, s)]`` for each stage ``s`` fed by another segment: in the
    consumer's heap ``"input"`` ``[rows, K_s]``, ``"counters"``, ``"slots"``, ``"tail"``,
    ``"started"`` (the previous segment has started call n) and ``"rows"`` (that call's rows),
    and where stage ``s`` normalises its input ``"sumsq"`` (and for a LayerNorm ``"sums"``)
    ``[rows, producer tiles]`` float32, its rows' partial sums; in the producer's heap
    ``"consumed"`` (the consumer has finished call n). ``nbytes``: the heap size, the largest
    rank's (a symmetric heap is the same size everywhere)."""

    rows: int
    regions: dict[tuple[str, int], Region]
    deps: dict[int, deps.Dependency]
    nbytes: int


def stage_spec(w: torch.Tensor, config: GemmConfig, epilogue) -> tuple:
    """What every rank must know of a stage to lay out the heap and link to it: ``(K, N, output
    columns, configuration, the norm of its input, whether it adds a residual)``."""
    if epilogue is None:
        return (int(w.shape[0]), int(w.shape[1]), int(w.shape[1]), config, None, False)
    cols = epilogue.out_cols(w.shape[1])
    return (int(w.shape[0]), int(w.shape[1]), int(cols), config, epilogue.norm_kind, epilogue.residual)


def heap_layout(
    placement: Placement, rows: int, config: GemmConfig | None, dtype: torch.dtype, queue: bool
) -> HeapLayout:
    """Lay out a plan of ``rows`` rows (every rank computes the same layout for every rank), in
    each stage's configuration (``placement.configs``; for a placement without them, ``config``
    for every stage). A link
    into a stage that normalises its input also holds the partial sums of its rows that the
    producer leaves, per producer tile (``"sumsq"``, and ``"sums"`` for a LayerNorm)."""
    used = [0] * (max(placement.rank_of) + 1)
    regions, links = {}, {}

    def put(name, s, rank, shape, dt):
        size = dt.itemsize
        for d in shape:
            size *= d
        regions[(name, s)] = Region(rank, used[rank], tuple(shape), dt)
        used[rank] += -(-size // ALIGN) * ALIGN

    configs = placement.configs or (config,) * placement.num_stages
    if any(c is None for c in configs):
        raise ValueError("heap_layout needs the stages' configurations: in the placement, or one config for all")
    # each stage's output tiles (half as wide as its GEMM's with a gated epilogue), as Pipeline's
    grids = [
        deps.TileGrid(rows, placement.cols(s), cfg.block_m, cfg.block_n * placement.cols(s) // N)
        for s, ((_, N), cfg) in enumerate(zip(placement.shapes, configs))
    ]
    for s in placement.cross_links():
        K = placement.shapes[s][0]
        dep = links[s] = _link_dependency(grids[s - 1], grids[s], K, queue, configs[s])
        consumer, producer = placement.rank_of[s], placement.rank_of[s - 1]
        for name, shape in (("counters", (dep.num_counters,)), ("slots", (dep.consumer.num_tiles,)),
                            ("tail", (1,)), ("started", (1,)), ("rows", (1,))):  # fmt: skip
            put(name, s, consumer, shape, torch.int64)
        put("consumed", s, producer, (1,), torch.int64)
        put("input", s, consumer, (rows, K), dtype)
        if placement.norm(s) is not None:  # one partial sum per row and producer tile (its GEMM's)
            parts = -(-placement.shapes[s - 1][1] // configs[s - 1].block_n)
            for name in ("sumsq", "sums") if placement.norm(s) == "layer" else ("sumsq",):
                put(name, s, consumer, (rows, parts), torch.float32)
    return HeapLayout(rows, regions, links, max(max(used), ALIGN))


@dataclass(eq=False)
class DistributedPlan:
    """This rank's part of a plan of ``M`` rows: its heap, the links that touch it, and per
    local segment its :class:`~ctapipelining.plan.Plan`, its input and output (None: the
    caller's ``x`` / ``out``) and its handshake state (``calls``: int64 [1], this plan's
    calls on the segment; the flags: int64 [1] views of a heap, None where there is no
    neighbour)."""

    M: int
    heap: fabric.Heap
    links: dict[int, Link]
    plans: list[Plan] = field(default_factory=list)
    inputs: list[torch.Tensor | None] = field(default_factory=list)
    outputs: list[torch.Tensor | None] = field(default_factory=list)
    calls: list[torch.Tensor] = field(default_factory=list)
    started_in: list[torch.Tensor | None] = field(default_factory=list)
    consumed_out: list[torch.Tensor | None] = field(default_factory=list)
    started_out: list[torch.Tensor | None] = field(default_factory=list)
    consumed_in: list[torch.Tensor | None] = field(default_factory=list)
    rows_in: list[torch.Tensor | None] = field(default_factory=list)
    rows_out: list[torch.Tensor | None] = field(default_factory=list)

    @property
    def pinned(self) -> bool:
        return any(p.pinned for p in self.plans)


class DistributedPipeline:
    """This rank's stages of a chain ``x @ W_0 @ W_1 @ ...`` spread over a process group.

    Parameters
    ----------
    weights : this rank's stages' ``[K, N]`` weights, in chain order, on this rank's GPU (CPU
        tensors under the Triton interpreter). Rank 0 holds the first stages, the last rank the
        last; every rank holds at least one.
    group : the process group (default: the world). GPU ranks need one host and peer access
        between consecutive ranks' GPUs. The ranks' host collectives (errors, plans, resets)
        run on a gloo group of the same ranks, made here (collective) unless ``group`` is gloo.
    policy, timeout_s, row_buckets, sm_budget : as for :class:`~ctapipelining.pipeline.Pipeline`
        (``policy``, ``row_buckets`` and ``sm_budget``, like ``max_plans`` and ``loopback``, the
        same on every rank).
    host_timeout_s : as for :class:`~ctapipelining.pipeline.Pipeline`, with its own default and
        bound (``start_timeout_s``, below).
    config : this rank's stages' tiles (:class:`GemmConfig`), or a list of one per stage
        (default :data:`PIPELINE_CONFIG`); every stage of the chain shares ``block_m``.
    epilogues : one :class:`~ctapipelining.epilogue.Epilogue` (or None) per stage of this
        rank, as for :class:`~ctapipelining.pipeline.Pipeline`: a stage that normalises its
        input takes its rows' partial sums from the stage before, on this rank or, through the
        heap, on the rank before; a residual is read on this rank, so a stage with one and the
        stage before it run in one segment (keep each transformer block's GEMMs on one rank,
        and no ``loopback``). ``ctapipelining.nn``'s blocks give theirs
        (:meth:`~ctapipelining.nn.FusedMLP.pipeline_stages`).
    start_timeout_s : how long a segment's gate waits for a peer rank to start a call (or to
        finish the one before) before it reports; default ``max(2.5, 2.5 * timeout_s)`` seconds
        (``host_timeout_s / 4`` when that is given). It bounds how far apart the ranks may start
        a call. ``host_timeout_s`` (default: at least 10 s, and above this bound) must exceed
        twice this plus ``timeout_s`` per local stage and one more, so that a late peer is a
        clean timeout, not a hung GPU. The timeouts are each rank's own; the other settings must
        be the same on every rank.
    meet_timeout_s : how long a host collective of the ranks (building a plan, checking errors,
        freeing plans) waits for a peer rank: the timeout of the gloo group made for them when
        ``group`` is of another backend (default PyTorch's for a new group, 30 minutes). Above
        ``host_timeout_s``, and long enough for what a peer may do first (compile its kernels at
        a new height, the caller's own work): once it expires the group is unusable. A gloo
        ``group`` is used as it is: its own timeout applies, and ``meet_timeout_s`` is refused.
    max_plans : plan heights kept (least recently used freed first, never one a captured graph
        points at; freeing is collective, at the same call on every rank).
    loopback : a segment per stage (each on an equal share of the GPU's SMs), so that every
        link goes through the heap: how one GPU tests the cross-rank path.

    Every rank checks its own arguments and GPU (a current CUDA device that is not the weights'
    too) at construction: an error anywhere is raised on every rank. Calls and graph replays hold
    a lock (one at a time on the host). A call is ordered after whatever the caller queued on this
    GPU's current stream, and that stream waits for it. A call that one rank refuses (bad input)
    or that fails part way puts that rank out of step with the others, who made the call: it
    refuses further calls until every rank calls :meth:`check_errors`, which reports it and
    resets them all (with ``check=True`` the refusing rank makes that check within the call).
    """

    def __init__(
        self,
        weights: list[torch.Tensor],
        group=None,
        *,
        policy: str = "static",
        config: GemmConfig | list[GemmConfig] | None = None,
        timeout_s: float = 1.0,
        start_timeout_s: float | None = None,
        host_timeout_s: float | None = None,
        meet_timeout_s: float | None = None,
        max_plans: int = MAX_PLANS,
        row_buckets: int = ROW_BUCKETS,
        sm_budget: int | None = None,
        loopback: bool = False,
        epilogues: list[Epilogue | None] | None = None,
    ):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistributedPipeline needs torch.distributed: call init_process_group first (torchrun)")
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        # the host's collectives (the gathers below, every _meet) on a gloo group of the same
        # ranks (hostgroup: they must complete while a GPU does not finish)
        backend = dist.get_backend(self.group)
        gloo = backend == "gloo"
        timeout = None  # a bad meet_timeout_s is refused below, on every rank
        if is_seconds(meet_timeout_s) and not gloo:
            timeout = datetime.timedelta(seconds=meet_timeout_s)
        self._host_group = self.group if gloo else hostgroup.gloo_group(self.group, timeout)
        # what each rank checks alone is gathered, so that every rank raises the same error
        local_error, weights = None, list(weights) if isinstance(weights, (list, tuple)) else weights
        first_weight = weights[0] if isinstance(weights, list) and weights else None
        try:
            nccl = "nccl" in str(backend)  # ("cpu:gloo,cuda:nccl" too)
            if isinstance(first_weight, torch.Tensor) and first_weight.is_cuda and nccl:
                current = torch.cuda.current_device()
                if current != first_weight.device.index:  # NCCL's collectives (sequential's sends) run there
                    raise RuntimeError(
                        f"rank {self.rank}'s weights are on {first_weight.device} but the current CUDA device is "
                        f"cuda:{current}: call torch.cuda.set_device({first_weight.device.index}) first"
                    )
            self._check_local(weights, policy, config, epilogues, timeout_s, start_timeout_s, host_timeout_s,
                              max_plans, row_buckets, sm_budget, loopback)  # fmt: skip
            if meet_timeout_s is not None:
                if gloo:
                    raise ValueError("meet_timeout_s bounds the gloo group made for a group of another backend; "
                                     "a gloo group's own timeout bounds its meets")  # fmt: skip
                if not is_seconds(meet_timeout_s) or meet_timeout_s <= self.host_timeout_s:
                    raise ValueError(f"meet_timeout_s must be a number of seconds above host_timeout_s "
                                     f"({self.host_timeout_s:g}: a meet may wait that long for a peer's GPU), "
                                     f"got {meet_timeout_s!r}")  # fmt: skip
        except Exception as e:  # noqa: BLE001 (any error: raised on every rank after the gather)
            local_error = f"{type(e).__name__}: {e}"
        device = weights[0].device if not local_error and weights else None
        # which of the pipelines built on this group it is: every meet names it (_meet), so ranks
        # that call different pipelines find out rather than wire one's heap to the other's
        self._serial = _count_built(self.group, 1)
        mine = {
            "serial": self._serial,
            "stages": [] if local_error else [stage_spec(*spec) for spec in zip(weights, self.configs, self.epilogues)],
            "dtype": str(weights[0].dtype) if not local_error and weights else None,
            "device": None if device is None else device.type,
            "uuid": str(torch.cuda.get_device_properties(device).uuid) if device is not None and device.type == "cuda"
            else None,
            "host": socket.gethostname(),
            "settings": self._settings if not local_error else None,
            "error": local_error,
        }  # fmt: skip
        every = self._gather_built(mine)
        _raise_any(every)
        _check_ranks(every)
        self.placement = Placement.of([e["stages"] for e in every], loopback)
        _check_stages(self.placement)
        self.device = device
        self.on_gpu = device.type == "cuda"
        self.weights = weights
        self.loopback = loopback
        self.is_first, self.is_last = self.rank == self.placement.rank_of[0], self.rank == self.placement.rank_of[-1]
        self._segment_ids = self.placement.segments_of(self.rank)
        share, error = None, None
        # the segments this rank runs, each a Pipeline over its stages on an equal share of the SMs
        # (what one refuses, such as an epilogue its stages cannot run, is raised on every rank)
        first_local = self.placement.rank_of.index(self.rank)
        self.segments: list[Pipeline] = []
        try:
            if self.on_gpu:
                sms = min(num_sms(device), sm_budget or num_sms(device))
                share = sms // len(self._segment_ids)
                error = _peer_error(every, self.rank, device)
                if share < 1:
                    error = f"sm_budget={sm_budget} leaves no SM to one of rank {self.rank}'s segments"
            for i in [] if error else self._segment_ids:
                stages = self.placement.segments[i]
                self.segments.append(
                    Pipeline(
                        [weights[s - first_local] for s in stages],
                        policy=self.policy,
                        config=[self.configs[s - first_local] for s in stages],
                        epilogues=[self.epilogues[s - first_local] for s in stages],
                        timeout_s=timeout_s,
                        host_timeout_s=self.host_timeout_s,
                        max_plans=1 << 30,
                        row_buckets=0,
                        sm_budget=share,
                        loopback=None if self.on_gpu else True,
                        segment=Segment(
                            stages[0],
                            functools.partial(self._segment_links, stages),
                            f"rank {self.rank}",
                            self.placement.norm(stages[-1] + 1),
                        ),
                    )  # fmt: skip
                )
        except Exception as e:  # noqa: BLE001 (raised on every rank after the gather)
            error = f"{type(e).__name__}: {e}"
        _raise_any(self._gather_built({"error": error}))
        self.num_stages = self.placement.num_stages
        self.out_features = self.placement.cols(self.num_stages - 1)
        self.in_features = self.placement.shapes[0][0]
        self._plans: collections.OrderedDict[int, DistributedPlan] = collections.OrderedDict()
        self._building: DistributedPlan | None = None
        self._lock = threading.RLock()
        self._unread: list[str] = []  # errors of freed plans, reported at the next check_errors
        self._replayed: torch.cuda.Event | None = None  # the last graph replay's end
        # the unfinished calls and replays of every segment, in one order: a host wait tells the
        # caller's work queued before one from the rank's own (Pipeline._wait)
        self._in_flight = InFlight(f"a call or replay on rank {self.rank}")
        for seg in self.segments:
            seg._in_flight = self._in_flight
        # a call captured in a graph of the caller's own (not capture()'s): its replays record no
        # end, so host waits also wait for the current stream (_wait)
        self._in_callers_graphs, self._capturing_own = False, False
        self._stream_ends = [  # (stream, event) per segment kernel stream: what a replay waits for
            (st, torch.cuda.Event()) for seg in self.segments for st in getattr(seg, "_kernel_streams", [])
        ]
        self._out_of_step: str | None = None  # why this rank's calls no longer pair with the others'

    def __reduce__(self):
        raise TypeError(
            "a DistributedPipeline holds process groups, symmetric memory and GPU buffers: it cannot be pickled or "
            "copied; build one in each process"
        )

    def _gather_built(self, mine: dict) -> list[dict]:
        """Collective, while the pipeline is built: every rank's ``mine`` (a dict). A rank that
        sent something else is not building one (it is in a meet of a pipeline built before):
        every rank that finds out raises that the ranks are out of step (the meeting ranks find
        out in :meth:`_meet`)."""
        every = hostgroup.gather_objects(self._host_group, mine)
        others = [r for r, e in enumerate(every) if not isinstance(e, dict) or e.keys() != mine.keys()]
        if others:
            _count_built(self.group, -1)  # not built: the next one built takes its number
            raise RuntimeError(
                f"the ranks are out of step: rank {others[0]} is not building a DistributedPipeline on this group "
                "while this rank is; build pipelines, and call them, in the same order on every rank"
            )
        return every

    def _check_local(
        self, weights, policy, config, epilogues, timeout_s, start_timeout_s, host_timeout_s, max_plans, row_buckets,
        sm_budget, loopback,
    ) -> None:  # fmt: skip
        """What this rank can check alone (raises ValueError / TypeError); sets the settings."""
        if not isinstance(weights, list) or not weights:
            raise ValueError("weights must be a non-empty list of this rank's weight matrices")
        for k, w in enumerate(weights):
            check_weight(w, f"rank {self.rank}'s weight {k}")
        devices, dtypes = {w.device for w in weights}, {w.dtype for w in weights}
        if len(devices) > 1:
            raise ValueError(f"rank {self.rank}'s weights are on {sorted(map(str, devices))}: a rank runs on one GPU")
        if len(dtypes) > 1:  # (each loopback segment holds one: no segment would see two)
            raise TypeError(f"rank {self.rank}'s weights are {sorted(map(str, dtypes))}: the chain runs in one dtype")
        if not isinstance(loopback, bool):
            raise ValueError(f"loopback must be True or False, got {loopback!r}")
        if weights[0].is_cuda:
            fabric.symmetric_memory()
        n = len(weights)
        configs = list(config) if isinstance(config, (list, tuple)) else [config] * n
        if len(configs) != n or not all(c is None or isinstance(c, GemmConfig) for c in configs):
            raise ValueError(f"config must be a GemmConfig or a list of one per stage of this rank ({n}): {config!r}")
        self.configs = [c or PIPELINE_CONFIG for c in configs]
        self.block_m = self.configs[0].block_m  # every stage's, on every rank (_check_stages)
        epilogues = [None] * n if epilogues is None else list(epilogues)
        if len(epilogues) != n or not all(e is None or isinstance(e, Epilogue) for e in epilogues):
            raise ValueError(f"epilogues must be a list of one Epilogue or None per stage of this rank ({n})")
        for w, e, c in zip(weights, epilogues, self.configs):  # (the stages chain: Placement.of, every rank)
            if e is not None:
                e.check(w.shape[1], w.dtype, w.device, c.block_n)
        self.epilogues = epilogues
        self.policy = deps.get_policy(policy)
        if not isinstance(max_plans, int) or isinstance(max_plans, bool) or max_plans < 1:
            raise ValueError(f"max_plans must be an int >= 1, got {max_plans!r}")
        self.max_plans = max_plans
        check_row_buckets(row_buckets)
        self.row_buckets = row_buckets
        if sm_budget is not None and (not isinstance(sm_budget, int) or isinstance(sm_budget, bool) or sm_budget < 1):
            raise ValueError(f"sm_budget must be None or an int >= 1, got {sm_budget!r}")
        check_seconds(timeout_s, "timeout_s")
        check_seconds(start_timeout_s, "start_timeout_s", optional=True)
        check_seconds(host_timeout_s, "host_timeout_s", optional=True)
        # defaults: a late peer gets 2.5 s (or 2.5 timeouts); the host waits past every bound a
        # call's kernels can reach (two gate waits and a timeout per stage), at least 10 s
        n = len(weights)
        if start_timeout_s is None:
            start = max(2.5, 2.5 * timeout_s) if host_timeout_s is None else host_timeout_s / 4
        else:
            start = start_timeout_s
        if host_timeout_s is None:
            host = max(10.0, 10 * timeout_s, 2 * start + (n + 2) * timeout_s)
        else:
            host = host_timeout_s
        for name, v in (("host_timeout_s", host), ("start_timeout_s", start)):
            if not is_seconds(v):
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        # a gate may wait twice start_timeout_s, then each stage up to timeout_s: the host waits longer
        if host <= 2 * start + (n + 1) * timeout_s:
            raise ValueError(
                f"host_timeout_s={host:g} must exceed 2 x start_timeout_s + (stages + 1) x timeout_s = "
                f"{2 * start + (n + 1) * timeout_s:g}: a late peer would otherwise look like a hung GPU"
            )
        self.host_timeout_s, self.start_timeout_ns = float(host), int(start * 1e9)
        # what every rank must share (the timeouts are each rank's own bounds)
        self._settings = (self.policy.name, loopback, row_buckets, max_plans, sm_budget)

    def __repr__(self) -> str:
        stages = [s for i in self._segment_ids for s in self.placement.segments[i]]
        return (
            f"DistributedPipeline(rank {self.rank} of {self.world}: stages {stages} of {self.num_stages}, "
            f"{len(self.segments)} segment(s), on {self.device})"
        )

    # -- plans -------------------------------------------------------------------------------
    def rows_for(self, M: int) -> int:
        """The height of the plan that serves calls on ``M`` rows (see ``row_buckets``)."""
        return deps.bucket_rows(M, self.block_m, self.row_buckets)

    def plan(self, M: int) -> DistributedPlan:
        """The plan for calls on ``M`` rows (collective when it is built or another is freed:
        every rank asks for it at the same call; under the pipeline's lock, as a call is)."""
        B = self.rows_for(plan_rows(M))
        with self._lock:
            dp = self._plans.get(B)
            if dp is None:
                if self._capturing():
                    raise RuntimeError(f"no plan for {M} rows yet: make one call on {M} rows before capturing it")
                dp = self._build_plan(B)
                self._plans[B] = dp
                self._evict(B)
            self._plans.move_to_end(B)
            return dp

    def _build_plan(self, B: int) -> DistributedPlan:
        """Collective: the heap (zeroed on every rank before any rank's first call can write into
        it), the links, each segment's plan, every kernel compiled. An error on any rank is raised
        on every rank, and no rank keeps the plan."""
        heights = self._meet("build a plan", B)
        if len(set(heights)) > 1:
            raise ValueError(
                f"the ranks called with different row counts (plan heights {heights} by rank): every rank must "
                "pass the same rows"
            )
        w = self.weights[0]
        layout = heap_layout(self.placement, B, None, w.dtype, self.policy.uses_queue)  # its stages' own
        if self.on_gpu:
            heap = fabric.symmetric_heap(layout.nbytes, self.device, self.group, self._meet)
        else:
            heap = fabric.shared_heap(layout.nbytes, self.group, self._meet)
        error = None
        try:
            with self._own_stream():  # the heap's zeroing and the plan's fills: waited for below
                heap.local.zero_()
                dp = self._bind_plan(B, heap, layout)
            self._wait()
        except Exception as e:  # noqa: BLE001 (raised on every rank below)
            error = f"{type(e).__name__}: {e}"
        self._meet("plan ready", B, error)
        for seg, p in zip(self.segments, dp.plans):  # kept only once every rank has it
            seg._plans[B] = p
        return dp

    def _bind_plan(self, B: int, heap: fabric.Heap, layout: HeapLayout) -> DistributedPlan:
        """This rank's part of a plan: links, segment plans, handshake state; kernels compiled
        (so that a consumer's deadline never runs while its producer's rank compiles)."""

        def view(name, s):
            r = layout.regions[(name, s)]
            return heap.view(r.rank, r.offset, r.shape, r.dtype)

        dp = DistributedPlan(B, heap, {})
        for s, dep in layout.deps.items():  # the links that touch this rank
            here_c, here_p = self.placement.rank_of[s] == self.rank, self.placement.rank_of[s - 1] == self.rank
            if not (here_c or here_p):
                continue
            dev = self.device
            dp.links[s] = Link(
                dep=dep,
                counters=view("counters", s),
                counter_of_tile=torch.as_tensor(dep.counter_of_tile, dtype=torch.int32).to(dev) if here_c else None,
                need_consumer=torch.as_tensor(dep.need, dtype=torch.int32).to(dev) if here_c else None,
                slots=view("slots", s),
                head=torch.zeros(1, dtype=torch.int64, device=dev) if here_c else None,
                tail=view("tail", s),
                lists=SignalLists.create(dep, dev) if here_p else None,
                sums=_sums_views(view, s, self.placement.norm(s)),
            )
        self._building = dp
        try:
            for i, seg in zip(self._segment_ids, self.segments):
                stages = self.placement.segments[i]
                first, last = stages[0], stages[-1]
                has_in, has_out = first > 0, last + 1 < self.num_stages
                dp.plans.append(seg._build_plan(B, 0, 0))
                dp.inputs.append(view("input", first) if has_in else None)
                dp.outputs.append(view("input", last + 1) if has_out else None)
                dp.calls.append(torch.zeros(1, dtype=torch.int64, device=self.device))
                dp.started_in.append(view("started", first) if has_in else None)
                dp.consumed_in.append(view("consumed", first) if has_in else None)
                dp.rows_in.append(view("rows", first) if has_in else None)
                dp.started_out.append(view("started", last + 1) if has_out else None)
                dp.consumed_out.append(view("consumed", last + 1) if has_out else None)
                dp.rows_out.append(view("rows", last + 1) if has_out else None)
        finally:
            self._building = None
        dtype = self.weights[0].dtype
        for k, seg in enumerate(self.segments):
            # the caller's x (first segment) and out (last) are stood in for, at their shapes
            a = dp.inputs[k] if dp.inputs[k] is not None else torch.empty(B, self.in_features, dtype=dtype,
                                                                          device=self.device)  # fmt: skip
            c = dp.outputs[k] if dp.outputs[k] is not None else torch.empty(B, self.out_features, dtype=dtype,
                                                                            device=self.device)  # fmt: skip
            seg.compile(dp.plans[k], a, c)
            if self.on_gpu:  # and the handshake's kernels
                self._gate(dp, k, B, compile_only=True)
                if dp.consumed_in[k] is not None:
                    finish.warmup(dp.calls[k], dp.consumed_in[k], grid=(1,), num_warps=HANDSHAKE_WARPS)
        return dp

    def _meet(self, what: str, payload=None, error: str | None = None) -> list:
        """Collective: every rank's ``payload`` for step ``what``. Every collective of this class
        goes through here, labelled, so ranks that meet in different steps (one rank refused a
        call the others made) find out instead of exchanging each other's data; an ``error`` of
        any rank is raised on every rank."""
        every = hostgroup.gather_objects(self._host_group, ((what, self._serial), payload, error))
        # (a rank inside another collective, such as another pipeline being built, sends something else)
        every = [e if _is_meet(e) else (("another collective", self._serial), None, None) for e in every]
        steps = {w for w, _, _ in every}
        if len(steps) > 1:
            apart = len({s for (_, s), _, _ in every}) > 1  # different pipelines: say which
            doing = ", ".join(
                f"rank {r}: {w}" + (f" of pipeline {s}" if apart else "") for r, ((w, s), _, _) in enumerate(every)
            )
            self._mark_out_of_step(f"rank {self.rank} met the others in a different step ({doing})")
            why = (
                "the ranks called different pipelines (call them in the same order on every rank)"
                if apart
                else "a call one of them refused or failed"
            )
            raise RuntimeError(
                f"the ranks are out of step ({doing}); {why}: call check_errors() on every rank (it reports this "
                "and resets them all)"
            )
        errors = [f"rank {r}: {e}" for r, (_, _, e) in enumerate(every) if e]
        if errors:
            raise RuntimeError(f"{what} failed: " + "; ".join(errors))
        return [p for _, p, _ in every]

    def _segment_links(self, stages: tuple[int, ...], M: int) -> tuple[Link | None, Link | None]:
        """The links into and out of the segment running ``stages``, for the plan being built."""
        dp = self._building
        if dp is None or dp.M != M:
            raise RuntimeError("a segment's plan is built by its DistributedPipeline.plan, not on its own")
        return dp.links.get(stages[0]), dp.links.get(stages[-1] + 1)

    def _evict(self, keep: int) -> None:
        """Free the least recently used plans beyond :attr:`max_plans`, the same ones on every
        rank (collective, after each plan built, which every rank builds at the same call): rank
        0's order of use decides (the ranks' orders may differ: a call one rank refused), no plan
        a graph points at on any rank goes, and a plan some rank no longer holds goes everywhere
        (its heap is gone there). Each rank frees them once its GPU is done with them, so no
        producer still writes into a heap that goes."""
        mine = [(m, p.pinned) for m, p in self._plans.items() if m != keep]
        every = self._meet("free plans", mine, self._hung())
        pinned = {m for held in every for m, pin in held if pin}
        everywhere = set.intersection(*[{m for m, _ in held} for held in every])
        partial = {m for held in every for m, _ in held} - everywhere - pinned
        candidates = [m for m, _ in every[0] if m in everywhere and m not in pinned]  # least recently used first
        evict = partial | set(candidates[: max(0, len(everywhere) + 1 - self.max_plans)])
        going = [m for m in self._plans if m in evict]
        self._unread += [msg for m in going for msg in self._messages(self._plans[m])]  # not lost with them
        for m in going:
            dp = self._plans.pop(m)
            for seg, p in zip(self.segments, dp.plans):
                seg._plans.pop(m, None)
                seg._pending.pop(p, None)

    # -- running -----------------------------------------------------------------------------
    def _rows(self, x, rows) -> int:
        """Check a call's input before anything changes; its row count."""
        if self.is_first:
            if x is None:
                raise ValueError(f"rank {self.rank} runs the chain's first stage: pass the input x")
            self.segments[0].check_input(x)
            if rows is not None and rows != x.shape[0]:
                raise ValueError(f"rows={rows} but x has {x.shape[0]} rows")
            return x.shape[0]
        if x is not None:
            raise ValueError(f"rank {self.rank} does not run the first stage: pass rows=M, not x")
        try:
            return plan_rows(rows)  # (numpy's ints too, as plan takes them)
        except (TypeError, ValueError) as e:
            raise ValueError(f"rank {self.rank}: rows must be the call's row count (an int >= 1), got {rows!r}") from e

    def _check_out(self, out: torch.Tensor, x: torch.Tensor | None, M: int) -> None:
        if not self.is_last:
            raise ValueError(f"rank {self.rank} does not run the last stage: it has no out")
        check_out(out, M, self.out_features, self.weights[0].dtype)
        if out.device != self.device:
            raise ValueError(f"out is on {out.device}; rank {self.rank} runs on {self.device}")
        bound = [t for seg in self.segments for t in seg._bound_tensors]  # the weights, the epilogues' vectors
        if overlaps(out, *([x] if x is not None else []), *bound):
            raise ValueError(
                "out shares memory with x, a weight or an epilogue's bias or column sums: the chain would overwrite "
                "its own operands"
            )

    def __call__(
        self,
        x: torch.Tensor | None = None,
        rows: int | None = None,
        out: torch.Tensor | None = None,
        check: bool = False,
    ) -> torch.Tensor | None:
        """Run one call of the chain. The first rank passes ``x`` ``[M, K_0]`` (on its GPU), the
        others ``rows=M``; the last rank gets ``[M, N_last]`` (``out`` if given), the others
        None. Does not synchronise and does not read the error words: call
        :meth:`check_errors` on every rank (``check=True``, the same on every rank: here,
        collectively). A rank that refuses a call with ``check=True`` (its own checks, before
        anything collective) makes that check too, where the other ranks make it, and raises
        its own error: where the call has its plan already, the check is made and nothing is
        left to call. Where the call needs a new plan, the others are building it (collective):
        they meet the refusing rank's check there, every rank raises that the ranks are out of
        step, and every rank calls :meth:`check_errors` once more. :meth:`capture` refuses the
        same way."""
        with self._lock:
            refused = True  # until this rank's own checks of the call pass
            try:
                self._usable()
                for seg in self.segments:  # its launches are bound to its weights' storage
                    seg.check_weights()
                M = self._rows(x, rows)
                if out is not None:
                    self._check_out(out, x, M)
                refused = False
                dp = self.plan(M)
                if self.is_last and out is None:
                    out = torch.empty(M, self.out_features, dtype=self.weights[0].dtype, device=self.device)
                self._run(dp, x, out, M)
                if self._capturing() and not self._capturing_own:
                    self._in_callers_graphs = True
            except BaseException as e:
                # the other ranks made (or are making) this call: ours no longer pair with theirs
                self._mark_out_of_step(f"rank {self.rank} refused or failed a call ({type(e).__name__}: {e})")
                if check and refused and isinstance(e, Exception) and not self._capturing():
                    # the others check the call collectively: meet them there (every rank then
                    # raises this refusal and resets) rather than leave them waiting; this rank
                    # raises its own error. (A failure inside a collective step, such as building
                    # a plan, has met them already: every rank raises it, and checks by hand.)
                    with contextlib.suppress(Exception):
                        self.check_errors()
                raise
            if check and not self._capturing():
                self.check_errors()
            return out if self.is_last else None

    def _run(self, dp: DistributedPlan, x, out, rows: int, only: list[int] | None = None) -> None:
        """Launch this rank's segments of one call on ``rows`` rows, each on its own stream: gate,
        the segment's kernels, finish. ``only`` (tests): the local segments to launch."""
        ks = [k for k in range(len(self.segments)) if only is None or k in only]
        streams = [self.segments[k].streams[0] if self.on_gpu else None for k in ks]
        if self.on_gpu:  # every stream waits before any launch records events (from the pool)
            caller = torch.cuda.current_stream(self.device)
            fork = caller.record_event()
            replayed = None if self._capturing() else self._replayed  # a replay from another stream
            for stream in streams:
                stream.wait_event(fork)
                if replayed is not None:
                    stream.wait_event(replayed)
            if replayed is not None and only is None:  # every segment stream waited for it
                self._replayed = None  # (its event goes back to the pool: not waited for again)
        for k, stream in zip(ks, streams):
            seg = self.segments[k]
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                self._gate(dp, k, rows)
                a = x if dp.inputs[k] is None else dp.inputs[k]
                c = out if dp.outputs[k] is None else dp.outputs[k]
                seg._launch(dp.plans[k], a, c)
                if dp.consumed_in[k] is not None:
                    finish[(1,)](dp.calls[k], dp.consumed_in[k], num_warps=HANDSHAKE_WARPS)
        for stream in streams:
            if stream is not None:
                caller.wait_stream(stream)

    def _gate(self, dp: DistributedPlan, k: int, rows: int, compile_only: bool = False) -> None:
        """Launch segment ``k``'s gate for a call on ``rows`` rows (``compile_only``: compile it)."""
        calls, first = dp.calls[k], self.placement.segments[self._segment_ids[k]][0]
        s_in, c_out, s_out = dp.started_in[k], dp.consumed_out[k], dp.started_out[k]
        r_in, r_out = dp.rows_in[k], dp.rows_out[k]
        flags = [calls if f is None else f for f in (s_in, r_in, c_out, s_out, r_out)]  # unused: any valid pointer
        launch = functools.partial(gate.warmup, grid=(1,)) if compile_only else gate[(1,)]
        launch(
            calls, *flags, dp.plans[k].errors[0], first, rows, self.start_timeout_ns,
            HAS_IN=s_in is not None, HAS_OUT=s_out is not None, INTERPRET=not self.on_gpu, num_warps=HANDSHAKE_WARPS,
        )  # fmt: skip

    def capture(self, M: int, out: torch.Tensor | None = None) -> DistributedGraphedCall:
        """Capture one call on ``M`` rows in a CUDA graph on every rank (collective: a checked
        warm-up call first, which builds the plan). Returns a :class:`DistributedGraphedCall`."""
        if not self.on_gpu:
            raise RuntimeError("capture needs CUDA devices (CUDA graphs do not exist on the CPU)")
        try:
            M = plan_rows(M)
            if self._capturing():
                raise RuntimeError("capture() makes a checked call first: call it outside any CUDA-graph capture")
            x = None  # (the warm-up's input: an allocation that fails is refused as the rest is)
            if self.is_first:
                x = torch.randn(M, self.in_features, device=self.device).to(self.weights[0].dtype)
        except Exception as e:
            # the other ranks are making the warm-up's checked call: meet them at its check, as a
            # call refused with check=True does (every rank then raises this refusal)
            self._mark_out_of_step(f"rank {self.rank} refused a capture ({type(e).__name__}: {e})")
            if not self._capturing():
                with contextlib.suppress(Exception):
                    self.check_errors()
            raise
        with self._lock:
            out = self(x, rows=None if self.is_first else M, out=out, check=True)
            dp = self.plan(M)
            pinned = [p.pinned for p in dp.plans]
            graph = torch.cuda.CUDAGraph()
            caller = torch.cuda.current_stream(self.device)  # (a failed capture may leave torch's current)
            failure = self._hung()
            if failure is None:
                self._capturing_own = True  # its replays record their end
                try:
                    with torch.cuda.device(self.device), torch.cuda.graph(graph):
                        self(x, rows=None if self.is_first else M, out=out)
                except BaseException as e:
                    cause = f" (after {type(e.__context__).__name__}: {e.__context__})" if e.__context__ else ""
                    failure = f"rank {self.rank}: {type(e).__name__}: {e}{cause}"
                    torch.cuda.set_stream(caller)
                else:
                    failure = self._hung()
                finally:
                    self._capturing_own = False
            try:
                self._meet("captured", None, failure)  # a capture that failed on one rank fails on every rank
            except RuntimeError as e:
                for p, pin in zip(dp.plans, pinned):  # no graph points at them
                    p.pinned = pin
                self._mark_out_of_step(f"a capture failed ({e}): check_errors() on every rank")
                raise
            return DistributedGraphedCall(self, dp, graph, x, out)

    def sequential(self, x: torch.Tensor | None = None, rows: int | None = None) -> torch.Tensor | None:
        """The same stages one after another, no pipelining (collective: each rank's result goes
        to the next by ``send``/``recv``): what a call must equal bitwise. Arguments and result
        as for a call."""
        with self._lock:
            return self._sequential(x, rows)

    def _sequential(self, x, rows) -> torch.Tensor | None:
        M, error = None, None
        try:
            M = self._rows(x, rows)
        except (ValueError, TypeError) as e:
            error = f"{type(e).__name__}: {e}"
        heights = self._meet("run the stages one after another", M, error)  # no rank left in a recv
        if len(set(heights)) > 1:
            raise ValueError(f"the ranks asked for different row counts ({heights} by rank)")
        B = self.rows_for(M)
        stages = [s for i in self._segment_ids for s in self.placement.segments[i]]
        first, last = stages[0], stages[-1]
        sums = None  # the partial sums of the rows passed on, for a norm of the next stage
        if self.is_first:
            h = torch.cat([x, x.new_zeros(B - M, x.shape[1])]) if B > M else x
        else:
            h = torch.empty(B, self.placement.shapes[first][0], dtype=self.weights[0].dtype, device=self.device)
            dist.recv(h, group_src=self.rank - 1, group=self.group)
            if self.placement.norm(first) is not None:
                parts = -(-self.placement.shapes[first - 1][1] // self.placement.configs[first - 1].block_n)
                f32 = dict(dtype=torch.float32, device=self.device)
                sums = [torch.empty(B, parts, **f32) for _ in range(2 if self.placement.norm(first) == "layer" else 1)]
                for t in sums:
                    dist.recv(t, group_src=self.rank - 1, group=self.group)
                sums = tuple(sums) if len(sums) == 2 else sums[0]
        for seg in self.segments:
            h, sums = seg._sequential(h, sums)
        if not self.is_last:
            dist.send(h.contiguous(), group_dst=self.rank + 1, group=self.group)
            if self.placement.norm(last + 1) is not None:
                for t in sums if isinstance(sums, tuple) else (sums,):
                    dist.send(t.contiguous(), group_dst=self.rank + 1, group=self.group)
            return None
        return h[:M]

    # -- errors and state --------------------------------------------------------------------
    def check_errors(self) -> None:
        """Collective: wait for this rank's GPU (bounded), gather every rank's errors; if a stage
        failed anywhere (or a rank refused a call), reset every rank (collectively) and raise
        :class:`~ctapipelining.pipeline.PipelineTimeout` on every rank, naming each failure. A
        rank whose GPU did not finish makes every rank raise
        :class:`~ctapipelining.pipeline.PipelineHung` (none resets; every rank then refuses
        calls). A rank whose wait for its caller's work ran out (queued before a call or replay,
        or replays of a call captured in a graph of the caller's own) makes every rank raise
        ``TimeoutError``, nothing read or
        reset: check again once that work is done."""
        with self._lock:
            hung, waited = None, None
            try:
                self._wait()
                msgs = self._unread + [m for dp in self._plans.values() for m in self._messages(dp)]
            except PipelineHung as e:
                hung, msgs = str(e), [f"rank {self.rank}: {e}"]
            except TimeoutError as e:  # the caller's work (before a call, its graphs' replays): on every rank
                waited, msgs = f"rank {self.rank}: {e}", []
            except Exception as e:  # noqa: BLE001 (a CUDA error, sticky: as a hang, on every rank)
                hung, msgs = f"{type(e).__name__}: {e}", [f"rank {self.rank}: {type(e).__name__}: {e}"]
            broken = next((seg._broken for seg in self.segments if seg._broken), None)
            if broken and not hung:  # an earlier hang: this rank refuses calls the others make
                hung = broken
                msgs.append(f"rank {self.rank} is unusable: {broken}")
            if self._out_of_step:
                msgs.append(self._out_of_step + ": its calls no longer paired with the other ranks'")
            every = self._meet("check errors", (msgs, hung is not None, waited))
            failed = [m for ms, _, _ in every for m in ms]
            waits = [w for _, _, w in every if w]
            if not failed and not waits:
                return
            if waits and not any(h for _, h, _ in every):  # the caller's work: nothing read, reset or broken
                raise TimeoutError("; ".join(waits) + (f" (and: {'; '.join(failed)})" if failed else ""))
            if any(h for _, h, _ in every):
                # a GPU that did not finish may still write into its peers' heaps: no rank zeroes
                # its state under it; the chain cannot run without that rank: none runs it again
                self._reset(zero=False)
                for seg in self.segments:
                    seg._broken = seg._broken or "a rank's GPU did not finish (" + "; ".join(failed) + ")"
                raise PipelineHung("; ".join(failed) + "; every rank now refuses calls")
            self._reset(zero=True)
            raise PipelineTimeout(
                f"a call failed: {'; '.join(failed)}. State reset on every rank; the next call starts clean."
            )

    def _messages(self, dp: DistributedPlan) -> list[str]:
        """What ``dp``'s error words say (read from the GPU: call after :meth:`_wait`)."""
        msgs = []
        for seg, p in zip(self.segments, dp.plans):
            msgs += [f"(plan of {dp.M} rows) {m}" for m in seg.error_messages(seg._read(p.errors))]
        return msgs

    def reset(self) -> None:
        """Collective: once every rank's GPU is done, zero every plan's heap, counters, epochs,
        error words and call counts, and meet again, so that the next call starts in step
        everywhere (errors not yet read are dropped)."""
        with self._lock:
            self._reset(zero=True, error=self._hung())

    def _reset(self, zero: bool, error: str | None = None) -> None:
        """Meet (no rank still writes into another's heap), zero this rank's state (not with a
        GPU that did not finish: ``zero=False``; it stays unusable), meet again."""
        self._meet("reset", None, error)  # a rank whose GPU hung: every rank raises
        if zero:
            try:
                with self._own_stream():  # waited for by _hung (the segments' streams)
                    for dp in self._plans.values():
                        dp.heap.local.zero_()
                        for c in dp.calls:
                            c.zero_()
                        for seg, p in zip(self.segments, dp.plans):
                            seg.reset(p)
                error = self._hung()
            except Exception as e:  # noqa: BLE001 (every rank raises it below, none left in the meet)
                error = f"rank {self.rank}: {type(e).__name__}: {e}"
        self._out_of_step = None
        try:
            self._meet("reset done", None, error)
        except RuntimeError as e:  # on every rank: calls wait for a reset that works
            self._out_of_step = f"a reset failed ({e}): check_errors() again on every rank"
            raise
        self._unread = []  # (kept if the reset failed: read again at the next check)

    def _wait(self) -> None:
        """Every call and graph replay in flight, then every segment's streams (handshakes, the
        heap's zeroing): the segments' waits, bounded (the calls and replays are theirs too)."""
        for seg in self.segments:
            seg._wait()
        if self._in_callers_graphs:  # (running out there raises TimeoutError: the caller's work)
            self.segments[0]._wait_for(
                [(CALLERS_STREAM, self.device, torch.cuda.current_stream(self.device).record_event())]
            )

    def _own_stream(self):
        """A context in which this rank's current stream is its first segment's (waited for by
        :meth:`_wait`), not the caller's."""
        return torch.cuda.stream(self.segments[0].streams[0]) if self.on_gpu else contextlib.nullcontext()

    def _hung(self) -> str | None:
        """:meth:`_wait`, its :class:`~ctapipelining.pipeline.PipelineHung` as a message (so the
        rank still joins the next collective)."""
        try:
            self._wait()
        except Exception as e:  # noqa: BLE001 (PipelineHung; TimeoutError: the caller's work; a CUDA error)
            return f"rank {self.rank}: {type(e).__name__}: {e}"
        return None

    def _usable(self) -> None:
        for seg in self.segments:
            if seg._broken:
                raise PipelineHung(f"this DistributedPipeline is unusable: {seg._broken}")
        if self._out_of_step:
            raise RuntimeError(
                f"{self._out_of_step}, so its calls no longer pair with the other ranks': call check_errors() on "
                "every rank (it reports this and resets them all) before the next call"
            )

    def _mark_out_of_step(self, why: str) -> None:
        """This rank's calls no longer pair with the other ranks' (the first reason is kept)."""
        self._out_of_step = self._out_of_step or why

    def _capturing(self) -> bool:
        """Whether the current stream of this rank's GPU is being captured into a graph."""
        return self.on_gpu and capturing_on(self.device.index)


@dataclass(eq=False)
class DistributedGraphedCall:
    """One call on ``M`` rows captured in a CUDA graph on this rank
    (:meth:`DistributedPipeline.capture`). Every rank replays it, the same number of times:
    ``replay()`` runs on whatever :attr:`x` (first rank) holds and returns :attr:`out` (last
    rank; None elsewhere). It keeps the pipeline, the plan (pinned) and the static tensors alive."""

    pipeline: DistributedPipeline
    plan: DistributedPlan
    graph: torch.cuda.CUDAGraph
    x: torch.Tensor | None
    out: torch.Tensor | None
    # the stream x and out were allocated on (the capture's current stream; a raw handle)
    _home: int | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.pipeline.on_gpu:
            self._home = torch.cuda.current_stream(self.pipeline.device).cuda_stream

    def replay(self) -> torch.Tensor | None:
        """Replay on the current stream (the pipeline's host waits wait for it there), on
        whatever :attr:`x` holds: a fill by hand must come after the previous replay or call."""
        return self._replay(None)

    def __call__(self, x: torch.Tensor | None = None) -> torch.Tensor | None:
        """First rank: copy ``x`` in (the shape and dtype of :attr:`x`, once the previous call no
        longer reads it), then replay."""
        return self._replay(x)

    def _replay(self, src: torch.Tensor | None) -> torch.Tensor | None:
        pipe = self.pipeline
        with pipe._lock:
            try:
                pipe._usable()
                if src is not None and self.x is None:
                    raise ValueError("only the first rank gives the input")
                if src is not None and (src.shape, src.dtype, src.device) != (
                    self.x.shape,
                    self.x.dtype,
                    self.x.device,
                ):
                    raise ValueError(f"this graph reads x {tuple(self.x.shape)} {self.x.dtype} on {self.x.device}")
                for seg in pipe.segments:  # a weight's storage swapped: the graph would read freed memory
                    seg.check_weights()
                if pipe._capturing():  # its waits on events recorded outside would break the capture
                    raise RuntimeError("a DistributedGraphedCall replays outside CUDA-graph captures")
                with torch.cuda.device(pipe.device):
                    first = torch.cuda.current_stream()
                    for st, ev in pipe._stream_ends:  # after the last eager call (its finish kernels too)
                        ev.record(st)
                        first.wait_event(ev)
                    if pipe._replayed is not None:  # and the last replay, from whichever stream
                        first.wait_event(pipe._replayed)
                    if src is not None:
                        with torch.no_grad():
                            self.x.copy_(src)
                    start = pipe._in_flight.record([first])
                    self.graph.replay()
                    done = pipe._in_flight.end_on(first, start)  # on the stream it replayed on
                    if first.cuda_stream != self._home:  # freed later: not before this replay ends
                        for t in (self.x, self.out):
                            if t is not None:
                                t.record_stream(first)
            except BaseException as e:  # the other ranks replay theirs: ours no longer pair with theirs
                pipe._mark_out_of_step(f"rank {pipe.rank} refused or failed a replay ({type(e).__name__}: {e})")
                raise
            pipe._replayed = done[0]
        return self.out


def _check_ranks(every: list[dict]) -> None:
    """The ranks agree on which pipeline of their group this is, dtype, device type and
    settings, and GPU ranks share one host."""
    first = every[0]
    for r, e in enumerate(every[1:], 1):
        if e["serial"] != first["serial"]:
            raise ValueError(
                f"this is rank {r}'s DistributedPipeline {e['serial']} on this group and rank 0's "
                f"{first['serial']}: build them in the same order on every rank"
            )
        if e["dtype"] != first["dtype"]:
            raise TypeError(f"rank {r}'s weights are {e['dtype']}, rank 0's are {first['dtype']}")
        if e["device"] != first["device"]:
            raise ValueError(f"rank {r} runs on {e['device']}, rank 0 on {first['device']}")
        if e["settings"] != first["settings"]:
            raise ValueError(
                f"rank {r} was built with (policy, loopback, row_buckets, max_plans, sm_budget) = "
                f"{e['settings']}, rank 0 with {first['settings']}: every rank must pass the same"
            )
        if e["host"] != first["host"]:
            raise ValueError(
                f"rank {r} runs on host {e['host']}, rank 0 on {first['host']}: CTA-pipelining spans the GPUs of one "
                "NVLink domain (one host); between hosts, use ordinary pipeline parallelism"
            )


def _sums_views(view, s: int, norm: str | None):
    """The heap's partial sums of stage ``s``'s input rows (as :attr:`Link.sums` holds them)."""
    if norm is None:
        return None
    return (view("sumsq", s), view("sums", s)) if norm == "layer" else view("sumsq", s)


def _check_stages(placement: Placement) -> None:
    """What the ranks' stages must agree on, checked on every rank alike: one ``block_m`` (the
    links count row-blocks), and no residual read across segments."""
    heights = {c.block_m for c in placement.configs}
    if len(heights) > 1:
        raise ValueError(
            f"the stages' configurations must share block_m across ranks, got {[c.block_m for c in placement.configs]}"
        )
    for s in [0, *placement.cross_links()]:
        if placement.residuals and placement.residuals[s]:
            raise ValueError(
                "stage 0 adds a residual, the input of the stage before it: it has none"
                if s == 0
                else f"stage {s} (rank {placement.rank_of[s]}) adds a residual, the input of the stage before it, "
                f"which runs in another segment (rank {placement.rank_of[s - 1]}): keep a block's GEMMs on one "
                "rank, without loopback"
            )


def _is_meet(e) -> bool:
    """Whether ``e`` is what :meth:`DistributedPipeline._meet` sends: ``((step, serial), payload, error)``."""
    return (
        isinstance(e, tuple) and len(e) == 3 and isinstance(e[0], tuple) and len(e[0]) == 2
        and isinstance(e[0][0], str) and isinstance(e[0][1], int)
    )  # fmt: skip


def _raise_any(every: list[dict]) -> None:
    """Raise, on every rank, what any rank found wrong alone."""
    errors = [f"rank {r}: {e['error']}" for r, e in enumerate(every) if e["error"]]
    if errors:
        raise ValueError("; ".join(errors))


def _peer_error(every: list[dict], rank: int, device: torch.device) -> str | None:
    """Why this rank's GPU cannot work with its neighbours' (None: it can). GPUs are told apart
    by UUID (each rank may see its GPU as cuda:0); peer access is checked both ways (a producer
    writes into the next rank's memory, its gate's flags are written back), with native atomics
    (the signals are atomics), where this process sees the neighbour's GPU."""
    mine = every[rank]["uuid"]
    visible = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}
    for other in (rank - 1, rank + 1):
        if not 0 <= other < len(every):
            continue
        theirs = every[other]["uuid"]
        if theirs == mine:
            return f"ranks {rank} and {other} are on the same GPU ({mine}): one rank per GPU"
        if theirs in visible:
            i, j = device.index, visible[theirs]
            if not (torch.cuda.can_device_access_peer(i, j) and torch.cuda.can_device_access_peer(j, i)):
                return (
                    f"rank {rank}'s GPU cuda:{i} and rank {other}'s cuda:{j} cannot access each other's memory "
                    "(no P2P between them): CTA-pipelining needs peer access between consecutive ranks' GPUs"
                )
            error = fabric.atomics_error(i, j) or fabric.atomics_error(j, i)
            if error:
                return f"rank {rank} and rank {other}: {error}"
    return None


__all__ = ["DistributedPipeline", "DistributedGraphedCall", "Placement", "heap_layout", "HeapLayout", "Region"]
