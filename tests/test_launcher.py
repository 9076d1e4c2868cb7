"""The raw launch path (:mod:`ctapipelining.launcher`) on the CPU: its arguments fit the
format of the launcher Triton builds for every kernel variant (GEMM and chain kernels) (a miscount would make every
launch after the first fail, or read an argument in the wrong place), and plan buffers pass
as addresses."""

from typing import NamedTuple

import pytest
import torch

from ctapipelining.launcher import RawLaunch, addresses, bound_stream, on_stream


@pytest.mark.xdist_group("sm90_compile")  # where conftest's sm90 report is built
def test_raw_arguments_fit_the_launchers_format_for_every_variant(sm90):
    """``launcher_format.py``, run with the other sm_90 compiles (conftest ``sm90``)."""
    got = sm90["launcher"]
    assert got["error"] is None, got["error"][-3000:]
    oks = [line for line in got["lines"] if line.startswith("ok")]
    assert len(oks) == 17, got["lines"]  # 5 GEMM variants, 3 epilogues, 4 norm passes (copy or not), 5 chains


class Bundle(NamedTuple):
    ptr: object
    n: object
    FLAG: object


def test_addresses_replace_tensors_and_keep_everything_else():
    t, u = torch.zeros(4), torch.zeros(2, dtype=torch.int64)
    got = addresses(Bundle(t, 7, None))
    assert isinstance(got, Bundle) and got == (t.data_ptr(), 7, None)
    assert addresses(u) == u.data_ptr() and addresses(None) is None and addresses(3) == 3


def test_tensor_maps_are_kept_per_slot_address_shape_stride_and_dtype(monkeypatch):
    """``RawLaunch.tensor_map`` encodes a tensor map once per slot, address, shape, row stride and
    dtype (what the map depends on; the block is the slot's own), reads the slot's metadata, and
    starts over when :data:`MAX_TENSOR_MAPS` are kept."""
    from ctapipelining import launcher

    made = []

    def encode(desc, meta):
        made.append((desc.base.data_ptr(), tuple(desc.shape), tuple(desc.strides), desc.base.dtype, meta))
        return [object()]

    monkeypatch.setattr(launcher, "make_tensordesc_arg", encode)
    raw = object.__new__(RawLaunch)  # the cache alone, without a compiled kernel
    raw._meta, raw._maps = ["meta0", "meta1"], {}
    t = torch.zeros(64, 32)
    first = raw.tensor_map(0, t, [16, 16])
    assert raw.tensor_map(0, t, [16, 16]) is first and len(made) == 1
    others = [t.clone(), t[:32], torch.zeros(64, 40)[:, :32], t.half()]  # address, shape, row stride, dtype
    for i, u in enumerate(others):
        assert raw.tensor_map(0, u, [16, 16]) is not first and len(made) == 2 + i
    raw.tensor_map(1, t, [16, 8])
    assert made[-1][-1] == "meta1" and len(made) == 6
    assert raw.tensor_map(0, t, [16, 16]) is first  # all still kept
    keep = [torch.zeros(8, 16) for _ in range(launcher.MAX_TENSOR_MAPS)]
    for u in keep:
        raw.tensor_map(0, u, [16, 16])
        assert len(raw._maps) <= launcher.MAX_TENSOR_MAPS
    assert raw.tensor_map(0, t, [16, 16]) is not first


