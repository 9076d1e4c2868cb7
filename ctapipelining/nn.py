"""Transformer blocks as ``torch.nn`` modules, their elementwise work fused into the GEMMs.

:class:`LlamaMLP` is a Llama-style MLP block with its RMSNorm and residual,
``y = x + W_down(silu(rmsnorm(x) @ W_gate) * (rmsnorm(x) @ W_up))``, as two GEMMs
(:func:`ctapipelining.gemm.matmul` with an :class:`~ctapipelining.epilogue.Epilogue`):

1. ``h = silu(gate) * up`` of ``x @ [W_gate | W_up]'``: the norm's weight folded into the gate
   and up weights, their columns interleaved in pairs, the rows' RMS summed in the K loop from
   the tiles of ``x`` it loads, and the activation in the epilogue (``h`` is half as wide as
   the GEMM);
2. ``y = x + h @ W_down``: the residual added in the epilogue.

Nothing else touches memory: ``x`` is read by the first GEMM (and as the residual), ``h`` is
written once and read once. The weights are laid out once, at construction (:meth:`refresh`
lays them out again from the source module after it changed).

On the GPU each GEMM is a persistent TMA kernel; without one, the Triton interpreter runs the
same kernels on the CPU (slowly; fp16 there, since the interpreter computes bf16 dots wrongly).
Inference only: ``forward`` is not differentiable (no gradient reaches ``x`` or the weights).
``forward`` calls the custom operator ``torch.ops.ctapipelining.llama_mlp`` (``torch.library``,
with a fake implementation for shapes), so a model compiled with ``torch.compile`` traces through
the block without a graph break.
Inputs with few rows (decode) run as they are: the kernels need no minimum, but a block of a
few hundred rows or fewer leaves most SMs idle in either GEMM, and nothing here changes that.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref

import torch

from .epilogue import Epilogue, fold_rms_weight, interleave, silu
from .gemm import check_tensor, matmul
from .kernels.gemm import PLAIN_CONFIG, GemmConfig

# The gate/up GEMM's tiles (a gated epilogue halves the stored tile: room for three stages), and the
# down GEMM's: its residual tile needs shared memory too, and 128 x 256 tiles then fit two stages
# only; 128 x 128 tiles with four ran the down GEMM 0.85x as long (benchmarks/results/2026-12-01-h200-mlp/).
GATE_UP_CONFIG = dataclasses.replace(PLAIN_CONFIG, split_tail=False)
DOWN_CONFIG = dataclasses.replace(PLAIN_CONFIG, block_n=128, num_stages=4, split_tail=False)


_BLOCKS: weakref.WeakValueDictionary[str, LlamaMLP] = weakref.WeakValueDictionary()  # the operator's blocks by key
_KEYS = itertools.count()


@torch.library.custom_op("ctapipelining::llama_mlp", mutates_args=())
def llama_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, block: str) -> torch.Tensor:
    """The fused block ``block`` (a :class:`LlamaMLP`'s key; ``gate_up`` and ``down`` are its
    laid-out weights, passed so that a compiler sees them as inputs) on ``x`` ``[M, H]``."""
    mlp = _BLOCKS.get(block)
    if mlp is None:
        raise RuntimeError(f"no LlamaMLP block {block!r} (it was freed)")
    return mlp._run(x, gate_up, down)


@llama_mlp.register_fake
def _(x, gate_up, down, block):
    return torch.empty_like(x)


class LlamaMLP(torch.nn.Module):
    """A Llama MLP block with its pre-norm and residual (module docstring), from weights in
    ``torch.nn.Linear``'s layout: ``w_gate``, ``w_up`` ``[I, H]``, ``w_down`` ``[H, I]``, the
    RMSNorm's ``norm_weight`` ``[H]`` and ``eps``. All on one device, one dtype (bf16, or fp16).
    ``forward(x)`` takes ``[..., H]`` and returns the block's output of that shape."""

    def __init__(
        self,
        w_gate: torch.Tensor,
        w_up: torch.Tensor,
        w_down: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float = 1e-5,
        *,
        gate_up_config: GemmConfig = GATE_UP_CONFIG,
        down_config: GemmConfig = DOWN_CONFIG,
    ):
        super().__init__()
        ws = {"w_gate": w_gate, "w_up": w_up, "w_down": w_down, "norm_weight": norm_weight}
        for name, t in ws.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        inter, H = w_gate.shape
        if w_up.shape != (inter, H) or w_down.shape != (H, inter) or norm_weight.shape != (H,):
            raise ValueError(
                f"shapes do not make a block: w_gate {tuple(w_gate.shape)}, w_up {tuple(w_up.shape)}, "
                f"w_down {tuple(w_down.shape)}, norm_weight {tuple(norm_weight.shape)} "
                "(want [I, H], [I, H], [H, I], [H])"
            )
        if inter % 8 or H % 8:
            raise ValueError(f"hidden ({H}) and intermediate ({inter}) sizes must be multiples of 8 (TMA rows)")
        if len({t.dtype for t in ws.values()}) != 1 or len({t.device for t in ws.values()}) != 1:
            raise ValueError("the block's weights must share one dtype and one device")
        if not (isinstance(eps, float) and eps > 0):
            raise ValueError(f"eps must be a float > 0, got {eps!r}")
        self.hidden, self.intermediate, self.eps = H, inter, eps
        self.gate_up_config, self.down_config = gate_up_config, down_config
        self._source = None
        self._lay_out(w_gate, w_up, w_down, norm_weight)
        self._register()

    def _register(self) -> None:
        """Give this block its own key in the operator's registry."""
        self._key = f"llama_mlp_{next(_KEYS)}"
        _BLOCKS[self._key] = self

    def __setstate__(self, state) -> None:  # a copy (deepcopy, pickle) runs its own weights
        super().__setstate__(state)
        self._register()

    def _lay_out(self, w_gate, w_up, w_down, norm_weight) -> None:
        """The kernels' weights: ``[H, 2I]`` gate/up (norm folded, columns in pairs), ``[I, H]`` down."""
        with torch.no_grad():
            gate_up = interleave(fold_rms_weight(norm_weight, w_gate.t()), fold_rms_weight(norm_weight, w_up.t()))
            down = w_down.t().contiguous()
        check_tensor(gate_up, "LlamaMLP: gate/up weight")
        check_tensor(down, "LlamaMLP: down weight")
        self.register_buffer("gate_up", gate_up, persistent=False)
        self.register_buffer("down", down, persistent=False)
        self._first = Epilogue(silu, gated=True, rms_eps=self.eps)
        self._second = Epilogue(residual=True)

    @classmethod
    def from_hf(cls, mlp: torch.nn.Module, norm: torch.nn.Module, **configs) -> LlamaMLP:
        """From a ``transformers`` ``LlamaMLP`` (``gate_proj``, ``up_proj``, ``down_proj``, no bias,
        SiLU) and the ``LlamaRMSNorm`` before it; :meth:`refresh` re-reads them."""
        act = getattr(mlp, "act_fn", None)
        if act is not None and type(act).__name__ not in ("SiLU", "SiLUActivation"):
            raise ValueError(f"only a SiLU-gated MLP fuses here, got {type(act).__name__}")
        for name in ("gate_proj", "up_proj", "down_proj"):
            if getattr(mlp, name).bias is not None:
                raise ValueError(f"{name} has a bias: a Llama MLP has none")
        eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
        block = cls(mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, norm.weight, eps, **configs)
        block._source = (mlp, norm)
        return block

    def refresh(self) -> None:
        """Lay the weights out again from the module this block was built from (after the
        source's weights changed: the block keeps its own copies)."""
        if self._source is None:
            raise RuntimeError("this block was built from tensors: build a new one instead")
        mlp, norm = self._source
        self._lay_out(mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, norm.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.shape[-1:] != (self.hidden,):
            raise ValueError(f"x must be [..., {self.hidden}], got {getattr(x, 'shape', type(x).__name__)}")
        if x.dtype != self.down.dtype or x.device != self.down.device:
            raise ValueError(f"x is {x.dtype} on {x.device}; the block is {self.down.dtype} on {self.down.device}")
        rows = x.reshape(-1, self.hidden).contiguous()
        return llama_mlp(rows, self.gate_up, self.down, self._key).reshape(x.shape)

    def _run(self, rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """The two fused GEMMs on ``rows`` ``[M, H]`` (the operator's body)."""
        h = matmul(rows, gate_up, config=self.gate_up_config, epilogue=self._first)
        return matmul(h, down, config=self.down_config, epilogue=self._second, residual=rows)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, intermediate={self.intermediate}, eps={self.eps}"
