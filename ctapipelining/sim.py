"""Discrete-event model of every method on 1 to N GPUs, calibrated on measured device runs.

What is modelled
----------------
* **Our GEMM**: persistent CTAs (one per SM) walking the tile order; a tile of ``BM x BN``
  over ``K`` takes ``K * tile_ns_per_k`` (plus ``epilogue_ns``); a producer writing into the
  peer GPU is slower by ``remote_factor`` and pays ``t1_ns`` per tile to signal; with
  ``signal_lag`` > 0 a tile is signalled that fraction into the CTA's next tile, the CTA's last
  tile at once (the kernels signal a quarter in: :data:`SIGNAL_LAG`). Split tails
  (``GemmConfig.split_tail``) in :func:`simulate_gemm` and :func:`simulate_chain_kernel`
  (``split_tail=True``), not in the stages of :func:`simulate_cta` or :func:`simulate_placed`.
  Not modelled: per-CTA variation of the tile time (static consumers fall a round behind mid-run
  without moving the chain's end,
  ``benchmarks/results/2026-11-30-h200x2-tails/``),
  the consumer's tiles running faster than a plain GEMM's (its GPU clocks higher), and the two
  GPUs' power limits (a producer writing into the peer clocks down ~5%,
  ``benchmarks/results/2026-11-30-h200x2-parts/``; ``remote_factor`` stands for it).
* **CTA-pipelining**: a counter fills when its last producer tile signalled; its consumer tiles
  become visible ``t2_ns`` later; a consumer CTA pays ``t3_ns`` to take a tile. ``static``:
  each CTA walks the tile order and waits; ``workqueue``: tiles run in readiness order on
  whichever CTA is free first. The same :mod:`ctapipelining.deps` structures as the kernels.
  ``wait_parts`` (static): a tile starts when part 0 of its input is visible and stalls at
  the K fraction where each later part begins until that part is (``GemmConfig.wait_parts``);
  checking a later part costs a tile bound by HBM ``t3_ns`` more, one that computes longer
  than it streams nothing (``Calibration.part_check_ns``).
  ``prefill_rows``: the second GPU copies ``x[:R]``, computes those rows of layer 1 at the
  local tile time, then starts its consumer (``Pipeline(prefill_rows=...)``). ``drain_rows``
  (two stages): the first GPU computes the last ``D`` rows of both layers after its producer,
  the second of them writing into the peer, and the consumer runs the rows before them
  (``Pipeline(drain_rows=...)``). The model has no split tails: it predicts 512 + 512 rows at
  0.97x the chain without them, where the kernels take 1.00x without split tails and 0.98-0.99x
  with them (``benchmarks/results/2026-11-30-h200x2-ends/``, runs e1-e3): it is optimistic for the ends.
* **cuBLAS** (``torch.matmul``): ``b * M`` per ``[M, K] x [K, N]`` at the calibrated ``K, N``,
  scaled by ``K * N`` for other shapes, plus ``a`` (the fit's intercept: the fixed cost of a
  timed eager call) when the bench calls it eagerly. It ignores cuBLAS's wave quantization, so
  it is optimistic for GEMMs of a single wave.
* **Copies** over NVLink at ``p2p_gbps`` on a copy engine (one per direction, in order);
  **all-reduce** ``alpha + 2 (g - 1) / g * bytes / busbw`` (ring).
* **Launch**: each kernel of a replayed CUDA graph starts ``launch_ns`` after the previous one
  on its stream.
* **Stages sharing one GPU**:
  - the chain kernel (:func:`simulate_chain_kernel`): CTAs claim the positions of the kernel's
    own combined order (:func:`ctapipelining.deps.chain_order`, stages interleaved) as they come
    free; its tiles take ``chain_tile_factor`` times the GEMM's, and ``chain_fixed_ns`` a kernel;
    a split last round ``chain_tail_slice_ns`` per slice;
  - the loopback (:func:`simulate_loopback`): a share of the SMs per stage;
  - our GEMMs one after another with split tails (:func:`simulate_ours_sequential`;
    ``tail_slice_ns`` per slice), on the calibrated tiles or in the configurations the library's
    tables give each row count (:func:`table_config`; ``Calibration.with_config``);
  - in every GEMM (one kernel, a chain kernel's stage, a pipeline's stage), a tile takes at
    least the time its operands take to stream from HBM: each round of the tile order reads the
    rows of A and columns of B its tiles cover once (``Calibration.for_gemm``, ``hbm_gbps``;
    a loopback's stages share it). That sets a round of narrow tiles over few rows (64 x 128
    tiles at 128 rows stream the whole weight matrix) and wide GEMMs over few rows (a Llama-70B
    gate/up GEMM at 128 rows); 128 x 256 tiles over a few hundred rows or more compute longer
    than they read. ``hbm_gbps`` (3770 GB/s) is fitted on our GEMM at 128 rows in
    ``benchmarks/results/2026-12-05-h200-default/``; the other runs with the same tiles imply
    3510-3670 GB/s.

  :func:`validate_shared` compares their ratios with a ``benchmarks/shared_gpu.py`` run. On the
  recorded run at 128-16384 rows on the calibrated tiles
  (``benchmarks/results/2026-12-01-h200x2-decision/depth/shared_gpu.json``):
  - the chain against the GEMMs one after another is within 3% at every height;
  - the chain against the loopback errs by up to 6.3% (128 rows) and 4.2% (640 rows), where the
    loopback's half-idle GPU clocks up.

  On the two runs of the current configuration tables (``tables=True``:
  ``benchmarks/results/2026-12-01-h200-configs/run11-parts/`` and
  ``benchmarks/results/2026-12-05-h200-default/``, two machines), with the tile time traced on
  a third H200 (``benchmarks/results/2026-12-01-h200-chain/trace_640.npz``), from 640 rows on:
  the chain, in its table's tiles or on 128 x 256 tiles, against our GEMMs one after another
  within 2.9% (the largest at 768 rows, where the measured ratio itself moves by 2-3% between
  machines: 1.031 in ``2026-12-05-h200-default/``, 1.054-1.064 in the other four runs), the
  chain against the loopback within 2%, and a split last round against none within 2.4%. At
  128 rows the chain in its table's tiles against our GEMMs is within 2% (its consumer tiles,
  bound by HBM, pay for each part they check); the chain on 128 x 256 tiles errs by 16-19%: a
  round of 32 tiles leaves 100 SMs idle, and the GPU clocks up (the model has no clocks). With
  the packaged calibration's tile time instead (``ctapipelining sim --validate-shared ...
  --tables``): up to 3.2% from 640 rows on (768 rows), 1.4-1.9% for the chain at 128 rows,
  30-34% for the 128 x 256 tiles at 128 rows. A run on another GPU is modelled with the HBM
  rate scaled to that GPU's peak (:meth:`Calibration.on_gpu`): on the two H100 runs of the
  current tables (``benchmarks/results/2026-12-05-cublas-stages/h100-4270285/``,
  ``benchmarks/results/2026-12-06-h100-verify-dd27f5f/``), the chain in its table's tiles against
  our GEMMs one after another within 2.7-4.1% at 128 rows (7.3-8.8% at the H200's rate),
  3.3-4.8% at 640, 2.8-3.3% at 768 and 2.2% from 1024 rows on.
* **More layers than GPUs** (:func:`simulate_placed`; :func:`placement` spreads them in
  contiguous ranges): each GPU's stages as chain kernels of up to
  :data:`ctapipelining.deps.CHAIN_MAX_STAGES` stages, the first stage of each waiting for the
  kernel before and the last signalling the kernel after, in parts; micro-batching on the same
  placement (:func:`simulate_microbatch` with ``devices``: a GPU's stages take turns chunk by
  chunk). ``gated``: a stage whose epilogue halves its output (a Llama block's gate/up GEMM),
  so the next computes over half of its columns. Against the one deep run measured, 4 layers on
  2 H200s at 2048-16384 rows (:func:`validate_depth`, which takes the tile time and the remote
  write's cost from the run,
  ``benchmarks/results/2026-12-01-h200x2-decision/depth/depth/results.json``): the interleaved
  order over stage after stage and waiting in parts over whole row-blocks within 3.1%, the chain
  over the best cuBLAS micro-batching within 2.0%, and over the floor optimistic by 3.5-5.1%.
  :func:`figure_depth` and :func:`figure_blocks` (Llama blocks on two GPUs: a block per GPU,
  and one block split the paper's way) are predictions.

Methods: sequential, micro-batching (one chunk size, or the best of a sweep), tensor
parallelism, CTA-pipelining (both policies) and CTA-pipelining combined with TP (stages x
TP degree: each shard pair is a pipelined chain, then an all-reduce inside the last stage).
:func:`simulate_cta` can also return the per-tile timeline in the trace mode's format, so
predicted and measured timelines can be drawn with :func:`ctapipelining.trace.plot_timeline`.

Calibration
-----------
:meth:`Calibration.default` is the 2x H200 calibration shipped with the package
(``ctapipelining/data/calibration-2xh200.json``); :meth:`Calibration.from_results` fits one on a
``bench`` results file, a ``trace`` summary and a GEMM tuning run of the same machine
(``ctapipelining sim --results FOLDER``). :attr:`Calibration.source` names the files and
:attr:`Calibration.device` the machine and versions. The packaged file is written by
:meth:`Calibration.save` from the committed runs it names in its ``source``::

    final = Path("benchmarks/results/2026-11-30-h200x2-protocol/final")
    cal = Calibration.from_results(final, tune="benchmarks/results/2026-11-30-h200x2-sim-inputs/tune1.json")
    environment = json.loads((final / "results.json").read_text())["environment"]
    cal.save("ctapipelining/data/calibration-2xh200.json", environment)
"""

from __future__ import annotations

import functools
import heapq
import importlib.resources
import json
import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np

from . import deps
from .argtypes import UsageError, chain_dims, existing_file, existing_path, positive_int, stage_indices
from .tables import GEMM_TABLE, PIPELINE_TABLE, pick_config, table_rows
from .trace import plot_timeline

# the checkout this module lies in: file names in a calibration's source are relative to it
REPO = Path(__file__).parent.parent
PACKAGED = "calibration-2xh200.json"  # under ctapipelining/data
# a producer signals each tile a quarter into its CTA's next tile (kernels/gemm.py), so its remote
# writes drain while that tile computes
SIGNAL_LAG = 0.25


def _rel(path: Path) -> str:
    """``path`` relative to the repository when it lies inside it (for reports that get committed)."""
    try:
        return Path(path).resolve().relative_to(REPO.resolve()).as_posix()
    except ValueError:
        return Path(path).as_posix()


