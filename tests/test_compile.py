"""The kernels compiled for Hopper (sm_90) on the CPU, without a GPU: each hook adds its
protocol instructions and nothing else; with both hooks off the kernel has none of them."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.xdist_group("sm90_compile")  # one worker: its compiles shared (conftest)


@pytest.fixture(scope="module")
def report(sm90):
    """The compile check's report of the GEMM and chain kernel variants (conftest ``sm90``)."""
    return sm90["kernels"]


def kernels(report, chain: bool):
    """The report's GEMM-kernel variants, or its chain-kernel ones."""
    return {k: v for k, v in report.items() if k.startswith("chain") == chain}


def test_every_variant_is_a_tma_wgmma_gemm(report):
    for name, r in kernels(report, chain=False).items():
        assert r["wgmma"] > 0 and r["tma_load"] > 0, name
        base = report["plain" if r["tma_store"] else "plain+ordinary_store"]
        # a few bytes more at most: scratch that broadcasts a scalar atomic's result to the CTA
        assert r["smem"] <= base["smem"] + 256, f"{name}: a hook added shared memory"


def test_tma_store_producer_waits_for_completed_writes_before_signalling(report):
    assert report["plain"]["tma_store"] > 0 and report["plain"]["bulk_wait_complete"] == 0
    for name in ("signal_static", "signal_workqueue", "wait_signal_static"):
        # wait_group 0 (writes complete, not the .read flavour): in the K loop and after it
        assert report[name]["bulk_wait_complete"] == 2, name
    assert report["plain+ordinary_store"]["tma_store"] == 0
    assert report["signal_static+ordinary_store"]["bulk_wait_complete"] == 0


def test_in_loop_signal_keeps_the_k_loop_software_pipelined(report):
    """A barrier inside the K loop would make Triton drop to one stage (shared memory of a
    single A+B tile); the signal's named barrier in inline PTX does not."""
    assert report["signal_static"]["smem"] == report["plain"]["smem"]
    assert report["wait_signal_static"]["smem"] == report["plain"]["smem"]
    assert report["signal_static+ordinary_store"]["smem"] == report["plain+ordinary_store"]["smem"]
    assert report["signal_static"]["tma_load"] == report["plain"]["tma_load"]


def test_plain_has_no_protocol_instructions(report):
    for name in ("plain", "plain+ordinary_store"):
        p = report[name]
        assert p["ld_acquire_sys"] == p["atom_sys"] == p["globaltimer"] == p["vote"] == p["atom_gpu"] == 0, name


def test_hooks_add_exactly_their_instructions(report):
    for name in ("wait_static", "wait_workqueue"):
        assert report[name]["ld_acquire_sys"] == 1 and report[name]["globaltimer"] == 2, name  # one bounded spin
        assert report[name]["atom_sys"] == 0, name
    # the signal step twice (a quarter into the next tile's K loop; the CTA's last tile after the loop)
    assert report["signal_static"]["atom_sys"] == 2 and report["signal_static"]["ld_acquire_sys"] == 0
    # each time: counter bump, tail claim, slot release
    assert report["signal_workqueue"]["atom_sys"] == 6
    assert report["wait_signal_workqueue"]["atom_sys"] == 6 and report["wait_signal_workqueue"]["ld_acquire_sys"] == 1
    assert report["wait_signal_static"]["atom_sys"] == 2 and report["wait_signal_static"]["ld_acquire_sys"] == 1


def test_trace_mode_is_free_when_off(report):
    # stamps: 4 reads of %globaltimer per tile in the plain kernel, none without a trace buffer
    assert report["plain+trace"]["globaltimer"] > 0 and report["plain"]["globaltimer"] == 0
    assert report["wait_workqueue+trace"]["globaltimer"] > report["wait_workqueue"]["globaltimer"]


def test_split_tail_keeps_the_main_loop_pipelined_and_adds_only_gpu_scope_atomics(report):
    """The split tail is a second K loop after the persistent one: the same shared memory
    (both loops software-pipelined), an arrival counter (acq_rel) and its rearm at GPU scope,
    partials read through L2, and no system-scope or spin instruction of its own."""
    for name, base in [
        ("plain+split_tail", "plain"),
        ("plain+ordinary_store+split_tail", "plain+ordinary_store"),
        ("signal_static+split_tail", "signal_static"),
        ("wait_static+split_tail", "wait_static"),
    ]:
        r, b = report[name], report[base]
        assert r["smem"] == b["smem"], name
        assert r["wgmma"] == 2 * b["wgmma"] and r["ld_cg"] > 0, name
        # the tail's own wait (consumer) repeats the prologue's spin and timeout report
        assert r["atom_gpu"] == 2 * b["atom_gpu"] + 2 and r["ld_acquire_sys"] == 2 * b["ld_acquire_sys"], name
    assert report["plain+split_tail"]["atom_sys"] == 0
    # the tail signals its tiles once: one more release at system scope than the producer without it
    assert report["signal_static+split_tail"]["atom_sys"] == report["signal_static"]["atom_sys"] + 1


