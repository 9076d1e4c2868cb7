"""What a pipeline reports when a stage fails: its exceptions, and what the error words say.

Every bounded wait on the GPU that gives up writes one *error word* per stage (the fields of
:data:`~ctapipelining.kernels.sync.ERR_FIELDS`: who waited, on which tile, for which counter or
ring position, what it saw and needed); the host reads the words after the call and raises
:class:`PipelineTimeout` with :func:`messages`' lines. A GPU that does not finish within the
host's bound raises :class:`PipelineHung` instead.
"""

from __future__ import annotations

from .kernels.sync import ERR_FIELDS, KIND_COUNTER, KIND_DONE, KIND_HEAD, KIND_ROWS, KIND_START, KIND_TICKET


class PipelineTimeout(RuntimeError):
    """A stage waited past its deadline for an input that never came."""


class PipelineHung(RuntimeError):
    """A stage's kernels did not finish within the host's bound: the pipeline is unusable."""


def failed_call(M: int, msgs: list[str]) -> str:
    """What a call on the plan for ``M`` rows whose error words say ``msgs`` is reported as."""
    return f"a call with the plan for {M} rows failed: " + "; ".join(msgs)


# what an error word of each kind says (its fields by name), besides a wait that timed out
SAYS = {
    KIND_HEAD.value: "CTA {cta} claimed work-queue position {index}, before this run's first: the ring's head is "
    "behind its epoch (a call launched without its consumer, or a CUDA graph replaying a freed Pipeline's buffers)",
    KIND_TICKET.value: "CTA {cta} of its chain kernel claimed position {index} of a run of {target} claims: the "
    "kernel's ticket is out of step with its epoch (buffers overwritten, or a kernel that never ended)",
    KIND_START.value: "the previous segment had started {seen} calls on this plan, this was call {target}: it did "
    "not start this call in time (a rank that never made it, or fell behind)",
    KIND_DONE.value: "the next segment had finished {seen} calls on this plan, this call needs {target} (it still "
    "reads the buffer this call overwrites): it did not finish in time, so every call since the last check is suspect",
    KIND_ROWS.value: "the previous segment's call had {seen} rows, this one {target}: every rank must pass the same "
    "rows",
}


def messages(words: list[list[int]], name, timeout_ns: int) -> list[str]:
    """What the error words ``words`` (one per stage, :data:`ERR_FIELDS`) say, one line per
    stage that failed; ``name(s)`` names stage ``s`` (its number in the chain and where it runs),
    ``timeout_ns`` is the stages' deadline."""
    msgs = []
    for s, w in enumerate(words):
        if not w[0]:
            continue
        e = dict(zip(ERR_FIELDS, w))
        if e["kind"] in SAYS:
            says = SAYS[e["kind"]].format(**e)
        else:
            what = f"counter {e['index']}" if e["kind"] == KIND_COUNTER.value else f"work-queue position {e['index']}"
            tile = f"tile {e['tile']}" if e["tile"] >= 0 else "its next tile"
            says = (
                f"CTA {e['cta']} timed out waiting for {tile} "
                f"({what} was {e['seen']}, needs {e['target']}; deadline {timeout_ns / 1e9:g} s)"
            )
        msgs.append(f"{name(s)}: {says}")
    return msgs
