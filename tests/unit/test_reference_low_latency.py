"""The low-latency reference (cupy_ep.reference) against hand-computed answers, in one process.

A 2-rank global view (E = 4 experts, L = 2 per rank, M = 4 tokens per rank at most):

    rank 0: x rows 1, 2, 3      topk_idx [[1, 2], [3, 2], [-1, 0]]
    rank 1: x rows 101, 102, 103 topk_idx [[2, -1], [0, 1], [-1, -1]]

Rows of a global expert: one per (source rank, token, k) selecting it, by source, token, then k:

    expert 0 (rank 0, local 0): (0, t2, k1), (1, t1, k0)                -> x 3, 102
    expert 1 (rank 0, local 1): (0, t0, k0), (1, t1, k1)                -> x 1, 102
    expert 2 (rank 1, local 0): (0, t0, k1), (0, t1, k1), (1, t0, k0)    -> x 1, 2, 101
    expert 3 (rank 1, local 1): (0, t1, k0)                              -> x 2

Rank 0's token 1 hits two experts of rank 1 (3 and 2): two rows, one in each expert. The FP8 expectations
below are worked out by hand from the e4m3 grid (3 mantissa bits: between 2**e and 2**(e+1) the step is
2**(e-3); subnormals are multiples of 2**-9).
"""
from __future__ import annotations

import numpy as np
import pytest

from cupy_ep import config, reference
from tests.helpers import BF16, random_bf16

E, M, H = 4, 4, 128
TOPK = [np.array([[1, 2], [3, 2], [-1, 0]], np.int64), np.array([[2, -1], [0, 1], [-1, -1]], np.int64)]
ROWS = [np.array([1, 2, 3], np.float32), np.array([101, 102, 103], np.float32)]
X = [np.repeat(r[:, None], H, axis=1).astype(BF16) for r in ROWS]


def _bytes(values) -> np.ndarray:
    return np.array(values, dtype=np.uint8)


def _row_values(recv_x, e, n):
    """The constant of each of the first n rows of local expert e (rows are constant here)."""
    rows = recv_x[e, :n].astype(np.float32)
    assert np.all(rows == rows[:, :1])
    return rows[:, 0].tolist()


# ---- dispatch (bf16) --------------------------------------------------------------------------------
def test_dispatch_rank0_rows_counts_src_info_and_layout_range():
    got = reference.low_latency_dispatch(X, TOPK, M, E, rank=0, use_fp8=False)
    assert got.recv_x.shape == (2, 2 * M, H) and got.recv_x.dtype == BF16
    assert got.recv_x_scales is None
    assert got.recv_count.dtype == np.int32 and got.recv_count.tolist() == [2, 2]
    assert _row_values(got.recv_x, 0, 2) == [3, 102]
    assert _row_values(got.recv_x, 1, 2) == [1, 102]
    assert got.src_info.dtype == np.int32 and got.src_info.shape == (2, 2 * M)
    assert got.src_info[0, :2].tolist() == [2, 1] and got.src_info[1, :2].tolist() == [0, 1]
    # (begin << 32) | count, per (local expert, source rank): 1 row from each source in both experts
    assert got.layout_range.dtype == np.int64
    assert got.layout_range.tolist() == [[1, 4294967297], [1, 4294967297]]
    # rows past recv_count are zero in the reference
    assert not got.recv_x[:, 2:].astype(np.float32).any() and not got.src_info[:, 2:].any()


def test_dispatch_rank1_two_experts_of_one_token_and_an_empty_source():
    got = reference.low_latency_dispatch(X, TOPK, M, E, rank=1, use_fp8=False)
    assert got.recv_count.tolist() == [3, 1]
    assert _row_values(got.recv_x, 0, 3) == [1, 2, 101]
    assert _row_values(got.recv_x, 1, 1) == [2]
    assert got.src_info[0, :3].tolist() == [0, 1, 0] and got.src_info[1, :1].tolist() == [1]
    # expert 2: 2 rows from rank 0 at 0, 1 row from rank 1 at 2 -> (2 << 32) | 1
    # expert 3: 1 row from rank 0 at 0, none from rank 1, whose block would start at 1 -> (1 << 32) | 0
    assert got.layout_range.tolist() == [[2, 8589934593], [1, 4294967296]]
    begin, count = reference.low_latency_unpack_range(got.layout_range)
    assert begin.tolist() == [[0, 2], [0, 1]] and count.tolist() == [[2, 1], [1, 0]]
    assert count.sum(axis=1).tolist() == got.recv_count.tolist()


