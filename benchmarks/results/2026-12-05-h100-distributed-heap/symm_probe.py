# session probe (not committed): where symm_mem.empty puts small heaps in torch 2.11, and whether
# get_buffer(rank, ..., offset) aliases the tensor
import inspect
import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed import _symmetric_memory as symm_mem

dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/s", rank=0, world_size=1)
print("torch", torch.__version__, "implicit pool", os.getenv("TORCH_SYMMMEM_IMPLICIT_POOL", "1"))
src = inspect.getsource(symm_mem.get_mem_pool) if hasattr(symm_mem, "get_mem_pool") else "no get_mem_pool"
print("no_split in get_mem_pool:", "no_split" in src)
keep = []
for n in (4096, 1 << 20, 4096, 3 << 20, 8192, 64 << 20, 4096):
    t = symm_mem.empty(n, dtype=torch.uint8, device="cuda:0")
    h = symm_mem.rendezvous(t, dist.group.WORLD)
    off = t.data_ptr() - h.buffer_ptrs[0]
    try:
        v = h.get_buffer(0, (n,), torch.uint8, off)
        gb = v.data_ptr() == t.data_ptr()
    except Exception as e:  # noqa: BLE001
        gb = f"{type(e).__name__}: {e}"[:200]
    try:
        rt = h.get_remote_tensor(0, (n,), torch.uint8).data_ptr() == t.data_ptr()
    except Exception as e:  # noqa: BLE001
        rt = f"{type(e).__name__}: {e}"[:200]
    print(n, "offset", off, "get_buffer+offset aliases", gb, "get_remote_tensor aliases", rt,
          "offset attr", getattr(h, "offset", None), "buffer_size", getattr(h, "buffer_size", None))
    keep.append((t, h))
dist.destroy_process_group()