def test_waiting_in_parts_keeps_the_k_loop_pipelined(report):
    """Four parts: part 0's spin before the tile, and for parts 1-3 one spin that runs before
    the tile (a part read within the pipeline's first steps) and one inside the K loop; the
    loop keeps its 3-stage buffers."""
    for name, base in [("wait_static+parts", "wait_static"), ("wait_signal_static+parts", "wait_signal_static")]:
        r, b = report[name], report[base]
        assert r["smem"] == b["smem"], name
        assert r["tma_load"] == b["tma_load"] and r["wgmma"] == b["wgmma"], name
        assert r["ld_acquire_sys"] == 1 + 2 * 3 and r["atom_sys"] == b["atom_sys"], name
        assert r["fence_proxy_async"] == b["fence_proxy_async"] + 3, name  # after each in-loop acquire


def test_every_wait_ends_in_a_cta_wide_vote(report):
    """A waiting CTA goes on or gives up as one: its spins are followed by ``bar.red.and.pred``
    (the threads' answers ANDed) before anything depends on them, so no thread acts on its own
    answer. A static consumer votes once per tile, however many parts it waits for; the split
    tail's wait has its own vote."""
    for name, r in kernels(report, chain=False).items():
        if not r["ld_acquire_sys"]:
            assert r["vote"] == 0, name
        else:
            assert r["vote"] == (2 if "split_tail" in name else 1), name


def test_chain_kernel_runs_each_stage_as_a_pipelined_tma_wgmma_gemm(report):
    """Each stage of a chain kernel is the GEMM's body (its wgmma and TMA store), its K loop
    keeps the 3-stage TMA ring (128x256x64 bf16: 147456 bytes) and, beside it, the store's
    staging tile (a tile's store overlaps the next tile's loads); the chain's stages all store
    with TMA but the last, which may store ordinarily (an ``out`` with padded rows)."""
    plain = report["plain"]
    ring, staging = 3 * (128 + 256) * 64 * 2, 128 * 256 * 2
    for name, stages in (("chain2", 2), ("chain2+outer_queue", 2), ("chain4", 4)):
        r = report[name]
        assert r["wgmma"] == stages * plain["wgmma"], name
        # a few bytes more at most: scratch that broadcasts the ticket's answer to the CTA
        assert ring + staging <= r["smem"] <= plain["smem"] + 1024, name
        assert r["tma_store"] == stages, name
    assert report["chain2+ordinary_store"]["tma_store"] == 1


def test_chain_kernel_votes_once_per_waiting_stage(report):
    """Every waiting stage body ends its waits in one CTA-wide vote: the stages after the first
    (links inside the kernel), and the first when it waits on another GPU."""
    assert report["chain2"]["vote"] == 1 and report["chain4"]["vote"] == 3
    assert report["chain2+outer_queue"]["vote"] == 2
    # links inside the kernel never push into a ring: only the outer signal does (3 system-scope atomics)
    assert report["chain2+outer_queue"]["atom_sys"] > report["chain2"]["atom_sys"]


def test_every_acquire_is_fenced_before_the_tma_loads_after_it(report):
    """In every variant that waits (one spin, four parts, the split tail's, a chain kernel's
    stages), no TMA load follows an acquire in the PTX without a ``fence.proxy.async`` between."""
    waiting = [name for name, r in report.items() if r["ld_acquire_sys"]]
    assert len(waiting) >= 10
    for name in waiting:
        assert report[name]["unfenced_loads"] == 0, name


def test_the_fence_check_finds_a_missing_fence():
    from ctapipelining.kernels.compile_check import unfenced_loads

    load = "@%p1 cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd1, {%r2}];"
    store = "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%rd1, {%r1, %r2}], [%r3];"
    acquire = "ld.acquire.sys.global.b64 %rd5, [%rd6];"
    fence = "fence.proxy.async.global;"
    assert unfenced_loads("\n".join([acquire, load, load])) == 2
    assert unfenced_loads("\n".join([acquire, fence, load, acquire, store, fence, load])) == 0
    assert unfenced_loads("\n".join([load, acquire, fence, load, acquire, load])) == 1


