"""A chain's stages one after another, each a plain GEMM: how a :class:`~ctapipelining.pipeline.Pipeline`
whose stages all share one GPU runs a call by default
(:attr:`~ctapipelining.pipeline.Pipeline.one_after_another`: faster there than the chain kernel).

Each GEMM is :func:`~ctapipelining.gemm.matmul` in its configuration for the call's rows, or
cuBLAS's (:func:`mm_into`) at the row counts where the plain GEMM's table measured cuBLAS faster
than every configuration of ours (:func:`runs_cublas`). :class:`BoundGemms` binds the GEMMs of a
checked call to the signatures of its input and output, so a repeated eager call launches them
with none of the checks.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from .gemm import GemmLaunch, matmul, plain_config, plain_launch
from .launcher import RawLaunch
from .operands import interpreting
from .tables import GEMM_TABLE, pick_config, table_flags


def runs_cublas(M: int) -> bool:
    """Whether a plain GEMM of ``M`` rows that a pipeline runs as one of its stages one after
    another (:func:`stage_gemm`) goes to cuBLAS rather than to :func:`~ctapipelining.gemm.matmul`: the plain GEMM's
    table row for ``M`` (the one :func:`~ctapipelining.gemm.plain_config` reads) measured cuBLAS faster than every
    configuration of ours (:func:`ctapipelining.tables.cublas_faster`): 193-384 and 513-768
    rows, measured at N = K = 8192 on an H200 and used for every width, as the table's tiles
    are. Never under the interpreter."""
    return not interpreting() and pick_config(table_flags(GEMM_TABLE, "cublas"), M)


CUBLAS_OUT_ALIGN = 256  # bytes: an out aligned at least this far runs cuBLAS's kernel for a fresh tensor


def stage_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` (into ``out``) as a pipeline runs its stages one after another
    (:attr:`ctapipelining.pipeline.Pipeline.one_after_another`; operands already checked there):
    cuBLAS where it measured faster for ``a``'s row count (:func:`runs_cublas`; not in
    deterministic mode, where cuBLAS may refuse), rounding as ``torch.mm`` does under torch's
    settings (``torch.backends.cuda.matmul``), else :func:`~ctapipelining.gemm.matmul` in its configuration for that
    row count."""
    if a.is_cuda and runs_cublas(a.shape[0]) and not torch.are_deterministic_algorithms_enabled():
        return mm_into(a, b, out)
    return matmul(a, b, out=out)


def mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.mm(a, b)`` into ``out`` (None: a new tensor) as a launch of ours behaves: no
    autograd graph (weights that require grad are read as they are), no autocast (``out`` keeps
    ``a``'s dtype), an ``out`` made under inference mode written as well. cuBLAS picks its kernel
    by the operands' strides and alignment, so an ``out`` that a fresh tensor's kernel could not
    write the same way (rows padded, or its address less aligned than
    :data:`CUBLAS_OUT_ALIGN`) takes the product through a fresh tensor, copied in: the result is
    bitwise the one into a new tensor."""
    M, N = a.shape[0], b.shape[1]
    direct = out is not None and out.stride() == (N, 1) and out.data_ptr() % CUBLAS_OUT_ALIGN == 0
    c = out if direct else torch.empty(M, N, dtype=a.dtype, device=a.device)
    autocast = torch.is_autocast_enabled(a.device.type)
    with torch.inference_mode(), torch.autocast(a.device.type, enabled=False) if autocast else nullcontext():
        torch.mm(a, b, out=c)
        if out is not None and not direct:
            out.copy_(c)
    return c if out is None else out


class BoundGemms:
    """:func:`stage_gemm`'s GEMMs ``x @ w_0 @ w_1 ...`` one after another (each on the previous
    one's output: :func:`~ctapipelining.gemm.matmul`'s plain launches in the configuration for ``x``'s rows, or
    cuBLAS's, :func:`runs_cublas`), bound to one signature
    (:func:`~ctapipelining.operands.signature`) of ``x`` and of the output and to one stream, after a checked call made
    them: a later eager call with that signature launches them with none of the checks it
    passed. Its intermediates (and a new output) are new each call, from the caching allocator;
    a launch's arguments are built again only where its input or output lands elsewhere than in
    the last call (the allocator mostly gives a freed block of the size back). It holds its
    launches (and so their split tails' buffers) while it lives, also past their eviction from
    :func:`~ctapipelining.gemm.matmul`'s cache. Not thread-safe: its owner calls it under a lock."""

    def __init__(self, steps: list[_BoundStep | None]):
        self._steps = steps  # per GEMM: our bound launch, or None for cuBLAS's (stage_gemm)

    @classmethod
    def of(cls, tensors: list[torch.Tensor], weights: list[torch.Tensor], stream: int) -> BoundGemms | None:
        """The GEMMs that ran ``tensors[s + 1] = tensors[s] @ weights[s]`` through
        :func:`stage_gemm` on ``stream`` (the raw handle of the device's current stream), checked
        and compiled; None where one of ours does not launch raw (:meth:`ctapipelining.gemm.GemmLaunch.bound`)."""
        steps = []
        for a, w, c in zip(tensors, weights, tensors[1:]):
            (M, K), N = a.shape, w.shape[1]
            if runs_cublas(M):
                steps.append(None)
                continue
            launch = plain_launch(M, N, K, plain_config(M), a.device, stream, None, 0)
            got = launch.bound(a, w, c)
            if got is None:
                return None
            steps.append(_BoundStep(launch, got[1], ((a.data_ptr(), c.data_ptr()), got[2])))
        return cls(steps)

    def __call__(self, x: torch.Tensor, weights: list[torch.Tensor], out: torch.Tensor | None, stream: int):
        """Launch the GEMMs on ``x`` (of the bound signature, on the current device) into ``out``
        (of the bound signature, or None: a new tensor) on ``stream``; returns the output."""
        a, last = x, len(self._steps) - 1
        for s, (step, w) in enumerate(zip(self._steps, weights)):
            shape = (a.shape[0], w.shape[1])
            c = out if s == last and out is not None else torch.empty(shape, dtype=x.dtype, device=x.device)
            if step is None:
                stage_gemm(a, w, c)
            else:
                step(a, w, c, stream)
            a = c
        return a


@dataclass(eq=False)
class _BoundStep:
    """One of our GEMMs in :class:`BoundGemms`: its launch, raw launch, and ``bound``: the input
    and output addresses of its last launch with the arguments built for them (one field, set
    at once, so the two always belong together)."""

    launch: GemmLaunch
    raw: RawLaunch
    bound: tuple[tuple[int, int], tuple]

    @property
    def at(self) -> tuple[int, int]:
        """The input and output addresses the arguments are built for."""
        return self.bound[0]

    def __call__(self, a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, stream: int) -> None:
        """Launch ``c = a @ w`` on ``stream``, its arguments built again where ``a`` or ``c`` lies
        elsewhere than the last time."""
        at = (a.data_ptr(), c.data_ptr())
        if at != self.bound[0]:
            self.bound = (at, self.launch.raw_args(self.raw.tensor_map, a, w, c))
        self.raw(self.launch.num_ctas, stream, *self.bound[1])
