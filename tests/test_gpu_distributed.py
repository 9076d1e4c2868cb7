"""One process per GPU on one GPU: world size 1 with a segment per stage, so every link goes
through PyTorch symmetric memory and the gate/finish handshake, bitwise equal to the
one-process pipeline; graph replay; a producer that starts late does not time its consumer
out; a producer does not overwrite what its consumer has not read. (Two ranks under torchrun:
examples/torchrun_chain.py, in the 2-GPU runs; the CPU tests run two ranks in two processes.)"""

import time

import pytest
import torch
import torch.distributed as dist

from ctapipelining.distributed import DistributedPipeline
from ctapipelining.kernels.gemm import PIPELINE_CONFIG
from ctapipelining.pipeline import Pipeline, PipelineTimeout

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group(
        "nccl", init_method=f"file://{store}", rank=0, world_size=1, device_id=torch.device("cuda:0")
    )
    yield
    dist.destroy_process_group()


def weights(dims, seed=0):
    g = torch.Generator(device="cuda:0").manual_seed(seed)
    return [(torch.randn(k, n, device="cuda:0", generator=g) / k**0.5).bfloat16() for k, n in zip(dims, dims[1:])]


@pytest.mark.parametrize("policy", ["static", "workqueue"])
@pytest.mark.parametrize("dims", [[1024, 2048, 1024], [1024, 1536, 2048, 512]])
def test_through_symmetric_memory_equals_the_one_process_pipeline(world1, policy, dims):
    ws = weights(dims)
    pipe = DistributedPipeline(ws, policy=policy, loopback=True, timeout_s=0.5)
    # the one-process pipeline in the distributed default's tiles at every height (built without a
    # config, it takes its table's tiles per plan height)
    ref = Pipeline(ws, policy=policy, loopback=True, timeout_s=0.5, config=PIPELINE_CONFIG)
    for M in (3000, 128, 3000):
        x = torch.randn(M, dims[0], device="cuda:0").bfloat16()
        y = pipe(x, check=True)
        assert torch.equal(y, ref(x)) and torch.equal(y, pipe.sequential(x))
    out = torch.full((3000, dims[-1]), float("nan"), device="cuda:0").bfloat16()
    for _ in range(200):  # back to back, one output buffer
        pipe(x, out=out)
    pipe.check_errors()
    assert torch.equal(out, ref(x))
    # a new plan's kernels are compiled when it is built, before any call runs a gate
    fresh = pipe.plan(5000)
    assert all(launch.gemm._compiled for p in fresh.plans for launch in p.launches)


@pytest.mark.parametrize("policy", ["static", "workqueue"])
def test_norms_across_segments_through_symmetric_memory(world1, policy):
    """A segment per stage: stage 1's RMSNorm (a gated SiLU after it) and stage 2's LayerNorm take
    their rows' partial sums from the stage before through symmetric memory, NaN-poisoned
    first: bitwise the one-process pipeline and the stages one after another."""
    from ctapipelining.epilogue import Epilogue, silu

    ws = weights([1024, 2048, 4096]) + weights([2048, 1024], seed=1)
    epis = [None, Epilogue(silu, gated=True, rms_eps=1e-5),
            Epilogue(layer_norm_eps=1e-5, col_sum=ws[2].float().sum(0).contiguous())]  # fmt: skip
    pipe = DistributedPipeline(ws, policy=policy, epilogues=epis, loopback=True, timeout_s=0.5)
    ref = Pipeline(ws, policy=policy, epilogues=epis, loopback=True, timeout_s=0.5, config=PIPELINE_CONFIG)
    for M in (3000, 777):
        plan = pipe.plan(M)
        for link in plan.links.values():
            for u in link.sums if isinstance(link.sums, tuple) else (link.sums,):
                u.fill_(float("nan"))
        x = torch.randn(M, 1024, device="cuda:0").bfloat16()
        y = pipe(x, check=True)
        assert not y.isnan().any() and torch.equal(y, ref(x)) and torch.equal(y, pipe.sequential(x)), M


def test_a_producer_waits_until_its_consumer_has_read_the_call_before(world1):
    """The consumer of call 1 is held back (a sleep on its stream) while the producer is asked
    for calls 1 and 2 back to back on another stream: the producer's gate holds call 2 until the
    consumer has finished call 1, so call 1 reads its own input (without the handshake, call 2
    would overwrite it first and call 1 would return call 2's result)."""
    ws = weights([1024, 2048, 1024])
    pipe = DistributedPipeline(ws, loopback=True, timeout_s=1.0)
    x1, x2 = (torch.randn(2048, 1024, device="cuda:0").bfloat16() for _ in range(2))
    want1, want2 = pipe.sequential(x1), pipe.sequential(x2)
    pipe(x1, check=True)
    dp = pipe.plan(2048)
    out1, out2 = (torch.full((2048, 1024), float("nan"), device="cuda:0").bfloat16() for _ in range(2))
    s0, s1 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s1):
        torch.cuda._sleep(200_000_000)  # about 0.1 s
        pipe._run(dp, None, out1, 2048, only=[1])
    with torch.cuda.stream(s0):
        pipe._run(dp, x1, None, 2048, only=[0])
        pipe._run(dp, x2, None, 2048, only=[0])
    with torch.cuda.stream(s1):
        pipe._run(dp, None, out2, 2048, only=[1])
    torch.cuda.synchronize()
    pipe.check_errors()
    assert torch.equal(out1, want1) and torch.equal(out2, want2)


