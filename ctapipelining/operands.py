"""What the kernels accept, checked on the host, and what identifies an operand.

Every host wrapper (:func:`ctapipelining.gemm.matmul`, :class:`~ctapipelining.pipeline.Pipeline`,
the :mod:`~ctapipelining.nn` blocks) checks its tensors with these before anything is launched,
and raises a clear error for one the TMA kernels cannot read or write: a dense row-major bf16 or
fp16 matrix on a CUDA device (or on the CPU under Triton's interpreter), rows a multiple of 16
bytes apart, based 16-byte aligned. :func:`tma_ready` is the common case in a few attribute
reads. A launch bound to an operand skips the checks for a later one with the same
:func:`signature` (:func:`bindable`), and :func:`overlaps` keeps an output off its inputs.
What a kernel accepts depends on where the kernels run (:func:`interpreting`: on the CPU under
the interpreter, fp16 only). A copy of an operand into a buffer of the library's reads it
:func:`untracked`, so that no call records an autograd graph.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from triton.runtime.interpreter import InterpretedFunction

from .kernels.gemm import gemm_kernel

DTYPES = (torch.bfloat16, torch.float16)


def interpreting() -> bool:
    """True when the kernels run on Triton's CPU interpreter (``TRITON_INTERPRET=1`` when they
    were first imported: Triton decides it then)."""
    return _INTERPRETED


_INTERPRETED = isinstance(gemm_kernel, InterpretedFunction)
# Triton 3.6's interpreter converts 1-element arrays to Python ints (its loops' bounds), which
# NumPy 2.4 and later refuse: under the interpreter, every kernel of the library fails there
_NUMPY_REFUSED = np.lib.NumpyVersion(np.__version__) >= "2.4.0.dev0"


MIN_CAPABILITY = (9, 0)  # TMA descriptors and bulk copies, fence.proxy.async: Hopper (sm_90) on


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def check_arch(device: torch.device) -> None:
    """Raise a clear error for a CUDA device the kernels cannot run on: they load and store
    through TMA and order its copies with ``fence.proxy.async``, which need sm_90 (Hopper) or
    later. Checked where a launch is built (once per shape and configuration, or per plan), not
    per call."""
    if device.type != "cuda":
        return
    index = torch.cuda.current_device() if device.index is None else device.index
    major, minor = _capability(index)
    if (major, minor) < MIN_CAPABILITY:
        raise RuntimeError(
            f"cuda:{index} ({torch.cuda.get_device_name(index)}) is sm_{major}{minor}; ctapipelining's kernels need "
            "sm_90 or later (Hopper's TMA)"
        )


def _row_major(t: torch.Tensor) -> bool:
    """Rows contiguous and at least a row apart, row stride a multiple of 16 bytes: what TMA
    reads and writes."""
    return t.stride(1) == 1 and t.stride(0) >= t.shape[1] and t.stride(0) * t.element_size() % 16 == 0


def tma_ready(t) -> bool:
    """The common case of :func:`check_tensor`, in a few attribute reads: a contiguous 2-D
    bf16/fp16 CUDA tensor whose rows are a multiple of 16 bytes, based 16-byte aligned."""
    if not (
        isinstance(t, torch.Tensor) and t.is_cuda and t.layout is torch.strided and not t.is_nested
        and t.dtype in DTYPES and t.dim() == 2 and t.is_contiguous()
    ):  # fmt: skip
        return False
    rows, cols = t.shape
    # contiguous with both sizes above 1: the strides are (cols, 1); 2-byte elements
    return cols % 8 == 0 and t.data_ptr() % 16 == 0 and not _INTERPRETED and (rows > 1 < cols or _row_major(t))


def check_matrix(t, name: str) -> None:
    """Raise a clear error for ``t`` unless it is a dense 2-D tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_dense(t, name)
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")


def check_tensor(t: torch.Tensor, name: str) -> None:
    """Raise a clear error for a matrix the TMA GEMM cannot read."""
    if tma_ready(t):
        return
    check_matrix(t, name)
    if t.dtype not in DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: bfloat16, float16")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (row-major)")
    if t.shape[1] * t.element_size() % 16:
        raise ValueError(
            f"{name}: rows of {t.shape[1]} elements are not a multiple of 16 bytes (TMA needs it); "
            f"pad the last dimension to a multiple of {16 // t.element_size()}"
        )
    if _INTERPRETED and _NUMPY_REFUSED:
        raise RuntimeError(
            f"Triton's CPU interpreter (TRITON_INTERPRET=1) cannot run the kernels with NumPy {np.__version__}: "
            "it converts 1-element arrays to ints, which NumPy 2.4 refuses; install 'numpy<2.4' (the package's "
            "dev extra does), or run on a GPU"
        )
    if t.dtype == torch.bfloat16 and _INTERPRETED:
        raise TypeError(
            f"{name} is bfloat16, which Triton's CPU interpreter (TRITON_INTERPRET=1) multiplies wrongly: "
            "use float16 there, or a GPU"
        )
    if not _row_major(t):
        raise ValueError(f"{name}: rows must be contiguous and a multiple of 16 bytes apart, strides {t.stride()}")
    if t.numel() and t.data_ptr() % 16:
        raise ValueError(f"{name} must start at a 16-byte aligned address (TMA needs it)")
    if t.device.type != "cuda" and not _INTERPRETED:
        raise ValueError(f"{name} is on {t.device}; the GEMM runs on CUDA devices (or under TRITON_INTERPRET=1)")