def test_duplicate_expert_in_one_row_gives_one_row_per_slot_in_k_order():
    x = [np.full((1, H), 7, BF16), np.zeros((0, H), BF16)]
    topk = [np.array([[2, 2]], np.int64), np.zeros((0, 2), np.int64)]
    got = reference.low_latency_dispatch(x, topk, M, E, rank=1, use_fp8=False)
    assert got.recv_count.tolist() == [2, 0]
    assert _row_values(got.recv_x, 0, 2) == [7, 7] and got.src_info[0, :2].tolist() == [0, 0]
    assert got.layout_range.tolist() == [[2, 8589934592], [0, 0]]
    assert reference.low_latency_rows(topk, 2) == [(0, 0, 0), (0, 0, 1)]
    # combine uses each slot's own row: 0.5 * 10 + 0.25 * 20 (not the last row twice, which gives 15)
    y = [np.zeros((2, 2 * M, H), BF16), np.zeros((2, 2 * M, H), BF16)]
    y[1][0, 0], y[1][0, 1] = 10, 20
    w = [np.array([[0.5, 0.25]], np.float32), np.zeros((0, 2), np.float32)]
    out = reference.low_latency_combine(y, topk, w, M, E, rank=0)
    assert out.dtype == BF16 and np.all(out.astype(np.float32) == 10)


def test_dispatch_with_no_tokens_anywhere():
    x = [np.zeros((0, H), BF16)] * 2
    topk = [np.zeros((0, 3), np.int64)] * 2
    got = reference.low_latency_dispatch(x, topk, M, E, rank=0, use_fp8=True)
    assert got.recv_count.tolist() == [0, 0] and got.layout_range.tolist() == [[0, 0], [0, 0]]
    assert got.recv_x.shape == (2, 2 * M, H) and got.recv_x_scales.shape == (2, 2 * M, 1)


def test_pack_range_round_trip():
    packed = reference.low_latency_pack_range([0, 5, 2**31 - 1], [3, 0, 7])
    assert packed.tolist() == [3, 5 << 32, ((2**31 - 1) << 32) | 7]
    begin, count = reference.low_latency_unpack_range(packed)
    assert begin.tolist() == [0, 5, 2**31 - 1] and count.tolist() == [3, 0, 7]


# ---- the FP8 cast ---------------------------------------------------------------------------------
def test_fp8_cast_by_hand():
    x = np.zeros((1, 256), np.float32)
    # group 0: amax 3.5 -> scale 448 / 3.5 = 128, scale_inv = 3.5 * fp32(1/448) = 2**-7 exactly
    x[0, :8] = [-3.5, 1.0, 0.3, 0.296875, 0.265625, 0.28125, 3 * 2.0**-17, 0.0]
    got_x, got_s = reference.per_token_cast_to_fp8(x.astype(BF16))
    # -3.5*128 = -448 -> 0xFE; 128 = 2**7 -> exp field 14, 0x70;
    # bf16(0.3) = 0.30078125, *128 = 38.5 -> between 36 and 40 (step 4 in [32, 64)) -> 40 = 1.25*32 -> 0x62;
    # 38 -> tie of 36 (mantissa 001) and 40 (010) -> even -> 40 -> 0x62; 34 -> tie of 32 (000), 36 -> 0x60;
    # 36 exact -> 0x61; 3*2**-10 = 1.5 * 2**-9 -> subnormal tie of 1 and 2 -> 2 -> 0x02; 0 -> 0x00
    assert got_x.dtype == np.uint8 and got_x.shape == (1, 256)
    assert got_x[0, :8].tolist() == [0xFE, 0x70, 0x62, 0x62, 0x60, 0x61, 0x02, 0x00]
    assert got_s.dtype == np.float32 and got_s.shape == (1, 2)
    assert got_s[0, 0] == np.float32(2.0**-7)
    # group 1 is all zero: amax is clamped to 1e-4, the bytes stay 0
    assert not got_x[0, 128:].any()
    assert got_s[0, 1] == np.float32(np.float32(1e-4) * np.float32(1 / 448))