def test_chain_kernel_split_tail_keeps_its_buffers_and_reads_partials_through_l2(report):
    """With the last stage's tail split, the chain kernel keeps the same shared memory (the
    slices' K loop is pipelined too), adds a second body of the last stage (the slices'), reads
    the partials through L2 (``.cg``) and takes its arrival counters at GPU scope."""
    r, b = report["chain2+split_tail"], report["chain2"]
    assert b["smem"] <= r["smem"] <= b["smem"] + 1024
    assert r["wgmma"] == b["wgmma"] + b["wgmma"] // 2 and r["ld_cg"] > 0 == b["ld_cg"]
    assert r["atom_gpu"] > b["atom_gpu"] and r["unfenced_loads"] == 0


def test_clock_probe_compiles_and_each_side_votes_on_its_waits():
    """The clock probe of ``ctapipelining trace`` (two GPUs only): both sides compile, and
    every wait ends in a CTA-wide vote."""
    code = "import json; from ctapipelining.kernels.compile_check import compile_probe as p; print(json.dumps(p()))"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    serve, answer = json.loads(r.stdout)
    for side in (serve, answer):
        assert side["vote"] >= 1 and side["vote"] == side["ld_acquire_sys"], side
        assert side["atom_sys"] >= 1, side


def test_fused_epilogues_compile_and_fit_the_block_configurations(sm90):
    """The MLP blocks' epilogues compile to pipelined TMA/wgmma GEMMs within Hopper's shared
    memory in the configurations :mod:`ctapipelining.nn` gives them (a stack's four stages in one
    chain kernel too; a down GEMM whose tiles are added onto its output by TMA, on the plain
    GEMM's tiles); a residual tile with three
    stages of 128 x 256 tiles would not fit (why the down GEMM's tiles are narrower)."""
    from ctapipelining.kernels.gemm import RESIDUAL_CONFIG, SMEM_LIMIT
    from ctapipelining.nn import DOWN_CONFIG, GATE_UP_CONFIG

    assert (GATE_UP_CONFIG.block_n, GATE_UP_CONFIG.num_stages) == (256, 3)
    assert (DOWN_CONFIG.block_n, DOWN_CONFIG.num_stages) == (256, 3)  # its residual added by TMA
    assert (RESIDUAL_CONFIG.block_n, RESIDUAL_CONFIG.num_stages) == (128, 4)  # one its epilogue loads
    got = sm90["epilogues"]
    assert got["accumulate"]["tma_store"] == 0 and got["accumulate"]["tma_reduce"] > 0
    # the gated tile (gate and up columns in runs, interleave) is stored as the plain GEMM's:
    # bf16 pairs through stmatrix, never an element at a time
    assert got["gated_rms"]["stmatrix"] > 0 and got["gated_rms"]["st_shared_b16"] == 0
    # a fused epilogue leaves the plain GEMM's persistent loop flattened (an RMSNorm's parts unroll),
    # also beside a split tail whose summing CTA applies it (EPILOGUE_CONFIG, the blocks' default)
    for name in ("gated_rms", "bias_residual", "accumulate", "layer_norm_bias", "gated_rms+split_tail",
                 "accumulate+split_tail"):  # fmt: skip
        assert got[name]["flattened"], name
    for name in ("gated_rms+split_tail", "accumulate+split_tail"):
        assert got[name]["smem"] <= SMEM_LIMIT and got[name]["ld_cg"] > 0, name  # the tail's partials
    assert got["gated_rms+split_tail"]["tma_store"] > got["gated_rms"]["tma_store"]  # the tail's own store
    assert got["accumulate+split_tail"]["tma_store"] == 0  # its tail tiles are added onto C too
    assert got["accumulate+split_tail"]["tma_reduce"] > got["accumulate"]["tma_reduce"]
    assert sm90["kernels"]["plain"]["flattened"]
    # ... and the check can tell: a workqueue consumer's K loop lies in its claim loop (a while), a
    # static consumer's in its tile loop (its wait spins before each tile)
    assert not sm90["kernels"]["wait_workqueue"]["flattened"] and not sm90["kernels"]["wait_static"]["flattened"]
    # SiLU and GELU take one special-function instruction an element (tanh), not exp and a division
    for name in ("gated_rms", "bias_residual", "layer_norm_bias", "stack_chain", "gpt_stack_chain"):
        assert got[name]["tanh_approx"] > 0 and got[name]["ex2_approx"] == 0, name
    from ctapipelining.nn import STACK_CONFIG

    assert (STACK_CONFIG.block_n, STACK_CONFIG.num_stages) == (128, 4)
    for name in ("stack_chain", "gpt_stack_chain"):
        assert got[name]["unfenced_loads"] == 0 and got[name]["vote"] >= 1, name
    for name in ("gated_rms", "bias_residual", "layer_norm_bias", "stack_chain", "chain_activation_last",
                 "gpt_stack_chain"):  # fmt: skip
        assert got[name]["wgmma"] > 0 and got[name]["tma_load"] > 0 and got[name]["tma_store"] > 0, name
    for name in ("gated_rms", "bias_residual", "layer_norm_bias", "stack_chain", "chain_activation_last",
                 "accumulate", "gpt_stack_chain"):  # fmt: skip
        assert got[name]["smem"] <= SMEM_LIMIT, (name, got[name]["smem"])
    assert got["bias_residual_3_stages"]["smem"] > SMEM_LIMIT
    # the linked stages of a split block and of blocks on ranks: within shared memory, each wait a
    # CTA-wide vote, every acquire fenced before the TMA loads after it, signals at system scope
    for name in ("residual_waits_in_parts", "gated_rms_sums_waits", "residual_sums_signals"):
        k = got[name]
        assert k["smem"] <= SMEM_LIMIT and k["wgmma"] > 0 and k["tma_load"] > 0 and k["unfenced_loads"] == 0, name
    assert got["residual_waits_in_parts"]["vote"] >= 1 and got["gated_rms_sums_waits"]["vote"] >= 1
    assert got["residual_sums_signals"]["atom_sys"] > 0 and got["residual_sums_signals"]["ld_acquire_sys"] == 0
    # the host's rule for tiles that leave room for a loaded residual agrees with the compiler
    from ctapipelining.kernels.gemm import EPILOGUE_CONFIG, fits_loaded_residual

    assert fits_loaded_residual(RESIDUAL_CONFIG) and fits_loaded_residual(STACK_CONFIG)
    assert not fits_loaded_residual(EPILOGUE_CONFIG)
    assert EPILOGUE_CONFIG.split_tail  # what the "+split_tail" variants above compile