def _device(environment: dict | None) -> str:
    """``"2x NVIDIA H200 (torch 2.11.0+cu130, Triton 3.6.0)"`` from a results file's ``environment``."""
    env = environment or {}
    gpus = env.get("gpus") or []
    if gpus and len(set(gpus)) == 1:
        what = f"{len(gpus)}x {gpus[0]}"
    else:
        what = " + ".join(gpus) or "unknown device"
    versions = [f"{name} {env[key]}" for key, name in (("torch", "torch"), ("triton", "Triton")) if env.get(key)]
    return f"{what} ({', '.join(versions)})" if versions else what


# Peak HBM bandwidth of the GPUs whose SMs and clocks are the calibrated H200's (the H100 SXM's
# are the same), TB/s, by a pattern of the name PyTorch gives them (NVIDIA's data sheets): on one
# of them a tile computes in the calibrated time, and the memory is what differs
# (:meth:`Calibration.on_gpu`). Other GPUs (an H100 PCIe or NVL, a GH200) are not modelled.
HBM_PEAK_TBPS = ((r"\bH200\b", 4.8), (r"\bH100 80GB HBM3\b", 3.35))


def hbm_peak_tbps(name: str | None) -> float | None:
    """The peak HBM bandwidth of the GPU ``name`` names (:data:`HBM_PEAK_TBPS`), or None."""
    return next((tbps for pattern, tbps in HBM_PEAK_TBPS if name and re.search(pattern, name)), None)