def test_an_unknown_launcher_falls_back_to_tritons_path(monkeypatch):
    """``RawLaunch.of`` takes Triton's launcher only in the shapes it knows: a C function
    (kernels without descriptors), or a wrapper whose closure holds that function and whose
    kernel records every descriptor's metadata; anything else (no launcher, scratch memory per
    launch, a closure of another shape, metadata missing) goes through Triton's path (None). A
    raw launch passes the grid, the stream, the kernel's function, its cooperative-grid and PDL
    flags (each in its place) and packed metadata before the kernel's arguments."""
    from types import SimpleNamespace

    from ctapipelining import launcher

    monkeypatch.setattr(launcher, "make_tensordesc_arg", lambda desc, meta: [desc])

    def kernel(launch, scratch=0, meta=("m",)):
        run = SimpleNamespace(
            launch=launch, launch_cooperative_grid="coop", launch_pdl="pdl", global_scratch_size=scratch,
            profile_scratch_size=0,
        )  # fmt: skip
        return SimpleNamespace(run=run, function=1, packed_metadata=2, metadata=SimpleNamespace(tensordesc_meta=meta))

    launched = []

    def c_launcher(*args):  # stands for the compiled launcher
        launched.append(args)
        return args

    def wrapper_of(inner):
        launcher = inner  # the name Triton's wrapper closes over

        def launch(*args):
            return launcher(*args)

        return launch

    def other_wrapper(*args):
        return args

    assert RawLaunch.of(SimpleNamespace(run=object())) is None  # no launcher
    assert RawLaunch.of(kernel(len, scratch=64)) is None  # scratch memory allocated per launch
    plain = RawLaunch.of(kernel(len))  # a C function (no __code__): used as it is
    assert plain is not None and plain._launch is len and plain._meta == []
    wrapped = RawLaunch.of(kernel(wrapper_of(c_launcher), meta=("m0", "m1")))
    assert wrapped is not None and wrapped._launch is c_launcher and wrapped._meta == ["m0", "m1"]
    wrapped(5, 9, "a", 3)  # grid, stream, the kernel's arguments: in the launcher's order
    assert launched == [(5, 1, 1, 9, 1, "coop", "pdl", None, None, 2, None, None, None, "a", 3)]
    assert RawLaunch.of(kernel(other_wrapper)) is None  # a closure without the launcher
    assert RawLaunch.of(kernel(wrapper_of(c_launcher), meta=None)) is None
    assert RawLaunch.of(kernel(wrapper_of(c_launcher), meta=("m0", None))) is None
    monkeypatch.setattr(launcher, "make_tensordesc_arg", None)  # a Triton without it
    assert RawLaunch.of(kernel(len)) is None


@pytest.mark.interpreter
@pytest.mark.parametrize("which", ["launch_enter_hook", "launch_exit_hook"])
def test_launch_hooks_take_tritons_path_not_the_raw_launch(which):
    """A profiler's launch hooks are called only on Triton's path: with one registered (an
    enter hook, or an exit hook alone), a launch whose raw launch is cached must not use it
    (under the interpreter Triton's path computes the product)."""
    from triton import knobs

    from ctapipelining.gemm import GemmLaunch
    from ctapipelining.kernels.gemm import GemmConfig

    cfg = GemmConfig(block_m=16, block_n=16, block_k=16, group_m=1, num_stages=2, num_warps=4)
    a, b = torch.randn(32, 16).half(), torch.randn(16, 16).half()
    c = torch.zeros(32, 16).half()
    launch = GemmLaunch(32, 16, 16, cfg, 2, torch.device("cpu"))
    used = []

    class Raw:  # records its launches
        def tensor_map(self, slot, t, block):
            return [None, *t.shape, *t.stride()]

        def __call__(self, *args):
            used.append(args)

    launch._compiled[(True, 16, torch.float16, None)] = (None, Raw())
    hook = lambda metadata: None  # noqa: E731
    hooks = getattr(knobs.runtime, which)
    hooks.add(hook)
    try:
        launch(a, b, c)
    finally:
        hooks.remove(hook)
    assert not used
    assert torch.allclose(c.float(), a.float() @ b.float(), atol=1e-2, rtol=1e-2)
    launch(a, b, torch.zeros_like(c), stream=0)  # no hook: the cached raw launch
    assert len(used) == 1


