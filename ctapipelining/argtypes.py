"""What the subcommands' parsers share: argument types that reject bad values while parsing (so
a user mistake ends in argparse's one-line error and exit status 2, never a traceback), the
help formatter, and :class:`UsageError` for mistakes only a subcommand can see."""

from __future__ import annotations

import argparse
from pathlib import Path


class UsageError(ValueError):
    """A user mistake found after parsing (a file of the wrong kind): the CLI reports it as
    argparse does, one line and exit status 2."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none (``None``, a required option)."""

    def _get_help_string(self, action):
        if action.default is None or action.required:
            return action.help
        return super()._get_help_string(action)


def _int(s: str) -> int:
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None


def at_least(low: int):
    """An integer type that accepts ``low`` and above."""

    def check(s: str) -> int:
        v = _int(s)
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
        return v

    return check


positive_int = at_least(1)


def non_negative_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {s}")
    return v


def _ints(s: str, least: int, what: str, bounded: str) -> list[int]:
    """Comma-separated integers ``what``, at least one, each ``>= least`` (``bounded`` names
    them so in the error)."""
    try:
        v = [int(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {s!r}") from None
    if not v or min(v) < least:
        raise argparse.ArgumentTypeError(f"expected {bounded}, got {s!r}")
    return v


def positive_ints(s: str) -> list[int]:
    """Comma-separated positive integers: ``1024,2048``."""
    return _ints(s, 1, "integers", "positive integers")


def stage_indices(s: str) -> list[int]:
    """Comma-separated stage numbers (from 0): ``0,2``."""
    return _ints(s, 0, "stage numbers", "stage numbers >= 0")


def chain_dims(s: str) -> list[int]:
    """A chain's widths ``K0,N0,N1,...``: at least two (one layer)."""
    v = positive_ints(s)
    if len(v) < 2:
        raise argparse.ArgumentTypeError(f"needs at least two widths (K0,N0: one layer), got {s!r}")
    return v


def existing_file(s: str) -> Path:
    p = Path(s)
    if not p.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {s}")
    return p


def existing_path(s: str) -> Path:
    """A file or a folder that exists."""
    p = Path(s)
    if not p.exists():
        raise argparse.ArgumentTypeError(f"no such file or folder: {s}")
    return p
