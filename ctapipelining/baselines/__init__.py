"""Baselines a skeptical reader would accept: sequential, micro-batching (CUDA graphs, side
streams; cuBLAS or our GEMM), Megatron tensor parallelism (NCCL; its all-reduce plain or
overlapped chunk by chunk) and data parallelism over rows with weight replicas."""

from .data_parallel import DataParallel
from .microbatch import MicroBatch
from .sequential import Sequential
from .tensor_parallel import TensorParallel

__all__ = ["DataParallel", "MicroBatch", "Sequential", "TensorParallel"]