def test_bound_stream_is_the_current_raw_stream_only_on_the_current_device_outside_capture_and_hooks(monkeypatch):
    """Where a bound call may launch (torch's queries patched: no GPU here): the current raw
    stream of the current device, the null (default) stream's handle 0 included; None on another
    device, while that stream is captured, or while a launch hook is set."""
    from triton import knobs

    state = {"device": 0, "capturing": False, "streams": {0: 0, 1: 0x7F01}}
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: state["device"], raising=False)
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: state["capturing"], raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: state["streams"][i], raising=False)
    assert bound_stream(0) == 0 and bound_stream(1) is None  # the null stream is a stream
    state["device"] = 1
    assert bound_stream(1) == 0x7F01 and bound_stream(0) is None
    state["device"], state["streams"][0] = 0, 0x7F00
    assert bound_stream(0) == 0x7F00
    state["capturing"] = True
    assert bound_stream(0) is None
    state["capturing"] = False
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_exit_hook.add(hook)
    try:
        assert bound_stream(0) is None
    finally:
        knobs.runtime.launch_exit_hook.remove(hook)
    assert bound_stream(0) == 0x7F00


def test_on_stream_makes_the_handles_stream_and_its_device_current(monkeypatch):
    """What ``on_stream`` enters (torch's queries patched: no GPU here): nothing on the CPU, or
    where the handle (None: the current one) is current on the current device; the device alone
    where it is current on another (Triton launches on the current device); the default stream
    for the null handle (``ExternalStream(0)`` would be a pool stream); else the handle's stream."""
    from contextlib import nullcontext

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 70 + index, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device: ("default", device))
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda handle, device: ("external", handle, device))
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: ("current", stream))
    cpu, gpu0, gpu1 = torch.device("cpu"), torch.device("cuda:0"), torch.device("cuda:1")
    assert type(on_stream(None, cpu)) is nullcontext and type(on_stream(5, cpu)) is nullcontext
    assert type(on_stream(None, gpu0)) is nullcontext and type(on_stream(70, gpu0)) is nullcontext
    for handle in (None, 71):
        switch = on_stream(handle, gpu1)
        assert isinstance(switch, torch.cuda.device) and switch.idx == 1
    assert on_stream(0, gpu1) == ("current", ("default", gpu1))
    assert on_stream(5, gpu0) == ("current", ("external", 5, gpu0))


class _FakeGemm:
    """A launch's GEMM that counts its full launches and binds them to a recording raw launch."""

    num_ctas = 7

    def __init__(self):
        self.full, self.raw_calls = [], []

    def __call__(self, a, b, c, stream, residual=None, compile_only=False):
        self.full.append((a.data_ptr(), c.data_ptr(), a.shape[0]))
        return "kernel"

    def bound(self, a, b, c):
        def raw(grid, stream, *args):
            self.raw_calls.append((grid, stream, args))

        return "kernel", raw, (a.data_ptr(), c.data_ptr())