def test_fp8_cast_non_power_of_two_amax_and_round_scale():
    x = np.zeros((2, 128), np.float32)
    x[0, :3] = [5.0, 1.0, -0.75]
    x[1, 0] = 1.2109375          # 1.2109375 * fp32(448 / 1.2109375) = 448.00003 in fp32 -> still 448
    xb = x.astype(BF16)
    plain_x, plain_s = reference.per_token_cast_to_fp8(xb)
    # scale = fp32(448/5) = 89.6: 5 -> 448 (0x7E); 89.6 -> 88 (step 8 in [64, 128), 1.375*64, 0x6B);
    # -67.2 -> -64 (0xE8)
    assert plain_x[0, :3].tolist() == [0x7E, 0x6B, 0xE8]
    assert plain_s[0, 0] == np.float32(np.float32(5) * np.float32(1 / 448))
    assert plain_x[1, 0] == 0x7E
    # round_scale: 5/448 = 0.01116 -> 2**ceil(log2) = 2**-6, scale 64: 320 (1.25*256, 0x7A), 64 (0x68),
    # -48 (-1.5*32, 0xE4)
    round_x, round_s = reference.per_token_cast_to_fp8(xb, round_scale=True)
    assert round_x[0, :3].tolist() == [0x7A, 0x68, 0xE4]
    assert round_s[0, 0] == np.float32(2.0**-6)
    # 1.2109375/448 = 0.0027 -> 2**-8
    assert round_s[1, 0] == np.float32(2.0**-8)


def test_round_scale_keeps_an_exact_power_of_two():
    # amax 3.5 and 448: amax * fp32(1/448) is exactly 2**-7 and 1.0, so the ceiling does not move
    x = np.zeros((1, 256), np.float32)
    x[0, 0], x[0, 128] = 3.5, -448.0
    _, s = reference.per_token_cast_to_fp8(x.astype(BF16), round_scale=True)
    assert s[0].tolist() == [2.0**-7, 1.0]


def test_ue8m0_byte_packing():
    # groups of 128 with amax 3.5, 5, 448, 0 (clamped to 1e-4): scale_inv 2**-7, 2**-6, 2**0, 2**-22
    # exponent bytes 127-7 = 0x78, 0x79, 0x7F, 127-22 = 0x69; group 4i+j in byte j -> 0x697F7978
    x = np.zeros((2, 512), np.float32)
    x[0, 0], x[0, 128], x[0, 256] = 3.5, 5.0, 448.0
    x[1, 384] = 3.5                # second row: only the last group has data -> 0x78 in the top byte
    data, packed = reference.per_token_cast_to_fp8(x.astype(BF16), round_scale=True, use_ue8m0=True)
    assert packed.dtype == np.int32 and packed.shape == (2, 1)
    assert packed[0, 0] == 0x697F7978
    assert packed[1, 0] == 0x78696969
    assert data[0, [0, 128, 256]].tolist() == [0x7E, 0x7A, 0x7E]
    unpacked = reference.unpack_ue8m0(packed)
    assert unpacked[0].tolist() == [2.0**-7, 2.0**-6, 1.0, 2.0**-22]
    # the int scales cast back like the float ones (DeepEP's per_token_cast_back reads ints as UE8M0)
    _, floats = reference.per_token_cast_to_fp8(x.astype(BF16), round_scale=True)
    assert np.array_equal(reference.per_token_cast_back(data, packed), reference.per_token_cast_back(data, floats))


def test_fp8_cast_argument_errors():
    with pytest.raises(ValueError, match="^use_ue8m0:"):
        reference.per_token_cast_to_fp8(np.zeros((1, 512), BF16), use_ue8m0=True)
    with pytest.raises(ValueError, match="^x:"):
        reference.per_token_cast_to_fp8(np.zeros((1, 256), BF16), round_scale=True, use_ue8m0=True)
    with pytest.raises(ValueError, match="^x:"):
        reference.per_token_cast_to_fp8(np.zeros((1, 96), BF16))


