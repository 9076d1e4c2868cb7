"""What every baseline checks of its arguments before it allocates anything: a clear error
naming the argument, rather than a raw error from deep inside a constructor or a first call."""

from __future__ import annotations

import torch


def check_count(v, name: str, least: int = 1) -> int:
    """``v``: an int (not a bool) of at least ``least``."""
    if not isinstance(v, int) or isinstance(v, bool) or v < least:
        raise ValueError(f"{name} must be an int >= {least}, got {v!r}")
    return v


def check_chunks(chunks, M: int) -> None:
    """``chunks``: an int (not a bool) in ``[1, M]``."""
    if not isinstance(chunks, int) or isinstance(chunks, bool) or not 1 <= chunks <= M:
        raise ValueError(f"chunks must be an int in [1, M={M}], got {chunks!r}")


def check_matrices(weights, name: str = "weight", chained: bool = True) -> None:
    """Each of ``weights`` a 2-D tensor, all of one dtype (``chained``: each taking the columns
    the one before gives)."""
    for s, w in enumerate(weights):
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            raise ValueError(f"{name} {s} must be a 2-D tensor, got {getattr(w, 'shape', type(w).__name__)}")
        if w.dtype != weights[0].dtype:
            raise TypeError(f"{name} {s} is {w.dtype}; {name} 0 is {weights[0].dtype}")
        if chained and s and w.shape[0] != weights[s - 1].shape[1]:
            raise ValueError(f"{name} {s} is {tuple(w.shape)}, {name} {s - 1} outputs {weights[s - 1].shape[1]}")


def device(d) -> torch.device:
    """``d`` (an int, a string or a ``torch.device``) as a device with its index: ``cuda`` names
    the current GPU (``cuda:0`` where CUDA is absent), as PyTorch resolves it."""
    d = torch.device(f"cuda:{d}") if isinstance(d, int) and not isinstance(d, bool) else torch.device(d)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return d


def check_devices(devices, distinct: bool = True) -> list[torch.device]:
    """``devices``: a non-empty list; ``distinct``: its GPUs distinct (``cuda`` and ``cuda:0`` are
    one GPU where it is the current one). Returns them resolved (:func:`device`)."""
    if not isinstance(devices, (list, tuple)) or not devices:
        raise ValueError(f"devices must be a non-empty list, got {devices!r}")
    resolved = [device(d) for d in devices]
    cuda = [d for d in resolved if d.type == "cuda"]
    if distinct and len(set(cuda)) != len(cuda):
        raise ValueError(f"devices must be distinct GPUs, got {devices!r}")
    return resolved
