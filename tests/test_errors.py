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


@pytest.mark.parametrize(
    "kind,says",
    [
        (KIND_COUNTER, "CTA 2 timed out waiting for tile 5 (counter 7 was 3, needs 4; deadline 0.25 s)"),
        (KIND_SLOT, "CTA 2 timed out waiting for tile 5 (work-queue position 7 was 3, needs 4; deadline 0.25 s)"),
        (KIND_HEAD, "CTA 2 claimed work-queue position 7, before this run's first"),
        (KIND_TICKET, "CTA 2 of its chain kernel claimed position 7 of a run of 4 claims"),
        (KIND_START, "the previous segment had started 3 calls on this plan, this was call 4"),
        (KIND_DONE, "the next segment had finished 3 calls on this plan, this call needs 4"),
        (KIND_ROWS, "the previous segment's call had 3 rows, this one 4"),
    ],
)
def test_each_kind_of_error_word_says_what_it_waited_for(kind, says):
    quiet = [0] * len(ERR_FIELDS)  # a stage that did not fail says nothing
    msgs = errors.messages([quiet, word(kind), quiet], lambda s: f"stage {s} on cuda:{s}", 250_000_000)
    assert len(msgs) == 1 and msgs[0].startswith(f"stage 1 on cuda:1: {says}"), msgs


def test_a_wait_with_no_tile_yet_names_its_next_tile():
    (msg,) = errors.messages([word(KIND_SLOT, tile=-1)], str, 10**9)
    assert msg.startswith("0: CTA 2 timed out waiting for its next tile (work-queue position 7")
