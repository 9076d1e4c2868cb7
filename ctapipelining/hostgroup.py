"""The host collectives of a :class:`~ctapipelining.distributed.DistributedPipeline`.

The ranks of a pipeline exchange host objects (errors, plans, resets) on a gloo group of their
own ranks: an exchange must complete while a GPU does not finish, and an NCCL collective would
queue behind its kernels. Each pipeline on a group of another backend makes one
(:func:`gloo_group`), named the same on every rank of it whatever groups the other ranks of the
world made: PyTorch's ``new_group(..., use_local_synchronization=True)`` names a group by the
number of groups the calling rank has, so a rank outside an earlier such group (a pipeline on two
of three ranks) gives a later group of all three another name than its peers, and they wait for
each other until the timeout. :func:`gather_objects` is the all-gather of picklable objects on
such a group, which PyTorch's ``all_gather_object`` takes only for groups it registered. The
group is the pipeline's own: PyTorch does not register it (``destroy_process_group`` and its
debug wrappers do not see it), and it goes when the pipeline does.
"""

from __future__ import annotations

import datetime
import hashlib
import pickle
import threading
import weakref

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

PREFIX = "ctapipelining/host"  # the store's keys of every group made here start with it
_lock = threading.Lock()
# per default process group (a world initialised again counts anew): {ranks: groups made for them}
_MADE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def gloo_group(group, timeout: datetime.timedelta | None = None) -> dist.ProcessGroupGloo:
    """Collective over ``group``'s ranks: a new gloo process group of the same ranks, in the
    same order, whose operations wait ``timeout`` for a peer (default PyTorch's for a new
    group, 30 minutes). It is named by its ranks and by how many such groups this process made
    for them before, in the world as initialised now: the ranks agree as long as they make them
    in the same order, as they must build their pipelines."""
    ranks = tuple(dist.get_process_group_ranks(group))
    with _lock:
        made = _MADE.setdefault(dist.group.WORLD, {})
        n = made[ranks] = made.get(ranks, 0) + 1
    store = dist.PrefixStore(f"{PREFIX}/{name(ranks, n)}/", _get_default_store())
    return dist.ProcessGroupGloo(
        store, dist.get_rank(group), len(ranks), timeout=timeout if timeout is not None else dist.default_pg_timeout
    )


def name(ranks: tuple[int, ...], n: int) -> str:
    """The name of the ``n``-th group :func:`gloo_group` makes for ``ranks`` (short for any
    number of ranks: it prefixes every key of the group's rendezvous)."""
    return f"{hashlib.sha1('_'.join(map(str, ranks)).encode(), usedforsecurity=False).hexdigest()}/{n}"


def gather_objects(group, obj) -> list:
    """Collective over ``group`` (a process group, registered or made by :func:`gloo_group`):
    every rank's ``obj`` (picklable), in the group's rank order. Its buffers are on the CPU,
    whatever the default device (gloo's exchanges are between hosts)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64, device="cpu") for _ in range(group.size())]
    group.allgather([sizes], [torch.tensor([data.numel()], device="cpu")]).wait()
    longest = max(int(s) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8, device="cpu")
    mine[: data.numel()] = data
    every = [torch.empty(longest, dtype=torch.uint8, device="cpu") for _ in sizes]
    group.allgather([every], [mine]).wait()
    return [pickle.loads(t[: int(s)].numpy().tobytes()) for t, s in zip(every, sizes)]
