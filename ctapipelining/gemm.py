"""Host wrapper of the persistent GEMM (:mod:`ctapipelining.kernels.gemm`).

:func:`matmul` is the plain GEMM (both hooks off). :func:`launch_gemm` is what a pipeline
stage calls, with a :class:`WaitHook` (its own scoreboard) and/or a :class:`SignalHook` (the
next stage's). Inputs are checked here, before anything is launched.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from . import deps, fabric
from .kernels.gemm import PLAIN_CONFIG, SIGNAL_MODES, GemmConfig, gemm_kernel

DTYPES = (torch.bfloat16, torch.float16)


def _cdiv(a: int, b: int) -> int:
    """``ceil(a / b)``; plain Python: ``triton.cdiv`` costs ~1.5 us a call on the host, and a
    launch computes several."""
    return -(-a // b)


def interpreting() -> bool:
    """True when Triton kernels run on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: a few CTAs, run one after another
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclass
class WaitHook:
    """This stage's scoreboard (in its own memory): wait on counters, or on the ring.

    ``parts > 1`` (``static``): each tile's input rows are counted in ``parts`` pieces of the
    producer's ``part_cols`` column-blocks of ``part_block`` columns (counter
    ``counter_of_tile[t] + q``; :func:`ctapipelining.deps.build_dependency`)."""

    counters: torch.Tensor
    counter_of_tile: torch.Tensor
    need: torch.Tensor
    slots: torch.Tensor
    head: torch.Tensor
    queue: bool
    parts: int = 1
    part_cols: int = 1
    part_block: int = 1


@dataclass
class SignalHook:
    """The next stage's scoreboard (in its memory) and this stage's CSR lists (in ours)."""

    counters: torch.Tensor
    signal_ptr: torch.Tensor
    signal_counters: torch.Tensor
    need: torch.Tensor
    push_ptr: torch.Tensor
    push_tiles: torch.Tensor
    slots: torch.Tensor
    tail: torch.Tensor
    consumer_tiles: int
    push_block: int
    max_signals: int
    queue: bool


@dataclass
class TailBuffers:
    """A split tail's state (:class:`ctapipelining.deps.TailSplit`), on the GEMM's device:
    ``workspace`` fp32 ``[tiles * splits, BLOCK_M * BLOCK_N]`` partial tiles and ``counters``
    int32 ``[tiles]`` arrivals, zero between launches (the last slice of a tile rearms its
    counter; an owner zeroes them after a launch that timed out)."""

    split: deps.TailSplit
    workspace: torch.Tensor
    counters: torch.Tensor

    @classmethod
    def create(cls, split: deps.TailSplit, config: GemmConfig, device: torch.device) -> TailBuffers:
        ws = torch.empty(split.items, config.block_m * config.block_n, dtype=torch.float32, device=device)
        return cls(split, ws, torch.zeros(split.tiles, dtype=torch.int32, device=device))


def tail_split(M: int, N: int, K: int, config: GemmConfig, num_ctas: int):
    """The :class:`~ctapipelining.deps.TailSplit` a launch uses (None: no split tail): only
    with ``config.split_tail`` (which a ``workqueue`` consumer cannot run: its order is
    dynamic; :meth:`ctapipelining.pipeline.Pipeline.stage_config` turns it off there)."""
    if not config.split_tail:
        return None
    tiles = _cdiv(M, config.block_m) * _cdiv(N, config.block_n)
    return deps.split_tail(tiles, num_ctas, _cdiv(K, config.block_k), config.tail_slice_k)