def test_the_norm_pass_keeps_its_registers_few_and_spills_nothing(sm90):
    """One row a program, so that every row's load is in flight: that needs many programs
    resident on an SM, so few registers (a pass that held a whole 8192-wide row in 4 warps took
    254 and allowed two programs). RMSNorm and LayerNorm, storing the copy of the rows."""
    norms = sm90["norms"]
    assert set(norms) == {"rms_copy", "layer_copy"}
    for name, usage in norms.items():
        if usage is None:
            pytest.skip("no ptxas in this Triton")
        assert usage["spill_bytes"] == 0 and usage["registers"] <= 96, (name, usage)


def test_flattened_reads_loop_nesting_from_the_printed_ir():
    """``flattened`` on IR as MLIR prints it (a loop closes at the indentation of its first line):
    an accumulator loop inside a tile loop, or inside a while loop's body, is not flattened; one
    beside them (an ``scf.if``'s ``} else {`` and a while's ``} do {`` in between) is."""
    from ctapipelining.kernels.compile_check import flattened

    acc_loop = "%r = scf.for %k = %c0 to %n step %c1 iter_args(%a = %z) -> (tensor<128x256xf32, #mma>) {"
    nested = ["scf.for %t = %0 to %n step %c132 : i32 {", "  " + acc_loop, "  }", "}"]
    in_while = ["%p = scf.while (%q = %0) : (i64) -> i64 {", "  scf.condition(%c) %q : i64", "} do {",
                "  " + acc_loop.replace("#mma>", "#mma1>"), "  }", "}"]  # fmt: skip
    beside = ["scf.if %x {", "} else {", "}", "%p = scf.while (%q = %0) : (i64) -> i64 {", "} do {", "}", acc_loop, "}"]
    assert not flattened("\n".join(nested)) and not flattened("\n".join(in_while))
    assert flattened("\n".join(beside))
    assert not flattened("\n".join(["scf.for %t = %0 to %n step %c1 : i32 {", "}"]))  # no accumulator loop
