"""What a failed stage's error word says (``ctapipelining.errors.messages``): one line per stage
whose word is set, naming the stage and the fields its kind reports."""

import pytest

from ctapipelining import errors
from ctapipelining.kernels.sync import (
    ERR_FIELDS,
    KIND_COUNTER,
    KIND_DONE,
    KIND_HEAD,
    KIND_ROWS,
    KIND_SLOT,
    KIND_START,
    KIND_TICKET,
)


def word(kind, tile=5, index=7, seen=3, target=4, cta=2):
    fields = dict(flag=1, stage=1, tile=tile, kind=kind.value, index=index, seen=seen, target=target, cta=cta)
    return [fields[f] for f in ERR_FIELDS]


HEAD = (
    "CTA 2 claimed work-queue position 7, before this run's first: the ring's head is behind its epoch (a call "
    "launched without its consumer, or a CUDA graph replaying a freed Pipeline's buffers)"
)
TICKET = (
    "CTA 2 of its chain kernel claimed position 7 of a run of 4 claims: the kernel's ticket is out of step with "
    "its epoch (buffers overwritten, or a kernel that never ended)"
)
START = (
    "the previous segment had started 3 calls on this plan, this was call 4: it did not start this call in time "
    "(a rank that never made it, or fell behind)"
)
DONE = (
    "the next segment had finished 3 calls on this plan, this call needs 4 (it still reads the buffer this call "
    "overwrites): it did not finish in time, so every call since the last check is suspect"
)
ROWS = "the previous segment's call had 3 rows, this one 4: every rank must pass the same rows"


@pytest.mark.parametrize(
    "kind,says",
    [
        (KIND_COUNTER, "CTA 2 timed out waiting for tile 5 (counter 7 was 3, needs 4; deadline 0.25 s)"),
        (KIND_SLOT, "CTA 2 timed out waiting for tile 5 (work-queue position 7 was 3, needs 4; deadline 0.25 s)"),
        (KIND_HEAD, HEAD),
        (KIND_TICKET, TICKET),
        (KIND_START, START),
        (KIND_DONE, DONE),
        (KIND_ROWS, ROWS),
    ],
)
def test_each_kind_of_error_word_says_what_it_waited_for(kind, says):
    quiet = [0] * len(ERR_FIELDS)  # a stage that did not fail says nothing
    msgs = errors.messages([quiet, word(kind), quiet], lambda s: f"stage {s} on cuda:{s}", 250_000_000)
    assert msgs == [f"stage 1 on cuda:1: {says}"]


def test_a_wait_names_its_tile_or_its_next_one():
    """Tile 0 is a tile; a negative tile (a work-queue consumer that has no tile yet) is its next."""
    (first,) = errors.messages([word(KIND_COUNTER, tile=0)], str, 10**9)
    assert first == "0: CTA 2 timed out waiting for tile 0 (counter 7 was 3, needs 4; deadline 1 s)"
    (msg,) = errors.messages([word(KIND_SLOT, tile=-1)], str, 10**9)
    assert msg == "0: CTA 2 timed out waiting for its next tile (work-queue position 7 was 3, needs 4; deadline 1 s)"
