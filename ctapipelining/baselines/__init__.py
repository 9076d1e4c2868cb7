"""Baselines a skeptical reader would accept: sequential, micro-batching (CUDA graphs, side
streams; cuBLAS or our GEMM; or fused MLP blocks), Megatron tensor parallelism (NCCL; its
all-reduce plain or overlapped chunk by chunk; of GEMMs or of fused Llama blocks) and data
parallelism over rows with weight replicas."""

from .data_parallel import DataParallel
from .microbatch import MicroBatch
from .sequential import Sequential
from .tensor_parallel import TensorParallel, TensorParallelBlocks

__all__ = ["DataParallel", "MicroBatch", "Sequential", "TensorParallel", "TensorParallelBlocks"]