def test_a_launch_binds_per_x_and_out_and_rebinds_when_they_change():
    """``Launch.run``: the first call on an ``x``/``out`` pair takes the full path and binds it;
    the next on the same pair goes straight to the raw launch with the bound arguments. Each
    part of the pair changed alone (either address, either row count, either row stride) takes
    the full path again (never stale arguments); the most recently used pairs stay bound
    (``MAX_BOUND``); with launch hooks set, or on a copy of ``x``, nothing is bound."""
    from triton import knobs

    from ctapipelining.plan import MAX_BOUND, Launch

    w = torch.zeros(8, 8)
    xb, ob = torch.zeros(64, 16), torch.zeros(64, 16)  # each view below: one part changed
    x, out = xb[:32, :8], ob[:32, :8]
    gemm = _FakeGemm()
    launch = Launch(0, gemm, [(("x", 0, 32), w, ("out", 0, 32))])
    launch.run(x, out, 5)
    launch.run(x, out, 6)
    assert len(gemm.full) == 1 and gemm.raw_calls == [(7, 6, (x.data_ptr(), out.data_ptr()))]
    changed = {
        "x's address": (xb[32:, :8], out),
        "out's address": (x, ob[32:, :8]),
        "x's rows": (xb[:31, :8], out),
        "out's rows": (x, ob[:31, :8]),
        "x's row stride": (xb.view(-1)[: 32 * 8].view(32, 8), out),
        "out's row stride": (x, ob.view(-1)[: 32 * 8].view(32, 8)),
    }
    for what, (x2, out2) in changed.items():
        full = len(gemm.full)
        launch.run(x2, out2, 6)
        assert len(gemm.full) == full + 1, f"{what} changed, yet the bound launch was used"
    assert len(gemm.raw_calls) == 1
    launch.run(x, out, 6)  # bound before the others; still among the most recent MAX_BOUND
    assert len(gemm.raw_calls) == 2
    others = [torch.zeros(32, 8) for _ in range(MAX_BOUND)]
    for o in others:
        launch.run(x, o, 6)
    full = len(gemm.full)
    launch.run(x, others[-1], 6)  # recent: bound
    launch.run(x, out, 6)  # the least recently used, dropped: full path
    assert len(gemm.full) == full + 1 and gemm.raw_calls[-1][2] == (x.data_ptr(), others[-1].data_ptr())
    assert len(launch._bound) == MAX_BOUND
    for o in others:  # all bound again, others[0] the least recently used
        launch.run(x, o, 6)
    launch.run(x, others[0], 6)  # used again: now the most recent
    full = len(gemm.full)
    launch.run(x, out, 6)  # bound anew: drops the least recently used, others[1]
    launch.run(x, others[0], 6)
    assert len(gemm.full) == full + 1 and gemm.raw_calls[-1][2] == (x.data_ptr(), others[0].data_ptr())
    launch.run(x, others[1], 6)
    assert len(gemm.full) == full + 2
    hooked = Launch(0, _FakeGemm(), launch.ops)
    knobs.runtime.launch_enter_hook.add(print)
    try:
        for _ in range(2):
            hooked.run(x, out, 6)
    finally:
        knobs.runtime.launch_enter_hook.remove(print)
    assert len(hooked.gemm.full) == 2 and not hooked.gemm.raw_calls
    copying = Launch(0, _FakeGemm(), launch.ops, copy_x=(torch.zeros(4, 8), 4))
    for _ in range(2):
        copying.run(x, out, 6)
    assert len(copying.gemm.full) == 2 and not copying.gemm.raw_calls