def check_tensor(t: torch.Tensor, name: str) -> None:
    """Raise a clear error for a matrix the TMA GEMM cannot read."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if t.dtype not in DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: bfloat16, float16")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (row-major)")
    if t.shape[1] * t.element_size() % 16:
        raise ValueError(
            f"{name}: rows of {t.shape[1]} elements are not a multiple of 16 bytes (TMA needs it); "
            f"pad the last dimension to a multiple of {16 // t.element_size()}"
        )
    if t.device.type != "cuda" and not interpreting():
        raise ValueError(f"{name} is on {t.device}; the GEMM runs on CUDA devices (or under TRITON_INTERPRET=1)")


def check_operands(a: torch.Tensor, b: torch.Tensor, what: str = "matmul") -> None:
    """Raise a clear error for operands the TMA GEMM cannot take."""
    check_tensor(a, f"{what}: A")
    check_tensor(b, f"{what}: B")
    if a.dtype != b.dtype:
        raise TypeError(f"{what}: A is {a.dtype} but B is {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"{what}: A is on {a.device} but B is on {b.device}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{what}: A is {tuple(a.shape)} and B is {tuple(b.shape)}: inner dimensions differ")


def launch_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    config: GemmConfig,
    num_ctas: int,
    *,
    wait: WaitHook | None = None,
    signal: SignalHook | None = None,
    epoch: torch.Tensor | None = None,
    err: torch.Tensor | None = None,
    trace: torch.Tensor | None = None,
    tail: TailBuffers | None = None,
    stage: int = 0,
    timeout_ns: int = 1_000_000_000,
):
    """Launch the GEMM on ``a.device``'s current stream (operands already checked); returns
    Triton's compiled-kernel handle (PTX, register and spill counts for inspection).

    ``c`` ([M, N], row-major, rows may be padded) may live on another GPU with peer access.
    ``trace``: int64 ``[num_tiles, 5]`` to receive per-tile ``%globaltimer`` stamps (GPU only).
    ``tail``: the split tail's buffers when ``config.split_tail`` splits this launch (see
    :func:`tail_split`); None: fresh ones (a plain GEMM's call).
    """
    if trace is not None and interpreting():
        raise ValueError("trace mode reads %globaltimer and needs a GPU (not the Triton interpreter)")
    M, K = a.shape
    N = b.shape[1]
    cfg = config
    a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k])
    b_desc = TensorDescriptor.from_tensor(b, [cfg.block_k, cfg.block_n])
    tma_store = cfg.tma_store and c.is_contiguous()  # a padded ``c`` takes ordinary stores
    # "next_tile" waits on bulk-store groups: with ordinary stores (padded ``c``) signal right away
    signal_when = SIGNAL_MODES["now" if cfg.signal == "next_tile" and not tma_store else cfg.signal]
    c_desc = TensorDescriptor.from_tensor(c, [cfg.block_m, cfg.block_n]) if tma_store else b_desc
    dummy = epoch if epoch is not None else torch.zeros(1, dtype=torch.int32, device=a.device)
    w = wait or WaitHook(dummy, dummy, dummy, dummy, dummy, False)
    s = signal or SignalHook(dummy, dummy, dummy, dummy, dummy, dummy, dummy, dummy, 1, 1, 1, False)
    if wait is not None and signal is not None and wait.queue != signal.queue:
        raise ValueError("a stage's input and output links must use the same policy")
    queue = wait.queue if wait is not None else s.queue
    parts = 1 if wait is None else wait.parts
    if parts > 1 and wait.queue:
        raise ValueError("a workqueue consumer runs whole tiles in readiness order and cannot wait in parts")
    if parts > 1 and (wait.part_cols < parts or wait.part_cols * wait.part_block < K):
        raise ValueError(
            f"{parts} parts of {wait.part_cols} producer column-blocks of {wait.part_block} do not cover K={K}"
        )
    split = tail_split(M, N, K, cfg, num_ctas)
    if split is not None and wait is not None and wait.queue:
        raise ValueError("a workqueue consumer runs tiles in readiness order and cannot split its tail")
    if split is not None and tail is None:
        tail = TailBuffers.create(split, cfg, a.device)
    elif split is not None and tail.split != split:
        raise ValueError(f"tail buffers are for {tail.split}, this launch splits {split}")
    return gemm_kernel[(num_ctas,)](
        a_desc,
        b_desc,
        c_desc,
        c,
        w.counters,
        w.counter_of_tile,
        w.need,
        w.slots,
        w.head,
        s.counters,
        s.signal_ptr,
        s.signal_counters,
        s.need,
        s.push_ptr,
        s.push_tiles,
        s.slots,
        s.tail,
        dummy if epoch is None else epoch,
        dummy if err is None else err,
        dummy if trace is None else trace,
        dummy if split is None else tail.workspace,
        dummy if split is None else tail.counters,
        M,
        N,
        _cdiv(K, cfg.block_k),
        c.stride(0),
        s.consumer_tiles,
        stage,
        timeout_ns,
        0 if split is None else split.first_pos,
        1 if split is None else split.splits,
        w.part_cols,
        w.part_block,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        NUM_CTAS=num_ctas,
        WAIT_INPUT=wait is not None,
        WAIT_PARTS=parts,
        WAIT_AHEAD=cfg.num_stages if parts > 1 else 0,
        SIGNAL_OUTPUT=signal is not None,
        QUEUE=queue,
        SIGNAL_WHEN=signal_when,
        PUSH_BLOCK=s.push_block,
        MAX_SIGNALS=s.max_signals,
        TMA_STORE=tma_store,
        FLATTEN=cfg.flatten,
        # the signal's and the split tail's CTA barriers need every warp; a wait orders the TMA
        # loads after it in the program order of the thread that issues them, which a separate
        # load partition would not keep
        WARP_SPECIALIZE=cfg.warp_specialize and signal is None and wait is None and split is None,
        SPLIT_TAIL=split is not None,
        TRACE=trace is not None,
        INTERPRET=interpreting(),
        num_stages=cfg.num_stages,
        num_warps=cfg.num_warps,
    )


def grid_size(M: int, N: int, config: GemmConfig, device: torch.device) -> int:
    """Persistent grid: one CTA per SM, fewer when there are fewer tiles."""
    return max(1, min(num_sms(device), _cdiv(M, config.block_m) * _cdiv(N, config.block_n)))


def matmul(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, config: GemmConfig | None = None
) -> torch.Tensor:
    """Plain persistent GEMM ``a @ b`` (both hooks off). ``out`` may be on a peer GPU (peer
    access is enabled here, or a :class:`~ctapipelining.fabric.PeerAccessError` says why not)."""
    check_operands(a, b)
    cfg = config or PLAIN_CONFIG
    M, N = a.shape[0], b.shape[1]
    if out is None:
        out = torch.empty(M, N, dtype=a.dtype, device=a.device)
    elif out.shape != (M, N) or out.dtype != a.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be a row-major [{M}, {N}] {a.dtype} tensor, got {tuple(out.shape)} {out.dtype}")
    if M == 0 or N == 0:
        return out
    if out.device != a.device:
        if out.device.type != "cuda" or a.device.type != "cuda":
            raise ValueError(f"out is on {out.device} but the GEMM runs on {a.device}")
        fabric.enable_peer_access([a.device.index, out.device.index])
    with torch.cuda.device(a.device) if a.device.type == "cuda" else contextlib.nullcontext():
        launch_gemm(a, b, out, cfg, grid_size(M, N, cfg, a.device))
    return out
