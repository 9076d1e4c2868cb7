"""The calls a pipeline queued that have not finished, so that a host wait can tell whose work
holds it up.

Each call records its start on the streams it is issued from, before its own work (what runs
there before it, past the previous call's end, is the caller's work, or another library's), and
its end on the streams its kernels ran on (the pipeline's own work). Waiting for these events in
the order the calls were made, the first one that does not finish names who is late: a start,
the caller (``TimeoutError``: nothing of ours is stuck); an end, the pipeline (its kernels still
run). Events of finished calls are recorded again by later calls on the same device (no event is
created per call once the pools hold enough).
"""

from __future__ import annotations

import collections

import torch

CALLERS_EARLIER = "the work queued before a call"  # a host wait's name for a call's start


class InFlight:
    """The unfinished calls, oldest first, each ``(starts, ends)``: lists of ``(device, event)``.
    The newest call stays even when finished (the next call orders itself after its end)."""

    def __init__(self, name: str = "a call of this pipeline"):
        self.name = name  # what a host wait calls an end
        self._calls: collections.deque = collections.deque()
        self._free: dict = {}  # device -> events of finished calls there, to record again (an event keeps its device)

    def record(self, streams: list) -> list:
        """An event recorded on each of ``streams`` now (from its device's pool where it can;
        an empty pool first takes back the events of finished calls)."""
        events = []
        for st in streams:
            pool = self._free.get(st.device)
            if not pool:
                self._prune()
                pool = self._free.get(st.device)
            ev = pool.pop() if pool else torch.cuda.Event()
            ev.record(st)
            events.append(ev)
        return events

    def add(self, starts: list, ends: list) -> None:
        """A call whose starts and ends (``(device, event)`` each) were recorded."""
        self._calls.append((starts, ends))

    def end_on(self, stream, start: list) -> list:
        """Record the end of a call issued on ``stream`` alone (its start ``start``, from
        :meth:`record`) and add the call; returns the end (one event)."""
        done = self.record([stream])
        self.add([(stream.device, *start)], [(stream.device, *done)])
        return done

    def _prune(self) -> None:
        """Return the events of finished calls but the newest to the pool."""
        while len(self._calls) > 1 and all(ev.query() for _, ev in self._calls[0][1]):
            starts, ends = self._calls.popleft()
            for device, ev in starts + ends:
                self._free.setdefault(device, []).append(ev)

    def events(self) -> list:
        """``(who, device, event)`` to wait for, in the order the calls were made."""
        out = []
        for starts, ends in self._calls:
            out += [(CALLERS_EARLIER, d, ev) for d, ev in starts]
            out += [(self.name, d, ev) for d, ev in ends]
        return out
