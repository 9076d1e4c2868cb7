"""A chain of GEMM stages across devices, CTA-pipelined.

``Pipeline([A, B, ...])`` puts stage ``s`` (``y_s = y_{s-1} @ W_s``) on the device of ``W_s``.
A call launches every stage at once, each on its own stream; stage ``s`` writes its tiles into
stage ``s + 1``'s input buffer on the next GPU and signals them there, and stage ``s + 1``'s
persistent CTAs start each tile as soon as its input rows have landed.

State lives in one object per input height ``M`` (:class:`Plan`): the intermediate buffers,
each link's scoreboard and ring, each stage's epoch and error word. Counters only grow, so
back-to-back calls need no reset, and a call can be captured in a CUDA graph:
:meth:`Pipeline.capture` returns a :class:`GraphedCall` that keeps the graph together with
everything it points to. (Captured by hand, with ``out=`` and ``check=False``, keep the
``Pipeline`` alive as long as the graph: it holds the addresses of the plan's buffers, not the
buffers.) After a call, :meth:`Pipeline.check_errors` reads the error words: a timed-out wait
raises :class:`PipelineTimeout` naming device, stage and tile, after which the state is reset
so the next call works.

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

Ordering with the caller: every stage's stream first waits for the current stream of every
stage's device, and those current streams then wait for every stage. So ``x``, ``out`` and the
result are ordered with whatever the caller does on any of the devices (the caching allocator
included), and a producer of call ``i + 1`` never overwrites a buffer that a consumer of call
``i`` still reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
from dataclasses import dataclass

import numpy as np
import torch
import triton

from . import deps, fabric
from .gemm import (
    SignalHook,
    TailBuffers,
    WaitHook,
    check_operands,
    check_tensor,
    grid_size,
    launch_gemm,
    matmul,
    num_sms,
    tail_split,
)
from .kernels.gemm import ENDS_CONFIG, PIPELINE_CONFIG, TRACE_FIELDS, GemmConfig
from .kernels.sync import ERR_FIELDS, KIND_COUNTER, KIND_HEAD

# tune_ends tries the rule's prefill (deps.balanced_ends) times each of these, and no ends at all,
# and leaves the rule's ends only for a candidate faster by more than TUNE_MARGIN: it times calls
# back to back, and on 2x H200 its choice, when within ~1% of the rule's, ran 3-5% slower than the
# rule's in the interleaved bench (2026-11-30-h200x2-s6/f5: M=8192 and 16384)
TUNE_FACTORS = (0.5, 1.0, 1.5, 2.0)
TUNE_MARGIN = 0.02


def faster_by(medians: dict, default, margin: float):
    """The key of ``medians`` with the smallest value if it is below ``default``'s by more than
    the fraction ``margin``, else ``default`` (which must be a key)."""
    best = min(medians, key=medians.get)
    return best if medians[best] < (1 - margin) * medians[default] else default


class PipelineTimeout(RuntimeError):
    """A stage waited past its deadline for an input that never came."""


def _int32_on(arr, device) -> torch.Tensor:
    return torch.as_tensor(arr, dtype=torch.int32).to(device)


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
        return cls(*(_int32_on(a, device) for a in arrays))


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

    @classmethod
    def create(cls, dep: deps.Dependency, producer: torch.device, consumer: torch.device) -> Link:
        i32 = dict(dtype=torch.int32, device=consumer)
        return cls(
            dep=dep,
            counters=torch.zeros(dep.num_counters, **i32),
            counter_of_tile=_int32_on(dep.counter_of_tile, consumer),
            need_consumer=_int32_on(dep.need, consumer),
            slots=torch.zeros(dep.consumer.num_tiles, **i32),
            head=torch.zeros(1, **i32),
            tail=torch.zeros(1, **i32),
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


@dataclass
class Plan:
    """Everything one input height ``M`` needs, allocated once and reused by every call."""

    M: int
    inputs: list[torch.Tensor | None]  # inputs[s]: stage s's A operand (None for stage 0: the caller's x)
    links: list[Link]  # links[s - 1]: stage s-1 -> stage s
    epochs: list[torch.Tensor]
    errors: list[torch.Tensor]
    traces: list[torch.Tensor | None]  # per stage [tiles, 5] int64 %globaltimer stamps (trace mode)
    tails: list[TailBuffers | None]  # per stage: the split tail's partials and arrival counters
    num_ctas: list[int]
    epoch_limit: int
    epoch: int = 0
    prefill_rows: int = 0  # rows of stage 1's input computed on stage 1's GPU (see Pipeline)
    prefill_x: torch.Tensor | None = None  # [prefill_rows, K_0] on stage 1's device
    prefill_ctas: int = 0
    prefill_tail: TailBuffers | None = None
    drain_rows: int = 0  # last rows of the chain computed on stage 0's GPU (see Pipeline)
    drain_h: torch.Tensor | None = None  # [drain_rows, N_0] on stage 0's device: the drain's layer 1
    drain_ctas: tuple[int, int] = (0, 0)  # the drain's two GEMMs
    drain_tails: tuple[TailBuffers | None, TailBuffers | None] = (None, None)

    def state(self) -> list[torch.Tensor]:
        ends = [self.prefill_tail, *self.drain_tails]
        tails = [t.counters for t in self.tails + ends if t is not None]  # partial after a timeout
        return [t for link in self.links for t in link.state()] + self.epochs + self.errors + tails


@dataclass(eq=False)
class GraphedCall:
    """One call of a :class:`Pipeline` on ``M`` rows, captured in a CUDA graph
    (:meth:`Pipeline.capture`): the lowest-latency way to run it again and again.

    It holds everything the graph's addresses point to, so none of it can be freed while the
    graph lives: the pipeline (its plan's buffers), the static input ``x`` ``[M, K_0]`` on
    stage 0's device and the output ``out`` ``[M, N_last]`` on the last stage's device. Each
    replay overwrites ``out``. A replay is ordered like an eager call: it waits for the current
    stream of every stage's device and those streams wait for it, so the caller may fill ``x``
    and read ``out`` on its own streams.
    """

    pipeline: Pipeline
    graph: torch.cuda.CUDAGraph
    x: torch.Tensor
    out: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Copy ``x`` (the shape, dtype and device of :attr:`x`) in, replay, return :attr:`out`."""
        if not isinstance(x, torch.Tensor) or x.shape != self.x.shape or x.dtype != self.x.dtype:
            raise ValueError(
                f"this graph was captured for x {tuple(self.x.shape)} {self.x.dtype}, "
                f"got {getattr(x, 'shape', type(x))} {getattr(x, 'dtype', '')}"
            )
        if x.device != self.x.device:
            raise ValueError(f"x is on {x.device}; the graph reads its input on {self.x.device}")
        if x.data_ptr() != self.x.data_ptr():
            self.x.copy_(x)
        return self.replay()

    def replay(self) -> torch.Tensor:
        """Run the captured call on whatever :attr:`x` holds now; returns :attr:`out`. Errors
        are not read here (that synchronises): call :meth:`check_errors` now and then."""
        devices = self.pipeline.devices
        first = torch.cuda.current_stream(devices[0])
        others = [torch.cuda.current_stream(d) for d in devices[1:]]
        for st in others:
            first.wait_event(st.record_event())
        with torch.cuda.device(devices[0]), torch.cuda.stream(first):
            self.graph.replay()
        done = first.record_event()
        for st in others:
            st.wait_event(done)
        return self.out

    def check_errors(self) -> None:
        """Raise :class:`PipelineTimeout` if a replay timed out (see :meth:`Pipeline.check_errors`)."""
        self.pipeline.check_errors(self.pipeline.plan(self.x.shape[0]))

    def __repr__(self) -> str:  # not the tensors' contents (a copy from the GPU)
        devices = ", ".join(str(d) for d in self.pipeline.devices)
        return f"GraphedCall(x={list(self.x.shape)} -> out={list(self.out.shape)}, {self.x.dtype}, on {devices})"


class Pipeline:
    """A chain ``x @ W_0 @ W_1 @ ...`` with stage ``s`` on ``W_s``'s device.

    Parameters
    ----------
    weights : list of ``[K_s, N_s]`` tensors, bf16 or fp16, row-major, ``N_s == K_{s+1}``,
        each on its own CUDA device (consecutive devices need peer access). Under the Triton
        interpreter they may all be CPU tensors; stages then run one after another.
    policy : ``"static"`` (each consumer CTA walks the tile order and waits on each tile's
        counter; the default: 2-10% faster than ``"workqueue"`` at every size measured on
        2x H200, benchmarks/results/2026-11-30-h200x2-s2/final and -s5/bench) or
        ``"workqueue"`` (consumers run tiles in the order they became ready, the paper's policy).
    config : tile configuration of every stage (:class:`GemmConfig`), default :data:`PIPELINE_CONFIG`.
        Its ``wait_parts`` is capped at the producer's column-blocks; a ``workqueue`` consumer
        runs whole tiles once they are ready, so it waits for whole row-blocks (one part).
    timeout_s : how long a CTA waits for an input before it gives up and reports.
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
        :func:`ctapipelining.deps.balanced_ends` (measured on 2x H200 at K = N = 8192: 0.81x,
        0.94x and 0.97x the chain without them at M = 2048, 8192 and 16384), with split tails
        (default config :data:`ENDS_CONFIG`). Costs a replica of each weight on the other GPU.
        Not with explicit ``prefill_rows`` / ``drain_rows``.
    """

    def __init__(
        self,
        weights: list[torch.Tensor],
        policy: str = "static",
        config: GemmConfig | None = None,
        timeout_s: float = 1.0,
        trace: bool = False,
        prefill_rows: int = 0,
        drain_rows: int = 0,
        ends: str | None = None,
    ):
        if not isinstance(weights, (list, tuple)) or not weights:
            raise ValueError("Pipeline needs a non-empty list of weight matrices")
        self.policy = deps.get_policy(policy)
        if ends not in (None, "balanced"):
            raise ValueError(f"ends must be None or 'balanced', got {ends!r}")
        if ends and (prefill_rows or drain_rows):
            raise ValueError("ends='balanced' sizes prefill_rows and drain_rows itself: pass one or the other")
        if ends and trace:
            raise ValueError("trace mode does not stamp the prefill and drain GEMMs: use ends=None to trace")
        if ends and len(weights) != 2:
            raise ValueError(f"ends='balanced' needs a chain of exactly two stages, got {len(weights)}")
        self.ends = ends
        self.config = config or (ENDS_CONFIG if ends else PIPELINE_CONFIG)
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_ns = int(timeout_s * 1e9)
        self.trace = trace
        self.weights = list(weights)
        for s, w in enumerate(self.weights):
            check_tensor(w, f"stage {s} weight")
        for s in range(1, len(self.weights)):
            if self.weights[s].shape[0] != self.weights[s - 1].shape[1]:
                raise ValueError(
                    f"stage {s} weight is {tuple(self.weights[s].shape)} but stage {s - 1} outputs "
                    f"{self.weights[s - 1].shape[1]} columns"
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
        self.on_gpu = self.devices[0].type == "cuda"
        if self.on_gpu:
            idx = [d.index for d in self.devices]
            if len(set(idx)) != len(idx):
                raise ValueError(
                    f"each stage needs its own GPU, got stages on {[str(d) for d in self.devices]}: "
                    "a consumer's persistent CTAs would occupy the SMs its producer needs"
                )
            fabric.enable_peer_access(idx)
            self.streams = [torch.cuda.Stream(d) for d in self.devices]
        # the prefill GEMM's weight on stage 1's device, the drain's second on stage 0's
        self.prefill_weight = self.weights[0].to(self.devices[1]) if prefill_rows or ends else None
        self.drain_weight = self.weights[1].to(self.devices[0]) if drain_rows or ends else None
        self._plans: dict[int, Plan] = {}
        self.tuned_ends: dict[int, tuple[int, int]] = {}  # M -> (R, D) chosen by tune_ends
        self.tuning: dict[int, dict[tuple[int, int], float]] = {}  # M -> median ms of each candidate

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
        return cls([w.to(f"cuda:{d}") for w, d in zip(weights, devices)], **kw)

    def stage_config(self, s: int) -> GemmConfig:
        """The configuration stage ``s`` runs: :attr:`config`, without a split tail for a
        ``workqueue`` consumer (it runs whole tiles in readiness order). The sequential GEMMs
        with these configurations give bitwise the chain's result."""
        if s > 0 and self.policy.uses_queue and self.config.split_tail:
            return dataclasses.replace(self.config, split_tail=False)
        return self.config

    def sequential(self, x: torch.Tensor) -> torch.Tensor:
        """The same GEMMs one after another, each with its stage's configuration, no
        pipelining: what a call must equal bitwise (a reference for tests and benchmarks)."""
        self.check_input(x)
        M = x.shape[0]
        R, D = self.ends_for(M)
        y = x
        for s, w in enumerate(self.weights):
            # cut as the pipeline cuts the rows: the prefill [0, R), the drain [M - D, M) (whose
            # GEMMs run stage 0's configuration), the pipelined rest
            cuts = sorted({0, M} | ({R, M - D} if s == 0 else {M - D} if s == 1 else set()))
            y = y.to(w.device)
            y = torch.cat(
                [matmul(y[a:b], w, config=self.stage_config(0 if a == M - D else s)) for a, b in zip(cuts, cuts[1:])]
            )
        return y

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
        the rule's prefill times each of ``factors`` (rounded down to row-blocks), each cut as
        a call would cut it; without repeats."""
        if self.ends != "balanced":
            raise ValueError(
                "tune_ends and end_candidates need Pipeline(ends='balanced') (it keeps the weight replicas)"
            )
        bm, (R, D) = self.config.block_m, self._rule_ends(M)
        cands = [(0, 0)] + [self._cut_ends(M, int(R * f) // bm * bm, D) for f in factors]
        return list(dict.fromkeys(cands))

    def tune_ends(
        self, M: int, reps: int = 30, warmup: int = 10, factors=TUNE_FACTORS, margin: float = TUNE_MARGIN
    ) -> tuple[int, int]:
        """Time the chain on ``M`` rows with each of :meth:`end_candidates` and keep the fastest
        for ``M`` if it beats the rule's ends by more than ``margin`` (else the rule's): later
        calls on ``M`` rows use it. Why: the best prefill depends on the two
        GPUs' own speeds under load, which differ from machine to machine (on 2x H200 at
        M=16384, 1408 + 512 rows took 0.94x the chain without ends on one machine and 1.00-1.02x
        on another, 2026-11-30-h200x2-s6/t16384 and f1).

        Each candidate is captured in a CUDA graph and replayed ``warmup`` times, then ``reps``
        times timed, on random input, all candidates taking turns in a shuffled order
        (:func:`ctapipelining.bench.time_interleaved`). These are calls back to back, both GPUs
        at their power cap all the time: every candidate's median came out ~6% above the same
        chain's in the bench, where GPU 1 idles while single-GPU methods run
        (2026-11-30-h200x2-s6/f2, f3, f5), and the best prefill there can differ (see
        :data:`TUNE_MARGIN`). The medians are kept in :attr:`tuning` ``[M]``. GPU only,
        ``ends="balanced"`` only, and before the first call on ``M`` rows (a graph captured
        earlier points at that plan). Returns ``(prefill_rows, drain_rows)``.
        """
        from .bench import Method, time_interleaved

        cands = self.end_candidates(M, factors)  # refuses a pipeline without ends="balanced"
        if not self.on_gpu:
            raise RuntimeError("tune_ends times CUDA graphs: it needs the stages on GPUs")
        if M in self._plans:
            raise RuntimeError(f"tune_ends({M}) must come before the first call on {M} rows (it builds their plan)")
        w0 = self.weights[0]
        x = torch.randn(M, w0.shape[0], device=self.devices[0]).to(w0.dtype)
        out = torch.empty(M, self.weights[-1].shape[1], dtype=w0.dtype, device=self.devices[-1])
        plans, graphs, methods = {}, [], []
        for cand in cands:
            plan = plans[cand] = self._build_plan(M, *cand)
            self._launch(plan, x, out)  # compiles; checked below
            self.check_errors(plan)
            self._sync()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.device(self.devices[0]), torch.cuda.graph(g):
                self._launch(plan, x, out)
            graphs.append(g)
            methods.append(Method(f"{cand[0]},{cand[1]}", g.replay))
        times = time_interleaved(methods, [d.index for d in self.devices], reps, warmup)
        for plan in plans.values():
            self.check_errors(plan)
        del graphs  # before the plans they point at
        medians = {cand: statistics.median(times[m.name]) for cand, m in zip(plans, methods)}
        best = faster_by(medians, self.ends_for(M), margin)
        self.reset(plans[best])  # its replays advanced the device's epochs, not the plan's count
        self.tuning[M] = medians
        self.tuned_ends[M] = best
        self._plans[M] = plans[best]
        return best

    # -- state -------------------------------------------------------------------------------
    def plan(self, M: int) -> Plan:
        """The buffers and scoreboards for inputs of ``M`` rows (built on first use)."""
        if M not in self._plans:
            self._plans[M] = self._build_plan(M, *self.ends_for(M))
        return self._plans[M]

    def _build_plan(self, M: int, R: int, D: int) -> Plan:
        """A plan for ``M`` rows whose second GPU prefills ``R`` and first GPU drains ``D``."""
        cfg, ws, devs = self.config, self.weights, self.devices
        P = M - D  # the rows the pipelined stages carry
        grids = [deps.TileGrid(P, w.shape[1], cfg.block_m, cfg.block_n) for w in ws]
        links, inputs = [], [None]
        for s in range(1, len(ws)):
            parts = 1 if self.policy.uses_queue else min(cfg.wait_parts, grids[s - 1].num_n)
            dep = deps.build_dependency(grids[s - 1], grids[s], "gemm", consumer_k=ws[s].shape[0], parts=parts)
            links.append(Link.create(dep, devs[s - 1], devs[s]))
            inputs.append(torch.empty(P, ws[s].shape[0], dtype=ws[0].dtype, device=devs[s]))
        if R:  # the prefill GEMM reads the CSR lists from its own device
            links[0].local_lists = SignalLists.create(links[0].dep, devs[1])

        def gemm(rows: int, w: torch.Tensor, device, s: int = 0) -> tuple[int, TailBuffers | None]:
            """A launch's persistent grid and split-tail buffers (None: no split tail)."""
            if not rows:
                return 0, None
            ctas = grid_size(rows, w.shape[1], cfg, device)
            split = tail_split(rows, w.shape[1], w.shape[0], self.stage_config(s), ctas)
            return ctas, None if split is None else TailBuffers.create(split, cfg, device)

        # the stages (the producer owns rows [R, P)), the prefill on stage 1's device, and the
        # drain's two GEMMs on stage 0's device, both in stage 0's configuration
        stages = [gemm(P - R if s == 0 else P, w, d, s) for s, (w, d) in enumerate(zip(ws, devs))]
        prefill = gemm(R, ws[0], devs[1]) if R else (0, None)
        drain = [gemm(D, ws[0], devs[0]), gemm(D, ws[1], devs[0])] if D else [(0, None)] * 2
        num_ctas = [c for c, _ in stages]
        limit = min((deps.epoch_limit(lk.dep, max(num_ctas)) for lk in links), default=deps.INT32_MAX)
        plan = Plan(
            M=M,
            inputs=inputs,
            links=links,
            epochs=[torch.zeros(1, dtype=torch.int32, device=d) for d in devs],
            errors=[torch.zeros(len(ERR_FIELDS), dtype=torch.int32, device=d) for d in devs],
            traces=[
                torch.full((g.num_tiles, TRACE_FIELDS.value), -1, dtype=torch.int64, device=d) if self.trace else None
                for g, d in zip(grids, devs)
            ],
            tails=[t for _, t in stages],
            num_ctas=num_ctas,
            epoch_limit=limit,
            prefill_rows=R,
            prefill_x=torch.empty(R, ws[0].shape[0], dtype=ws[0].dtype, device=devs[1]) if R else None,
            prefill_ctas=prefill[0],
            prefill_tail=prefill[1],
            drain_rows=D,
            drain_h=torch.empty(D, ws[0].shape[1], dtype=ws[0].dtype, device=devs[0]) if D else None,
            drain_ctas=(drain[0][0], drain[1][0]),
            drain_tails=(drain[0][1], drain[1][1]),
        )
        return plan

    def reset(self, plan: Plan | None = None) -> None:
        """Wait for every device, then zero counters, rings, epochs and error words."""
        self._sync()
        for p in [plan] if plan else self._plans.values():
            for t in p.state():
                t.zero_()
            p.epoch = 0
        self._sync()

    def _sync(self):
        if self.on_gpu:
            for d in self.devices:
                torch.cuda.synchronize(d)

    # -- running -----------------------------------------------------------------------------
    def check_input(self, x: torch.Tensor) -> None:
        w0 = self.weights[0]
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
        check_operands(x, w0, "pipeline input")

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None, check: bool = True) -> torch.Tensor:
        """Run the chain on ``x`` ([M, K_0] on stage 0's device); returns ``[M, N_last]`` on the
        last stage's device. ``check=False`` skips the (synchronising) error-word check, for
        CUDA-graph capture and timing; call :meth:`check_errors` later."""
        self.check_input(x)
        M, last = x.shape[0], self.weights[-1]
        if out is None:
            out = torch.empty(M, last.shape[1], dtype=last.dtype, device=self.devices[-1])
        elif out.shape != (M, last.shape[1]) or out.dtype != last.dtype or out.device != self.devices[-1]:
            raise ValueError(f"out must be [{M}, {last.shape[1]}] {last.dtype} on {self.devices[-1]}")
        plan = self.plan(M)
        self._launch(plan, x, out)
        if check and not (self.on_gpu and torch.cuda.is_current_stream_capturing()):
            self.check_errors(plan)
        return out

    def capture(self, M: int, out: torch.Tensor | None = None) -> GraphedCall:
        """Capture one call on ``M`` rows in a CUDA graph, after an eager warm-up call (which
        compiles the kernels, builds the plan and checks it ran clean).

        Returns a :class:`GraphedCall`: ``y = graphed(x)`` copies ``x`` in and replays, or fill
        ``graphed.x`` yourself and ``graphed.replay()``. It keeps this pipeline, its static
        input and its output (``out``, or a new ``[M, N_last]`` tensor) alive as long as the
        graph. To capture the pipeline inside a larger graph of your own instead, call it with
        ``out=`` and ``check=False`` under your capture, after one call outside it.
        """
        if not self.on_gpu:
            raise RuntimeError("capture needs the stages on CUDA devices (CUDA graphs do not exist on the CPU)")
        if not isinstance(M, int) or M < 1:
            raise ValueError(f"M must be a positive int, got {M!r}")
        w0 = self.weights[0]
        x = torch.zeros(M, w0.shape[0], dtype=w0.dtype, device=self.devices[0])
        out = self(x, out=out)  # the warm-up call (checks out's shape, dtype and device too)
        self._sync()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.devices[0]), torch.cuda.graph(graph):
            self(x, out=out, check=False)
        self._sync()
        return GraphedCall(self, graph, x, out)

    def _launch(
        self,
        plan: Plan,
        x,
        out,
        only: list[int] | None = None,
        delay_cycles: dict[int, int] | None = None,
        advance_epoch: bool = True,
    ):
        """Launch the stages of one call. For tests and measurements: ``only`` launches a
        subset (under ``workqueue``, a call without the consumer leaves the ring's head behind
        the epoch: :meth:`reset` before the next full call); ``advance_epoch=False`` launches
        against the current epoch (e.g. the consumer of a run whose producer already ran
        alone); ``delay_cycles`` sleeps before a stage (after a prefill, which is launched
        with stage 1). Returns Triton's compiled-kernel handle of each launched stage (None for
        the others)."""
        if advance_epoch:
            if plan.epoch >= plan.epoch_limit:
                self.reset(plan)
            plan.epoch += 1
        n = len(self.weights)
        queue = self.policy.uses_queue
        callers = self._caller_streams()
        starts = [c.record_event() for c in callers]
        kernels = [None] * n
        R, D = plan.prefill_rows, plan.drain_rows
        P = x.shape[0] - D  # the pipelined stages' rows
        first = R // self.config.block_m * plan.links[0].dep.producer.num_n if R else 0  # producer tile of row R
        for s in range(n):
            own = slice(R if s == 0 else 0, P)  # stage 0's producer owns rows [R, P)
            a = (x if s == 0 else plan.inputs[s])[own]
            c = (out if s == n - 1 else plan.inputs[s + 1])[own]
            with self._on_stream(s, starts):
                if advance_epoch:
                    plan.epochs[s].add_(1)
                if only is not None and s not in only:
                    continue
                if s == 1 and R:  # the prefill: rows [0, R) of stage 0, here, before the consumer
                    # a copy first: the GEMM reading x across NVLink with TMA took 1.29x the whole
                    # chain (2026-11-30-h200x2-s6/e3)
                    plan.prefill_x.copy_(x[:R])
                    launch_gemm(
                        plan.prefill_x, self.prefill_weight, plan.inputs[1][:R], self.stage_config(0),
                        plan.prefill_ctas, signal=plan.links[0].signal_hook(queue, local=True),
                        epoch=plan.epochs[1], err=plan.errors[1], tail=plan.prefill_tail, timeout_ns=self.timeout_ns,
                    )  # fmt: skip
                if delay_cycles and s in delay_cycles:
                    torch.cuda._sleep(delay_cycles[s])
                kernels[s] = launch_gemm(
                    a,
                    self.weights[s],
                    c,
                    self.stage_config(s),
                    plan.num_ctas[s],
                    wait=plan.links[s - 1].wait_hook(queue) if s > 0 else None,
                    signal=plan.links[s].signal_hook(queue, first if s == 0 else 0) if s < n - 1 else None,
                    epoch=plan.epochs[s],
                    err=plan.errors[s],
                    trace=plan.traces[s],
                    tail=plan.tails[s],
                    stage=s,
                    timeout_ns=self.timeout_ns,
                )
                if s == 0 and D:  # the drain, here, after the producer
                    self._drain(plan, x[P:], out[P:])
        for caller in callers:  # none on the CPU
            for st in self.streams:
                caller.wait_stream(st)
        return kernels

    def _drain(self, plan: Plan, x: torch.Tensor, out: torch.Tensor) -> None:
        """The last rows of both layers on stage 0's device (on its current stream): ``x``
        ``[D, K_0]`` into ``plan.drain_h``, then that times the replica of ``W_1`` into
        ``out`` ``[D, N_1]``, which lies on the last stage's device (a peer write)."""
        gemms = [(x, self.weights[0], plan.drain_h), (plan.drain_h, self.drain_weight, out)]
        for (a, w, c), ctas, tail in zip(gemms, plan.drain_ctas, plan.drain_tails):
            launch_gemm(
                a, w, c, self.stage_config(0), ctas, epoch=plan.epochs[0], err=plan.errors[0], tail=tail,
                timeout_ns=self.timeout_ns,
            )  # fmt: skip

    def _caller_streams(self) -> list:
        """The streams a call forks from and joins back to: the current stream of every stage's
        device, so that tensors the caller allocated or reads on any of them (``x``, ``out``,
        the result) are ordered with the stages. Under CUDA-graph capture only the capturing
        stream (stage 0's device) may be used; the graph's replay then orders everything."""
        if not self.on_gpu:
            return []
        if torch.cuda.is_current_stream_capturing():
            return [torch.cuda.current_stream(self.devices[0])]
        return [torch.cuda.current_stream(d) for d in self.devices]

    @contextlib.contextmanager
    def _on_stream(self, s: int, starts):
        if not self.on_gpu:
            yield
            return
        st = self.streams[s]
        with torch.cuda.device(self.devices[s]), torch.cuda.stream(st):
            for ev in starts:
                st.wait_event(ev)
            yield

    def traces(self, M: int) -> list[np.ndarray]:
        """The stamps of the last call with ``M`` rows, per stage ``[tiles, 5]`` (ns; see
        :mod:`ctapipelining.trace`)."""
        if not self.trace:
            raise RuntimeError("this pipeline was built without trace=True")
        self._sync()
        return [t.cpu().numpy() for t in self.plan(M).traces]

    def check_errors(self, plan: Plan | None = None) -> None:
        """Read every stage's error word (synchronises); on a timeout, reset and raise."""
        plans = [plan] if plan else list(self._plans.values())
        for p in plans:
            words = [e.cpu().tolist() for e in p.errors]
            bad = [(s, dict(zip(ERR_FIELDS, w))) for s, w in enumerate(words) if w[0]]
            if bad:
                self.reset(p)
                msgs = []
                for s, e in bad:
                    if e["kind"] == KIND_HEAD.value:
                        msgs.append(
                            f"stage {s} on {self.devices[s]}: CTA {e['cta']} claimed work-queue position "
                            f"{e['index']}, before this run's first: the ring's head is behind its epoch (a call "
                            "launched without its consumer, or a CUDA graph replaying a freed Pipeline's buffers)"
                        )
                        continue
                    on_counter = e["kind"] == KIND_COUNTER.value
                    what = f"counter {e['index']}" if on_counter else f"work-queue position {e['index']}"
                    tile = f"tile {e['tile']}" if e["tile"] >= 0 else "its next tile"
                    msgs.append(
                        f"stage {s} on {self.devices[s]}: CTA {e['cta']} timed out waiting for {tile} "
                        f"({what} was {e['seen']}, needs {e['target']}; deadline {self.timeout_ns / 1e9:g} s)"
                    )
                raise PipelineTimeout("; ".join(msgs) + ". State reset; the next call starts clean.")


__all__ = ["Pipeline", "PipelineTimeout", "Plan", "Link", "GraphedCall"]
