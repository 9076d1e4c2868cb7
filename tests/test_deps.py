"""Hand-checked small cases for every function of ctapipelining.deps."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ctapipelining import deps


def test_tile_grid_edges():
    g = deps.TileGrid(M=10, N=7, block_m=4, block_n=3)
    assert (g.num_m, g.num_n, g.num_tiles) == (3, 3, 9)
    assert g.coords(5) == (1, 2)
    assert g.rows(2) == (8, 10)
    assert g.cols(2) == (6, 7)
    assert g.tile_slices(8) == (slice(8, 10), slice(6, 7))
    with pytest.raises(IndexError):
        g.coords(9)
    with pytest.raises(ValueError, match="block_m"):
        deps.TileGrid(10, 7, 0, 3)


def test_gemm_rule_same_blocks_one_counter_per_row_block():
    p = deps.TileGrid(M=8, N=6, block_m=4, block_n=3)  # 2 x 2 tiles
    c = deps.TileGrid(M=8, N=4, block_m=4, block_n=2)  # 2 x 2 tiles
    d = deps.build_dependency(p, c, "gemm", consumer_k=6)
    assert d.counter_of_tile.tolist() == [0, 0, 1, 1]
    assert d.need.tolist() == [2, 2]
    assert d.needs(0) == (0, 1) and d.needs(3) == (2, 3)
    assert [d.signals(t).tolist() for t in range(4)] == [[0], [0], [1], [1]]
    assert [d.pushes(k).tolist() for k in range(2)] == [[0, 1], [2, 3]]
    assert d.signal_ptr.dtype == np.int32 and d.push_tiles.dtype == np.int32


def test_gemm_rule_mismatched_block_m_and_ragged_m():
    # producer row-blocks [0,4) [4,8) [8,10); consumer row-blocks [0,3) [3,6) [6,9) [9,10)
    p = deps.TileGrid(M=10, N=5, block_m=4, block_n=5)
    c = deps.TileGrid(M=10, N=2, block_m=3, block_n=2)
    d = deps.build_dependency(p, c, "gemm")
    assert [d.needs(t) for t in range(4)] == [(0,), (0, 1), (1, 2), (2,)]
    assert d.need.tolist() == [1, 2, 2, 1]
    # producer tile 1 (rows 4..8) is read by consumer row-blocks 1 and 2
    assert d.signals(1).tolist() == [1, 2]
    assert (d.max_signals, d.max_push, d.max_need) == (2, 1, 2)


def test_elementwise_rule_shares_nothing_across_columns():
    p = deps.TileGrid(M=4, N=6, block_m=2, block_n=3)
    c = deps.TileGrid(M=4, N=6, block_m=4, block_n=2)
    d = deps.build_dependency(p, c, "elementwise")
    # consumer tile 1 covers rows 0..4, cols 2..4: producer col-blocks 0 and 1, row-blocks 0 and 1
    assert d.needs(1) == (0, 1, 2, 3)
    assert d.needs(0) == (0, 2) and d.needs(2) == (1, 3)
    assert d.num_counters == 3


def test_rule_shape_checks():
    p = deps.TileGrid(8, 6, 4, 3)
    with pytest.raises(ValueError, match="producer M=8 != consumer M=9"):
        deps.build_dependency(p, deps.TileGrid(9, 4, 4, 2), "gemm")
    with pytest.raises(ValueError, match="consumer K=7"):
        deps.build_dependency(p, deps.TileGrid(8, 4, 4, 2), "gemm", consumer_k=7)
    with pytest.raises(ValueError, match="elementwise"):
        deps.build_dependency(p, deps.TileGrid(8, 4, 4, 2), "elementwise")
    with pytest.raises(ValueError, match="unknown rule"):
        deps.build_dependency(p, p, "conv")


def test_tile_orders():
    g = deps.TileGrid(M=6, N=4, block_m=2, block_n=2)  # 3 x 2 tiles
    assert deps.tile_order(g, 1).tolist() == [0, 1, 2, 3, 4, 5]
    # groups of 2 row-blocks, column-major inside: (0,0) (1,0) (0,1) (1,1), then the last row-block
    assert deps.tile_order(g, 2).tolist() == [0, 2, 1, 3, 4, 5]
    assert sorted(deps.tile_order(g, 3).tolist()) == list(range(6))
    with pytest.raises(ValueError):
        deps.tile_order(g, 0)


def test_policies_and_epoch_arithmetic():
    p = deps.TileGrid(8, 6, 4, 3)
    d = deps.build_dependency(p, deps.TileGrid(8, 4, 4, 2), "gemm")
    assert deps.wait_target(d, 3, epoch=5) == (1, 10)
    assert deps.fills(d, 1, old=9, epoch=5) and not deps.fills(d, 1, old=8, epoch=5)
    assert deps.get_policy("static").tiles_of_cta(np.arange(7), 1, 3).tolist() == [1, 4]
    assert deps.get_policy("workqueue").uses_queue
    with pytest.raises(ValueError, match="unknown policy"):
        deps.get_policy("fifo")
    for bad in (None, 3):  # (a DistributedPipeline's rank would fail later, alone, on .name)
        with pytest.raises(TypeError, match="policy must be a Policy"):
            deps.get_policy(bad)
    # 4 consumer tiles: position 5 is lap 2 (epoch 2), so it holds 2*4 + tile
    assert deps.slot_value(5, 4, 3) == 11
    assert deps.head_base(3, num_tiles=4, num_ctas=2) == 12


def test_split_tail_h200_workload():
    """X[16384, 8192] @ [8192, 8192], 128x256x64 tiles, 132 SMs: 31 rounds + 4 tiles."""
    split = deps.split_tail(4096, 132, 128, 16)
    assert split == deps.TailSplit(first_pos=4092, tiles=4, splits=8)
    assert split.items == 32
    assert split.slice_of(0, 128) == (4092, 0, 16) and split.slice_of(31, 128) == (4095, 112, 128)
    assert deps.split_tail(160, 132, 128, 16) == deps.TailSplit(132, 28, 4)  # 640 rows: 28 tiles on 112 CTAs


def test_fewer_tiles_than_ctas_are_split_whole():
    """A GEMM of fewer tiles than CTAs is one partial round: every tile split along K (split-K),
    as many slices as the CTAs and its K-steps allow. A Llama-8B block's down GEMM at decode
    (16 tiles of 128 x 256, K = 14336): 8 slices of 28 K-steps each, on 128 CTAs."""
    split = deps.split_tail(16, 132, 224, 16)
    assert split == deps.TailSplit(first_pos=0, tiles=16, splits=8) and split.items == 128
    assert split.slice_of(0, 224) == (0, 0, 28) and split.slice_of(127, 224) == (15, 196, 224)
    assert deps.split_tail(16, 132, 40, 16) == deps.TailSplit(0, 16, 2)  # K-steps for 2 slices only
    assert deps.split_tail(1, 4, 3, 1) == deps.TailSplit(0, 1, 3)  # (the interpreter's 4 CTAs)


def test_a_tail_split_that_is_not_its_grids_tail_is_refused():
    """Fewer than two slices a tile is no split; a slice without its CTA would never arrive, and
    its tile would never be summed; a slice without K-steps is a CTA's work for nothing; tiles
    that do not end the tile order would leave the tiles after them unwritten (the full rounds
    stop where the tail begins)."""
    for bad in [(-1, 2, 2), (0, 0, 2), (0, 2, 1)]:
        with pytest.raises(ValueError, match="a TailSplit needs"):
            deps.TailSplit(*bad)
    with pytest.raises(ValueError, match="more slices a tile than its 2 K-steps"):
        deps.TailSplit(0, 1, 4).check(1, 4, 2)
    deps.TailSplit(0, 1, 4).check(1, 4, 4)
    with pytest.raises(ValueError, match="4 slices for 3 CTAs"):  # one CTA a slice
        deps.TailSplit(0, 1, 4).check(1, 3, 4)
    with pytest.raises(ValueError, match="are not the last"):  # the tail ends the tile order
        deps.TailSplit(0, 1, 4).check(2, 4, 4)


@given(tiles=st.integers(1, 5000), ctas=st.integers(1, 200), k_tiles=st.integers(1, 300), min_k=st.integers(1, 32))
def test_split_tail_covers_each_tail_tile_once_and_fits_the_grid(tiles, ctas, k_tiles, min_k):
    split = deps.split_tail(tiles, ctas, k_tiles, min_k)
    if split is None:
        return
    split.check(tiles, ctas, k_tiles)
    assert split.first_pos == tiles - tiles % ctas and split.first_pos % ctas == 0
    assert 2 <= split.splits and split.items <= ctas  # every slice has a CTA that is idle after the full rounds
    covered = {}
    for i in range(split.items):
        pos, k0, k1 = split.slice_of(i, k_tiles)
        assert split.first_pos <= pos < tiles and k1 - k0 >= min_k
        covered.setdefault(pos, []).append((k0, k1))
    for pos in range(split.first_pos, tiles):  # the slices of a tile tile its K exactly, in order
        ranges = covered[pos]
        assert ranges[0][0] == 0 and ranges[-1][1] == k_tiles
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_last_stage_tail_is_the_combined_loops_tail_counted_in_the_last_stage():
    """A chain kernel's split tail: the whole loop's partial round, when it lies within the last
    stage, at the position the last stage run alone counts; else none."""
    two = deps.last_stage_tail([160, 160], 132, 128, 16)  # 320 tiles: 2 rounds, then 56 (positions 264-319)
    assert two == deps.TailSplit(264 - 160, 56, 2)
    assert deps.last_stage_tail([160], 132, 128, 16) == deps.split_tail(160, 132, 128, 16)  # one stage: its own
    assert deps.last_stage_tail([300, 20], 132, 128, 16) is None  # the tail starts in the first stage
    assert deps.last_stage_tail([132, 132], 132, 128, 16) is None  # whole rounds
    assert deps.last_stage_tail([160, 160], 132, 16, 16) is None  # the last stage's K too short to split


def test_split_tail_none_without_a_partial_round_or_room():
    assert deps.split_tail(4092, 132, 128, 16) is None  # whole rounds
    assert deps.split_tail(100, 132, 128, 16) is None  # one partial round, no room for 2 slices a tile
    assert deps.split_tail(10, 10, 128, 16) is None  # a grid of a CTA per tile: no partial round
    assert deps.split_tail(132 + 100, 132, 128, 16) is None  # 100 tail tiles, 132 CTAs: no 2 slices each
    assert deps.split_tail(4096, 132, 20, 16) is None  # K too short for two slices
    with pytest.raises(ValueError, match="min_slice_k"):
        deps.split_tail(4096, 132, 128, 0)


def test_parts_split_a_row_block_by_producer_columns():
    """Each row-block gets one counter per part; a producer tile bumps the part its columns
    fall in; the parts' producer tiles together are the whole row-block's."""
    p, c = deps.TileGrid(8, 10, 4, 2), deps.TileGrid(8, 6, 4, 3)  # 5 producer column-blocks
    d = deps.build_dependency(p, c, "gemm", consumer_k=10, parts=2)
    assert d.parts == 2 and d.part_first_col == (0, 2) and [d.part_k_start(q) for q in range(2)] == [0, 4]
    assert d.counter_of_tile.tolist() == [0, 0, 2, 2] and d.need.tolist() == [2, 3, 2, 3]
    assert d.part_needs(0, 0) == (0, 1) and d.part_needs(0, 1) == (2, 3, 4) and d.part_needs(3, 1) == (7, 8, 9)
    assert d.needs(1) == (0, 1, 2, 3, 4)
    assert [d.signals(t).tolist() for t in range(p.num_tiles)] == [[0], [0], [1], [1], [1], [2], [2], [3], [3], [3]]
    assert deps.wait_target(d, 2, epoch=3, part=1) == (3, 9)
    one = deps.build_dependency(p, c, "gemm", consumer_k=10)
    assert all(d.needs(t) == one.needs(t) for t in range(c.num_tiles))


def test_parts_are_checked():
    p = deps.TileGrid(8, 10, 4, 2)
    with pytest.raises(ValueError, match=r"parts must be in \[1, 5\]"):
        deps.build_dependency(p, deps.TileGrid(8, 6, 4, 3), "gemm", parts=6)
    with pytest.raises(ValueError, match="only a GEMM consumer"):
        deps.build_dependency(p, p, "elementwise", parts=2)
    with pytest.raises(IndexError, match="part 2 outside 2 parts"):
        deps.build_dependency(p, deps.TileGrid(8, 6, 4, 3), "gemm", parts=2).part_needs(0, 2)


def test_balanced_ends_on_the_h200_workload():
    """On 2x H200's workload (K = N = 8192, 128x256 tiles, 132 SMs) the rule gives a drain of 4
    row-blocks (128 tiles, one round) and a prefill of that plus M / 64 rows: the best measured
    at 2048 and 8192, the middle of the machines' best at 16384 (deps.balanced_ends)."""
    ends = {M: deps.balanced_ends(M, 8192, 8192, 128, 256, 132) for M in (2048, 8192, 16384)}
    assert ends == {2048: (512, 512), 8192: (640, 512), 16384: (768, 512)}


