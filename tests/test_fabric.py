"""Peer access bookkeeping, on the CPU with the CUDA calls replaced."""

import pytest

from ctapipelining import fabric


@pytest.fixture
def fake_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(fabric, "_enabled", set())
    monkeypatch.setattr(fabric.torch.cuda, "can_device_access_peer", lambda s, d: (s, d) != (1, 2))
    monkeypatch.setattr(fabric, "_enable_one", lambda s, d: calls.append((s, d)))
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
