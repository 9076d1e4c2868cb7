"""What the baselines' schedules share around CUDA: a capture that falls back to eager calls,
and the ordering of a schedule with the caller's work on every device."""

from __future__ import annotations

from collections.abc import Callable

import torch


def try_capture(run: Callable[[], object], devices: list) -> tuple[torch.cuda.CUDAGraph | None, str]:
    """``run`` (already warmed up) captured in one CUDA graph on the first device's stream:
    ``(graph, "")``; or, if the capture fails, ``(None, why)`` with every device synchronised,
    and the schedule runs eagerly."""
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(devices[0]), torch.cuda.graph(graph):
            run()
        return graph, ""
    except Exception as e:  # record why, run eagerly
        for d in devices:
            torch.cuda.synchronize(d)
        return None, f"{type(e).__name__}: {e}"


def order_devices(devices: list) -> Callable[[], None]:
    """Make the first device's current stream wait for every other device's current stream, and
    return a function that makes each of those wait for the first's: a schedule that forks from
    and joins back to the first device's stream (a CUDA graph replayed there) is then ordered with
    the caller's work on every device (its inputs filled there, its outputs read there)."""
    first = torch.cuda.current_stream(devices[0])
    others = [torch.cuda.current_stream(d) for d in dict.fromkeys(devices[1:]) if d != devices[0]]
    for st in others:
        first.wait_stream(st)

    def join() -> None:
        for st in others:
            st.wait_stream(first)

    return join