@pytest.mark.parametrize("round_scale", [False, True])
def test_cast_back_error_bound(round_scale):
    """e4m3 has 3 mantissa bits: between 2**e and 2**(e+1) the grid step is 2**(e-3), so rounding to nearest
    moves a scaled value v by at most half a step, 2**(e-4) <= 2**-4 * |v|; below 2**-6 (subnormals) the
    step is 2**-9, an error of at most 2**-10. Scaling back by scale_inv (the scaled values stay within
    +-448, so nothing saturates): |x - back| <= 2**-4 * |x| + 2**-10 * scale_inv, plus a few fp32
    roundings (relative 2**-24 each, bounded here by 2**-20 * amax)."""
    rng = np.random.default_rng(3)
    x = random_bf16(rng, (64, 512))
    x[0] = 0                          # an all-zero token (amax clamped to 1e-4)
    x[1, :128] = 2.0**-30            # a group below the 1e-4 clamp: scaled into e4m3's subnormal range
    x[2, :64] = 1e-6
    data, scales = reference.per_token_cast_to_fp8(x, round_scale=round_scale)
    back = reference.per_token_cast_back(data, scales)
    xf = x.astype(np.float32)
    amax = np.maximum(np.abs(xf).reshape(64, 4, 128).max(axis=2), np.float32(1e-4))
    scale_inv = np.repeat(scales, 128, axis=1)
    bound = 2.0**-4 * np.abs(xf) + 2.0**-10 * scale_inv + 2.0**-20 * np.repeat(amax, 128, axis=1)
    assert np.all(np.abs(xf - back) <= bound)
    # and the bound is not loose by much: some values do lose close to 2**-4 of themselves
    rel = np.abs(xf - back)[np.abs(xf) > 0.25 * np.repeat(amax, 128, axis=1)] / np.abs(xf)[
        np.abs(xf) > 0.25 * np.repeat(amax, 128, axis=1)]
    assert rel.max() > 2.0**-5
    if round_scale:
        assert np.all(np.log2(scales) == np.round(np.log2(scales)))


# ---- combine ----------------------------------------------------------------------------------------
def _y(rank):
    """Rank ``rank``'s expert outputs: row i of local expert e is the constant 16*rank + 8*e + i + 1."""
    y = np.zeros((2, 2 * M, H), np.float32)
    for e in range(2):
        for i in range(2 * M):
            y[e, i] = 16 * rank + 8 * e + i + 1
    return y.astype(BF16)


W = [np.array([[0.5, 2.0], [0.25, 1.0], [3.0, 4.0]], np.float32),
     np.array([[1.5, 9.0], [2.0, 0.5], [1.0, 1.0]], np.float32)]


def test_combine_weights_by_hand():
    y = [_y(0), _y(1)]
    # rank 0: t0 = 0.5 * y0[e1, row 0] (9) + 2 * y1[e0, row 0] (17) = 38.5
    #         t1 = 0.25 * y1[e1, row 0] (25) + 1 * y1[e0, row 1] (18) = 24.25
    #         t2 = (k0 is -1, its weight 3 is ignored) 4 * y0[e0, row 0] (1) = 4
    out0 = reference.low_latency_combine(y, TOPK, W, M, E, rank=0)
    assert out0.dtype == BF16 and out0.shape == (3, H)
    assert out0.astype(np.float32)[:, 0].tolist() == [38.5, 24.25, 4.0]
    assert np.all(out0 == out0[:, :1])
    # rank 1: t0 = 1.5 * y1[e0, row 2] (19) = 28.5; t1 = 2 * y0[e0, row 1] (2) + 0.5 * y0[e1, row 1] (10) = 9;
    #         t2 selects nothing -> 0
    out1 = reference.low_latency_combine(y, TOPK, W, M, E, rank=1)
    assert out1.astype(np.float32)[:, 0].tolist() == [28.5, 9.0, 0.0]


