"""Baselines a skeptical reader would accept, all cuBLAS (``torch.matmul``) based:
sequential, micro-batching (CUDA graphs, side streams) and Megatron tensor parallelism (NCCL)."""

from .microbatch import MicroBatch
from .sequential import Sequential
from .tensor_parallel import TensorParallel

__all__ = ["MicroBatch", "Sequential", "TensorParallel"]