@dataclass(frozen=True)
class Calibration:
    """Machine parameters of the model (times in ns)."""

    num_sms: int = 132
    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 4
    tile_ns_per_k: float = 11.8  # one 128x256 tile, per unit of K
    epilogue_ns: float = 0.0
    remote_factor: float = 1.06
    t1_ns: float = 3_840.0
    signal_lag: float = 0.0  # fraction of the next tile after which a tile is signalled (0: at once)
    t2_ns: float = 1_290.0
    t3_ns: float = 770.0
    cublas_a_ns: float = 30_000.0
    cublas_b_ns: float = 186.0  # per row of X at the calibrated K x N
    cublas_kn: int = 8192 * 8192
    tp_factor: float = 1.0  # TP's half-width GEMMs relative to the cuBLAS model
    p2p_gbps: float = 380.0
    allreduce_alpha_ns: float = 20_000.0
    allreduce_busbw_gbps: float = 300.0
    launch_ns: float = 5_000.0
    eager_overhead_ns: float = 100_000.0  # Python launch cost of one eager call of our kernels
    # stages sharing one GPU (one H200, benchmarks/results/2026-12-01-h200-chain/chain_schedule-2.json:
    # a one-stage chain kernel 1.040x our GEMM at 2048 rows and 1.013x at 16384, solved for a
    # per-tile factor and a per-kernel cost)
    chain_tile_factor: float = 1.009  # a chain kernel's tile over the GEMM's
    chain_fixed_ns: float = 12_700.0  # a chain kernel's own cost (its ticket's first and last claims)
    # a split tail's cost per slice beyond its share of K (its partial's write and read in the sum,
    # its pipeline fill), fitted on the chain over our GEMMs one after another at 640 and 768 rows in
    # the five one-GPU runs (shared_gpu-*.json in the same folder, 2026-12-01-h200-configs/run11-parts/,
    # 2026-12-05-h200-default/; validate_shared): within 2.9% in each
    tail_slice_ns: float = 4_500.0
    # the same in a chain kernel's split tail, whose kernel holds the last stage's body twice (more
    # registers, its slices waiting on a producer's last rows), fitted on the chain with and without
    # a split tail at 640 rows (benchmarks/results/2026-12-01-h200-configs/run6-table/shared_gpu.json);
    # run11-parts/ there, another machine, then comes within 1.3% at 640 rows and 1% at 16384
    chain_tail_slice_ns: float = 11_000.0
    # other tile shapes the planner may pick: (block_m, block_n, time per unit of work relative
    # to the calibrated 128x256 tile), measured in a tuning run; a shape not listed computes at
    # the calibrated tile's rate
    tile_shapes: tuple = ((128, 128, 1.13),)
    # the rate at which a GEMM's tiles stream their operands from HBM (bytes/ns), shared by the
    # CTAs running at once: a tile takes at least its share of that time (:meth:`for_gemm`).
    # Fitted on our plain GEMM at 128 rows, one round of 64 x 128 tiles that compute in less
    # than they read (benchmarks/results/2026-12-05-h200-default/shared_gpu.json: 41.2 us a
    # GEMM of X[128, 8192] @ W[8192, 8192], a launch included)
    hbm_gbps: float = 3_770.0
    hbm_gpu: str = "NVIDIA H200"  # the GPU hbm_gbps is of (Calibration.on_gpu)
    source: str = "defaults"  # the files fitted on, " + "-separated
    device: str = "unknown device"  # the machine and versions they were measured with

    @property
    def label(self) -> str:
        """The device and the folder of the results fitted on, for reports."""
        if self.source == "defaults":
            return "built-in defaults"
        return f"{self.device}, runs in {Path(self.source.split(' + ')[0]).parent.as_posix()}"

    # -- the pieces ---------------------------------------------------------------------------
    def tile_ns(self, K: int) -> float:
        return K * self.tile_ns_per_k + self.epilogue_ns

    def with_tile(self, block_m: int, block_n: int, relative_cost: float) -> Calibration:
        """The same machine running tiles of ``block_m x block_n`` (``relative_cost``: time per
        unit of work relative to the calibrated tile)."""
        area = (block_m * block_n) / (self.block_m * self.block_n)
        return replace(self, block_m=block_m, block_n=block_n, tile_ns_per_k=self.tile_ns_per_k * area * relative_cost)

    def with_config(self, config: dict) -> Calibration:
        """The same machine running a GEMM configuration (a dict of
        :class:`~ctapipelining.kernels.gemm.GemmConfig`'s fields, e.g. :func:`table_config`'s):
        its tile shape, at its relative cost in :attr:`tile_shapes` (a shape not listed there
        computes at the calibrated tile's rate), its K step and its row-block grouping."""
        bm, bn = config["block_m"], config["block_n"]
        rel = next((c for m, n, c in self.tile_shapes if (m, n) == (bm, bn)), 1.0)
        cal = self if (bm, bn) == (self.block_m, self.block_n) else self.with_tile(bm, bn, rel)
        return replace(cal, group_m=config.get("group_m", self.group_m), block_k=config.get("block_k", self.block_k))

    def for_gemm(self, M: int, K: int, N: int, share: float = 1.0) -> Calibration:
        """The same machine on one GEMM ``[M, K] x [K, N]``: its tiles take at least the time
        their operands take to stream from HBM at :attr:`hbm_gbps` (``share``: the part of it
        this GEMM has, when other kernels stream beside it). Each round of the tile order
        (:func:`ctapipelining.deps.tile_order`, as many tiles as CTAs run at once) reads the
        ``block_m x K`` rows of A and the ``K x block_n`` columns of B its tiles cover, once
        each (a tile's neighbours in the round find them in L2); the tiles' floor is the mean
        round's. Only few rows make it bind (a round of narrow tiles streaming the whole weight
        matrix); otherwise the calibration is returned as it is."""
        grid = deps.TileGrid(M, N, self.block_m, self.block_n)
        active = min(self.num_sms, grid.num_tiles)
        pm, pn = np.divmod(deps.tile_order(grid, self.group_m), grid.num_n)
        rnd = np.arange(grid.num_tiles) // active
        rows = np.bincount(np.unique(rnd * grid.num_m + pm) // grid.num_m)
        cols = np.bincount(np.unique(rnd * grid.num_n + pn) // grid.num_n)
        per_k = 2 * (rows * self.block_m + cols * self.block_n)  # bytes a round reads per unit of K
        floor = float(per_k.mean()) / (self.hbm_gbps * share)
        return self if floor <= self.tile_ns_per_k else replace(self, tile_ns_per_k=floor)

    def on_gpu(self, name: str | None) -> Calibration:
        """This calibration on the GPU ``name`` names (as PyTorch names it): :attr:`hbm_gbps`
        (of :attr:`hbm_gpu`) scaled by the two GPUs' peak HBM bandwidths
        (:data:`HBM_PEAK_TBPS`) where both are known and differ; else unchanged. A tile's
        compute time stays as calibrated."""
        here, there = hbm_peak_tbps(self.hbm_gpu), hbm_peak_tbps(name)
        if here is None or there is None or here == there:
            return self
        return replace(self, hbm_gbps=self.hbm_gbps * there / here, hbm_gpu=name)

    def part_check_ns(self, M: int, K: int, N: int) -> float:
        """What checking a later part of a tile's input costs mid K loop (``wait_parts``): the
        acquire holds back the loads behind it, which the K-steps already in flight hide while
        the tile computes longer than it streams, and which cost the tile :attr:`t3_ns` when HBM
        bounds it (:meth:`for_gemm`'s floor binds: the loads held back are what it waits on)."""
        return self.t3_ns if self.for_gemm(M, K, N).tile_ns_per_k > self.tile_ns_per_k else 0.0

    def cublas_ns(self, M: int, K: int, N: int, eager: bool = False) -> float:
        """GPU time of ``torch.matmul``; ``eager`` adds the fixed cost of one timed eager call
        (the intercept of the fit: launch and synchronisation), which graph replay avoids."""
        return (self.cublas_a_ns if eager else 0.0) + self.cublas_b_ns * M * (K * N / self.cublas_kn)

    def copy_ns(self, nbytes: float) -> float:
        return nbytes / self.p2p_gbps

    def allreduce_ns(self, nbytes: float, g: int) -> float:
        if g <= 1:
            return 0.0
        return self.allreduce_alpha_ns + 2 * (g - 1) / g * nbytes / self.allreduce_busbw_gbps

    # -- calibration ------------------------------------------------------------------------
    @classmethod
    def default(cls) -> Calibration:
        """The calibration shipped with the package: 2x H200 (see :attr:`device`, :attr:`source`)."""
        return _packaged()

    @classmethod
    def load(cls, path: Path | str) -> Calibration:
        """A calibration written by :meth:`save`."""
        return cls._from_json(json.loads(Path(path).read_text()))

    @classmethod
    def _from_json(cls, data: dict) -> Calibration:
        src, params = data["source"], dict(data["parameters"])
        params["tile_shapes"] = tuple(tuple(shape) for shape in params["tile_shapes"])
        return cls(**params, source=" + ".join(src["files"]) or "defaults", device=src["device"])

    def save(self, path: Path | str, environment: dict | None = None) -> Path:
        """Write the parameters and their source (the files fitted on, the device; with
        ``environment``, a results file's, the versions and date too) as JSON that :meth:`load`
        reads back to an equal calibration."""
        src: dict = dict(files=[] if self.source == "defaults" else self.source.split(" + "), device=self.device)
        if environment:
            src["environment"] = {k: environment[k] for k in ("date", "torch", "triton", "python", "gpus", "p2p")
                                  if k in environment}  # fmt: skip
        params = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("source", "device")}
        Path(path).write_text(json.dumps(dict(source=src, parameters=params), indent=1) + "\n")
        return Path(path)

    @classmethod
    def from_results(
        cls, results: Path | str, trace: Path | str | None = None, tune: Path | str | None = None
    ) -> Calibration:
        """Fit the parameters on a ``bench`` results JSON (or a folder holding ``results.json``),
        a ``trace`` JSON for T1..T3 (by default the ``timeline_static_*.json`` of the largest M
        beside the results, if any) and a GEMM tuning run's JSON for the 128x128 tile's cost
        (``benchmarks/tune.py``; by default none). What a file does not give keeps the class
        default.

        Only single-method measurements are fitted: the Triton and cuBLAS floors, the
        sequential chain (copy bandwidth), TP compute and TP (all-reduce), the producer with
        its signal (remote factor). Micro-batching and CTA-pipelining are not used, so the
        model's predictions for them can be checked against measurement.
        """
        results = Path(results)
        if results.is_dir():
            results = results / "results.json"
        if trace is None:
            found = {int(p.stem.split("_")[-1]): p for p in results.parent.glob("timeline_static_*.json")
                     if p.stem.split("_")[-1].isdigit()}  # fmt: skip
            trace = found[max(found)] if found else None
        trace = Path(trace) if trace else None
        tune = Path(tune) if tune else None
        r = json.loads(results.read_text())
        K = int(r.get("k", 8192))
        med = {(s["method"], s["seq"], s["chunk"]): s["median_ms"] * 1e6 for s in r["summaries"]}
        seqs = sorted({s["seq"] for s in r["summaries"] if s["method"] == "floor_triton"})
        base = cls()
        # Triton floor = eager overhead + waves * tile time (a least-squares line in waves)
        waves = [math.ceil(math.ceil(m / base.block_m) * math.ceil(K / base.block_n) / base.num_sms) for m in seqs]
        t_tr = [med[("floor_triton", m, None)] for m in seqs]
        slope, icpt = np.polyfit(waves, t_tr, 1)
        # cuBLAS line in M
        b, a = np.polyfit(seqs, [med[("floor_cublas", m, None)] for m in seqs], 1)
        big = max(seqs)
        nbytes = big * K * 2
        copy = med[("sequential", big, None)] - 2 * med[("floor_cublas", big, None)]
        tp_factor = med[("tp_compute", big, None)] / (2 * (a + b * big / 2))  # two eager half-width GEMMs
        ar = [(m * K * 2, med[("tp", m, None)] - med[("tp_compute", m, None)]) for m in seqs]
        ar_slope, ar_icpt = np.polyfit([x for x, _ in ar], [y for _, y in ar], 1)
        t = json.loads(trace.read_text()) if trace else {}
        t1 = t.get("T1_signal", {}).get("median_us", base.t1_ns / 1e3) * 1e3
        # remote factor: the producer alone (remote writes + signals, an eager call) over the
        # plain GEMM (eager), both without the eager overhead, less the signals' own share
        prod = med.get(("producer_signal_static", big, None))
        remote = base.remote_factor
        if prod:
            gpu_floor = med[("floor_triton", big, None)] - icpt
            remote = (prod - icpt - waves[seqs.index(big)] * t1) / gpu_floor
        shapes = base.tile_shapes
        if tune:  # 128x128 vs 128x256, both grouped by 8, same run (names of benchmarks/tune.py, or older)
            tr = {row["method"]: row["median_ms"] for row in json.loads(tune.read_text())["rows"]}
            for small, big in (("plain 128x128x64 g8 st4", "plain 128x256x64 g8 st3"),
                               ("plain 128x128 g8 st4", "plain g8 {}")):  # fmt: skip
                if small in tr and big in tr:
                    shapes = ((128, 128, tr[small] / tr[big]),)
                    break
        return cls(
            tile_shapes=shapes,
            tile_ns_per_k=float(slope) / K,
            remote_factor=float(remote),
            t1_ns=t1,
            signal_lag=SIGNAL_LAG,
            t2_ns=t.get("T2_pingpong_one_way_us", base.t2_ns / 1e3) * 1e3,
            t3_ns=t.get("T3_fetch_when_ready", {}).get("median_us", base.t3_ns / 1e3) * 1e3,
            cublas_a_ns=float(max(a, 0.0)),
            cublas_b_ns=float(b),
            cublas_kn=K * K,
            tp_factor=float(tp_factor),
            p2p_gbps=nbytes / copy if copy > 0 else base.p2p_gbps,
            allreduce_alpha_ns=float(max(ar_icpt, 0.0)),
            allreduce_busbw_gbps=float(1.0 / ar_slope) if ar_slope > 0 else base.allreduce_busbw_gbps,
            eager_overhead_ns=float(max(icpt, 0.0)),
            source=" + ".join(_rel(p) for p in (results, trace, tune) if p),
            device=_device(r.get("environment")),
        )

    def to_dict(self) -> dict:
        return asdict(self)


@functools.cache
def _packaged() -> Calibration:
    text = (importlib.resources.files(__package__) / "data" / PACKAGED).read_text()
    return Calibration._from_json(json.loads(text))


# --------------------------------------------------------------------------- methods


@dataclass
class CtaResult:
    total_ns: float
    producer_end_ns: list[float]  # per stage: when its last tile finished
    trace: list[np.ndarray] = field(repr=False, default_factory=list)  # trace-mode rows per stage


def _gemm_stage(grid: deps.TileGrid, K: int, cal: Calibration, ready: np.ndarray | None, policy: str,
                start_ns: float, remote: bool, signals: bool, part_frac: np.ndarray | None = None):  # fmt: skip
    """Run one persistent GEMM stage; ``ready[tile]`` = when its input is visible (or None);
    with ``part_frac`` (``static``), ``ready[tile, q]`` = when part ``q`` is, which the tile
    first reads ``part_frac[q]`` of the way through its K loop.
    Returns per-tile rows ``[wait, start, stored, done, cta]`` (ns)."""
    T = grid.num_tiles
    P = min(cal.num_sms, T)
    t_tile = cal.for_gemm(grid.M, K, grid.N).tile_ns(K) * (cal.remote_factor if remote else 1.0)
    post = cal.t1_ns if signals else 0.0
    fetch = cal.t3_ns if ready is not None else 0.0
    check = cal.part_check_ns(grid.M, K, grid.N)
    rows = np.zeros((T, 5))
    if ready is not None and policy == "workqueue":
        order = np.argsort(ready, kind="stable")
        free = [(start_ns, pid) for pid in range(P)]
        heapq.heapify(free)
        for tile in order:
            t_free, pid = heapq.heappop(free)
            begin = max(t_free, ready[tile]) + fetch
            rows[tile] = (t_free, begin, begin + t_tile, begin + t_tile + post, pid)
            heapq.heappush(free, (begin + t_tile + post, pid))
    else:
        order = deps.tile_order(grid, cal.group_m)
        for pid in range(P):
            t = start_ns
            for tile in order[pid::P]:
                if ready is None:
                    begin = end = t
                elif part_frac is None:
                    begin = end = max(t, ready[tile]) + fetch
                else:  # run to where each later part begins, stall there until it is visible
                    begin = end = max(t, ready[tile, 0]) + fetch
                    for q in range(1, len(part_frac)):
                        end = max(end + (part_frac[q] - part_frac[q - 1]) * t_tile, ready[tile, q]) + check
                    end -= part_frac[-1] * t_tile
                rows[tile] = (t, begin, end + t_tile, end + t_tile + post, pid)
                t = end + t_tile + post
    if signals and cal.signal_lag > 0:  # signalled a fraction into the CTA's next tile
        for pid in range(P):
            mine = np.flatnonzero(rows[:, 4] == pid)
            mine = mine[np.argsort(rows[mine, 1])]
            rows[mine[:-1], 3] = rows[mine[1:], 1] + cal.signal_lag * t_tile
    return rows


def _link_ready(
    producer: deps.TileGrid, consumer: deps.TileGrid, sent: np.ndarray, K: int, wait_parts: int, cal: Calibration
) -> tuple[np.ndarray, np.ndarray | None]:
    """When each consumer tile's input is visible across a link (``(ready, part_frac)`` as
    :func:`_gemm_stage` takes them), the producer's tiles signalled at ``sent``: a counter fills
    when the last producer tile that signals it is done, and is seen ``t2_ns`` later; in up to
    ``wait_parts`` parts of the consumer's ``K``."""
    dep = _gemm_dependency(producer, consumer, min(wait_parts, producer.num_n))
    filled = np.full(dep.num_counters, -np.inf)
    np.maximum.at(filled, dep.signal_counters, np.repeat(sent, np.diff(dep.signal_ptr)))
    ready = cal.t2_ns + filled[dep.counter_of_tile[:, None] + np.arange(dep.parts)]
    if dep.parts == 1:
        return ready[:, 0], None
    return ready, np.array([dep.part_k_start(q) / K for q in range(dep.parts)])


def simulate_cta(
    M: int,
    dims: list[int],
    cal: Calibration,
    policy: str = "static",
    wait_parts: int = 1,
    prefill_rows: int = 0,
    drain_rows: int = 0,
) -> CtaResult:
    """A chain ``X[M, dims[0]] @ W_0[dims[0], dims[1]] @ ...`` with one stage per GPU;
    ``wait_parts`` > 1: static consumers wait for their input in parts (capped as the
    pipeline caps them, at the producer's column-blocks); ``prefill_rows``: the second GPU
    first copies ``x[:R]`` and computes those rows of stage 0 itself (writing locally), then
    starts its consumer, while stage 0's GPU computes the rest; ``drain_rows`` (two stages):
    stage 0's GPU computes the last rows of both layers after its producer, and the consumer
    stops before them (as :class:`ctapipelining.pipeline.Pipeline` does). Stage 0's end
    includes its drain."""
    if wait_parts > 1 and policy != "static":
        raise ValueError("wait_parts > 1 needs the static policy")
    bm = cal.block_m
    D = max(0, min(drain_rows, (M - 1) // bm * bm)) if len(dims) == 3 else 0
    M -= D  # the pipelined rows
    R = max(0, min(prefill_rows, (M - 1) // bm * bm)) if len(dims) > 2 else 0
    grids = [deps.TileGrid(M, n, bm, cal.block_n) for n in dims[1:]]
    ready, frac = None, None
    traces, ends = [], []
    start_next = 0.0
    for s, grid in enumerate(grids):
        last = s == len(grids) - 1
        start = s * cal.launch_ns + (start_next if s == 1 else 0.0)
        own = deps.TileGrid(M - R, grid.N, bm, cal.block_n) if s == 0 and R else grid
        rows = _gemm_stage(own, dims[s], cal, ready, policy, start, remote=not last, signals=not last, part_frac=frac)
        if own is not grid:  # stage 0 owns rows [R, M); the prefill GEMM on GPU 1 computes [0, R) first
            copy = cal.copy_ns(R * dims[0] * 2)
            pre = _gemm_stage(
                deps.TileGrid(R, grid.N, bm, cal.block_n), dims[0], cal, None, policy, copy, remote=False, signals=True
            )
            start_next = float(pre[:, 3].max())
            rows = np.concatenate([pre, rows])  # row-major tile ids: the prefill's rows come first
        traces.append(rows)
        ends.append(float(rows[:, 3].max()))
        if not last:
            ready, frac = _link_ready(grid, grids[s + 1], rows[:, 3], dims[s + 1], wait_parts, cal)
    for s in range(2 if D else 0):  # the drain, on stage 0's GPU after its producer
        grid = deps.TileGrid(D, dims[s + 1], bm, cal.block_n)
        rows = _gemm_stage(grid, dims[s], cal, None, "static", ends[0] + cal.launch_ns, remote=s == 1, signals=False)
        ends[0] = float(rows[:, 3].max())
    return CtaResult(max(ends) + cal.launch_ns, ends, traces)


def simulate_gemm(M: int, K: int, N: int, cal: Calibration, split_tail: bool = False, split_k: bool = False) -> float:
    """Our persistent GEMM alone (GPU time); ``split_tail``: its partial last round split along
    K over the CTAs it leaves idle (:func:`ctapipelining.deps.split_tail`), each tail tile done
    when its last slice is, plus :attr:`Calibration.tail_slice_ns` per slice; ``split_k``: a lone
    partial round (fewer tiles than SMs) too, on a CTA per slice (``GemmConfig.split_k``)."""
    cal = cal.for_gemm(M, K, N)
    grid = deps.TileGrid(M, N, cal.block_m, cal.block_n)
    P, k_tiles = min(cal.num_sms, grid.num_tiles), -(-K // cal.block_k)
    split_tail = split_k if grid.num_tiles < cal.num_sms else split_tail
    split = deps.split_tail(grid.num_tiles, cal.num_sms, k_tiles, deps.TAIL_MIN_SLICE_K) if split_tail else None
    if split is None:
        rows = _gemm_stage(grid, K, cal, None, "static", 0.0, False, False)
        return float(rows[:, 3].max()) + cal.launch_ns
    P, t_tile = max(P, split.items), cal.tile_ns(K)  # (fewer tiles than SMs: a CTA per slice)
    free = [(split.first_pos - pid + P - 1) // P * t_tile for pid in range(P)]  # after the full rounds
    ends = [
        free[i] + (k1 - k0) / k_tiles * t_tile for i in range(split.items) for _, k0, k1 in [split.slice_of(i, k_tiles)]
    ]
    # (split, the round's tiles no longer bound the streaming: the operands still stream once)
    stream = 2 * (M * K + K * N) / cal.hbm_gbps
    return max(max(free), max(ends) + split.splits * cal.tail_slice_ns, stream) + cal.launch_ns


def table_config(name: str, M: int) -> dict:
    """The configuration (:class:`~ctapipelining.kernels.gemm.GemmConfig`'s fields) that the
    library's measured table ``name`` gives ``M`` rows (:data:`GEMM_TABLE`: the plain GEMM's, as
    :func:`ctapipelining.gemm.plain_config` reads it; :data:`PIPELINE_TABLE`: a pipeline's per
    plan height): the row of the smallest row count ``>= M``, the last row's beyond it."""
    return pick_config(table_rows(name), M)


def simulate_ours_sequential(M: int, dims: list[int], cal: Calibration, config: dict | None = None) -> float:
    """Our GEMMs one after another on one GPU, in one graph (GPU time): on the calibrated tiles
    with split tails, or each in ``config`` (e.g. ``table_config(GEMM_TABLE, M)``, the one
    :func:`~ctapipelining.gemm.matmul` runs for ``M`` rows; a configuration recorded without
    ``split_k`` has none)."""
    if config is not None:
        cal, split, split_k = cal.with_config(config), config["split_tail"], config.get("split_k", False)
    else:
        split, split_k = True, False
    return sum(simulate_gemm(M, k, n, cal, split, split_k) for k, n in zip(dims, dims[1:]))


@functools.lru_cache(maxsize=256)
def _gemm_dependency(producer: deps.TileGrid, consumer: deps.TileGrid, parts: int) -> deps.Dependency:
    """:func:`ctapipelining.deps.build_dependency` of a GEMM link, built once per grids and parts
    (a sweep models the same links again and again; the models only read it)."""
    return deps.build_dependency(producer, consumer, "gemm", parts=parts)


def simulate_chain_kernel(
    M: int,
    dims: list[int],
    cal: Calibration,
    wait_parts: int = 8,
    split_tail: bool = False,
    interleave: bool = True,
) -> float:
    """The stages of ``dims`` sharing one GPU in one chain kernel (:mod:`ctapipelining.kernels.chain`):
    CTAs claim the positions of the kernel's combined order (:func:`ctapipelining.deps.chain_order`,
    the same table: stages interleaved one round apart, or with ``interleave=False`` stage after
    stage) as they come free; a tile of a later stage waits for each part of its input as
    :func:`_gemm_stage` does; a tile is signalled a fraction into its CTA's next tile of the same
    stage, or when its CTA takes a tile of another stage (before it waits), or ends. Tiles take
    :attr:`Calibration.chain_tile_factor` times the GEMM's, the kernel
    :attr:`Calibration.chain_fixed_ns` more. ``split_tail``: the last stage's partial last
    round runs as K-slices (each waits for its tile's whole input; a tile is done with its last
    slice, plus :attr:`Calibration.chain_tail_slice_ns` per slice). Returns the GPU time."""
    return _chain_kernel(M, dims, cal, wait_parts, split_tail, interleave)[0]


def _chain_kernel(
    M: int,
    dims: list[int],
    cal: Calibration,
    wait_parts: int = 8,
    split_tail: bool = False,
    interleave: bool = True,
    inbound: tuple[np.ndarray, np.ndarray | None] | None = None,
    start_ns: float = 0.0,
    outbound: bool = False,
    remote: bool = True,
    ks: list[int] | None = None,
) -> tuple[float, np.ndarray | None]:
    """:func:`simulate_chain_kernel`, launched at ``start_ns``, as one kernel of a longer
    chain: ``inbound`` = ``(ready, part_frac)`` of its first stage's input from the kernel
    before (as :func:`_gemm_stage` takes them); ``outbound``: its last stage signals each tile
    for the kernel after, as the other stages do, writing into the next GPU (``remote``:
    ``remote_factor``) or its own. ``ks``: the K each stage's tiles compute over (default
    ``dims[:-1]``; less after a gated stage, whose output is half its GEMM's columns). Returns
    the kernel's end and, with ``outbound``, when each last-stage tile was signalled."""
    if outbound and split_tail:
        raise ValueError("a chain kernel that signals the next GPU has no split tail (the pipeline splits none)")
    bm, bn = cal.block_m, cal.block_n
    grids = [deps.TileGrid(M, n, bm, bn) for n in dims[1:]]
    S = len(grids)
    P = min(cal.num_sms, sum(g.num_tiles for g in grids))
    ks = ks or dims[:-1]
    t_tiles = [cal.for_gemm(M, k, n).tile_ns(k) * cal.chain_tile_factor for k, n in zip(ks, dims[1:])]
    checks = [cal.part_check_ns(M, k, n) for k, n in zip(ks, dims[1:])]
    if outbound and remote:
        t_tiles[-1] *= cal.remote_factor
    links = [_gemm_dependency(grids[s], grids[s + 1], min(wait_parts, grids[s].num_n))
             for s in range(S - 1)]  # fmt: skip
    producers = [np.split(np.repeat(np.arange(d.producer.num_tiles), np.diff(d.signal_ptr))[np.argsort(
        d.signal_counters, kind="stable")], np.cumsum(np.bincount(d.signal_counters, minlength=d.num_counters))[:-1])
        for d in links]  # fmt: skip
    # (the loop below reads a few entries at a time: Python lists, not arrays)
    producers = [[p.tolist() for p in ps] for ps in producers]
    counter_of = [d.counter_of_tile.tolist() for d in links]
    signal = [[math.nan] * g.num_tiles for g in grids]  # when each tile was signalled
    owner = [[0] * g.num_tiles for g in grids]
    cta_free = [float(start_ns)] * P
    pending: dict[int, tuple[int, int]] = {}
    heap = [(float(start_ns), c) for c in range(P)]  # CTAs free at the same time claim in CTA order
    signals_out = S - 1 if outbound else S - 2  # the deepest stage whose tiles are signalled

    def visible(s, tile, q):
        """When part ``q`` of stage ``s``'s ``tile``'s input is visible: its producers' signals,
        a signal not yet sent estimated at its CTA's free time (when it is flushed); stage 0's
        from the GPU before."""
        if s == 0:
            ready = inbound[0]
            return float(ready[tile] if ready.ndim == 1 else ready[tile, q])
        sig, own, latest = signal[s - 1], owner[s - 1], -math.inf
        for p in producers[s - 1][counter_of[s - 1][tile] + q]:
            t = sig[p]
            if t != t:  # NaN: not signalled yet
                t = cta_free[own[p]]
            if t > latest:
                latest = t
        if latest == -math.inf:
            raise AssertionError(f"stage {s}'s tile {tile} has no producers in part {q}")
        return latest + cal.t2_ns

    def part_starts(s):
        """Where in stage ``s``'s K loop each part of its input is first read (fractions)."""
        if s == 0:
            frac = inbound[1]
            return [0.0] if frac is None else list(frac)
        d = links[s - 1]
        return [d.part_k_start(r) / dims[s] for r in range(d.parts)]

    waits = [s > 0 or inbound is not None for s in range(S)]
    fracs = [part_starts(s) if waits[s] else [0.0] for s in range(S)]
    k_last = -(-dims[-2] // cal.block_k)
    split = deps.last_stage_tail([g.num_tiles for g in grids], P, k_last, deps.TAIL_MIN_SLICE_K) if split_tail else None
    orders = [deps.tile_order(g, cal.group_m) for g in grids]
    codes = deps.chain_order(grids[0].num_m, [g.num_n for g in grids], cal.group_m, P if interleave else None, split)
    tail_done: dict[int, float] = {}  # a tail tile's last slice so far
    for code in codes:
        s, q = int(code) >> deps.STAGE_SHIFT, int(code) & ((1 << deps.STAGE_SHIFT) - 1)
        t_tile, post = t_tiles[s], (cal.t1_ns if s <= signals_out else 0.0)
        t, c = heapq.heappop(heap)
        if split is not None and s == S - 1 and q >= split.first_pos:  # a K-slice of a tail tile
            j = q - split.first_pos
            tile, p = int(orders[s][split.first_pos + j // split.splits]), j % split.splits
            if c in pending:
                ps, pt = pending.pop(c)
                signal[ps][pt] = t
            ready = t
            if waits[s]:  # every part of its input
                ready = max(t, max(visible(s, tile, r) for r in range(len(fracs[s])))) + cal.t3_ns
            k0, k1 = p * k_last // split.splits, (p + 1) * k_last // split.splits
            cta_free[c] = ready + (k1 - k0) / k_last * t_tile
            tail_done[tile] = max(tail_done.get(tile, 0.0), cta_free[c])
            heapq.heappush(heap, (cta_free[c], c))
            continue
        tile = int(orders[s][q])
        same = c in pending and pending[c][0] == s
        if c in pending and not same:  # flushed before this tile waits
            ps, pt = pending.pop(c)
            signal[ps][pt] = t
        begin = end = t
        if waits[s]:
            f = fracs[s]
            begin = end = max(t, visible(s, tile, 0)) + cal.t3_ns
            for r in range(1, len(f)):
                end = max(end + (f[r] - f[r - 1]) * t_tile, visible(s, tile, r)) + checks[s]
            end -= f[-1] * t_tile
        if same:
            ps, pt = pending.pop(c)
            signal[ps][pt] = begin + cal.signal_lag * t_tile
        cta_free[c] = end + t_tile + post
        owner[s][tile] = c
        if s <= signals_out:
            pending[c] = (s, tile)
        heapq.heappush(heap, (cta_free[c], c))
    for c, (ps, pt) in pending.items():  # a CTA signals the tile it holds as it ends
        signal[ps][pt] = cta_free[c]
    end_all = max((done + split.splits * cal.chain_tail_slice_ns for done in tail_done.values()), default=0.0)
    end = max(max(cta_free), end_all) + cal.chain_fixed_ns + cal.launch_ns
    return end, (np.array(signal[-1]) if outbound else None)


def _work_k(dims: list[int], gated: list[bool] | None) -> list[int]:
    """The K each stage of the chain ``dims`` computes over: half of ``dims[s]`` after a gated
    stage (``gated[s - 1]``)."""
    gated = list(gated) if gated is not None else [False] * (len(dims) - 1)
    if len(gated) != len(dims) - 1:
        raise ValueError(f"{len(dims) - 1} stages but {len(gated)} gated flags")
    return [dims[0]] + [n // 2 if g else n for n, g in zip(dims[1:-1], gated)]


def simulate_placed(
    M: int,
    dims: list[int],
    devices: list[int],
    cal: Calibration,
    wait_parts: int = 8,
    interleave: bool = True,
    gated: list[bool] | None = None,
    chain: bool = True,
) -> float:
    """The static pipeline of the chain ``dims`` with stage ``s`` on GPU ``devices[s]`` (each
    GPU a contiguous range of stages, as :class:`ctapipelining.pipeline.Pipeline` places them):
    a GPU's stages run as chain kernels of up to :data:`ctapipelining.deps.CHAIN_MAX_STAGES`
    stages one after another (:func:`simulate_chain_kernel`, ``interleave`` as there), a single
    leftover stage as :func:`simulate_cta`'s stages run; each kernel's first stage waits for the
    kernel before it and its last stage signals the kernel after it, every link in
    ``wait_parts`` parts. The first kernel on each GPU starts :attr:`Calibration.launch_ns`
    after the previous GPU's, a later one on a GPU when the one before it there ends.
    ``gated[s]``: stage ``s``'s epilogue halves its output (a Llama block's gate/up GEMM: ``dims``
    holds the GEMM's columns, and the next stage computes over half of them). ``chain=False``:
    every stage a kernel of its own, a GPU's one after another (as a pipeline runs consecutive
    stages whose configurations differ, e.g. a ``LlamaStack`` in its blocks' configurations).
    Returns the GPU time (ns)."""
    if len(devices) != len(dims) - 1:
        raise ValueError(f"{len(dims) - 1} stages but {len(devices)} devices")
    ks = _work_k(dims, gated)
    groups: list[list[int]] = []  # the stages of each kernel, in chain order
    for s, d in enumerate(devices):
        if groups and devices[groups[-1][-1]] == d and len(groups[-1]) < (deps.CHAIN_MAX_STAGES if chain else 1):
            groups[-1].append(s)
        elif d in devices[:s] and devices[s - 1] != d:
            raise ValueError(f"each GPU must hold a contiguous range of stages, got {devices}")
        else:
            groups.append([s])
    bm, bn = cal.block_m, cal.block_n
    inbound, ends, gpu_end = None, [], {}
    for g, group in enumerate(groups):
        last = g == len(groups) - 1
        sub, dev = dims[group[0] : group[-1] + 2], devices[group[0]]
        remote = not last and devices[group[-1] + 1] != dev
        start = gpu_end.get(dev, len(gpu_end) * cal.launch_ns)
        if len(group) == 1:
            ready, frac = inbound if inbound is not None else (None, None)
            grid = deps.TileGrid(M, sub[1], bm, bn)
            rows = _gemm_stage(grid, ks[group[0]], cal, ready, "static", start, remote=remote, signals=not last,
                               part_frac=frac)  # fmt: skip
            end, sent = float(rows[:, 3].max()) + cal.launch_ns, rows[:, 3]
        else:
            end, sent = _chain_kernel(M, sub, cal, wait_parts, False, interleave, inbound, start, not last, remote,
                                      ks[group[0] : group[-1] + 1])  # fmt: skip
        ends.append(end)
        gpu_end[dev] = end
        if not last:  # the next kernel's first stage waits for these tiles, in parts
            grid, consumer = deps.TileGrid(M, sub[-1], bm, bn), deps.TileGrid(M, dims[group[-1] + 2], bm, bn)
            inbound = _link_ready(grid, consumer, sent, dims[group[-1] + 1], wait_parts, cal)
    return max(ends)


def simulate_loopback(M: int, dims: list[int], cal: Calibration, wait_parts: int = 8) -> float:
    """The stages of ``dims`` sharing one GPU as kernels of their own (``loopback=True``), each
    on an equal share of its SMs, writing locally (GPU time)."""
    stages = len(dims) - 1  # each on its share of the SMs and of HBM's bandwidth
    shared = replace(cal, num_sms=cal.num_sms // stages, remote_factor=1.0, hbm_gbps=cal.hbm_gbps / stages)
    return simulate_cta(M, dims, shared, wait_parts=wait_parts).total_ns


def traced_tile_ns(trace: Path | str) -> float:
    """The median compute time of stage 0's tiles in a trace saved as ``.npz`` (arrays ``s0``,
    ``s1``, ... of :meth:`ctapipelining.pipeline.Pipeline.traces` rows)."""
    s0 = np.load(trace)["s0"]
    return float(np.median(s0[:, 2] - s0[:, 1]))


def _ratio_row(M: int, ratio: str, predicted: float, measured: float) -> dict:
    """One validation row of a ratio between methods: predicted, measured, the error (%)."""
    return dict(seq=M, ratio=ratio, predicted=round(predicted, 4), measured=round(measured, 4),
                error_pct=round(100 * (predicted / measured - 1), 2))  # fmt: skip


def validate_shared(
    cal: Calibration, results: Path, K: int = 8192, tile_ns: float | None = None, tables: bool = False
) -> list[dict]:
    """Predicted against measured ratios of ``benchmarks/shared_gpu.py``'s results (two
    ``K``-wide layers on one GPU): the chain kernel over our GEMMs one after another, over the
    loopback, stage after stage over interleaved, and with a split last round over without.
    The chain and our GEMMs run the calibrated 128 x 256 tiles at every height, unless the run
    recorded the configurations its lines ran (``configs`` in a row) or ``tables`` says it ran
    the library's current tables (:data:`GEMM_TABLE`, :data:`PIPELINE_TABLE`): then our GEMMs
    one after another run as :func:`~ctapipelining.gemm.matmul` configured them, the ``chain``
    line in its own tiles, split tail and parts (``chain/ours_seq`` is what
    :attr:`~ctapipelining.pipeline.Pipeline.one_after_another` decides on), and the variants are
    compared through the ``chain_wide`` line (the chain on 128 x 256 tiles at every height).
    ``tile_ns``: the tile time on that GPU (e.g. :func:`traced_tile_ns`), in place of the
    calibration's. The run is modelled on the GPU it names (:meth:`Calibration.on_gpu`: its HBM
    rate). The model has no clocks: a GPU whose SMs partly idle (a loopback's waiting consumer, a
    round of few tiles) clocks up, which it does not see."""
    if tile_ns is not None:
        cal = replace(cal, tile_ns_per_k=(tile_ns - cal.epilogue_ns) / K)
    r = json.loads(Path(results).read_text())
    cal = cal.on_gpu(_run_gpu(r))
    rows = []
    for M, row in r["rows"].items():
        M, med = int(M), row["median_ms"]
        configs = row.get("configs") or (
            {"ours_seq": table_config(GEMM_TABLE, M), "chain": table_config(PIPELINE_TABLE, M)} if tables else None
        )
        chain = "chain_wide" if "chain_wide" in med else "chain"
        model = {  # each line's model: simulated only where the run has the line
            chain: (simulate_chain_kernel, {}),
            "chain_stage_major": (simulate_chain_kernel, {"interleave": False}),
            "chain_split": (simulate_chain_kernel, {"split_tail": True}),
            "ours_seq": (simulate_ours_sequential, {}),
            "loopback": (simulate_loopback, {}),
        }
        p = {k: f(M, [K, K, K], cal, **kw) for k, (f, kw) in model.items() if k in med}
        if configs is not None:  # our GEMMs and the chain as the run configured them
            plain, cfg = configs["ours_seq"], configs["chain"]
            p["ours_seq"] = simulate_ours_sequential(M, [K, K, K], cal, plain)
            p["chain"] = simulate_chain_kernel(
                M, [K, K, K], cal.with_config(cfg), wait_parts=cfg["wait_parts"], split_tail=cfg["split_tail"]
            )
        ratios = [(chain, "ours_seq"), (chain, "loopback"), ("chain_stage_major", chain), ("chain_split", chain)]
        if configs is not None and chain != "chain":
            ratios.append(("chain", "ours_seq"))
        for num, den in [(n, d) for n, d in ratios if n in med and d in med]:
            measured = row.get(f"{num}/{den}", {}).get("median", med[num] / med[den])
            predicted = p[num] / p[den]
            rows.append(_ratio_row(M, f"{num}/{den}", predicted, measured))
    return rows


def placement(layers: int, gpus: int) -> list[int]:
    """Stage ``s``'s GPU when ``layers`` stages spread over ``gpus`` GPUs in contiguous ranges as
    even as they go (``s * gpus // layers``; as ``bench --layers`` places them)."""
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in (layers, gpus)):
        raise ValueError(f"placement needs ints layers >= 1 and gpus >= 1, got {layers!r}, {gpus!r}")
    return [s * min(gpus, layers) // layers for s in range(layers)]


def figure_blocks(cal: Calibration, hidden: int = 8192, inter: int = 28672, rows=(4096, 8192)) -> list[dict]:
    """Llama MLP blocks on two GPUs (predictions; the blocks' epilogues are not modelled, and
    their GEMMs run the calibrated tiles): two blocks, a block per GPU, its two GEMMs in one chain
    kernel (``stack``) or one kernel after the other (``stack_kernels_apart``, as the default
    ``LlamaStack`` runs them), against the floor (one block on one GPU, its GEMMs one after
    another) and the best micro-batching of the same placement; and one block split the paper's
    way (its gate/up GEMM on the first GPU, its down GEMM on the second) against the same floor."""
    H, inter_cols = hidden, 2 * inter  # the gate/up GEMM's columns: gate and up, interleaved
    out = []
    for M in rows:
        floor = simulate_gemm(M, H, inter_cols, cal, split_tail=True) + simulate_gemm(M, inter, H, cal, split_tail=True)
        stack_dims, stack_gated = [H, inter_cols, H, inter_cols, H], [True, False] * 2
        stack = simulate_placed(M, stack_dims, [0, 0, 1, 1], cal, gated=stack_gated)
        apart = simulate_placed(M, stack_dims, [0, 0, 1, 1], cal, gated=stack_gated, chain=False)
        mb, chunk = best_microbatch(M, stack_dims, cal, devices=[0, 0, 1, 1], gated=stack_gated)
        split = simulate_placed(M, [H, inter_cols, H], [0, 1], cal, gated=[True, False])
        out.append(dict(hidden=H, intermediate=inter, rows=M, floor_ms=round(floor / 1e6, 4),
                        stack_over_floor=round(stack / floor, 4), stack_over_microbatch=round(stack / mb, 4),
                        stack_kernels_apart_over_floor=round(apart / floor, 4), best_chunk=chunk,
                        split_over_floor=round(split / floor, 4)))  # fmt: skip
    return out


def validate_depth(cal: Calibration, results: Path) -> list[dict]:
    """Predicted against measured ratios of a ``bench --layers L --gpus G`` run with more layers
    than GPUs (:func:`simulate_placed`, :func:`simulate_microbatch` on the same placement): the
    static chain over the floor (one GPU's share of the layers, our GEMMs back to back) and over
    the best cuBLAS micro-batching, and the chain waiting for whole row-blocks and stage after
    stage over it. Every link waits in 8 parts (``PIPELINE_CONFIG``'s, as the code of the
    recorded run did; a table per height now lets a link inside a chain kernel wait for whole
    rows). The model takes two things from the run itself at each height: the tile time (so
    that it gives the run's floor) and how much slower a GEMM writing into the other GPU runs
    (``triton_remote_write`` over one GEMM of ``floor_triton``)."""
    r = json.loads(Path(results).read_text())
    cal = cal.on_gpu(_run_gpu(r))
    layers, gpus = r.get("layers", r["gpus"]), r["gpus"]
    if layers <= gpus:
        raise ValueError(f"{results}: {layers} layers on {gpus} GPUs; validate_depth wants more layers than GPUs")
    K, devices = r["k"], placement(layers, gpus)
    share = max(devices.count(d) for d in set(devices))
    dims = [K] * (layers + 1)
    med = {(x["method"], x["seq"], x["chunk"]): x["median_ms"] for x in r["summaries"]}
    rows = []
    for M in sorted({x["seq"] for x in r["summaries"]}):
        floor = med[("floor_triton_graph", M, None)] * 1e6
        remote = med[("triton_remote_write", M, None)] / (med[("floor_triton", M, None)] / share)
        one = simulate_gemm(M, K, K, cal, split_tail=True) - cal.launch_ns
        c = replace(cal, tile_ns_per_k=cal.tile_ns_per_k * (floor / share - cal.launch_ns) / one, remote_factor=remote)
        predicted = {
            "cta_static_graph": simulate_placed(M, dims, devices, c),
            "cta_static_whole_rows_graph": simulate_placed(M, dims, devices, c, wait_parts=1),
            "cta_static_stage_major_graph": simulate_placed(M, dims, devices, c, interleave=False),
            "floor_triton_graph": share * simulate_gemm(M, K, K, c, split_tail=True),
            "microbatch": best_microbatch(M, dims, c, devices=devices)[0],
        }
        measured = {k: med.get((k, M, None)) for k in predicted}
        # cuBLAS's micro-batching, as the model's (not the run's micro-batching of our GEMM)
        measured["microbatch"] = min((v for (m, q, _), v in med.items() if m == "microbatch" and q == M), default=None)
        for num, den in (("cta_static_graph", "floor_triton_graph"), ("cta_static_graph", "microbatch"),
                         ("cta_static_whole_rows_graph", "cta_static_graph"),
                         ("cta_static_stage_major_graph", "cta_static_graph")):  # fmt: skip
            if measured[num] is None or measured[den] is None:
                continue
            want, got = measured[num] / measured[den], predicted[num] / predicted[den]
            rows.append(_ratio_row(M, f"{num}/{den}", got, want))
    return rows


def figure_depth(cal: Calibration, M: int = 16384, K: int = 8192, cases=((4, 2), (8, 4), (16, 8))) -> list[dict]:
    """Chains with more layers than GPUs (``(layers, gpus)`` per case, placed by
    :func:`placement`): the static chain against the floor (one GPU's share of the layers, our
    GEMMs back to back) and the best micro-batching of the same placement (predictions)."""
    out = []
    for layers, gpus in cases:
        dims, devices = [K] * (layers + 1), placement(layers, gpus)
        share = max(devices.count(d) for d in set(devices))
        cta = simulate_placed(M, dims, devices, cal)
        floor = share * simulate_gemm(M, K, K, cal, split_tail=True)
        mb, chunk = best_microbatch(M, dims, cal, devices=devices)
        out.append(dict(layers=layers, gpus=gpus, cta_ms=round(cta / 1e6, 4), floor_ms=round(floor / 1e6, 4),
                        best_microbatch_ms=round(mb / 1e6, 4), best_chunk=chunk,
                        cta_over_floor=round(cta / floor, 4), cta_over_microbatch=round(cta / mb, 4)))  # fmt: skip
    return out


def simulate_sequential(M: int, dims: list[int], cal: Calibration, eager: bool = True) -> float:
    """GEMM, copy, GEMM, ... one after another (the bench runs it eagerly)."""
    t = 0.0
    for s in range(len(dims) - 1):
        if s:
            t += cal.copy_ns(M * dims[s] * 2) + cal.launch_ns
        t += cal.cublas_ns(M, dims[s], dims[s + 1], eager)
    return t


def simulate_microbatch(
    M: int, dims: list[int], chunk: int, cal: Calibration, devices: list[int] | None = None,
    gated: list[bool] | None = None,
) -> float:  # fmt: skip
    """Chunks along M, stage ``s`` on GPU ``devices[s]`` (default ``s``), copies between GPUs on
    copy engines, one graph replay. Stages that share a GPU take turns on it (of the GEMMs that
    can start earliest, the earliest chunk first): an approximation of
    :class:`ctapipelining.baselines.MicroBatch`, whose stages run on streams of their own and
    so share the GPU's SMs at once, with copies within a GPU too (not modelled). ``gated`` as
    for :func:`simulate_placed`."""
    stages = len(dims) - 1
    ks = _work_k(dims, gated)
    devices = list(range(stages)) if devices is None else list(devices)
    if len(devices) != stages:
        raise ValueError(f"{stages} stages but {len(devices)} devices")
    chunks = [min(chunk, M - i) for i in range(0, M, chunk)]
    free = dict.fromkeys(devices, 0.0)  # when each GPU is next free
    copy_free = dict.fromkeys(devices, 0.0)  # each GPU's outgoing copy engine
    waiting = {(i, 0): 0.0 for i in range(len(chunks))}  # (chunk, stage) -> when its input is there
    end = 0.0
    while waiting:
        (i, s), ready = min(waiting.items(), key=lambda e: (max(free[devices[e[0][1]]], e[1]), e[0]))
        del waiting[i, s]
        d = devices[s]
        begin = max(free[d], ready) + cal.launch_ns
        free[d] = done = begin + cal.cublas_ns(chunks[i], ks[s], dims[s + 1])
        end = max(end, done)
        if s + 1 < stages:
            if devices[s + 1] != d:
                copy_free[d] = done = max(done, copy_free[d]) + cal.copy_ns(chunks[i] * ks[s + 1] * 2)
            waiting[i, s + 1] = done
    return end


def best_microbatch(
    M: int, dims: list[int], cal: Calibration, chunks=(512, 1024, 2048, 4096, 8192), devices: list[int] | None = None,
    gated: list[bool] | None = None,
):  # fmt: skip
    """``(ms, chunk)`` of the best chunk size."""
    cands = [(simulate_microbatch(M, dims, c, cal, devices, gated), c) for c in chunks if c <= M] or [
        (simulate_microbatch(M, dims, M, cal, devices, gated), M)
    ]
    return min(cands)


def simulate_tp(M: int, K: int, N: int, g: int, cal: Calibration, eager: bool = True) -> dict:
    """Megatron MLP ``X @ A[K, N] @ B[N, K]`` on ``g`` GPUs: compute and all-reduce (the bench
    runs it eagerly)."""
    compute = cal.tp_factor * (cal.cublas_ns(M, K, N // g, eager) + cal.cublas_ns(M, N // g, K, eager))
    comm = cal.allreduce_ns(M * K * 2, g)
    return dict(total_ns=compute + comm, compute_ns=compute, comm_ns=comm)


def simulate_hybrid(M: int, K: int, N: int, tp: int, cal: Calibration, policy: str = "static") -> dict:
    """2 stages x TP ``tp`` (``2 * tp`` GPUs): shard ``j`` of ``X @ A[:, j]`` is pipelined into
    GPU ``j`` of stage 2 (``@ B[j, :]``), then an all-reduce inside stage 2's group."""
    r = simulate_cta(M, [K, N // tp, K], cal, policy)
    comm = cal.allreduce_ns(M * K * 2, tp)
    return dict(total_ns=r.total_ns + comm, compute_ns=r.total_ns, comm_ns=comm)


# --------------------------------------------------------------------------- planner


@dataclass(frozen=True)
class Layout:
    method: str  # "single", "sequential", "microbatch", "cta", "tp", "cta+tp"
    stages: int
    tp: int
    detail: str
    predicted_ms: float


def plan(
    M: int, dims: list[int], gpus: int, cal: Calibration | None = None, gated: list[bool] | None = None
) -> list[Layout]:
    """Every layout of the chain ``dims`` that fits on ``gpus`` GPUs, fastest first.

    ``single`` (no pipelining: the chain on one GPU) wins when the chain is too small to
    overlap; TP layouts are offered for 2-layer MLP blocks (``dims[0] == dims[2]``, no gated
    stage). With more layers than GPUs, each GPU holds a contiguous range of them
    (:func:`placement`). ``gated`` as for :func:`simulate_placed` (a Llama block: ``dims`` =
    ``[H, 2 I, H]``, ``gated = [True, False]``; one stage per GPU is the block split the paper's
    way).
    """
    if gpus < 1 or len(dims) < 2 or M < 1:
        raise ValueError("plan needs M >= 1, at least one layer (two dims) and at least one GPU")
    cal = cal or Calibration.default()
    layers = len(dims) - 1
    ks = _work_k(dims, gated)
    gated_any = bool(gated) and any(gated)
    out = [
        Layout(
            "single",
            1,
            1,
            "all layers on one GPU",
            sum(simulate_gemm(M, ks[s], dims[s + 1], cal) for s in range(layers)) / 1e6,
        )
    ]  # noqa: E501
    if gpus >= layers > 1 and gated_any:  # one stage per GPU (the placed model knows gated stages)
        ms, chunk = best_microbatch(M, dims, cal, gated=gated)
        kind = "sequential" if chunk >= M else "microbatch"
        out.append(Layout(kind, layers, 1, "one GEMM per GPU" + ("" if chunk >= M else f", chunk {chunk}"), ms / 1e6))
        ms = simulate_placed(M, dims, list(range(layers)), cal, gated=gated) / 1e6
        out.append(Layout("cta", layers, 1, "policy static, one GEMM per GPU", ms))
    elif gpus >= layers > 1:
        ms, chunk = best_microbatch(M, dims, cal)
        if chunk >= M:  # one chunk: the layers one after another, nothing overlaps
            out.append(Layout("sequential", layers, 1, "one GEMM per GPU, copies between", ms / 1e6))
        else:
            out.append(Layout("microbatch", layers, 1, f"chunk {chunk}", ms / 1e6))
        shapes = [(cal.block_m, cal.block_n, cal)] + [
            (bm, bn, cal.with_tile(bm, bn, c)) for bm, bn, c in cal.tile_shapes
        ]
        for bm, bn, c in shapes:
            for policy in ("static", "workqueue"):
                ms = simulate_cta(M, dims, c, policy).total_ns / 1e6
                out.append(Layout("cta", layers, 1, f"policy {policy}, tile {bm}x{bn}", ms))
    elif layers > gpus > 1:  # each GPU a contiguous range of layers; a GPU's layers share a chain kernel
        devices = placement(layers, gpus)
        share = max(devices.count(d) for d in set(devices))
        ms, chunk = best_microbatch(M, dims, cal, devices=devices, gated=gated)
        if chunk >= M:  # one chunk: the GPUs one after another, nothing overlaps
            out.append(Layout("sequential", gpus, 1, f"up to {share} layers a GPU, copies between", ms / 1e6))
        else:
            out.append(Layout("microbatch", gpus, 1, f"chunk {chunk}, up to {share} layers a GPU", ms / 1e6))
        ms = simulate_placed(M, dims, devices, cal, gated=gated) / 1e6
        out.append(Layout("cta", gpus, 1, f"policy static, up to {share} layers a GPU in a chain kernel", ms))
    if layers == 2 and dims[0] == dims[2] and not gated_any:
        K, N = dims[0], dims[1]
        for g in range(2, gpus + 1):
            if N % g == 0:
                out.append(Layout("tp", 1, g, f"TP {g}", simulate_tp(M, K, N, g, cal)["total_ns"] / 1e6))
        for t in range(2, gpus // 2 + 1):
            if N % t == 0:
                ms = simulate_hybrid(M, K, N, t, cal)["total_ns"] / 1e6
                out.append(Layout("cta+tp", 2, t, f"2 stages x TP {t}", ms))
    return sorted(out, key=lambda lay: lay.predicted_ms)


def predict_2gpu(M: int, K: int, cal: Calibration) -> dict[str, float]:
    """The bench's methods at ``X[M, K] @ [K, K] @ [K, K]`` on 2 GPUs (ms), named as in the
    bench's results: GPU time, plus the eager launch overhead for ``floor_triton`` (the bench
    calls it eagerly; the CTA lines compared are the graph-replayed ones)."""
    dims = [K, K, K]
    mb = {c: simulate_microbatch(M, dims, c, cal) / 1e6 for c in (512, 1024, 2048, 4096, 8192) if c <= M}
    return dict(
        floor_triton=(simulate_gemm(M, K, K, cal) + cal.eager_overhead_ns) / 1e6,
        floor_cublas=cal.cublas_ns(M, K, K, eager=True) / 1e6,
        sequential=simulate_sequential(M, dims, cal) / 1e6,
        tp=simulate_tp(M, K, K, 2, cal)["total_ns"] / 1e6,
        microbatch_best=min(mb.values()),
        cta_static_graph=simulate_cta(M, dims, cal, "static").total_ns / 1e6,
        cta_workqueue_graph=simulate_cta(M, dims, cal, "workqueue").total_ns / 1e6,
        **{f"microbatch/{c}": v for c, v in mb.items()},
    )


# --------------------------------------------------------------------------- reports and CLI

PAPER_REDUCTION_VS_MICROBATCH = {2: 31.8, 4: 30.0, 8: 23.4}  # %, the paper's Figure 4 (B200/H200, CUTLASS)
PAPER_REDUCTION_VS_TP = 29.6


def validate(cal: Calibration, results: Path, seqs=(2048, 8192, 16384), K: int = 8192) -> list[dict]:
    """Predicted vs measured for every method the results file has, at ``seqs``."""
    r = json.loads(Path(results).read_text())
    cal = cal.on_gpu(_run_gpu(r))
    med = {(s["method"], s["seq"], s["chunk"]): s["median_ms"] for s in r["summaries"]}
    rows = []
    for M in seqs:
        p = predict_2gpu(M, K, cal)
        meas = {k: med.get((k, M, None)) for k in ("floor_triton", "floor_cublas", "sequential", "tp")}
        meas["microbatch_best"] = min((v for (m, q, _), v in med.items() if m == "microbatch" and q == M), default=None)
        for k in ("cta_static_graph", "cta_workqueue_graph"):
            meas[k] = med.get((k, M, None))
        for c in (512, 1024, 2048, 4096, 8192):
            meas[f"microbatch/{c}"] = med.get(("microbatch", M, c))
        for k, v in meas.items():
            if v is not None and k in p:
                rows.append(dict(seq=M, method=k, predicted_ms=round(p[k], 4), measured_ms=v,
                                 error_pct=round(100 * (p[k] / v - 1), 2)))  # fmt: skip
    return rows


def figure4(cal: Calibration, M: int = 16384, K: int = 8192, gpus=(2, 4, 8)) -> list[dict]:
    """N-layer chain on N GPUs: predicted CTA-pipelining vs micro-batching (each chunk)."""
    out = []
    for g in gpus:
        dims = [K] * (g + 1)
        cta = min(simulate_cta(M, dims, cal, p).total_ns for p in ("static", "workqueue")) / 1e6
        mb = {c: simulate_microbatch(M, dims, c, cal) / 1e6 for c in (512, 1024, 2048, 4096, 8192)}
        best = min(mb.values())
        out.append(dict(gpus=g, cta_ms=round(cta, 4), microbatch_ms={c: round(v, 4) for c, v in mb.items()},
                        reduction_vs_best_pct=round(100 * (1 - cta / best), 2),
                        paper_reduction_pct=PAPER_REDUCTION_VS_MICROBATCH.get(g)))  # fmt: skip
    return out


def figure7(cal: Calibration, M: int = 16384, K: int = 8192, gpus=(4, 8)) -> list[dict]:
    """2-layer MLP on ``g`` GPUs: pure TP ``g`` vs 2 stages x TP ``g/2`` vs TP ``g/2`` alone
    (the referee's ablation: is the gain the pipelining or just a smaller TP degree?)."""
    out = []
    for g in gpus:
        rows = {"tp": simulate_tp(M, K, K, g, cal), "tp_half": simulate_tp(M, K, K, g // 2, cal),
                "hybrid": simulate_hybrid(M, K, K, g // 2, cal)}  # fmt: skip
        out.append(dict(gpus=g, **{k: {n: round(v / 1e6, 4) for n, v in r.items()} for k, r in rows.items()}))
    return out


def plot_figures(fig4: list[dict], fig7: list[dict], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = np.arange(len(fig4))
    ax.bar(xs - 0.2, [f["reduction_vs_best_pct"] for f in fig4], 0.4, label="model (calibrated on 2x H200)")
    ax.bar(xs + 0.2, [f["paper_reduction_pct"] or 0 for f in fig4], 0.4, label="paper (CUTLASS, 8-GPU systems)")
    ax.set_xticks(xs, [f"{f['gpus']} GPUs" for f in fig4])
    ax.set_ylabel("latency reduction vs best micro-batching (%)")
    ax.axhline(0, color="k", lw=0.8)
    ax.legend(fontsize=8)
    ax.set_title("Fig. 4 predicted: N-layer chain on N GPUs")
    fig.tight_layout()
    paths.append(out_dir / "sim_fig4.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels, comp, comm = [], [], []
    for f in fig7:
        g = f["gpus"]
        for key, name in (("tp", f"TP{g}"), ("tp_half", f"TP{g // 2}"), ("hybrid", f"2x TP{g // 2}")):
            labels.append(name)
            comp.append(f[key]["compute_ns"])
            comm.append(f[key]["comm_ns"])
    ax.bar(labels, comp, label="compute (incl. pipelining)")
    ax.bar(labels, comm, bottom=comp, label="all-reduce")
    ax.set_ylabel("ms")
    ax.set_title("Fig. 7 predicted: 2-layer MLP, TP vs CTA-pipelining x TP")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "sim_fig7.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def _calibration(args) -> Calibration:
    """The packaged calibration, or one fitted on ``--results`` (with ``--trace``, ``--tune``)."""
    if args.results is None:
        if args.trace or args.tune:
            raise UsageError("--trace and --tune calibrate together with --results: give --results too")
        return Calibration.default()
    try:
        return Calibration.from_results(args.results, args.trace, args.tune)
    except (OSError, ValueError, KeyError, TypeError) as e:  # not a bench results file, or a broken one
        raise UsageError(f"cannot calibrate on {args.results}: {type(e).__name__}: {e}") from None


def _measured(path: Path) -> bool:
    """Check that ``path`` is a bench results file; whether it has more layers than GPUs."""
    try:
        r = json.loads(Path(path).read_text())
        r["summaries"][0]["median_ms"]
        return r.get("layers", r["gpus"]) > r["gpus"]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise UsageError(f"--validate {path}: not a bench results file ({type(e).__name__}: {e})") from None


def _print_ratios(rows: list[dict]) -> None:
    for r in rows:
        print(f"  {r['seq']:6d} {r['ratio']:46s} predicted {r['predicted']:.4f}  measured {r['measured']:.4f}  "
              f"{r['error_pct']:+6.1f}%")  # fmt: skip


def _depth_rows(cal: Calibration, path: Path) -> list[dict]:
    try:
        return validate_depth(cal, path)
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as e:
        what = f"{type(e).__name__}: {e}"
        raise UsageError(f"--validate {path}: not a bench run of more layers than GPUs ({what})") from None


def _shared_rows(cal: Calibration, path: Path, tables: bool = False) -> list[dict]:
    try:
        return validate_shared(cal, path, tables=tables)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        what = f"{type(e).__name__}: {e}"
        raise UsageError(f"--validate-shared {path}: not a shared_gpu.py results file ({what})") from None


def _run_gpu(data) -> str | None:
    """The first GPU a results file's ``environment`` names, or None."""
    env = data.get("environment") if isinstance(data, dict) else None
    gpus = env.get("gpus") if isinstance(env, dict) else None
    return gpus[0] if gpus and isinstance(gpus, list) and isinstance(gpus[0], str) else None


def measured_on(cal: Calibration, path: Path) -> str:
    """The GPU a results file was measured on (its ``environment``), whether the calibration is
    of another GPU (whose tile time the model then uses), and whether the model scales its HBM
    rate to the run's GPU (:meth:`Calibration.on_gpu`, as every validation does): for a report's
    header (empty where the file names none)."""
    gpu = _run_gpu(json.loads(Path(path).read_text()))
    if gpu is None:
        return ""
    note = f"measured on {gpu}"
    if cal.source != "defaults" and gpu not in cal.device:
        note += "; the model is calibrated on another GPU"
    if cal.on_gpu(gpu) is not cal:
        note += f"; its HBM rate is scaled to this GPU's ({hbm_peak_tbps(gpu)} TB/s peak)"
    return f" ({note})"


def run(args) -> int:
    """``ctapipelining sim``: calibration, validation table, Figures 4 and 7, a timeline."""
    cal = _calibration(args)
    # checked before any output
    deep = [_depth_rows(cal, path) if _measured(path) else None for path in args.validate]
    shared = [_shared_rows(cal, path, args.tables) for path in args.validate_shared]
    print(f"calibrated on {cal.label}")
    args.out.mkdir(parents=True, exist_ok=True)
    report = dict(calibration=cal.to_dict(), validation={}, figure4=figure4(cal), figure7=figure7(cal),
                  figure_depth=figure_depth(cal), figure_blocks=figure_blocks(cal))  # fmt: skip
    for path, depth in zip(args.validate, deep):
        if depth is not None:
            rows = report["validation"][_rel(path)] = depth
            print(
                f"\nmore layers than GPUs, against {_rel(path)}{measured_on(cal, path)} "
                "(ratios; the error of the predicted one):"
            )
            _print_ratios(rows)
            continue
        rows = validate(cal, path)
        report["validation"][_rel(path)] = rows
        if not rows:
            print(f"\nvalidation against {_rel(path)}: no method measured at 2048, 8192 or 16384 rows")
            continue
        worst = max(rows, key=lambda r: abs(r["error_pct"]))
        print(
            f"\nvalidation against {_rel(path)}{measured_on(cal, path)}: worst {worst['error_pct']:+.1f}% "
            f"({worst['method']} at {worst['seq']})"
        )
        for r in rows:
            if "/" not in r["method"]:
                print(
                    f"  {r['seq']:6d} {r['method']:22s} predicted {r['predicted_ms']:8.4f}  "
                    f"measured {r['measured_ms']:8.4f}  {r['error_pct']:+6.1f}%"
                )
    for path, rows in zip(args.validate_shared, shared):
        report["validation"][_rel(path)] = rows
        print(
            f"\nstages sharing one GPU, against {_rel(path)}{measured_on(cal, path)} "
            "(ratios; the error of the predicted one):"
        )
        _print_ratios(rows)
    print("\nFigure 4 (N-layer chain on N GPUs, M=16384): reduction vs best micro-batching")
    for f in report["figure4"]:
        print(f"  {f['gpus']} GPUs: model {f['reduction_vs_best_pct']:+.1f}%   paper {f['paper_reduction_pct']}%")
    print("\nMore layers than GPUs (M=16384, each GPU's layers in one chain kernel): static chain over")
    for f in report["figure_depth"]:
        print(f"  {f['layers']:2d} layers on {f['gpus']} GPUs: the floor {f['cta_over_floor']:.3f}, "
              f"the best micro-batching {f['cta_over_microbatch']:.3f} (chunk {f['best_chunk']})")  # fmt: skip
    print("\nLlama-70B MLP blocks on 2 GPUs (epilogues not modelled):")
    for f in report["figure_blocks"]:
        print(f"  M={f['rows']}: two blocks, one per GPU, over one block on one GPU {f['stack_over_floor']:.3f} "
              f"({f['stack_kernels_apart_over_floor']:.3f} with each block's GEMMs one kernel after the other), "
              f"over the best micro-batching {f['stack_over_microbatch']:.3f}; one block split (gate/up | down) "
              f"over one GPU {f['split_over_floor']:.3f}")  # fmt: skip
    print("\nFigure 7 (2-layer MLP, M=16384), ms total (compute + all-reduce):")
    for f in report["figure7"]:
        print("  " + "  ".join(f"{k}: {f[k]['total_ns']:.3f} ({f[k]['compute_ns']:.3f}+{f[k]['comm_ns']:.3f})"
                               for k in ("tp", "tp_half", "hybrid")) + f"   [{f['gpus']} GPUs]")  # fmt: skip
    (args.out / "sim.json").write_text(json.dumps(report, indent=1))
    for p in plot_figures(report["figure4"], report["figure7"], args.out):
        print("wrote", p)
    r = simulate_cta(args.seq, [args.k] * 3, cal, "static")
    p = plot_timeline([t.astype(np.int64) for t in r.trace], [0.0, 0.0], args.out / "sim_timeline_static.png",
                      f"model: X[{args.seq},{args.k}] @ A @ B, static")  # fmt: skip
    print("wrote", p)
    return 0


def run_plan(args) -> int:
    """``ctapipelining plan``: the fastest layout of a chain on a number of GPUs."""
    cal = _calibration(args)
    stages = len(args.dims) - 1
    bad = [s for s in args.gated if s >= stages]
    if bad:
        raise UsageError(f"--gated {bad}: the chain {args.dims} has stages 0 to {stages - 1}")
    gated = [s in args.gated for s in range(stages)]
    layouts = plan(args.m, args.dims, args.gpus, cal, gated=gated)
    print(f"chain X[{args.m},{args.dims[0]}] through {len(args.dims) - 1} layers {args.dims} on {args.gpus} GPUs "
          f"(model calibrated on {cal.label})")  # fmt: skip
    for i, lay in enumerate(layouts):
        mark = "->" if i == 0 else "  "
        print(f" {mark} {lay.predicted_ms:8.3f} ms  {lay.method:10s} stages={lay.stages} tp={lay.tp}  {lay.detail}")
    return 0


def add_arguments(p, plan_args: bool = False) -> None:
    """The options of ``ctapipelining sim`` (``plan_args``: of ``ctapipelining plan``)."""
    p.add_argument(
        "--results", type=existing_path, default=None,
        help="bench results JSON, or its folder, to calibrate on (default: the packaged 2x H200 calibration)",
    )  # fmt: skip
    p.add_argument(
        "--trace", type=existing_file, default=None,
        help="trace summary JSON for T1, T2, T3 (default: the timeline_static_*.json beside --results)",
    )  # fmt: skip
    p.add_argument("--tune", type=existing_file, default=None, help="GEMM tuning JSON for the 128x128 tile's cost")
    if plan_args:
        p.add_argument("--m", type=positive_int, required=True, help="rows of X")
        p.add_argument("--dims", type=chain_dims, required=True, help="K0,N0,N1,...: the chain's widths")
        p.add_argument("--gpus", type=positive_int, required=True, help="GPUs to lay the chain out on")
        p.add_argument(
            "--gated", type=stage_indices, default=[], metavar="S,...",
            help="stages whose output is gated (half their columns: a Llama block's gate/up GEMM, "
            "e.g. --dims 8192,57344,8192 --gated 0)",
        )  # fmt: skip
    else:
        p.add_argument(
            "--validate", type=existing_file, nargs="*", default=[], metavar="RESULTS",
            help="bench results JSONs to compare the predictions with",
        )  # fmt: skip
        p.add_argument(
            "--validate-shared", type=existing_file, nargs="*", default=[], metavar="RESULTS",
            help="benchmarks/shared_gpu.py JSONs (stages sharing one GPU) to compare the chain kernel's model with",
        )  # fmt: skip
        p.add_argument(
            "--tables", action="store_true",
            help="those runs ran the library's current configuration tables (runs that recorded their "
                 "configurations need not say)",
        )  # fmt: skip
        p.add_argument("--seq", type=positive_int, default=16384, help="rows of X of the predicted timeline")
        p.add_argument("--k", type=positive_int, default=8192, help="hidden size of the predicted timeline")
        p.add_argument("--out", type=Path, default=Path("sim-out"), help="folder for sim.json and the PNGs")