def _one_rank_combine(values, weights, topk_row):
    """Combine of one token on one rank, expert e's row 0 holding ``values[e]``."""
    num_experts = len(values)
    y = np.zeros((num_experts, 4, H), np.float32)
    for e, v in enumerate(values):
        y[e, 0] = v
    topk = [np.array([topk_row], np.int64)]
    w = [np.array([weights], np.float32)]
    return reference.low_latency_combine([y.astype(BF16)], topk, w, 4, num_experts, rank=0)[0, 0]


def test_combine_rounds_to_bf16_once():
    # 256 + 1 + 1 = 258 is a bf16 value; rounding after each step would stick at 256 (257 ties to even)
    assert float(_one_rank_combine([256.0, 1.0, 1.0], [1, 1, 1], [0, 1, 2])) == 258.0


def test_combine_accumulates_in_fp32_in_k_order():
    # 2**24 + 1 rounds to 2**24 in fp32, then -2**24 gives 0 (in fp64, or in another order, it would be 1)
    assert float(_one_rank_combine([2.0**24, 1.0, 2.0**24], [1, 1, -1], [0, 1, 2])) == 0.0
    assert float(_one_rank_combine([2.0**24, 1.0, 2.0**24], [1, -1, 1], [0, 2, 1])) == 1.0
    # a -1 slot in the middle is skipped
    assert float(_one_rank_combine([3.0, 100.0, 5.0], [1, 7, 2], [0, -1, 2])) == 13.0


# ---- FP8 dispatch in the global view ----------------------------------------------------------------
@pytest.mark.parametrize("round_scale,use_ue8m0", [(False, False), (True, False), (True, True)])
def test_fp8_dispatch_carries_each_source_tokens_cast(round_scale, use_ue8m0):
    hidden = 512
    x = [np.repeat(r[:, None], hidden, axis=1).astype(BF16) for r in ROWS]
    x[0][1, 200] = -7.0   # make token 1 of rank 0 not constant (its second group gets amax 7)
    got = reference.low_latency_dispatch(x, TOPK, M, E, rank=1, round_scale=round_scale, use_ue8m0=use_ue8m0)
    assert got.recv_x.dtype == np.uint8 and got.recv_x.shape == (2, 2 * M, hidden)
    width = 1 if use_ue8m0 else 4
    assert got.recv_x_scales.shape == (2, 2 * M, width)
    assert got.recv_x_scales.dtype == (np.int32 if use_ue8m0 else np.float32)
    casts = [reference.per_token_cast_to_fp8(v, round_scale, use_ue8m0) for v in x]
    # expert 2 rows: (0, t0), (0, t1), (1, t0); expert 3: (0, t1)
    for (e, i), (src, t) in {(0, 0): (0, 0), (0, 1): (0, 1), (0, 2): (1, 0), (1, 0): (0, 1)}.items():
        assert np.array_equal(got.recv_x[e, i], casts[src][0][t])
        assert np.array_equal(got.recv_x_scales[e, i], casts[src][1][t])
    # a constant row casts to 448 (0x7E) everywhere without round_scale
    if not round_scale:
        assert np.all(got.recv_x[0, 0] == 0x7E)
    assert not got.recv_x[0, 3:].any() and not got.recv_x_scales[0, 3:].any()


# ---- the RDMA size hint ----------------------------------------------------------------------------
def test_low_latency_rdma_size_hint():
    # DeepEP's example: 128 tokens, hidden 7168, 288 experts
    assert config.low_latency_rdma_size_hint(128, 7168, 8, 288) == 2_146_961_792
    # M=1, H=128, E=1: dispatch msg 16 + max(256, 132) = 272, combine msg 4 + 256 = 260, send = recv = 272,
    # signal = 128 -> 2*128 + 2*272 + 2*272 = 1344 -> ((1344 + 128) // 128) * 128 = 1408
    # ... but our layout (fp32 combine partials, per-token flags) needs more there: the hint is the larger
    assert config.low_latency_layout(1, 128, 1, 1)["total_bytes"] > 1408
    assert config.low_latency_rdma_size_hint(1, 128, 1, 1) == config.low_latency_layout(1, 128, 1, 1)["total_bytes"]
    # M=8, H=1024, E=16: msgs 2064 / 2080 bytes, send = recv = 16*8*2080 = 266240, signal 128 ->
    # 1065216, already a multiple of 128, still gains 128 bytes (DeepEP's rounding)
    assert config.low_latency_rdma_size_hint(8, 1024, 2, 16) == 1_065_344
    for bad, name in (((0, 128, 1, 1), "num_max_dispatch_tokens_per_rank"), ((1, 100, 1, 1), "hidden"),
                      ((1, 128, 3, 4), "num_experts"), ((1, 128, 1.0, 1), "num_ranks")):
        with pytest.raises(ValueError, match=f"^{name}:"):
            config.low_latency_rdma_size_hint(*bad)


