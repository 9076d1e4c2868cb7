"""The measured configuration tables under ``ctapipelining/data``: per row count, the tile
configuration that ``benchmarks/configs.py`` measured fastest (the plain GEMM's,
:data:`GEMM_TABLE`; two stages in one chain kernel per plan height, :data:`PIPELINE_TABLE`).
Each row names its results folder. Read here without torch, as plain dicts of
:class:`~ctapipelining.kernels.gemm.GemmConfig`'s fields, so that the simulator reads the same
rows as the kernels' host code (:func:`ctapipelining.gemm.config_table`). A row of the plain
GEMM's table also says whether cuBLAS measured faster than every candidate of ours there
(:func:`cublas_faster`), which a pipeline's stages run one after another follow
(:func:`ctapipelining.serial.runs_cublas`)."""

from __future__ import annotations

import functools
import importlib.resources
import json

GEMM_TABLE = "gemm_configs.json"  # the plain GEMM's rows (ctapipelining.gemm.plain_config)
PIPELINE_TABLE = "pipeline_configs.json"  # a pipeline's, per plan height (Pipeline.plan_configs)


@functools.cache
def _rows(name: str) -> tuple[dict, ...]:
    """Table ``name``'s rows by increasing row count, read once."""
    rows = json.loads((importlib.resources.files(__package__) / "data" / name).read_text())["rows"]
    return tuple(sorted(rows, key=lambda row: row["M"]))


@functools.cache
def table_rows(name: str) -> tuple[tuple[int, dict], ...]:
    """Table ``name``'s ``(rows, configuration fields)`` by increasing rows."""
    return tuple((row["M"], row["config"]) for row in _rows(name))


@functools.cache
def table_flags(name: str, flag: str) -> tuple[tuple[int, bool], ...]:
    """Table ``name``'s ``(rows, flag)`` by increasing rows (a row without the flag: False)."""
    return tuple((row["M"], bool(row.get(flag, False))) for row in _rows(name))


CUBLAS_MARGIN = 0.02  # how much faster cuBLAS must be, at the low end of the 95% CI, to run in our place


def cublas_faster(over_cublas: dict) -> bool:
    """Whether a row count's measurement of its fastest candidate over cuBLAS (``median`` and
    ``ci95``, paired) says cuBLAS is faster than every candidate of ours: the whole interval
    above ``1 + CUBLAS_MARGIN``."""
    return over_cublas["ci95"][0] > 1 + CUBLAS_MARGIN


def pick_config(table, M: int):
    """``table``'s (``(rows, configuration)`` by increasing rows) configuration for ``M`` rows:
    its row for the smallest row count ``>= M``, the last row's beyond it."""
    return next((cfg for rows, cfg in table if M <= rows), table[-1][1])
