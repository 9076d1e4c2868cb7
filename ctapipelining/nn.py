"""Transformer MLP blocks as ``torch.nn`` modules, their elementwise work fused into the GEMMs.

Each block is two GEMMs (the launches :func:`ctapipelining.gemm.matmul` makes, with an
:class:`~ctapipelining.epilogue.Epilogue`) and one pass over ``x`` for the norm's row
statistics; nothing else touches memory: ``x`` is read by the norm's pass (which also copies it
into the output) and by the first GEMM, the second GEMM adds its tiles onto that copy (the
residual, read once), and the intermediate ``h`` is written once and read once. The norm's weight (and bias)
is folded into the first GEMM's weight (and bias), and its epilogue applies the statistics.

- :class:`LlamaMLP`: ``y = x + W_down(silu(rmsnorm(x) @ W_gate) * (rmsnorm(x) @ W_up))``, no
  bias. The gate and up columns are interleaved in runs of 8
  (:func:`~ctapipelining.epilogue.interleave`), so the gated activation is an epilogue and
  ``h`` is half as wide as the first GEMM.
- :class:`GPTMLP`: ``y = x + W_2(gelu(layernorm(x) @ W_1 + b_1)) + b_2``. The LayerNorm is
  ``(x @ W_1' - mean * colsum(W_1')) * rstd + (beta @ W_1 + b_1)`` in the first epilogue
  (:func:`~ctapipelining.epilogue.fold_layer_norm`; where a row's mean is large next to its
  spread the subtraction cancels: the error is then about the fp32 accumulator's rounding of
  ``mean * colsum``, tested on such rows).

The weights are laid out once, at construction. A block built from ``transformers`` modules
(``from_hf``) lays them out again, in place, at the first call after a source weight changed in
place as PyTorch counts it (``w.mul_(2)``, ``w.copy_(...)``: the tensor's version moves; inside a
CUDA-graph capture it refuses instead), or was replaced by another tensor; a change PyTorch does
not count (through ``w.data``, or in an inference-mode tensor) needs :meth:`~LlamaMLP.refresh`,
and a graph replay runs no Python, so it follows nothing (call the block once, or ``refresh()``,
before replaying: the weights are laid out in place, and the graph reads the new ones). The
custom operator (below) writes none of its inputs, so inside it (a compiled model) a changed
source is refused, not followed: ``forward`` follows it before the operator when nothing traces
the call; otherwise call the block once eagerly, or ``refresh()``. What an epilogue derives from
a laid-out weight (a GPT block's column sums) follows an in-place change of that weight at the
next call. Two CUDA graphs that capture the same call of a block on one stream share its
launches' buffers (norm statistics, split tails): do not replay them at the same time on two
streams (capture such graphs on separate streams).
Under ``torch.compile``, ``torch.jit.trace``, ``torch.func`` transforms or a dispatch mode (or
for a tensor subclass, or one that asks for a gradient) ``forward`` calls the custom operator
``torch.ops.ctapipelining.mlp_block`` (``torch.library``, with a fake implementation for
shapes), so a compiled model traces through the block without a graph break (the operator
names its block by a key unique to the process: a program traced in one process and loaded in
another finds no block and says so; so a compiled graph differs from process to process, and
compilation caches kept across processes miss); an eager call runs
the kernels directly (the operator's dispatch is host time before the first kernel starts).

On the GPU each GEMM is a persistent TMA kernel; without one, the Triton interpreter runs the
same kernels on the CPU (slowly; fp16 there, since the interpreter computes bf16 dots wrongly).
Inference only: ``forward`` is not differentiable (no gradient reaches ``x`` or the weights).
Inputs with few rows (decode) run as they are: the kernels need no minimum. There is nothing to
pipeline, and the weights' bandwidth bounds the time: a block built without configurations runs
its down GEMM up to 768 rows, and its first GEMM up to 64 (a GPT block's up to 128 and at
257-384), in narrower tiles, split along K where that is measured faster
(:data:`FEW_ROWS_CONFIGS`, :data:`GPT_FEW_ROWS_CONFIGS`). At the row counts where cuBLAS's
GEMMs and the elementwise passes measured faster than the fused kernels (:data:`LLAMA_UNFUSED_ROWS`,
:data:`GPT_UNFUSED_ROWS`), such a block runs :meth:`~FusedMLP.unfused` instead: its norm, cuBLAS's
GEMMs, its activation, bias and residual as PyTorch's own operations.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import uuid
import weakref
from typing import NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .cugraph import CaptureError, StreamGraph
from .epilogue import GATE_RUN, Epilogue, column_sums, fold_layer_norm, fold_rms_weight, gelu, interleave, silu
from .gemm import MAX_CALLS, GemmLaunch, launch_checked, matmul
from .kernels.gemm import EPILOGUE_CONFIG, PIPELINE_CONFIG, RESIDUAL_CONFIG, GemmConfig, fits_loaded_residual
from .launcher import bound_stream
from .operands import check_dense, check_matrix, check_tensor, check_weight, is_dense, overlaps, signature, tma_ready

# The gate/up GEMM's tiles (a gated epilogue halves the stored tile: room for three stages), and the
# down GEMM's: the plain GEMM's too, since its residual is added onto the output by TMA (matmul);
# in a pipeline stage the epilogue loads it, and needs narrower tiles (kernels.gemm.RESIDUAL_CONFIG)
GATE_UP_CONFIG = EPILOGUE_CONFIG
DOWN_CONFIG = EPILOGUE_CONFIG
# a stack's GEMMs in one configuration, so that the stages on one GPU share a chain kernel: the down
# GEMM's tiles (its residual), the pipeline's tile order and waits in parts (LlamaStack: measured slower
# than each GEMM in its block's configuration). Wider tiles that leave room for the residual's
# (128 x 256 with K in steps of 32, 4 stages) spill registers in such a chain kernel
# (kernels.compile_check.compile_chain, sm_90)
STACK_CONFIG = dataclasses.replace(PIPELINE_CONFIG, block_n=128, num_stages=4)
# a GPT block's first GEMM stores full tiles (no gating): its bias and column sums fit beside three stages
UP_CONFIG = EPILOGUE_CONFIG


def _few(block_m: int, block_n: int, block_k: int, num_stages: int, split: bool = True) -> GemmConfig:
    """Tiles for few rows: 4 warps; ``split``: a split tail, split-K where the tiles are fewer than SMs."""
    return GemmConfig(
        block_m, block_n, block_k, group_m=8, num_stages=num_stages, num_warps=4, split_tail=split, split_k=split
    )


# Decode-sized inputs: a block built without configurations runs a call of ``M`` rows in the tiles of
# the first row (rows, first GEMM's, second GEMM's) of its class's table (FusedMLP.few_rows_configs)
# whose rows are at least ``M``: few rows, where the weights' bandwidth bounds the time and 128 x 256
# tiles leave most SMs idle (a Llama-8B block's down GEMM: 16 tiles up to 128 rows). Narrower tiles
# spread the weights over more CTAs, and ``split_k`` splits a round of fewer tiles than SMs along K.
# Measured on an H100, each GEMM alone with its epilogue against cuBLAS (benchmarks/block_tiles.py):
# per row, the configuration whose worse ratio of the two is the least. FEW_ROWS_CONFIGS: the
# Llama-8B and -70B blocks at 1, 16, 64, 128, 256, 384, 512 and 768 rows
# (benchmarks/results/2026-12-06-h100-block-decode/).
FEW_ROWS_CONFIGS = (
    (64, _few(64, 256, 64, 4), _few(64, 64, 128, 6)),
    (128, EPILOGUE_CONFIG, _few(64, 128, 64, 5)),
    (512, EPILOGUE_CONFIG, _few(64, 256, 64, 4)),
    (768, EPILOGUE_CONFIG, _few(128, 128, 64, 4)),
)
# GPT_FEW_ROWS_CONFIGS: the GPT block (hidden 4096, intermediate 16384) at 1, 16, 64, 96, 128, 256,
# 384, 512 and 768 rows on an H100 (benchmarks/results/2026-12-06-h100-gpt-tiles/, its 384-rows/)
# and at 320 rows on an H200 (benchmarks/results/2026-12-06-h200-gpt-320-rows/). Its first GEMM, not
# gated, has half the Llama-8B block's output columns: 64 tiles of 64 x 256 up to 128 rows, which
# split along K lose (1.36-1.39x cuBLAS against 1.09-1.12x whole) and 128 x 256 tiles leave idle
# (1.21x); at 321-384 rows 64 x 256 tiles make 2.9 rounds of half tiles where 128 x 256 ones make 1.45
# whole rounds (1.28x cuBLAS against 1.40x at 384 rows). Its down GEMM at 129-320 rows takes
# 64 x 128 x 128 tiles (1.02x against 1.12x at 256 rows), and at 257-320 rows its first GEMM too
# (1.39x cuBLAS against 1.44x at 320 rows).
GPT_FEW_ROWS_CONFIGS = (
    (64, _few(64, 256, 64, 4, split=False), _few(64, 64, 128, 6)),
    (128, _few(64, 256, 64, 4, split=False), _few(64, 128, 64, 5)),
    (256, EPILOGUE_CONFIG, _few(64, 128, 128, 4)),
    (320, _few(64, 128, 128, 4), _few(64, 128, 128, 4)),
    (384, _few(64, 256, 64, 4, split=False), FEW_ROWS_CONFIGS[2][2]),
    *FEW_ROWS_CONFIGS[2:],  # 385-768 rows: the Llama table's
)


# The row counts at which a block built without configurations runs unfused (FusedMLP.unfused_rows):
# where cuBLAS's GEMMs and the elementwise passes together beat the fused block in its few-rows tiles,
# graph-replayed, on an H100 and on an H200 alike (benchmarks/mlp_block.py, MLP_BLOCKS=rows; in
# benchmarks/results/: 2026-12-07-h100-unfused-rows/, 2026-12-07-h100-verify-ebf3856/rows/,
# 2026-12-07-h100-unfused-eager-e9cc858/, 2026-12-07-h200-unfused-eager-b56c075/). Unfused over fused
# at 264-320 rows: the Llama blocks 0.78-0.98x (H100) and 0.81-0.95x (H200), but the Llama-8B block
# 1.08-1.10x at 288 rows on the H100s; the GPT block 0.56-0.84x and 0.62-0.87x; at 520-640 rows the
# GPT block 0.69-0.90x and 0.75-0.91x. Not taken: the GPT block's 704 and 768 rows (0.92x and 0.98x
# on the H100, 0.99x and 1.03x on the H200); the Llama blocks' 520 rows (0.78-0.95x on both) and the
# Llama-70B block's 576 (0.91x, 0.98x), since the Llama-8B block lost at 576 and 640 rows, where its
# fused tiles are the same; and the row counts where one card gained and the other did not (1, 16 and
# 192 rows on the H200, whose few-rows tiles were chosen on the H100; the Llama-70B block at 1 row on
# the H100). Each range spans the row counts at which the fused block's tiles make as many row blocks
# as at the rows measured in it. (An eager call adds the unfused form's launches: docs/results.md.)
LLAMA_UNFUSED_ROWS = ((257, 320),)
GPT_UNFUSED_ROWS = ((257, 320), (513, 640))


_BLOCKS: weakref.WeakValueDictionary[str, FusedMLP] = weakref.WeakValueDictionary()  # the operator's blocks
_IN_OPERATOR = contextvars.ContextVar("in_operator", default=False)  # an operator's body: no writes to inputs


def _new_key(kind: str) -> str:
    """An operator key no other block or stack has, in this process or another (a program
    exported in one process and loaded in another finds no block under it, rather than another
    block that happens to share a counter's value)."""
    return f"{kind}_{uuid.uuid4().hex}"


@contextlib.contextmanager
def _operator_body():
    token = _IN_OPERATOR.set(True)
    try:
        yield
    finally:
        _IN_OPERATOR.reset(token)


def _capture_underway() -> bool:
    """Whether the current CUDA stream is being captured into a graph (where a block's own
    in-place updates would be captured, not run)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _missing(what: str, key: str) -> RuntimeError:
    return RuntimeError(
        f"no {what} {key!r} in this process (it was freed, or the program calling it was traced in another "
        "process: build the model here and trace or export it again)"
    )


@torch.library.custom_op("ctapipelining::mlp_block", mutates_args=())
def mlp_block(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, block: str) -> torch.Tensor:
    """The block ``block`` (a :class:`FusedMLP`'s key; ``w_in`` and ``w_out`` are its
    laid-out weights, passed so that a compiler sees them as inputs) on ``x`` ``[M, H]``, as
    its ``forward`` runs it."""
    mlp = _BLOCKS.get(block)
    if mlp is None:
        raise _missing("fused MLP block", block)
    with _operator_body():  # its schema mutates nothing: a moved source is refused, not followed
        return mlp._run(_tma_rows(x), w_in, w_out)


@mlp_block.register_fake
def _(x, w_in, w_out, block):
    return torch.empty_like(x)


def _no_backward(ctx, grad):
    raise RuntimeError(
        "the fused MLP blocks are inference only: no gradient flows through ctapipelining.mlp_block (run and "
        "compile models that hold them under torch.no_grad() or torch.inference_mode())"
    )


mlp_block.register_autograd(_no_backward)


def _tma_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (contiguous), or a copy of them where they start at an address TMA cannot read
    from (not 16-byte aligned)."""
    return rows if rows.data_ptr() % 16 == 0 else rows.clone()


def _direct(x: torch.Tensor) -> bool:
    """Whether a call on ``x`` runs the kernels directly rather than through its custom operator:
    a plain tensor, with no gradient asked of it, and nothing that records or transforms the
    call (``torch.compile`` and export, ``torch.jit.trace``, ``torch.func`` transforms such as
    ``vmap``, a dispatch mode such as ``make_fx``'s). The operator's dispatch costs more host
    time than a kernel launch, and an eager call waits for it before its first kernel starts;
    whatever records or transforms the call must see the operator (a trace of the launches
    would hold only the torch ops around them), a fake tensor needs its fake implementation,
    and a gradient its refusal."""
    return type(x) is torch.Tensor and not (x.requires_grad and torch.is_grad_enabled()) and not _tracing()


def _tracing() -> bool:
    """Whether something records or transforms the calls now (:func:`_direct`)."""
    return (
        torch.compiler.is_compiling()  # (first: under Dynamo, nothing after it is traced)
        or torch._C._is_tracing()  # torch.jit.is_tracing()
        or torch._C._are_functorch_transforms_active()
        or torch._C._len_torch_dispatch_stack() > 0  # a dispatch mode (_python_dispatch._get_current_dispatch_mode)
    )


def _checked_ranges(ranges) -> tuple[tuple[int, int], ...]:
    """``ranges`` as a tuple of ``(lo, hi)`` row counts, ``0 < lo <= hi``, in order and apart;
    anything else refused by name."""
    try:
        out = tuple((lo, hi) for lo, hi in ranges)
    except (TypeError, ValueError):
        out = None
    if out is None or not all(
        type(lo) is int and type(hi) is int and 0 < lo <= hi for lo, hi in out
    ) or any(a[1] >= b[0] for a, b in zip(out, out[1:])):  # fmt: skip
        raise ValueError(f"unfused_rows must be (lo, hi) row counts, 0 < lo <= hi, in order and apart; got {ranges!r}")
    return out


def _check_eps(eps, name: str = "eps") -> None:
    if not (isinstance(eps, float) and eps > 0):
        raise ValueError(f"{name} must be a float > 0, got {eps!r}")


def _check_input(x, hidden: int, weight: torch.Tensor, what: str = "the block") -> None:
    """Refuse, by name, an ``x`` a block or stack of width ``hidden`` cannot take: not a dense
    tensor (a nested one has no shape to read), not ``[..., hidden]``, or not of ``weight``'s
    dtype and device (``what``'s)."""
    if isinstance(x, torch.Tensor):
        check_dense(x, "x")
    if not isinstance(x, torch.Tensor) or x.shape[-1:] != (hidden,):
        raise ValueError(f"x must be [..., {hidden}], got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype != weight.dtype or x.device != weight.device:
        raise ValueError(f"x is {x.dtype} on {x.device}; {what} is {weight.dtype} on {weight.device}")


_PLAIN_LOOKUP: dict[tuple[type, str], bool] = {}  # (class, name): whether _attr may read the module's dicts


def _attr(module: torch.nn.Module, name: str):
    """``getattr(module, name)``, read straight from the module's parameters, buffers or
    submodules where ``torch.nn.Module.__getattr__`` would find it there: its class overrides
    neither ``__getattr__`` nor ``__getattribute__`` and defines no attribute of that name (as of
    the first lookup), and the instance's ``__dict__`` lacks it. A block built from modules reads
    their weights at every call, and ``__getattr__`` costs about a microsecond a name."""
    cls = type(module)
    plain = _PLAIN_LOOKUP.get((cls, name))
    if plain is None:
        if len(_PLAIN_LOOKUP) >= 1024:  # (classes made per module, as parametrizations make them)
            _PLAIN_LOOKUP.clear()
        plain = _PLAIN_LOOKUP[cls, name] = (
            cls.__getattr__ is torch.nn.Module.__getattr__
            and cls.__getattribute__ is object.__getattribute__
            and not any(name in k.__dict__ for k in cls.__mro__)
        )
    if plain and name not in module.__dict__:
        d = module.__dict__
        for store in ("_parameters", "_buffers", "_modules"):
            held = d.get(store)
            if held is not None and name in held:
                return held[name]
    return getattr(module, name)


def _room_for(bound: dict, key, limit: int = MAX_CALLS) -> dict:
    """``bound`` (a block's calls by key: a :class:`_BoundCall`, or None for a call seen once),
    or a copy of it without one entry where it holds ``limit`` entries and not ``key``: the
    oldest seen once, else the oldest bound, so that calls which never repeat do not push the
    bound ones out."""
    if key in bound or len(bound) < limit:
        return bound
    items = list(bound.items())
    drop = next((k for k, v in items if v is None), items[0][0])
    return {k: v for k, v in items if k != drop}


class _BoundCall(NamedTuple):
    """A block's common call, as its two launches ran it (:meth:`GemmLaunch.steps`): the next
    call on rows of the same signature, on the same stream, whose intermediate and output land
    at the same addresses, launches the same arguments, as one CUDA graph of them where it
    could be captured (:class:`~ctapipelining.cugraph.StreamGraph`; None: launched one by one).
    It holds its launches, so their buffers (norm statistics, split tails) outlive their
    eviction from the launch cache."""

    first: GemmLaunch
    first_steps: tuple
    second: GemmLaunch
    second_steps: tuple
    graph: StreamGraph | None

    def launch(self, stream: int) -> None:
        """The call's launches on ``stream``, one by one."""
        self.first.relaunch(self.first_steps, stream)
        self.second.relaunch(self.second_steps, stream)

    def run(self, stream: int) -> None:
        """The call on ``stream``: its graph replayed (under the launches' locks, as each one's
        norm pass and kernel are queued), or its launches one by one."""
        if self.graph is None:
            self.launch(stream)
        else:
            with self.first.lock, self.second.lock:
                self.graph.replay(stream)

    @classmethod
    def of(cls, first: GemmLaunch, first_steps: tuple, second: GemmLaunch, second_steps: tuple, stream: int):
        """The call, its graph captured (to replay on ``stream``) unless the capture fails."""
        call = cls(first, first_steps, second, second_steps, None)
        try:
            return call._replace(graph=StreamGraph(call.launch, stream))
        except CaptureError:
            return call


class _LastCall(NamedTuple):
    """A block's bound call last bound or looked up by ``forward`` (:meth:`FusedMLP._replay`):
    its key in the block's bound calls (rows' signature, stream, addresses of h and y), the
    signature of the tensor ``forward`` took (the rows, or a contiguous tensor of more dims whose
    bytes they are), the bytes of h per row, the call, and the storages of the weights it reads
    (held, so that another thread's replacement of a weight, or of its ``.data``, cannot free
    them before a replay is queued; the call's launches hold the epilogues' vectors)."""

    key: tuple
    entry: tuple
    h_row_bytes: int
    call: _BoundCall
    storages: tuple

    @classmethod
    def of(cls, key: tuple, entry: tuple, h: torch.Tensor, call: _BoundCall, w_in, w_out) -> _LastCall:
        return cls(key, entry, h.stride(0) * h.element_size(), call, (w_in.untyped_storage(), w_out.untyped_storage()))


class FusedMLP(torch.nn.Module):
    """What the blocks share: the weights ``w_in`` ``[H, N_in]`` and ``w_out`` ``[I, H]`` as
    laid out for the kernels and the epilogues' vectors (buffers: ``.to()`` moves them), the
    configurations, the operator key. Subclasses lay the weights out (:meth:`_laid_out`) and
    say what each GEMM's epilogue does (:meth:`_make_epilogues`)."""

    hidden: int
    _norm_kind: str  # what a source norm computes: "rms" or "layer" (_check_norm)
    _norm_unchecked = False  # a source norm on the meta device, probed at refresh (a block pickled before this field)
    _defaults = (None, None)  # the GEMMs left to their default configuration: that default (configs_for)
    _config_defaults = (GATE_UP_CONFIG, DOWN_CONFIG)  # each GEMM's configuration where none is given
    # each GEMM's tiles at few rows, where left to its default (configs_for): the class's measured table
    few_rows_configs = FEW_ROWS_CONFIGS
    # the row counts (inclusive ranges) at which a block with both GEMMs left to their defaults runs
    # unfused (:meth:`unfused`): the class's measured table (a block may set its own, __setattr__)
    unfused_rows: tuple[tuple[int, int], ...] = ()
    w_in: torch.Tensor
    w_out: torch.Tensor

    def __init__(
        self,
        in_config: GemmConfig | None,
        out_config: GemmConfig | None,
        names=("in_config", "out_config"),
    ):
        for name, cfg in zip(names, (in_config, out_config)):  # (names: the subclass's keywords)
            if not (cfg is None or isinstance(cfg, GemmConfig)):
                raise TypeError(
                    f"{name} must be a ctapipelining.kernels.gemm.GemmConfig or None, got {type(cfg).__name__}"
                )
        super().__init__()
        # a GEMM given no configuration: its default (_config_defaults), and few_rows_configs' tiles
        # at few rows (configs_for) until it is given one (__setattr__ records which)
        self._defaults = (None, None)
        self.in_config, self.out_config = in_config, out_config
        self._source = None  # the modules it was built from (from_hf), and their weights' versions
        self._source_versions = None
        self._norm_unchecked = False  # a source norm on the meta device, probed at refresh (_check_norm)
        self._epi = None  # (the buffers' addresses, first epilogue, second): rebuilt when they move
        self._derived = None  # the buffers' versions the epilogues' derived tensors follow (_buffer_versions)
        # the common call's launches, by rows' signature, stream and the addresses of h and y
        # (None: seen once, not bound yet)
        self._bound: dict[tuple, _BoundCall | None] = {}
        self._last: _LastCall | None = None  # the one forward tries first (_replay)
        self._bound_under = self._tables()  # the tables the calls bound were chosen under (_bound_calls)
        self._register()

    def _register(self) -> None:
        """Give this block its own key in the operator's registry."""
        self._key = _new_key("mlp_block")
        _BLOCKS[self._key] = self

    def __getstate__(self) -> dict:  # the epilogues are rebuilt from the buffers (they hold jit functions)
        self._follow_source()  # the copy starts in step with its source
        # (weak references, and launches bound to this process's GPU buffers: not copied)
        return {**self.__dict__, "_epi": None, "_source_versions": None, "_bound": {}, "_last": None}

    def _apply(self, fn, recurse=True):
        # the buffers moved or cast (``.to()``, ``.cpu()``, ``.half()``): what was built on the
        # old ones, and the last call holding their memory, go now rather than at the next call
        self._epi, self._derived, self._bound, self._last = None, None, {}, None
        return super()._apply(fn, recurse)

    def __setstate__(self, state) -> None:  # a copy (deepcopy, pickle) runs its own weights
        super().__setstate__(state)
        self._bound, self._last = {}, None  # (a state may lack them: a block pickled without bound calls)
        self._bound_under = self._tables()
        if self._source is not None:  # its own copy of the source, whose versions start anew
            self._source_versions = self._versions()
        self._register()

    def _set_weights(self, **tensors: torch.Tensor | None) -> None:
        """Set the laid-out weights and vectors (buffers). Once set, they are overwritten in
        place (:meth:`refresh`), so a CUDA graph that captured the block reads the new values;
        a source whose shape, dtype or device changed needs a new block."""
        check_tensor(tensors["w_in"], f"{type(self).__name__}: first weight")
        check_tensor(tensors["w_out"], f"{type(self).__name__}: second weight")
        have = self._check_weights(tensors)  # every check before any copy: a refused refresh changes nothing
        for name, t in tensors.items():
            old = have.get(name)
            if name not in have:
                self.register_buffer(name, t, persistent=False)
            elif old is not None:
                with torch.inference_mode() if old.is_inference() else torch.no_grad():
                    old.copy_(t)
        if self._epi is not None:  # in place too: a captured graph holds these epilogues
            self._update_epilogues(*self._epi[1:])
            self._derived = self._buffer_versions()

    def _check_weights(self, tensors: dict, device: torch.device | None = None) -> dict:
        """Refuse laid-out ``tensors`` that cannot be copied into the ones already set (a
        source whose shape, dtype or device changed), each on ``device`` if given (laid out on
        the meta device: :meth:`_checked_source`). Returns those already set: buffers, or
        parameters they were reassigned as."""
        have = {name: d[name] for name in tensors for d in (self._buffers, self._parameters) if name in d}
        for name, t in tensors.items():
            old = have.get(name)
            if name in have and (
                (old is None) != (t is None) or old is not None and (old.shape, old.dtype, old.device) != (
                    t.shape, t.dtype, device or t.device
                )
            ):  # fmt: skip
                raise ValueError(
                    f"{type(self).__name__}.refresh: the source's {name} changed shape, dtype or device; "
                    "build a new block"
                )
        return have

    def __setattr__(self, name: str, value) -> None:
        """``in_config`` and ``out_config`` are set as at construction: a :class:`GemmConfig`, run
        at every row count, or None for the GEMM's default (with :attr:`few_rows_configs`' tiles
        at few rows). :attr:`few_rows_configs` is the class's measured table, not set per block
        (give a GEMM a configuration instead). :attr:`unfused_rows` may be set per block (``()``:
        the fused kernels at every row count). The calls a block bound go when any of these is
        set, or a class's table is replaced (:meth:`_epilogues`, :meth:`_bound_calls`)."""
        if name == "few_rows_configs":
            raise AttributeError(
                "few_rows_configs is the block class's measured table: set in_config or out_config to run other tiles"
            )
        if name == "unfused_rows":  # this block's own ranges (``()``: fused at every row count)
            value = _checked_ranges(value)
            if value and type(self)._unfused_first is FusedMLP._unfused_first:
                raise ValueError(f"{type(self).__name__} has no unfused form (_unfused_first)")
        if name in ("in_config", "out_config"):
            if not (value is None or isinstance(value, GemmConfig)):
                raise TypeError(
                    f"{name} must be a ctapipelining.kernels.gemm.GemmConfig or None, got {type(value).__name__}"
                )
            i = int(name == "out_config")
            if value is None:  # the default, marked as such (configs_for)
                value = default = self._config_defaults[i]
            else:
                default = None
            self._defaults = tuple(default if j == i else d for j, d in enumerate(self._defaults))
        elif name == "eps":
            _check_eps(value)
            source = self.__dict__.get("_source")
            norms = None if source is None else self._source_eps(source[1])
            if norms is not None and value != norms:
                raise ValueError(f"this block follows its source norm's epsilon ({norms!r}): set the norm's instead")
        super().__setattr__(name, value)

    def configs_for(self, M: int) -> tuple[GemmConfig, GemmConfig]:
        """Each GEMM's configuration for a call on ``M`` rows: ``in_config`` and ``out_config``,
        except for a GEMM left to its default (given None, at construction or since): that one
        takes the tiles of :attr:`few_rows_configs`' first row of at least ``M`` rows, if any.
        (To run the default's tiles at every row count, set it: ``block.in_config =
        nn.GATE_UP_CONFIG``.)"""
        configs = [self.in_config, self.out_config]
        row = next((r for r in self.few_rows_configs if M <= r[0]), None)
        if row is not None:
            for i, default in enumerate(self._defaults):
                if default is not None:
                    configs[i] = row[1 + i]
        return configs[0], configs[1]

    def runs_unfused(self, M: int) -> bool:
        """Whether ``forward`` runs :meth:`unfused` on ``M`` rows: at the row counts of the
        class's :attr:`unfused_rows`, where both GEMMs are left to their defaults. (:meth:`run`,
        and a stack that pipelines its blocks, run the fused kernels at every row count.)"""
        return None not in self._defaults and any(lo <= M <= hi for lo, hi in self.unfused_rows)

    def _tables(self) -> tuple:
        """The tables that choose a call's tiles and path besides its configurations (which the
        epilogues' key follows, :meth:`_epilogues`): :attr:`few_rows_configs` and
        :attr:`unfused_rows`, the block's own or its class's, which a caller may replace."""
        return self.few_rows_configs, self.unfused_rows

    def _bound_calls(self) -> dict:
        """The bound calls, dropped first (with the last call) if a table that chose them was
        set or replaced since (:meth:`_tables`, compared by identity): a call runs in the tiles
        and on the path the tables choose now."""
        under = self._bound_under
        if under[0] is not self.few_rows_configs or under[1] is not self.unfused_rows:
            self._bound, self._last, self._bound_under = {}, None, self._tables()
        return self._bound

    def unfused(self, x: torch.Tensor) -> torch.Tensor:
        """The block on ``x`` ``[..., H]`` in PyTorch's own operations: the norm, cuBLAS's GEMMs
        on the laid-out weights, the activation, the bias and the residual as passes of their
        own (inference only: no gradient). It rounds the normalised rows and the first GEMM's
        output with its bias, as the unfused module does, then the second GEMM's output with the
        residual (cuBLAS's ``C``), and then, for a GPT block, its sum with the bias (the module
        rounds the GEMM's output with the bias first: tested within the same bound against
        ``transformers``' block). So it equals the fused block within a rounding, not bitwise.
        ``forward`` runs it where :meth:`runs_unfused` says: at those rows cuBLAS's GEMMs and
        the passes measured faster than the fused kernels. A subclass that runs it defines
        :meth:`_unfused_first` and its own :attr:`unfused_rows`."""
        _check_input(x, self.hidden, self.w_out)
        self._follow_source()
        self._epilogues()  # the weights' checks
        with torch.no_grad():
            return self._unfused(x.reshape(-1, self.hidden)).reshape(x.shape)

    def _unfused(self, rows: torch.Tensor) -> torch.Tensor:
        """:meth:`unfused` on checked ``rows`` ``[M, H]``: the first GEMM with its norm and
        activation (:meth:`_unfused_first`), then the second with the residual as cuBLAS's
        ``C``, then its bias."""
        y = torch.addmm(rows, self._unfused_first(rows), self.w_out)
        bias = getattr(self, "b_out", None)
        return y if bias is None else y.add_(bias)

    def _unfused_first(self, rows: torch.Tensor) -> torch.Tensor:
        """The intermediate ``h`` of checked ``rows``, unfused (the subclasses know their norm and
        activation)."""
        raise NotImplementedError(f"{type(self).__name__} has no unfused form (_unfused_first)")

    def _derives(self) -> bool:
        """Whether an epilogue derives something from the laid-out weights (:meth:`_update_epilogues`)."""
        return type(self)._update_epilogues is not FusedMLP._update_epilogues

    def _buffer_versions(self) -> tuple | None:
        """The laid-out buffers' version counters, where an epilogue derives something from them
        (:meth:`_update_epilogues`; None where none does, or a buffer is an inference tensor)."""
        if not self._derives():
            return None
        # (a weight reassigned as a parameter too, as _epilogues reads it)
        ts = [t for t in (*self._buffers.values(), *self._parameters.values()) if t is not None]
        return None if any(t.is_inference() for t in ts) else tuple(t._version for t in ts)

    def _update_epilogues(self, first: Epilogue, second: Epilogue) -> None:
        """Bring what the epilogues derive from the weights up to date, in place (nothing here)."""

    @staticmethod
    def _check_module(mlp: torch.nn.Module) -> None:
        """Refuse a source MLP module that does not compute what the block does, at build and at
        refresh (nothing here: the subclasses know their modules)."""

    def _epilogues(self) -> tuple[Epilogue, Epilogue]:
        """Each GEMM's epilogue, bound to the buffers where they are now (built once per place:
        a launch is compiled and cached per epilogue). Whenever a buffer's signature (address,
        shape, strides, dtype, device), a configuration (or whether it is left to its default) or
        ``eps`` changes, the weights and epilogues are checked again, as
        :func:`~ctapipelining.gemm.matmul` checks them at each call: ``_run``'s own call relies on
        it."""
        tensors = (*self._buffers.values(), *self._parameters.values())  # (a weight reassigned as a parameter)
        # (a list, not a generator: Python 3.12 runs it inline, and every call of a block makes this key;
        # a buffer that is not dense has no signature: checked, and refused, below)
        signed = [signature(t) if is_dense(t) else None for t in tensors if t is not None]
        # (the configurations kept as defaults too: configs_for gives them few rows' tiles)
        key = (*signed, self.in_config, self.out_config, self._defaults, self.eps)
        if self._epi is None or self._epi[0] != key:
            w_in, w_out, name = self.w_in, self.w_out, type(self).__name__
            check_weight(w_in, f"{name}: first weight")
            check_weight(w_out, f"{name}: second weight")
            first, second = self._make_epilogues()
            if (
                w_in.shape[0] != self.hidden
                or w_out.shape != (first.out_cols(w_in.shape[1]), self.hidden)
                or (w_in.dtype, w_in.device) != (w_out.dtype, w_out.device)
            ):
                raise ValueError(
                    f"{name}: weights {tuple(w_in.shape)} {w_in.dtype} on {w_in.device} and {tuple(w_out.shape)} "
                    f"{w_out.dtype} on {w_out.device} do not make a block of hidden size {self.hidden}"
                )
            # (few_rows_configs' tiles are multiples of 16 wide, as every epilogue can close)
            first.check(w_in.shape[1], w_in.dtype, w_in.device, self.in_config.block_n)
            second.check(w_out.shape[1], w_out.dtype, w_out.device, self.out_config.block_n)
            self._epi = (key, first, second)
            self._bound, self._last = {}, None  # launches bound to the epilogues replaced
            self._derived = self._buffer_versions()
        elif self._derived is not None and self._buffer_versions() != self._derived:
            # a laid-out buffer changed in place (``block.w_in.mul_(2)``): what the epilogues
            # derive from it (a GPT block's column sums) follows, in place
            if _capture_underway():
                raise RuntimeError(
                    "the block's laid-out weights changed in place since its epilogues were derived from them: "
                    "call the block once outside the CUDA-graph capture"
                )
            self._update_epilogues(*self._epi[1:])
            self._derived = self._buffer_versions()
        return self._epi[1], self._epi[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        direct = _direct(x)
        if direct:
            y = self._replay(x)
            if y is not None:
                return y
        w_in, w_out = self.w_in, self.w_out  # (read once: the weights checked are the ones run)
        _check_input(x, self.hidden, w_out)
        flat = x.dim() == 2 and x.stride() == (self.hidden, 1)  # already the rows the kernels take
        rows = x if flat else x.reshape(-1, self.hidden).contiguous()
        if direct:  # (a contiguous x's rows are a view of its bytes: a later call on them is x's)
            run = _tma_rows(rows)
            entry = signature(x) if run is rows and (flat or x.is_contiguous()) else None
            y = self._run(run, w_in, w_out, fits=True, entry=entry)
            return y if flat else y.reshape(x.shape)
        if not _tracing():  # here, not in the operator, which writes none of its inputs
            self._follow_source()
        return mlp_block(rows, w_in, w_out, self._key).reshape(x.shape)

    def _replay(self, x: torch.Tensor) -> torch.Tensor | None:
        """The block's last bound call (:class:`_LastCall`) run again on ``x``, if it is that
        call: ``x`` of the same signature as that call's (so it passes the checks that one
        passed: ``forward`` makes none of its own first), on the same device and stream,
        outside any capture and launch hooks, with the epilogues the call was bound to (the
        weights where they were, ``_epilogues``), and the new y and h landing at its
        addresses. Else None, neither GEMM launched: the caller takes the checked path, which
        looks up the other bound calls. Its host time comes before the first kernel starts, so
        it makes as few calls as it can: h, which no one sees, is raw memory of PyTorch's
        caching allocator (the block a tensor of h's size would get), given back once the call
        is queued, as h's tensor would be (stream-ordered: only work queued after the call
        reuses it)."""
        self._bound_calls()  # (drops a last call bound under other tiles or ranges)
        last = self._last
        if last is None or not is_dense(x) or signature(x) != last.entry:
            return None  # (a tensor that is not dense has no signature: forward refuses it by name)
        stream = last.key[1]
        if bound_stream(last.key[0][4]) != stream:
            return None
        if self._source is not None:
            self._follow_source()
        first, second = self._epilogues()
        call = last.call
        if call.first.epilogue is not first or call.second.epilogue is not second:
            return None
        # (x is contiguous, so y is the rows' output in x's shape; saying so spares the layout's inference)
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
        h = torch._C._cuda_cudaCachingAllocator_raw_alloc(last.key[0][1][0] * last.h_row_bytes, stream)
        try:
            if (h, y.data_ptr()) != last.key[2:]:
                return None
            call.run(stream)
        finally:
            torch._C._cuda_cudaCachingAllocator_raw_delete(h)
        return y

    def first_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """The first GEMM alone, its epilogue included: what the second GEMM reads (``x``
        ``[M, H]``)."""
        self._follow_source()
        return matmul(x, self.w_in, config=self.configs_for(x.shape[0])[0], epilogue=self._epilogues()[0])

    def run(self, rows: torch.Tensor, out: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
        """The block on ``rows`` ``[M, H]`` (a row-major matrix on the block's device) into
        ``out`` (``[M, H]``, row-major without padded rows, overlapping nothing the block reads),
        without the custom operator: for a schedule that places its rows itself (micro-batching a
        stack over GPUs, :class:`ctapipelining.baselines.MicroBatch`). ``h``: where the first GEMM
        writes the intermediate (``[M, I]``; default a new tensor), for a schedule captured in a
        CUDA graph on another GPU's stream, whose own allocations would not be the graph's."""
        for name, t in (("rows", rows), ("out", out), ("h", h)):
            if t is not None or name == "rows":
                check_matrix(t, name)
        return self._run(rows, self.w_in, self.w_out, out, h)

    def _run(
        self,
        rows: torch.Tensor,
        w_in: torch.Tensor,
        w_out: torch.Tensor,
        out: torch.Tensor | None = None,
        h: torch.Tensor | None = None,
        fits: bool = False,
        entry: tuple | None = None,
    ) -> torch.Tensor:
        """The two fused GEMMs on ``rows`` ``[M, H]`` (the operator's body), into ``out`` (default
        a new tensor), the intermediate into ``h`` (default a new tensor); or, for a call on the
        block's own weights into tensors of its own, :meth:`unfused` where
        :meth:`runs_unfused` says. The first GEMM's norm
        pass, which reads the rows anyway, also copies them into the output, and the second adds
        its tiles onto them there: the residual is read once. ``fits``: the caller checked that
        the rows are of the block's width, dtype and device (:meth:`forward` does). ``entry``:
        the signature of the tensor ``forward`` took, whose bytes the rows are: a bound call then
        becomes the block's last (:meth:`_replay`)."""
        self._follow_source()
        first, second = self._epilogues()
        own = out is None and h is None and w_in is self.w_in and w_out is self.w_out
        fits = fits or (rows.shape[1:] == (self.hidden,) and (rows.dtype, rows.device) == (w_in.dtype, w_in.device))
        if own and fits and self.runs_unfused(rows.shape[0]):
            return self._unfused(rows)
        if own and fits and rows.shape[0] and tma_ready(rows):
            # the common call: rows TMA-ready and of the block's width, dtype and device, the
            # weights and epilogues checked (``_epilogues``), the intermediate and output new (so
            # they overlap nothing): none of matmul's checks is left to make, and the first
            # kernel starts sooner. Any other call goes through matmul's checks.
            y = torch.empty_like(rows)
            h = torch.empty(rows.shape[0], first.out_cols(w_in.shape[1]), dtype=rows.dtype, device=rows.device)
            stream = bound_stream(rows.device.index) if rows.is_cuda else None
            bind = stream is not None
            if bind:  # the launches of an earlier call on these rows whose h and y landed where these did
                key = (signature(rows), stream, h.data_ptr(), y.data_ptr())
                got = self._bound_calls().get(key)
                # (the epilogues' identity: a call that began before another thread replaced a
                # weight may have bound launches of the old ones after the rebuild)
                if got is not None and got.first.epilogue is first and got.second.epilogue is second:
                    got.run(stream)
                    if entry is not None:
                        self._last = _LastCall.of(key, entry, h, got, w_in, w_out)
                    return y
            in_config, out_config = self.configs_for(rows.shape[0])
            first_launch = launch_checked(rows, w_in, h, in_config, first, a_copy=y)
            second_launch = launch_checked(h, w_out, y, out_config, second, residual=y)
            if bind:
                # bound at its second sighting (None: seen once): a caller whose calls never
                # repeat one (it keeps its outputs, its row counts change) looks up no steps
                # and captures no graph
                seen, bound = key in self._bound, _room_for(self._bound, key)
                bound[key] = None
                if seen:
                    steps = first_launch.steps(rows, w_in, h, a_copy=y), second_launch.steps(h, w_out, y, residual=y)
                    if None not in steps:  # both launched raw
                        call = bound[key] = _BoundCall.of(first_launch, steps[0], second_launch, steps[1], stream)
                        if entry is not None:
                            self._last = _LastCall.of(key, entry, h, call, w_in, w_out)
                self._bound = bound
                last = self._last
                if last is not None and last.key not in bound:  # evicted (_room_for)
                    self._last = None
            return y
        # what the second GEMM reads besides its input: out and h must overlap none of it, refused
        # before the first GEMM writes
        read = [t for t in (w_out, None if second.bias is None else second.bias.view(1, -1)) if t is not None]
        if out is not None:  # what the second GEMM would refuse, refused before the first writes
            if (
                out.shape != rows.shape
                or (out.dtype, out.device) != (rows.dtype, rows.device)
                or not out.is_contiguous()
            ):
                raise ValueError(
                    f"out must be a contiguous {list(rows.shape)} {rows.dtype} tensor on {rows.device} (the "
                    f"residual is added onto it in place), got {list(out.shape)} {out.dtype} on {out.device}"
                )
            if overlaps(out, *([] if h is None else [h]), *read):
                raise ValueError("out shares memory with h or the second GEMM's weight or bias")
        if h is not None:  # the second GEMM's input: what it would refuse, refused before the first writes
            check_tensor(h, "h")
            want = (rows.shape[0], first.out_cols(w_in.shape[1]))
            if h.shape != want or (h.dtype, h.device) != (rows.dtype, rows.device):
                raise ValueError(f"h must be a {list(want)} {rows.dtype} tensor on {rows.device}, "
                                 f"got {list(h.shape)} {h.dtype} on {h.device}")  # fmt: skip
            if overlaps(h, *read):
                raise ValueError("h shares memory with the second GEMM's weight or bias")
        y = torch.empty_like(rows) if out is None else out
        in_config, out_config = self.configs_for(rows.shape[0])
        h = matmul(rows, w_in, out=h, config=in_config, epilogue=first, a_copy=y)
        return matmul(h, w_out, out=y, config=out_config, epilogue=second, residual=y)

    def pipeline_stages(self) -> tuple[list[torch.Tensor], list[GemmConfig], list[Epilogue]]:
        """The block as two stages of a pipeline (:class:`~ctapipelining.pipeline.Pipeline`,
        :class:`~ctapipelining.distributed.DistributedPipeline`): its laid-out weights, their
        configurations and epilogues. The second GEMM loads its residual in its epilogue there
        (the first stage's input), so where its configuration leaves no shared memory for the
        residual's tile (the default :data:`DOWN_CONFIG`'s) it runs in
        :data:`~ctapipelining.kernels.gemm.RESIDUAL_CONFIG`. The weights are the block's own:
        :meth:`refresh` updates them in place. The epilogues hold the norm's epsilon as it is now:
        a pipeline built from them keeps it (build another after the epsilon changes)."""
        self._follow_source()
        out_config = self.out_config if fits_loaded_residual(self.out_config) else RESIDUAL_CONFIG
        return [self.w_in, self.w_out], [self.in_config, out_config], list(self._epilogues())

    def refresh(self) -> None:
        """Lay the weights out again from the module this block was built from, and read its norm's
        epsilon again (a call does both by itself after an in-place change PyTorch counts or a new
        epsilon; this is for a change it does not see, such as through ``w.data``). In place, so a
        CUDA graph that captured the block runs the new weights. Refused, it changes nothing."""
        self._renew(*self._checked_source())

    def _checked_source(self) -> tuple[float, bool]:
        """Every check :meth:`refresh` makes, before it changes anything: the source norm's
        epsilon and form, and the weights it lays out, laid out on the meta device (shapes and
        dtypes) from sources on the block's device. Returns the epsilon and whether the norm
        still waits for its probe (:meth:`_renew` takes them)."""
        if self._source is None:
            raise RuntimeError("this block was built from tensors: build a new one instead")
        mlp, norm = self._source
        self._check_module(mlp)
        eps, unchecked, w = self._source_eps(norm), self._norm_unchecked, getattr(norm, "weight", None)
        _check_eps(eps, "the source norm's epsilon")
        # probed (unchecked: built on the meta device, probed once real) unless its weight changed
        # shape, which the layout's check below refuses by name; a norm without a weight is refused
        if not isinstance(w, torch.Tensor) or ((unchecked or eps != self.eps) and w.shape == (self.hidden,)):
            unchecked = not _check_norm(norm, self._norm_kind, eps)
        weights = self._source_weights()
        devices = {t.device for t in weights if t is not None}
        if len(devices) != 1:
            raise ValueError(f"{type(self).__name__}.refresh: the source's weights lie on {len(devices)} devices")
        meta = [None if t is None else t.detach().to("meta") for t in weights]
        self._check_weights(self._laid_out(*meta), devices.pop())
        return eps, unchecked

    def _renew(self, eps: float, unchecked: bool) -> None:
        """:meth:`refresh` after :meth:`_checked_source`: the weights laid out again in place."""
        self._set_weights(**self._laid_out(*self._source_weights()))
        self.eps, self._norm_unchecked = eps, unchecked
        self._source_versions = self._versions()

    def _versions(self) -> tuple:
        """Each source weight's storage (held weakly: a storage freed and another allocated at
        its address is not taken for it), address and version counter (PyTorch moves it at each
        in-place change; an inference-mode tensor has none: only its replacement is seen)."""
        return tuple(
            (StorageWeakRef(t.untyped_storage()), t.data_ptr(), None if t.is_inference() else t._version)
            for t in self._source_tensors()
            if t is not None
        )

    def _source_tensors(self) -> tuple:
        """The source module's own tensors whose changes :meth:`_versions` follows: its
        parameters themselves, never views of them (a view made inside a compiled region's
        runtime does not share its base's version counter)."""
        return self._source_weights()

    def _source_moved(self) -> bool:
        if self._source is None:
            return False
        now, then = [t for t in self._source_tensors() if t is not None], self._source_versions
        return len(now) != len(then) or self._source_eps(self._source[1]) != self.eps or any(
            t.data_ptr() != ptr
            or (None if t.is_inference() else t._version) != version
            or ref.expired()
            or ref.cdata != t.untyped_storage()._cdata
            for t, (ref, ptr, version) in zip(now, then)
        )

    def _follow_source(self) -> None:
        """Lay the weights out again if a source weight was replaced or changed in place since
        (its version moved), or the source norm's epsilon changed; inside a CUDA-graph capture
        or the custom operator, refuse instead (the copy would be captured, not run; the
        operator writes none of its inputs)."""
        if not self._source_moved():
            return
        if _IN_OPERATOR.get() or _capture_underway():
            raise RuntimeError(
                "a weight or the norm's epsilon of the block's source module changed since it was laid out: call "
                "the block once eagerly outside any CUDA-graph capture or compiled region (or refresh()) to lay it "
                "out again"
            )
        self.refresh()

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, intermediate={self.intermediate}, eps={self.eps}"


def _matrix_shape(w) -> tuple[int, int]:
    """A block's first weight's shape, or ``(0, 0)`` for what is not a dense matrix (which
    :func:`_check_block` then refuses by name)."""
    return tuple(w.shape) if isinstance(w, torch.Tensor) and is_dense(w) and w.dim() == 2 else (0, 0)


def _check_block(ws: dict, shapes: dict, optional: tuple[str, ...] = ()) -> None:
    """Dense tensors of the ``shapes`` (by name; the ``optional`` ones may be None), of one dtype
    on one device."""
    for name, t in ws.items():
        if not isinstance(t, torch.Tensor) and not (t is None and name in optional):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t is not None:
            check_dense(t, name)
    got = {n: tuple(t.shape) for n, t in ws.items() if t is not None}
    if got != {n: s for n, s in shapes.items() if n in got}:
        raise ValueError(f"shapes do not make a block: {got} (want {shapes})")
    present = [t for t in ws.values() if t is not None]
    if len({t.dtype for t in present}) != 1 or len({t.device for t in present}) != 1:
        raise ValueError("the block's weights must share one dtype and one device")


def _check_norm(norm: torch.nn.Module, kind: str, eps: float) -> bool:
    """Refuse a ``transformers`` norm module that does not compute what the fold assumes
    (``kind`` ``"rms"``: ``x * rsqrt(mean(x^2) + eps) * weight``; ``"layer"``: a LayerNorm, with
    the epsilon read from the module), probed on rows of several magnitudes, a tiny one (where
    the epsilon weighs) and a zero one among them: a norm of another form (``(1 + weight)``, an
    epsilon under another name) would otherwise fold into a block that computes something else.
    Returns False for a module on the meta device (deferred initialisation: nothing to probe
    yet; the block probes it when it lays its weights out again, :meth:`FusedMLP.refresh`)."""
    if kind not in ("rms", "layer"):
        raise ValueError(f"kind must be 'rms' or 'layer', got {kind!r}")
    w, b = getattr(norm, "weight", None), getattr(norm, "bias", None)
    if not isinstance(w, torch.Tensor):
        raise ValueError(
            f"{type(norm).__name__} has no weight (elementwise_affine=False?): build the block from tensors, "
            "with a norm weight of ones"
        )
    if w.is_meta:
        return False
    if kind == "rms":
        what = f"x * rsqrt(mean(x^2) + {eps:g}) * weight"

        def expected(x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.detach().float()
    else:
        what = f"a LayerNorm with eps {eps:g}"

        def expected(x):
            bias = None if b is None else b.detach().float()
            return torch.nn.functional.layer_norm(x, (w.shape[0],), w.detach().float(), bias, eps)

    scale = torch.tensor([[1.0], [20.0], [1e-3], [0.0]])
    x = (torch.randn(4, w.shape[0], generator=torch.Generator().manual_seed(0)) * scale).to(w.device, w.dtype)
    with torch.no_grad():
        got, want = norm(x).float(), expected(x.float())
    err = (got - want).norm(dim=-1)
    if not bool((err <= 0.02 * want.norm(dim=-1) + 1e-3).all()):
        raise ValueError(
            f"{type(norm).__name__} does not compute {what} (relative error per probe row "
            f"{[round(float(e), 3) for e in err / want.norm(dim=-1).clamp_min(1e-6)]}): it does not fold here"
        )
    return True


class LlamaMLP(FusedMLP):
    """A Llama MLP block with its pre-norm and residual (module docstring), from weights in
    ``torch.nn.Linear``'s layout: ``w_gate``, ``w_up`` ``[I, H]``, ``w_down`` ``[H, I]``, the
    RMSNorm's ``norm_weight`` ``[H]`` and ``eps``. All on one device, one dtype (bf16, or fp16).
    ``forward(x)`` takes ``[..., H]`` and returns the block's output of that shape."""

    _norm_kind = "rms"  # what its source norm must compute (_check_norm)
    unfused_rows = LLAMA_UNFUSED_ROWS

    def __init__(
        self,
        w_gate: torch.Tensor,
        w_up: torch.Tensor,
        w_down: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float = 1e-5,
        *,
        gate_up_config: GemmConfig | None = None,
        down_config: GemmConfig | None = None,
    ):
        super().__init__(gate_up_config, down_config, ("gate_up_config", "down_config"))
        inter, H = _matrix_shape(w_gate)
        ws = {"w_gate": w_gate, "w_up": w_up, "w_down": w_down, "norm_weight": norm_weight}
        _check_block(ws, {"w_gate": (inter, H), "w_up": (inter, H), "w_down": (H, inter), "norm_weight": (H,)})
        if inter % 8 or H % 8 or not inter:
            raise ValueError(f"hidden ({H}) and intermediate ({inter}) sizes must be multiples of 8 (TMA rows)")
        self.hidden, self.intermediate, self.eps = H, inter, eps
        self._set_weights(**self._laid_out(w_gate, w_up, w_down, norm_weight))

    @staticmethod
    def _laid_out(w_gate, w_up, w_down, norm_weight) -> dict:
        """``[H, 2I]`` gate/up (norm folded, columns in runs of gate and up) and ``[I, H]`` down."""
        with torch.no_grad():
            gate_up = interleave(fold_rms_weight(norm_weight, w_gate.t()), fold_rms_weight(norm_weight, w_up.t()))
            down = w_down.t().clone(memory_format=torch.contiguous_format)  # never a view of the source
        return {"w_in": gate_up, "w_out": down}

    def _make_epilogues(self) -> tuple[Epilogue, Epilogue]:
        return Epilogue(silu, gated=True, rms_eps=self.eps), Epilogue(residual=True)

    def _unfused_first(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows normalised (the norm's weight is folded into ``w_in``), the gate/up GEMM, the
        gated SiLU on its runs of gate and up columns (:func:`~ctapipelining.epilogue.interleave`)."""
        normed = torch.nn.functional.rms_norm(rows, (self.hidden,), eps=self.eps)
        runs = (normed @ self.w_in).view(rows.shape[0], self.intermediate // GATE_RUN.value, 2, GATE_RUN.value)
        return (torch.nn.functional.silu(runs[:, :, 0]) * runs[:, :, 1]).view(rows.shape[0], self.intermediate)

    @classmethod
    def from_hf(cls, mlp: torch.nn.Module, norm: torch.nn.Module, **configs) -> LlamaMLP:
        """From a ``transformers`` ``LlamaMLP`` (``gate_proj``, ``up_proj``, ``down_proj``, no bias,
        SiLU) and the ``LlamaRMSNorm`` before it; :meth:`refresh` re-reads them."""
        cls._check_module(mlp)
        eps = cls._source_eps(norm)
        checked = _check_norm(norm, cls._norm_kind, eps)  # (first: a norm without a weight is refused by name)
        block = cls(mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, norm.weight, eps, **configs)
        block._source, block._norm_unchecked = (mlp, norm), not checked
        block._source_versions = block._versions()
        return block

    @staticmethod
    def _check_module(mlp: torch.nn.Module) -> None:
        """Refuse an MLP module that does not compute what the block does (at build and refresh)."""
        act = getattr(mlp, "act_fn", None)
        if act is not None and type(act).__name__ not in ("SiLU", "SiLUActivation"):
            raise ValueError(f"only a SiLU-gated MLP fuses here, got {type(act).__name__}")
        for name in ("gate_proj", "up_proj", "down_proj"):
            if getattr(mlp, name).bias is not None:
                raise ValueError(f"{name} has a bias: a Llama MLP has none")

    @staticmethod
    def _source_eps(norm: torch.nn.Module) -> float:
        """The epsilon of an RMSNorm module (``transformers``' ``variance_epsilon``, else ``eps``;
        read at every call of a block built from one: the common attribute first)."""
        eps = norm.__dict__.get("variance_epsilon")
        if eps is None:
            eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
        if eps is None:  # torch.nn.RMSNorm's default: it normalises in float32, with float32's epsilon
            eps = torch.finfo(torch.float32).eps  # (_check_norm's probe checks that it does)
        return float(eps)

    def _source_weights(self):
        mlp, norm = self._source  # (_attr: read at every call)
        return (
            _attr(_attr(mlp, "gate_proj"), "weight"),
            _attr(_attr(mlp, "up_proj"), "weight"),
            _attr(_attr(mlp, "down_proj"), "weight"),
            _attr(norm, "weight"),
        )

    @property
    def gate_up(self) -> torch.Tensor:
        return self.w_in

    @property
    def down(self) -> torch.Tensor:
        return self.w_out


GELU_TANH = ("NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "GELUPytorchTanh", "FastGELUActivation")


class GPTMLP(FusedMLP):
    """A GPT-style MLP block with its pre-norm and residual (module docstring), from weights in
    ``torch.nn.Linear``'s layout: ``w_1`` ``[I, H]`` and ``b_1`` ``[I]``, ``w_2`` ``[H, I]`` and
    ``b_2`` ``[H]``, the LayerNorm's ``norm_weight`` and ``norm_bias`` ``[H]`` (``None``: no
    bias) and ``eps``. The activation is GELU's tanh form (GPT-2's ``gelu_new``). All on one
    device, one dtype. ``forward(x)`` takes ``[..., H]`` and returns the block's output."""

    _norm_kind = "layer"
    _config_defaults = (UP_CONFIG, DOWN_CONFIG)
    few_rows_configs = GPT_FEW_ROWS_CONFIGS
    unfused_rows = GPT_UNFUSED_ROWS

    def __init__(
        self,
        w_1: torch.Tensor,
        b_1: torch.Tensor | None,
        w_2: torch.Tensor,
        b_2: torch.Tensor | None,
        norm_weight: torch.Tensor,
        norm_bias: torch.Tensor | None,
        eps: float = 1e-5,
        *,
        up_config: GemmConfig | None = None,
        down_config: GemmConfig | None = None,
    ):
        super().__init__(up_config, down_config, ("up_config", "down_config"))
        inter, H = _matrix_shape(w_1)
        ws = {"w_1": w_1, "b_1": b_1, "w_2": w_2, "b_2": b_2, "norm_weight": norm_weight, "norm_bias": norm_bias}
        want = {"w_1": (inter, H), "b_1": (inter,), "w_2": (H, inter), "b_2": (H,), "norm_weight": (H,),
                "norm_bias": (H,)}  # fmt: skip
        _check_block(ws, want, optional=("b_1", "b_2", "norm_bias"))
        if inter % 8 or H % 8 or not inter:
            raise ValueError(f"hidden ({H}) and intermediate ({inter}) sizes must be multiples of 8 (TMA rows)")
        self.hidden, self.intermediate, self.eps = H, inter, eps
        self._set_weights(**self._laid_out(w_1, b_1, w_2, b_2, norm_weight, norm_bias))

    @staticmethod
    def _laid_out(w_1, b_1, w_2, b_2, norm_weight, norm_bias) -> dict:
        """``[H, I]`` first weight (norm folded) and bias, ``[I, H]`` second weight and bias."""
        with torch.no_grad():
            w_in, _, b_in = fold_layer_norm(norm_weight, norm_bias, w_1.t(), b_1)
            w_out = w_2.t().clone(memory_format=torch.contiguous_format)  # never a view of the source
            b_out = None if b_2 is None else b_2.detach().clone().contiguous()
        return {"w_in": w_in, "w_out": w_out, "b_in": b_in, "b_out": b_out}

    def _make_epilogues(self) -> tuple[Epilogue, Epilogue]:
        # the column sums of the weight as it is now (fp32, whatever the block's dtype: the
        # LayerNorm's subtraction needs them exact): computed where the weight is
        first = Epilogue(gelu, layer_norm_eps=self.eps, col_sum=column_sums(self.w_in), bias=self.b_in)
        return first, Epilogue(bias=self.b_out, residual=True)

    def _unfused_first(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows normalised (the norm's weight and bias are folded into ``w_in`` and ``b_in``),
        the first GEMM with its bias, GELU's tanh form."""
        normed = torch.nn.functional.layer_norm(rows, (self.hidden,), eps=self.eps)
        return torch.nn.functional.gelu(torch.addmm(self.b_in, normed, self.w_in), approximate="tanh")

    def _update_epilogues(self, first: Epilogue, second: Epilogue) -> None:
        """The column sums of the weight laid out again, into the same tensor (an inference
        tensor where the epilogues were built in inference mode)."""
        with torch.inference_mode() if first.col_sum.is_inference() else torch.no_grad():
            first.col_sum.copy_(column_sums(self.w_in))

    @classmethod
    def from_hf(cls, mlp: torch.nn.Module, norm: torch.nn.Module, **configs) -> GPTMLP:
        """From a ``transformers`` ``GPT2MLP`` (``c_fc``, ``c_proj``: ``Conv1D``, whose weights are
        ``[in, out]``; or ``nn.Linear``) with a GELU-tanh activation, and the ``LayerNorm`` before
        it; :meth:`refresh` re-reads them."""
        cls._check_module(mlp)
        eps = cls._source_eps(norm)
        checked = _check_norm(norm, cls._norm_kind, eps)  # (first: a norm without a weight is refused by name)
        block = cls(*cls._hf_weights(mlp, norm), eps, **configs)
        block._source, block._norm_unchecked = (mlp, norm), not checked
        block._source_versions = block._versions()
        return block

    @staticmethod
    def _check_module(mlp: torch.nn.Module) -> None:
        """Refuse an MLP module whose activation is not GELU's tanh form (at build and refresh)."""
        act = getattr(mlp, "act", None)
        if type(act).__name__ not in GELU_TANH:
            raise ValueError(f"only GELU's tanh form (gelu_new) fuses here, got {type(act).__name__}")

    @staticmethod
    def _source_eps(norm: torch.nn.Module) -> float:
        """The epsilon of a LayerNorm module."""
        return float(norm.eps)

    @staticmethod
    def _hf_weights(mlp, norm, raw: bool = False):
        """The block's weights from the modules (``raw``: each layer's weight as the layer keeps it)."""

        def linear(layer):  # Conv1D keeps [in, out]; nn.Linear [out, in] (_attr: read at every call)
            w = _attr(layer, "weight")
            return w.t() if type(layer).__name__ == "Conv1D" and not raw else w, _attr(layer, "bias")

        (w_1, b_1), (w_2, b_2) = linear(_attr(mlp, "c_fc")), linear(_attr(mlp, "c_proj"))
        return w_1, b_1, w_2, b_2, _attr(norm, "weight"), _attr(norm, "bias")

    def _source_weights(self):
        return self._hf_weights(*self._source)

    def _source_tensors(self):
        return self._hf_weights(*self._source, raw=True)


_STACKS: weakref.WeakValueDictionary[str, MLPStack] = weakref.WeakValueDictionary()  # the stack operator's


@torch.library.custom_op("ctapipelining::mlp_stack", mutates_args=())
def mlp_stack(x: torch.Tensor, weights: list[torch.Tensor], stack: str) -> torch.Tensor:
    """The pipelined stack ``stack`` (an :class:`MLPStack`'s key; ``weights``: its blocks' laid-out
    weights, passed so that a compiler sees them as inputs) on ``x`` ``[M, H]``."""
    st = _STACKS.get(stack)
    if st is None:
        raise _missing("pipelined MLP stack", stack)
    with _operator_body():  # its schema mutates nothing: a moved source is refused, not followed
        return st._run(_tma_rows(x))


@mlp_stack.register_fake
def _(x, weights, stack):
    return x.new_empty(x.shape, device=weights[-1].device)  # on the last block's device


mlp_stack.register_autograd(_no_backward)


class MLPStack(torch.nn.Module):
    """Fused MLP blocks one after another (``x -> block_{L-1}(... block_0(x))``, each with its
    norm and residual), run as one CTA-pipelined chain (:class:`~ctapipelining.pipeline.Pipeline`)
    of their GEMMs: block ``b``'s first GEMM starts on a row-block as soon as block ``b - 1``'s
    second GEMM has written it, on the same GPU or on the next. :class:`LlamaStack` and
    :class:`GPTStack` build one from ``transformers`` modules.

    ``blocks``: :class:`FusedMLP` blocks (:class:`LlamaMLP`, :class:`GPTMLP`) of one hidden size
    and dtype, each on the device it runs on (a block's two GEMMs run on one device; a
    :class:`~ctapipelining.pipeline.Pipeline` over one block's two GEMMs may place them on two,
    the second reading its residual, the block's input, where it lives); consecutive blocks on one device
    or on GPUs with peer access. What the fusion does per block is the block's own, with one
    difference: block ``b > 0``'s norm takes its rows' sums of squares (and, for a LayerNorm,
    sums) from block ``b - 1``'s second GEMM, which stores them with each output tile (partial
    sums per column-block, added in a fixed order: the result is deterministic, and rounds
    differently from the block alone, whose pass over ``x`` sums in another order; a LayerNorm's
    parts are centred on their own means and combined by Chan's formula, so no cancellation).

    ``config``: None (the default), each GEMM in its block's configuration, but a second GEMM
    whose tiles leave no room for the residual tile a stage loads (the default
    :data:`DOWN_CONFIG`'s) in :data:`~ctapipelining.kernels.gemm.RESIDUAL_CONFIG`, so the stages
    on one GPU run one kernel after another; or one :class:`GemmConfig` for every GEMM, so that
    they share one chain kernel (:data:`STACK_CONFIG` fits: 128 x 128 tiles leave room for the
    residual's). On one H200 the pipeline of two Llama blocks runs 1.05-1.09x as long as the same
    blocks called one after another with the default (a block alone adds its residual by TMA on
    wider tiles), and 1.35-1.41x with one chain kernel in :data:`STACK_CONFIG`
    (``benchmarks/results/2026-12-05-h200-verify/``): on one GPU a stack has nothing to gain, so
    a stack whose blocks all sit on one GPU runs them one after another, each block as it runs
    alone (:meth:`blocks_apart`), unless something asks for the pipeline (``config``, loopback,
    a trace, an SM budget, ``always_pipelined=True``). Its place is blocks on several
    GPUs, each block's second GEMM feeding the next GPU's first GEMM row-block by row-block.
    There, by the model (``ctapipelining.sim.figure_blocks``; not measured), only one
    configuration (:data:`STACK_CONFIG`) pipelines: in the default a GPU's second GEMM starts
    once its first has ended. Other keyword arguments go to the
    :class:`~ctapipelining.pipeline.Pipeline` (``policy``, ``timeout_s``, ``row_buckets``,
    ``loopback``, ``always_pipelined``, ...). The blocks' weights are the pipeline's:
    :meth:`refresh` (each block's built from a module) updates them in place.
    """

    block_type: type = FusedMLP  # what the blocks must be

    def __init__(self, blocks: list[FusedMLP], config: GemmConfig | None = None, **pipeline_kw):
        super().__init__()
        blocks = list(blocks)
        if not blocks or not all(isinstance(b, self.block_type) for b in blocks):
            raise TypeError(f"{type(self).__name__} takes a non-empty list of {self.block_type.__name__} blocks")
        b0 = blocks[0]
        for i, b in enumerate(blocks):
            if b.hidden != b0.hidden or b.w_out.dtype != b0.w_out.dtype:
                raise ValueError(
                    f"block {i} is hidden={b.hidden} {b.w_out.dtype}; block 0 is hidden={b0.hidden} {b0.w_out.dtype}"
                )
        self.config = config  # (checked by __setattr__)
        self.blocks = torch.nn.ModuleList(blocks)
        self.hidden = b0.hidden
        self._pipeline_kw = pipeline_kw
        self._built = None  # (the weights' addresses, the Pipeline): rebuilt when they move
        self._pipeline()  # builds and checks it now
        self._key = _new_key("mlp_stack")
        _STACKS[self._key] = self

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_built": None}

    def __setattr__(self, name: str, value) -> None:
        """``config`` set as at construction: None (each block's) or a :class:`GemmConfig`,
        which the next call's pipeline runs."""
        if name == "config" and not (value is None or isinstance(value, GemmConfig)):
            raise ValueError(f"config must be None (each block's) or a GemmConfig, got {value!r}")
        super().__setattr__(name, value)

    def _apply(self, fn, recurse=True):
        # the blocks' buffers moved or cast: the pipeline built on the old ones (and holding them) goes now
        self._built = None
        return super()._apply(fn, recurse)

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._key = _new_key("mlp_stack")
        _STACKS[self._key] = self

    def _weights(self) -> list[torch.Tensor]:
        return [w for b in self.blocks for w in (b.w_in, b.w_out)]

    @property
    def pipeline(self):
        """The :class:`~ctapipelining.pipeline.Pipeline` of the blocks' GEMMs, where the weights are now."""
        return self._pipeline()

    def _pipeline(self):
        from .pipeline import Pipeline  # nn is imported by the package's users; the pipeline only here

        epilogues = []
        for b in self.blocks:  # each lays its weights out again, in place, if its source changed,
            b._follow_source()
            # and its epilogues where its buffers, configurations and epsilon are now (the same
            # objects while nothing changed: compared by identity), what they derive up to date
            epilogues += b._epilogues()
        weights = self._weights()
        key = (*((w.data_ptr(), w.device) for w in weights), *epilogues, self.config)
        if self._built is None or self._built[0] != key:
            stages = [b.pipeline_stages() for b in self.blocks]  # each block's configurations (its epilogues: above)
            configs = self.config or [c for _, cfgs, _ in stages for c in cfgs]
            self._built = (key, Pipeline(weights, config=configs, epilogues=epilogues, **self._pipeline_kw))
        return self._built[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_x(x)
        rows = x.reshape(-1, self.hidden).contiguous()
        if _direct(x):
            return self._run(_tma_rows(rows)).reshape(x.shape)
        if not _tracing():  # here, not in the operator, which writes none of its inputs
            for b in self.blocks:
                b._follow_source()
        return mlp_stack(rows, self._weights(), self._key).reshape(x.shape)

    def blocks_apart(self) -> bool:
        """Whether a call runs the blocks one after another, each as it runs alone: every block
        on one device and nothing that asks for the pipeline there (no ``config``, loopback,
        trace or SM budget, and not ``always_pipelined``; see the class docstring)."""
        return self._apart(self._pipeline())

    def _apart(self, pipeline) -> bool:
        return self.config is None and pipeline.free_on_one_device

    def _run(self, rows: torch.Tensor) -> torch.Tensor:
        if not rows.shape[0]:  # no rows, no output rows (as a block gives; a Pipeline refuses them)
            return rows.new_empty(rows.shape, device=self.blocks[-1].w_out.device)
        pipeline = self._pipeline()
        if self._apart(pipeline):
            for b in self.blocks:
                rows = b._run(rows, b.w_in, b.w_out)
            return rows
        return pipeline(rows)

    def _check_x(self, x) -> None:
        """Refuse, by name, an ``x`` that is not ``[..., H]`` of the first block's dtype and device."""
        _check_input(x, self.hidden, self.blocks[0].w_out, "the stack's first block")

    def sequential(self, x: torch.Tensor) -> torch.Tensor:
        """The same GEMMs one after another, no pipelining: what ``forward`` equals bitwise (the
        blocks one after another, when :meth:`blocks_apart`)."""
        self._check_x(x)
        rows = _tma_rows(x.reshape(-1, self.hidden).contiguous())
        if self.blocks_apart() or not rows.shape[0]:
            return self._run(rows).reshape(x.shape)
        return self._pipeline().sequential(rows).reshape(x.shape)

    def refresh(self) -> None:
        """:meth:`FusedMLP.refresh` of every block built from a module (in place: the pipeline
        reads the new weights; a block built from tensors has nothing to re-read), every block's
        checks first: a block that refuses (its source changed shape) leaves every block as it
        was."""
        sourced = [b for b in self.blocks if b._source is not None]
        if not sourced:
            raise RuntimeError("every block of this stack was built from tensors: build a new one instead")
        for b, checked in [(b, b._checked_source()) for b in sourced]:
            b._renew(*checked)

    @classmethod
    def from_hf(cls, mlps: list, norms: list, config: GemmConfig | None = None, **pipeline_kw) -> MLPStack:
        """From ``transformers`` MLP modules and the norm before each (for Llama the decoder
        layers' ``mlp`` and ``post_attention_layernorm``; for GPT-2 ``mlp`` and ``ln_2``), each
        block on its module's device: the blocks' own ``from_hf``."""
        if len(mlps) != len(norms):
            raise ValueError(f"{len(mlps)} MLPs but {len(norms)} norms")
        if cls.block_type is FusedMLP:
            raise TypeError("MLPStack.from_hf does not know the blocks' kind: use LlamaStack or GPTStack")
        return cls([cls.block_type.from_hf(m, n) for m, n in zip(mlps, norms)], config, **pipeline_kw)


class LlamaStack(MLPStack):
    """:class:`MLPStack` of :class:`LlamaMLP` blocks (``from_hf``: ``transformers`` ``LlamaMLP``
    modules and their ``LlamaRMSNorm``)."""

    block_type = LlamaMLP


class GPTStack(MLPStack):
    """:class:`MLPStack` of :class:`GPTMLP` blocks (``from_hf``: ``transformers`` ``GPT2MLP``
    modules and their ``LayerNorm``)."""

    block_type = GPTMLP
