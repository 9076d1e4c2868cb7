"""Peer access bookkeeping, on the CPU with the CUDA calls replaced."""

import pytest

from ctapipelining import fabric


@pytest.fixture
def fake_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(fabric, "_enabled", set())
    monkeypatch.setattr(fabric, "_native", set())
    monkeypatch.setattr(fabric.torch.cuda, "can_device_access_peer", lambda s, d: (s, d) != (1, 2))
    monkeypatch.setattr(fabric, "_enable_one", lambda s, d: calls.append((s, d)))
    monkeypatch.setattr(fabric, "native_peer_atomics", lambda s, d: True)
    capturing = {"now": False}
    monkeypatch.setattr(fabric.torch.cuda, "is_current_stream_capturing", lambda: capturing["now"])
    return calls, capturing


def test_each_pair_is_enabled_once_and_then_capture_is_fine(fake_cuda):
    calls, capturing = fake_cuda
    fabric.enable_peer_access([0, 1, 0])
    fabric.enable_peer_access([0, 1])
    assert calls == [(0, 1), (1, 0)]  # the second call made no CUDA call
    capturing["now"] = True
    fabric.enable_peer_access([0, 1])  # already enabled: allowed while a graph is captured
    with pytest.raises(fabric.PeerAccessError, match="during CUDA-graph capture: run the call once before"):
        fabric.enable_peer_access([0, 2])


def test_a_pair_without_p2p_is_named(fake_cuda):
    with pytest.raises(fabric.PeerAccessError, match=r"cuda:1 cannot access cuda:2's memory"):
        fabric.enable_peer_access([0, 1, 2])


def test_a_shared_heap_whose_peer_fails_leaves_no_file(monkeypatch):
    """A rank's shared-memory file is removed when a later step of the heap's setup fails (a peer
    whose file cannot be mapped), and the failure is raised; nothing is left in /dev/shm."""
    import os

    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    created = []

    def meet(what, value, error):
        if error:
            raise RuntimeError(f"{what}: {error}")
        created.append(value)
        return [value, os.path.join(os.path.dirname(value), "no-such-dir", "peer")]

    with pytest.raises(RuntimeError, match="map the heap"):
        fabric.shared_heap(4096, None, meet)
    assert len(created) == 1 and created[0] and not os.path.exists(created[0])


class _FakeSymmetricMemory:
    """Two ranks' pool segments of PyTorch symmetric memory (CPU tensors), this process rank 0,
    the heap ``offset`` bytes into each (an allocation that does not start a segment); what
    ``get_buffer`` gives is counted from the segment's start, as PyTorch's."""

    def __init__(self, offset: int, nbytes: int):
        import torch

        self.segments = [torch.zeros(offset + nbytes + 1024, dtype=torch.uint8) for _ in range(2)]
        self.offset, self.rank, self.world_size = offset, 0, 2
        self.buffer_ptrs = [s.data_ptr() for s in self.segments]

    def empty(self, nbytes, dtype, device):
        return self.segments[0][self.offset : self.offset + nbytes]

    def rendezvous(self, t, group):
        return self

    def get_buffer(self, rank, sizes, dtype, storage_offset=0):
        return self.segments[rank][storage_offset : storage_offset + sizes[0]]


@pytest.mark.parametrize("offset", [0, 4096])
def test_a_symmetric_heap_inside_a_pool_segment_is_addressed_where_it_is_on_every_rank(monkeypatch, offset):
    """A heap that starts ``offset`` bytes into its rank's segment of the symmetric-memory pool
    is addressed on each peer where that rank's heap is (here 512 bytes further into rank 1's
    segment), not at the segment's start; this rank's view is its own tensor."""
    import torch

    fake = _FakeSymmetricMemory(offset, 1024)
    monkeypatch.setattr(fabric, "symmetric_memory", lambda: fake)
    met = []

    def meet(what, value, error):
        if error:
            raise RuntimeError(f"{what}: {error}")
        met.append(what)
        return [value, None if value is None else value + 512]  # rank 1's offset, as it says

    heap = fabric.symmetric_heap(1024, torch.device("cpu"), None, meet)
    assert met == ["allocate the heap", "map the heap", "view the heaps"]
    assert heap.local.data_ptr() == fake.segments[0].data_ptr() + offset
    assert heap.peers[1].data_ptr() == fake.segments[1].data_ptr() + offset + 512 and heap.peers[1].numel() == 1024