def test_partial_wire_rounds_to_24_bits_nearest_even():
    ulp = 2.0 ** -15   # of the wire's 15 mantissa bits at 1.0
    x = np.array([1 + ulp / 2, 1 + 3 * ulp / 2, 1 + 3 * ulp / 4, -(1 + ulp / 2 + 2.0 ** -20), 2.0 ** 24 + 2 ** 7,
                  np.inf, -0.0], np.float32)
    want = np.array([1, 1 + 2 * ulp, 1 + ulp, -(1 + ulp), 2.0 ** 24, np.inf, -0.0], np.float32)
    assert np.array_equal(reference.low_latency_partial_wire(x).view(np.uint32), want.view(np.uint32))


def test_bf16_partial_wire_rounds_to_bf16_nearest_even():
    ulp = 2.0 ** -7    # of bf16's 7 mantissa bits at 1.0
    x = np.array([1 + ulp / 2, 1 + 3 * ulp / 2, 1 + 3 * ulp / 4, -(1 + ulp / 2 + 2.0 ** -20), 2.0 ** 24 + 2 ** 15,
                  np.inf, -0.0], np.float32)
    want = np.array([1, 1 + 2 * ulp, 1 + ulp, -(1 + ulp), 2.0 ** 24, np.inf, -0.0], np.float32)
    got = reference.low_latency_partial_wire(x, bf16=True)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    rng = np.random.default_rng(5)   # and as ml_dtypes rounds fp32 to bf16
    y = (rng.standard_normal(4096) * 2.0 ** rng.integers(-30, 30, 4096)).astype(np.float32)
    assert np.array_equal(reference.low_latency_partial_wire(y, bf16=True),
                          y.astype(reference.bfloat16).astype(np.float32))


def test_combine_sums_the_partials_as_the_wire_carries_them():
    # owner 0's token: expert 0 (own rank) gives -1, experts 2 and 3 (rank 1) give 1 and 1.5 * 2^-16: rank 1's
    # partial 1 + 1.5 * 2^-16 crosses as 1 + 2^-15 (0.75 of the wire's ulp rounds up), so the sum is 2^-15,
    # not the 1.5 * 2^-16 an fp32 partial would give (both exact in bf16)
    E, L, Mx = 4, 2, 4
    y0 = np.zeros((L, 2 * Mx, H), np.float32)
    y1 = np.zeros((L, 2 * Mx, H), np.float32)
    y0[0], y1[0], y1[1] = -1.0, 1.0, 1.5 * 2.0 ** -16
    topk = [np.array([[0, 2, 3]], np.int64), np.zeros((0, 3), np.int64)]
    w = [np.ones((1, 3), np.float32), np.zeros((0, 3), np.float32)]
    out = reference.low_latency_combine([y0.astype(BF16), y1.astype(BF16)], topk, w, Mx, E, rank=0)
    assert np.all(out.astype(np.float32) == np.float32(2.0 ** -15))


def test_mask_ranks_reference():
    idx = np.array([[0, 3, -1, 5], [7, 6, 1, 2]], np.int32)
    got = reference.mask_ranks(idx, [1, 3], 8, 4)  # rank 1 owns experts 2, 3; rank 3 owns 6, 7
    assert got.dtype == np.int32 and got.tolist() == [[0, -1, -1, 5], [-1, -1, 1, -1]]
    assert reference.mask_ranks(idx, np.array([True, False, False, False]), 8, 4).tolist() == \
        [[-1, 3, -1, 5], [7, 6, -1, 2]]
    assert idx[0, 1] == 3  # the input is not changed
    assert reference.mask_ranks(idx, [], 8, 4).tolist() == idx.tolist()