def test_bound_gemms_rebuild_a_gemms_arguments_only_where_its_input_or_output_moved(monkeypatch):
    """``serial.BoundGemms``: each GEMM launches the arguments built for its input's and output's
    addresses in the last call; where the intermediate lands elsewhere, the GEMM that writes it
    and the one that reads it both build theirs again, for the new tensors; a given ``out`` is
    written, and without one a new output in the step's shape (its GEMM's arguments built again
    where it lands elsewhere)."""
    from ctapipelining.serial import BoundGemms, _BoundStep

    class Raw:
        tensor_map = None

        def __init__(self):
            self.calls = []

        def __call__(self, grid, stream, *args):
            self.calls.append((grid, stream, args))

    class Launch:
        num_ctas = 3

        def __init__(self):
            self.built = []

        def raw_args(self, tensor_map, a, b, c):
            self.built.append((a.data_ptr(), b.data_ptr(), c.data_ptr()))
            return (a.data_ptr(), b.data_ptr(), c.data_ptr())

    ws = [torch.zeros(8, 16), torch.zeros(16, 4)]
    x, mid, out = torch.zeros(5, 8), torch.zeros(5, 16), torch.zeros(5, 4)
    launches, raws = [Launch(), Launch()], [Raw(), Raw()]
    steps = [
        _BoundStep(launches[0], raws[0], ((x.data_ptr(), mid.data_ptr()), ("bound", 0))),
        _BoundStep(launches[1], raws[1], ((mid.data_ptr(), out.data_ptr()), ("bound", 1))),
    ]
    bound = BoundGemms(steps)
    mid2, out2 = torch.zeros(5, 16), torch.zeros(5, 4)
    allocated = iter([mid, mid2, mid2, out2])  # the intermediate where it was, elsewhere, there again; a new out

    def empty(shape, dtype, device):
        t = next(allocated)
        assert tuple(t.shape) == tuple(shape) and dtype == x.dtype
        return t

    monkeypatch.setattr(torch, "empty", empty)
    assert bound(x, ws, out, 9) is out
    assert [r.calls for r in raws] == [[(3, 9, ("bound", 0))], [(3, 9, ("bound", 1))]]
    assert not launches[0].built and not launches[1].built
    assert bound(x, ws, out, 9) is out  # the intermediate moved: both GEMMs build theirs
    assert launches[0].built == [(x.data_ptr(), ws[0].data_ptr(), mid2.data_ptr())]
    assert launches[1].built == [(mid2.data_ptr(), ws[1].data_ptr(), out.data_ptr())]
    assert raws[0].calls[-1][2] == launches[0].built[-1] and raws[1].calls[-1][2] == launches[1].built[-1]
    assert steps[0].at == (x.data_ptr(), mid2.data_ptr()) and steps[1].at == (mid2.data_ptr(), out.data_ptr())
    assert bound(x, ws, None, 9) is out2  # a new output elsewhere: only the last GEMM builds again
    assert len(launches[0].built) == 1 and launches[1].built[-1] == (mid2.data_ptr(), ws[1].data_ptr(), out2.data_ptr())
    assert raws[0].calls[-1][2] == launches[0].built[-1] and raws[1].calls[-1][2] == launches[1].built[-1]


def test_bound_gemms_run_a_cublas_step_through_stage_gemm(monkeypatch):
    """A step of ``None`` (cuBLAS's) runs ``stage_gemm`` into the step's output: the given ``out``
    for the last GEMM, else a new tensor, which the next GEMM reads."""
    from ctapipelining import serial

    ws = [torch.zeros(8, 16), torch.zeros(16, 4)]
    x, out = torch.zeros(5, 8), torch.zeros(5, 4)
    ran = []
    monkeypatch.setattr(serial, "stage_gemm", lambda a, w, c: ran.append((a, w, c)))
    assert serial.BoundGemms([None, None])(x, ws, out, 9) is out
    (a0, w0, c0), (a1, w1, c1) = ran
    assert a0 is x and w0 is ws[0] and a1 is c0 and w1 is ws[1] and c1 is out
    assert c0.shape == (5, 16) and c0.dtype == x.dtype and c0.device == x.device
    new = serial.BoundGemms([None, None])(x, ws, None, 9)
    assert new is ran[-1][2] and new is not out and new.shape == (5, 4) and new.dtype == x.dtype


def test_a_bound_step_whose_arguments_fail_to_build_keeps_its_last_ones():
    """``_BoundStep``: where building the arguments for new addresses raises, the step keeps the
    addresses and arguments it had (one field), so a later launch at the old addresses launches
    the old arguments, not new ones built for other tensors."""
    from ctapipelining.serial import _BoundStep

    class Launch:
        num_ctas = 2

        def raw_args(self, tensor_map, a, b, c):
            raise RuntimeError("no tensor map")

    class Raw:
        tensor_map = None

        def __call__(self, grid, stream, *args):
            launched.append(args)

    launched = []
    x, w, c, c2 = torch.zeros(4, 8), torch.zeros(8, 4), torch.zeros(4, 4), torch.zeros(4, 4)
    step = _BoundStep(Launch(), Raw(), ((x.data_ptr(), c.data_ptr()), (1,)))
    with pytest.raises(RuntimeError, match="no tensor map"):
        step(x, w, c2, 0)
    assert step.at == (x.data_ptr(), c.data_ptr()) and not launched
    step(x, w, c, 0)
    assert launched == [(1,)]