def test_a_symmetric_heap_whose_view_disagrees_with_its_tensor_is_refused(monkeypatch):
    """A symmetric-memory view of this rank's own heap that is not where its tensor is (an
    offset counted otherwise) is refused on every rank, rather than letting peers write
    elsewhere."""
    import torch

    fake = _FakeSymmetricMemory(4096, 1024)
    fake.get_buffer = lambda rank, sizes, dtype, storage_offset=0: fake.segments[rank][: sizes[0]]
    monkeypatch.setattr(fabric, "symmetric_memory", lambda: fake)

    def meet(what, value, error):
        if error:
            raise RuntimeError(f"{what}: {error}")
        return [value, value]

    with pytest.raises(RuntimeError, match="view the heaps: viewing the ranks' heaps failed on cpu: RuntimeError"):
        fabric.symmetric_heap(1024, torch.device("cpu"), None, meet)


def test_a_pair_without_native_peer_atomics_is_refused_before_access_is_enabled(fake_cuda, monkeypatch):
    """Peer access over PCIe usually comes without native atomics, and the tiles' signals are
    atomics on the consumer's memory: such a pair is refused by name, and nothing is enabled."""
    calls, _ = fake_cuda
    monkeypatch.setattr(fabric, "native_peer_atomics", lambda s, d: (s, d) != (1, 0))
    fabric.enable_peer_access([0, 1])
    with pytest.raises(fabric.PeerAccessError, match=r"cuda:1 cannot make atomic operations on cuda:0's memory"):
        fabric.enable_peer_access([0, 1, 0])
    assert calls == [(0, 1)]
    fabric.enable_peer_access([1, 0], atomics=False)  # plain stores or reads across: enabled
    assert calls == [(0, 1), (1, 0)]
    with pytest.raises(fabric.PeerAccessError, match="cannot make atomic operations"):
        fabric.enable_peer_access([1, 0])  # enabled already, but now for atomics: still checked
    monkeypatch.setattr(fabric, "native_peer_atomics", lambda s, d: None)  # cannot be told: not refused
    fabric.enable_peer_access([1, 0])
    assert calls == [(0, 1), (1, 0)]


class _FakeCudart:
    """The two calls of the CUDA runtime that the atomics query makes, answering for a pair:
    ``answers`` per attribute (an attribute missing: the runtime does not know it, error 1)."""

    def __init__(self, answers: dict):
        self.answers, self.asked, self.cleared = answers, [], 0

    def cudaDeviceGetP2PAttribute(self, value, attr, src, dst):  # noqa: N802 (the runtime's name)
        self.asked.append((attr.value, src.value, dst.value))
        if attr.value not in self.answers:
            return 1  # cudaErrorInvalidValue
        value._obj.value = self.answers[attr.value]
        return 0

    def cudaGetLastError(self):  # noqa: N802
        self.cleared += 1
        return 0


ALL, SOME = fabric._NATIVE_ATOMICS, fabric._SOME_NATIVE_ATOMICS


@pytest.mark.parametrize(
    ("answers", "expected", "asked"),
    [
        ({ALL: 1, SOME: 0}, True, [ALL]),
        ({ALL: 0, SOME: 0}, False, [ALL, SOME]),
        ({ALL: 0}, False, [ALL, SOME]),  # a runtime before CUDA 13: no partial answer
        ({ALL: 0, SOME: 1}, None, [ALL, SOME]),  # some atomics native: not refused
        ({}, None, [ALL]),  # the query failed
    ],
)
def test_native_peer_atomics_asks_the_runtime_for_the_pair(monkeypatch, answers, expected, asked):
    lib = _FakeCudart(answers)
    monkeypatch.setattr(fabric, "_cudart", lambda: lib)
    assert fabric.native_peer_atomics(2, 3) is expected
    assert lib.asked == [(a, 2, 3) for a in asked]
    assert lib.cleared == sum(a not in answers for a in asked)
    assert fabric.native_peer_atomics(1, 1) is True and len(lib.asked) == len(asked)  # one GPU: nothing to ask
    monkeypatch.setattr(fabric, "_cudart", lambda: None)
    assert fabric.native_peer_atomics(2, 3) is None