@given(
    M=st.integers(1, 1 << 16),
    n0=st.integers(1, 1 << 15),
    n1=st.integers(1, 1 << 15),
    bm=st.sampled_from([16, 64, 128]),
    bn=st.sampled_from([16, 128, 256]),
    sms=st.integers(1, 200),
)
def test_balanced_ends_are_row_blocks_and_the_drain_fits_one_round(M, n0, n1, bm, bn, sms):
    R, D = deps.balanced_ends(M, n0, n1, bm, bn, sms)
    assert R % bm == 0 and D % bm == 0 and R >= 0 and D >= bm
    per_row_block = max(-(-n0 // bn), -(-n1 // bn))
    # both drain GEMMs in one round of the CTAs, unless even one row-block needs more
    assert D // bm * per_row_block <= max(sms, per_row_block)
    assert (D // bm + 1) * per_row_block > sms


def _decode(codes):
    return [(int(c) >> deps.STAGE_SHIFT, int(c) & ((1 << deps.STAGE_SHIFT) - 1)) for c in codes]


def _assert_each_tile_waits_only_on_earlier_positions(order, num_m, num_ns, group_m, ring_first=False, tail=None):
    """Every tile of a stage after the first comes after each tile of the stage before that it
    reads (all of them when the first stage's tiles come from a ring); a tail slice reads the
    row-block of its tile, ``tail.first_pos + (q - tail.first_pos) // tail.splits``."""
    S = len(num_ns)

    def row(s, q):
        if s == S - 1 and tail is not None and q >= tail.first_pos:
            q = tail.first_pos + (q - tail.first_pos) // tail.splits
        return deps.grouped_tile(q, num_m, num_ns[s], group_m) // num_ns[s]

    where = {}  # (stage, row-block) -> positions in the combined order
    for pos, (s, q) in enumerate(order):
        where.setdefault((s, row(s, q)), []).append(pos)
    for pos, (s, q) in enumerate(order):
        if s == 0:
            continue
        r = row(s, q)
        inputs = [p for (t, rr), ps in where.items() if t == s - 1 and (rr == r or (s == 1 and ring_first)) for p in ps]
        assert max(inputs) < pos, (pos, s, q)


@given(
    num_m=st.integers(1, 12),
    num_ns=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    group_m=st.integers(1, 4),
    lag=st.one_of(st.none(), st.integers(0, 20)),
    ring_first=st.booleans(),
    tail_tiles=st.integers(0, 6),
    splits=st.integers(2, 4),
)
def test_chain_order_keeps_each_stage_in_order_after_its_inputs(
    num_m, num_ns, group_m, lag, ring_first, tail_tiles, splits
):
    """Every position of every stage once (the last stage's tail tiles as ``splits`` slices
    each, when it has a tail), each stage in its own order, and every tile or slice after each
    tile of the stage before that it reads: a tile waits only on earlier positions, so the chain
    kernel cannot deadlock."""
    last_tiles = num_m * num_ns[-1]
    tail = None
    if tail_tiles:
        tiles = min(tail_tiles, last_tiles)
        tail = deps.TailSplit(last_tiles - tiles, tiles, splits)
    order = _decode(deps.chain_order(num_m, num_ns, group_m, lag, tail, ring_first))
    S = len(num_ns)
    for s in range(S):
        mine = [q for t, q in order if t == s]
        spans = tail.first_pos + tail.items if s == S - 1 and tail is not None else num_m * num_ns[s]
        assert mine == list(range(spans)), s
    _assert_each_tile_waits_only_on_earlier_positions(order, num_m, num_ns, group_m, ring_first, tail)
    if lag is None:
        assert [s for s, _ in order] == sorted(s for s, _ in order)  # stage after stage


def test_chain_order_interleaves_so_the_last_stage_starts_early():
    """Two 8192-wide stages on 2048 rows (16 row-blocks of 32 tiles) on 132 CTAs: the second
    stage starts about a round after its first row-blocks are placed, long before the first
    stage ends, and not before a whole round has passed since its inputs."""
    num_m, num_ns = 16, [32, 32]
    order = _decode(deps.chain_order(num_m, num_ns, 4, 132))
    first_consumer = next(p for p, (s, _) in enumerate(order) if s == 1)
    last_producer = max(p for p, (s, _) in enumerate(order) if s == 0)
    row0 = 31 * 4  # the producer's row-block 0 ends with the last column of its group of 4 row-blocks
    assert first_consumer == row0 + 132 + 1
    assert first_consumer < last_producer - 132
    assert _decode(deps.chain_order(num_m, num_ns, 4, None))[512] == (1, 0)  # stage after stage


@pytest.mark.parametrize(
    "num_m,num_ns,lag,tail",
    [
        (2, [4, 4], 2, deps.TailSplit(first_pos=6, tiles=2, splits=3)),
        (4, [3, 3], 0, deps.TailSplit(first_pos=9, tiles=3, splits=2)),  # the tail: the last row-block
        (8, [1, 1], 0, deps.TailSplit(first_pos=6, tiles=2, splits=2)),  # the tail: the last two row-blocks
    ],
)
def test_chain_order_places_each_tail_slice_of_the_last_stage_after_its_tiles_inputs(num_m, num_ns, lag, tail):
    """The last stage's positions are its tiles before the tail, then ``splits`` slices of each
    tail tile, each slice after every tile of the stage before in its tile's row-block."""
    order = _decode(deps.chain_order(num_m, num_ns, 1, lag, tail))
    last = [q for s, q in order if s == 1]
    assert last == list(range(tail.first_pos + tail.items))
    _assert_each_tile_waits_only_on_earlier_positions(order, num_m, num_ns, 1, tail=tail)


def test_chain_order_refuses_a_bad_shape_or_a_negative_lag():
    with pytest.raises(ValueError, match="chain_order: bad shape"):
        deps.chain_order(2, [4, 0], 1, 2)
    with pytest.raises(ValueError, match="lag must be >= 0"):
        deps.chain_order(2, [4, 4], 1, -1)