def test_graph_replay_and_a_whole_chain_on_one_rank(world1):
    ws = weights([1024, 2048, 1024])
    for loopback in (True, False):
        pipe = DistributedPipeline(ws, loopback=loopback)
        graphed = pipe.capture(4096)
        x = torch.randn(4096, 1024, device="cuda:0").bfloat16()
        want = pipe.sequential(x)
        for _ in range(20):
            assert torch.equal(graphed(x), want)
        pipe.check_errors()


def test_a_producer_that_starts_late_does_not_time_its_consumer_out(world1):
    """The consumer segment is launched, then the host waits 4 x its timeout before it launches
    the producer (a rank that starts late): the gate holds the consumer until the producer
    starts, so the call is right and nothing times out."""
    ws = weights([1024, 2048, 1024])
    pipe = DistributedPipeline(ws, loopback=True, timeout_s=0.05, start_timeout_s=2.0)
    x = torch.randn(2048, 1024, device="cuda:0").bfloat16()
    want = pipe.sequential(x)
    pipe(x, check=True)
    dp = pipe.plan(2048)
    out = torch.full((2048, 1024), float("nan"), device="cuda:0").bfloat16()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        pipe._run(dp, x, out, 2048, only=[1])  # the consumer first, on a stream of its own
    time.sleep(0.2)
    pipe._run(dp, x, out, 2048, only=[0])
    torch.cuda.synchronize()
    pipe.check_errors()
    assert torch.equal(out, want)
    # and a producer that never comes is reported on the consumer's stage, after the start timeout
    quick = DistributedPipeline(ws, loopback=True, timeout_s=0.05, start_timeout_s=0.2)
    quick(x, check=True)
    quick._run(quick.plan(2048), x, out, 2048, only=[1])
    with pytest.raises(PipelineTimeout, match=r"stage 1 \(rank 0\) on cuda:0: the previous segment had started 1 "):
        quick.check_errors()
    assert torch.equal(quick(x, check=True), want)


def test_a_weight_off_the_rank_gpu_is_refused(world1):
    ws = weights([1024, 2048])
    with pytest.raises(ValueError, match="rank 0: ValueError: rank 0's weight 1 is on cpu"):
        DistributedPipeline([ws[0], ws[0].cpu()])
    pipe = DistributedPipeline(ws, config=PIPELINE_CONFIG)
    assert pipe.is_first and pipe.is_last and len(pipe.segments) == 1


@pytest.mark.gpu2
def test_two_ranks_under_torchrun(tmp_path):
    """Two processes, a rank per GPU (examples/torchrun_chain.py): bitwise equal to the stages one
    after another and to the one-process pipeline; a first rank 2 s late (the kernels' timeout is
    1 s) makes three calls that are right, and nothing times out."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).parent.parent / "examples" / "torchrun_chain.py"
    out = tmp_path / "torchrun.json"
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(example), "--rows", "2048",
         "--dim", "4096", "--reps", "5", "--out", str(out)],
        capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["bitwise_equal_one_process"] is True and res["late_first_rank"]["no_timeout"] is True
    assert '"bitwise_equal_sequential": true' in r.stdout and '"late_calls_right": true' in r.stdout


@pytest.mark.parametrize("ranks", [pytest.param(1, marks=pytest.mark.gpu), pytest.param(2, marks=pytest.mark.gpu2)])
def test_ranks_at_several_heights_and_back(ranks):
    """``tests/ranks_heights.py`` under torchrun (one rank: two stages through the heap; two: a
    rank per GPU): six checked calls at three heights whose heaps are a few MB each, returning to
    earlier ones, each bitwise equal to the stages one after another on the last rank, and a graph
    captured at the first height replayed after the others were built, equal too."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    if torch.cuda.device_count() < ranks:
        pytest.skip(f"needs {ranks} GPUs, found {torch.cuda.device_count()}")
    script = Path(__file__).parent / "ranks_heights.py"
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), str(script)],
        capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["world"] == ranks and res["equal"] == [True] * 6 and res["graph_replay_equal"] is True
    assert res["plans"] == [256, 1024, 3000]
