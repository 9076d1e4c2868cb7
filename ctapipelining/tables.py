"""The measured configuration tables under ``ctapipelining/data``: per row count, the tile
configuration that ``benchmarks/configs.py`` measured fastest (the plain GEMM's,
:data:`GEMM_TABLE`; two stages in one chain kernel per plan height, :data:`PIPELINE_TABLE`).
Each row names its results folder. Read here without torch, as plain dicts of
:class:`~ctapipelining.kernels.gemm.GemmConfig`'s fields, so that the simulator reads the same
rows as the kernels' host code (:func:`ctapipelining.gemm.config_table`)."""

from __future__ import annotations

import functools
import importlib.resources
import json

GEMM_TABLE = "gemm_configs.json"  # the plain GEMM's rows (ctapipelining.gemm.plain_config)
PIPELINE_TABLE = "pipeline_configs.json"  # a pipeline's, per plan height (Pipeline.plan_configs)


@functools.cache
def table_rows(name: str) -> tuple[tuple[int, dict], ...]:
    """Table ``name``'s ``(rows, configuration fields)`` by increasing rows."""
    rows = json.loads((importlib.resources.files(__package__) / "data" / name).read_text())["rows"]
    return tuple(sorted(((row["M"], row["config"]) for row in rows), key=lambda r: r[0]))


def pick_config(table, M: int):
    """``table``'s (``(rows, configuration)`` by increasing rows) configuration for ``M`` rows:
    its row for the smallest row count ``>= M``, the last row's beyond it."""
    return next((cfg for rows, cfg in table if M <= rows), table[-1][1])