def check_weight(w: torch.Tensor, name: str) -> None:
    """:func:`check_tensor`, and neither dimension empty."""
    check_tensor(w, name)
    if 0 in w.shape:
        raise ValueError(f"{name} is empty: {tuple(w.shape)}")


def check_operands(a: torch.Tensor, b: torch.Tensor, what: str = "matmul") -> None:
    """Raise a clear error for operands the TMA GEMM cannot take."""
    if not (tma_ready(a) and tma_ready(b)):  # (else an empty inner dimension is B's, refused below)
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) and is_dense(t) and t.dim() == 2 else None
                  for t in (a, b)]  # fmt: skip
        if None not in shapes and shapes[0][1] == shapes[1][0] == 0:
            raise ValueError(f"{what}: A is {shapes[0]} and B is {shapes[1]}: the inner dimension is empty")
        check_tensor(a, f"{what}: A")
        check_tensor(b, f"{what}: B")
    if 0 in b.shape:
        raise ValueError(f"{what}: B is empty: {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"{what}: A is {a.dtype} but B is {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"{what}: A is on {a.device} but B is on {b.device}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{what}: A is {tuple(a.shape)} and B is {tuple(b.shape)}: inner dimensions differ")


_OPERAND_TYPES = (torch.Tensor, torch.nn.Parameter)  # exactly these: a subclass may dispatch elsewhere


def untracked(t: torch.Tensor) -> torch.Tensor:
    """``t`` without its autograd history (where it has one): what a copy into a buffer of ours
    reads, so that the copy records no graph, as a launch of ours records none."""
    return t.detach() if t.requires_grad else t


def bindable(t) -> bool:
    """Whether ``t`` may take a bound launch (its checks skipped on its :func:`signature`): a
    strided CUDA tensor of exactly ``torch.Tensor`` or ``Parameter`` (a subclass may dispatch
    elsewhere; a sparse or nested tensor has no address to sign: the checks refuse it)."""
    return type(t) in _OPERAND_TYPES and t.is_cuda and is_dense(t)


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t`` is one strided block of memory (not sparse, not nested): what has an address
    to sign (:func:`signature`)."""
    return t.layout is torch.strided and not t.is_nested


def check_dense(t: torch.Tensor, name: str) -> None:
    """Raise a clear error for a tensor without one strided block of memory (sparse, nested)."""
    if not is_dense(t):
        what = "nested" if t.is_nested else f"of layout {t.layout}"
        raise TypeError(f"{name} must be a dense (strided) tensor, got one {what}")


def signature(t: torch.Tensor) -> tuple:
    """What every check of an operand reads: its address, shape, strides, dtype and device (a
    CUDA device's index, -1 for any other). Addresses are unique across the GPUs of a process
    (unified addressing), so two tensors with one signature pass or fail the same checks,
    overlap the same tensors and take the same tensor maps."""
    return t.data_ptr(), t.shape, t.stride(), t.dtype, t.get_device() if t.is_cuda else -1


def span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range ``[first, end)`` that ``t``'s elements occupy (a non-empty matrix or
    vector, strides >= 0)."""
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def overlaps(a: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether ``a`` shares memory with any of ``others`` (matrices or vectors: same device,
    non-empty, byte ranges intersect)."""
    if a.numel() == 0:
        return False
    a0, a1 = span(a)
    for b in others:
        if b.get_device() == a.get_device() and b.device == a.device and b.numel():
            b0, b1 = span(b)
            if a0 < b1 and b0 < a1:
                return True
    return False


def same_view(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether ``x`` and ``y`` are the same matrix in memory (device, address, shape, strides)."""
    return x.device == y.device and x.data_ptr() == y.data_ptr() and x.shape == y.shape and x.stride() == y.stride()


def check_out(out: torch.Tensor, M: int, N: int, dtype: torch.dtype, what: str = "out") -> None:
    """Raise a clear error for an output the GEMM cannot write: ``[M, N]`` of ``dtype``, rows
    contiguous (row stride ``>= N``, a multiple of 16 bytes), base 16-byte aligned."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(out).__name__}")
    check_dense(out, what)
    if out.shape != (M, N) or out.dtype != dtype:
        raise ValueError(f"{what} must be a [{M}, {N}] {dtype} tensor, got {tuple(out.shape)} {out.dtype}")
    if M and N and not (M > 1 < N and N % 8 == 0 and out.is_contiguous() or _row_major(out)):
        raise ValueError(
            f"{what} must be row-major with rows a multiple of 16 bytes apart, got strides {tuple(out.stride())}"
        )
    if out.data_ptr() % 16:
        raise ValueError(f"{what} must start at a 16-byte aligned address (TMA and the compiled kernel need it)")
