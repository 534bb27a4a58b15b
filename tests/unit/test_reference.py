"""The numpy oracle on small hand-worked examples: every expected value below is a literal worked out by
hand (see the comments), never re-derived with the reference's own code.

The main example has R=2 ranks, E=4 experts (rank 0 owns experts 0-1, rank 1 owns 2-3), K=2:

    rank 0 (T=4): t0 [0, 3]   -> ranks 0 and 1       rank 1 (T=3): u0 [3, 2]  -> rank 1 (both experts)
                  t1 [1, 1]   -> rank 0 (duplicate)                u1 [0, -1] -> rank 0
                  t2 [-1, -1] -> nowhere                           u2 [1, 2]  -> ranks 0 and 1
                  t3 [2, -1]  -> rank 1

    rank 0 receives t0, t1 (from rank 0) then u1, u2 (from rank 1): recv_src_idx [0, 1, 1, 2]
    rank 1 receives t0, t3 (from rank 0) then u0, u2 (from rank 1): recv_src_idx [0, 3, 0, 2]
"""
from __future__ import annotations

import numpy as np
import pytest

from cupy_ep import reference
from cupy_ep.reference import bfloat16

TOPK = [np.array([[0, 3], [1, 1], [-1, -1], [2, -1]], dtype=np.int64),
        np.array([[3, 2], [0, -1], [1, 2]], dtype=np.int64)]
WEIGHTS = [np.array([[0.5, 0.25], [1.0, 2.0], [3.0, 4.0], [0.125, 8.0]], dtype=np.float32),
           np.array([[1.5, 2.5], [0.75, 9.0], [5.0, 6.0]], dtype=np.float32)]
# token t of rank r carries the values (100 r + 10 t, 100 r + 10 t + 1): every row is recognisable
X = [np.array([[0, 1], [10, 11], [20, 21], [30, 31]], dtype=np.float32).astype(bfloat16),
     np.array([[100, 101], [110, 111], [120, 121]], dtype=np.float32).astype(bfloat16)]
NUM_EXPERTS = 4


def bf16(values) -> np.ndarray:
    return np.array(values, dtype=np.float32).astype(bfloat16)


def bits(a) -> list:
    return np.asarray(a).view(np.uint16).tolist()


# ---- layout ------------------------------------------------------------------------------------------
def test_layout_counts_duplicates_twice_per_expert_once_per_rank():
    per_rank, per_rdma, per_expert, in_rank = reference.get_dispatch_layout(TOPK[0], NUM_EXPERTS, 2)
    assert per_rank.dtype == np.int32 and per_expert.dtype == np.int32 and in_rank.dtype == bool
    assert per_rank.tolist() == [2, 2]                 # rank 0: t0, t1; rank 1: t0, t3
    assert per_expert.tolist() == [1, 2, 1, 1]         # expert 1 twice (t1 holds it twice)
    assert in_rank.tolist() == [[True, True], [True, False], [False, False], [False, True]]
    assert per_rdma is None


def test_layout_zero_tokens():
    per_rank, per_rdma, per_expert, in_rank = reference.get_dispatch_layout(
        np.zeros((0, 3), dtype=np.int64), 6, 2)
    assert per_rank.tolist() == [0, 0]
    assert per_expert.tolist() == [0] * 6
    assert in_rank.shape == (0, 2) and per_rdma is None


def test_layout_all_minus_one_rows():
    per_rank, _, per_expert, in_rank = reference.get_dispatch_layout(np.full((3, 2), -1, np.int32), 4, 2)
    assert per_rank.tolist() == [0, 0]
    assert per_expert.tolist() == [0, 0, 0, 0]
    assert not in_rank.any() and in_rank.shape == (3, 2)


def test_layout_one_expert_per_rank():
    per_rank, _, per_expert, in_rank = reference.get_dispatch_layout(np.array([[0], [1], [1], [-1]]), 2, 2)
    assert per_rank.tolist() == [1, 2]
    assert per_expert.tolist() == [1, 2]
    assert in_rank.tolist() == [[True, False], [False, True], [False, True], [False, False]]


def test_layout_per_node_counts():
    # R=4, 2 ranks per node, E=8 (2 per rank): [0, 7] -> ranks 0, 3 (nodes 0, 1); [2, 3] -> rank 1
    # (node 0, once); [-1, -1] nowhere; [4, 6] -> ranks 2, 3 (node 1, once)
    topk = np.array([[0, 7], [2, 3], [-1, -1], [4, 6]])
    per_rank, per_rdma, per_expert, _ = reference.get_dispatch_layout(topk, 8, 4, num_ranks_per_node=2)
    assert per_rank.tolist() == [1, 1, 1, 2]
    assert per_rdma.tolist() == [2, 2]
    assert per_expert.tolist() == [1, 0, 1, 1, 1, 0, 1, 1]
    assert reference.get_dispatch_layout(topk, 8, 4, num_ranks_per_node=4)[1] is None
    assert reference.get_dispatch_layout(topk, 8, 4)[1] is None


# ---- channels ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_tokens, num_channels, want", [
    (4, 3, [(0, 2), (2, 4), (4, 4)]),
    (5, 3, [(0, 2), (2, 4), (4, 5)]),
    (3, 3, [(0, 1), (1, 2), (2, 3)]),
    (2, 3, [(0, 1), (1, 2), (2, 2)]),
    (0, 2, [(0, 0), (0, 0)]),
    (7, 1, [(0, 7)]),
])
def test_channel_ranges(num_tokens, num_channels, want):
    assert reference.channel_ranges(num_tokens, num_channels) == want


# ---- dispatch ----------------------------------------------------------------------------------------
def _dispatch(rank, **kwargs):
    return reference.dispatch(X, TOPK, WEIGHTS, NUM_EXPERTS, rank, **kwargs)


def test_dispatch_rows_order_and_remap():
    r0, r1 = _dispatch(0), _dispatch(1)
    assert r0.recv_src_idx.tolist() == [0, 1, 1, 2] and r0.recv_src_idx.dtype == np.int32
    assert r1.recv_src_idx.tolist() == [0, 3, 0, 2]
    assert r0.recv_x.astype(np.float32).tolist() == [[0, 1], [10, 11], [110, 111], [120, 121]]
    assert r1.recv_x.astype(np.float32).tolist() == [[0, 1], [30, 31], [100, 101], [120, 121]]
    assert r0.recv_x.dtype == bfloat16
    # local ids: rank 0 keeps experts 0, 1 as 0, 1; rank 1 maps 2, 3 to 0, 1; others become -1
    assert r0.recv_topk_idx.tolist() == [[0, -1], [1, 1], [0, -1], [1, -1]]
    assert r1.recv_topk_idx.tolist() == [[-1, 1], [0, -1], [1, 0], [-1, 0]]
    assert r0.recv_topk_weights.tolist() == [[0.5, 0], [1, 2], [0.75, 0], [5, 0]]
    assert r1.recv_topk_weights.tolist() == [[0, 0.25], [0.125, 0], [1.5, 2.5], [0, 6]]
    assert r0.recv_x_scales is None


@pytest.mark.parametrize("alignment, want0, want1", [
    (1, [2, 3], [3, 2]),          # rank 0: e0 <- t0, u1; e1 <- t1 (twice), u2. rank 1: e2 <- t3, u0, u2
    (2, [2, 4], [4, 2]),
    (128, [128, 128], [128, 128]),
])
def test_dispatch_expert_counts_aligned(alignment, want0, want1):
    assert _dispatch(0, expert_alignment=alignment).num_recv_tokens_per_expert_list == want0
    assert _dispatch(1, expert_alignment=alignment).num_recv_tokens_per_expert_list == want1


def test_dispatch_rank_prefix_matrix():
    # rank 0 sends [2, 2] (to rank 0, rank 1), rank 1 sends [2, 2] (u1, u2 to 0; u0, u2 to 1)
    assert _dispatch(0).rank_prefix_matrix.tolist() == [[2, 2], [4, 4]]
    assert reference.rank_prefix_matrix([np.array([3, 0, 1]), np.array([0, 0, 2]), np.array([1, 5, 0])]
                                        ).tolist() == [[3, 0, 1], [3, 0, 3], [4, 5, 3]]


def test_dispatch_handle_fields_three_channels():
    r0 = _dispatch(0, num_channels=3)
    r1 = _dispatch(1, num_channels=3)
    # rank 0: T=4, C=3 -> channels {t0, t1}, {t2, t3}, {}; to rank 0: 2, 0, 0; to rank 1: 1 (t0), 1 (t3), 0
    assert r0.channel_prefix_matrix.tolist() == [[2, 2, 2], [1, 2, 2]]
    # rank 1: T=3, C=3 -> channels {u0}, {u1}, {u2}; to rank 0: 0, 1, 1; to rank 1: 1, 0, 1
    assert r1.channel_prefix_matrix.tolist() == [[0, 1, 2], [1, 1, 2]]
    # receiver side, exclusive prefix inside each source block: rank 0 gets [2, 0, 0] from rank 0 and
    # [0, 1, 1] from rank 1; rank 1 gets [1, 1, 0] and [1, 0, 1]
    assert r0.recv_channel_prefix_matrix.tolist() == [[0, 2, 2], [0, 0, 1]]
    assert r1.recv_channel_prefix_matrix.tolist() == [[0, 1, 2], [0, 1, 1]]
    # send_head: the token's row inside the destination's block of rows from this rank, -1 if not sent
    # (channels do not matter: t3 is rank 0's second token to rank 1 although it is alone in its channel)
    assert r0.send_head.tolist() == [[0, 0], [1, -1], [-1, -1], [-1, 1]]
    assert r1.send_head.tolist() == [[-1, 0], [0, -1], [1, 1]]
    assert r0.send_head.dtype == np.int32 and r0.channel_prefix_matrix.dtype == np.int32
    assert r0.is_token_in_rank.tolist() == [[True, True], [True, False], [False, False], [False, True]]


def test_dispatch_handle_fields_two_channels():
    r0 = _dispatch(0, num_channels=2)
    r1 = _dispatch(1, num_channels=2)
    # rank 1: T=3, C=2 -> channels {u0, u1}, {u2}
    assert r0.channel_prefix_matrix.tolist() == [[2, 2], [1, 2]]
    assert r1.channel_prefix_matrix.tolist() == [[1, 2], [1, 2]]
    assert r0.recv_channel_prefix_matrix.tolist() == [[0, 2], [0, 1]]
    assert r1.recv_channel_prefix_matrix.tolist() == [[0, 1], [0, 1]]
    assert r1.send_head.tolist() == [[-1, 0], [0, -1], [1, 1]]
    # the same with one channel: send_head does not depend on the channels
    assert reference.dispatch(X, TOPK, WEIGHTS, NUM_EXPERTS, 1, num_channels=1).send_head.tolist() == \
        [[-1, 0], [0, -1], [1, 1]]


def test_channel_send_head_restarts_in_every_channel():
    # the internode rule: rank 1's u2 opens channel 1 of 2, so its counters are 0
    itr = reference.token_rank_matrix(TOPK[1], NUM_EXPERTS, 2)
    assert reference.local_channel_send_head(itr, 2).tolist() == [[-1, 0], [0, -1], [0, 0]]
    assert reference.local_channel_send_head(itr, 1).tolist() == reference.local_send_head(itr).tolist()


def test_dispatch_without_channels_leaves_channel_fields_empty():
    r0 = _dispatch(0)
    assert r0.channel_prefix_matrix is None and r0.recv_channel_prefix_matrix is None and r0.send_head is None


def test_dispatch_fp8_scales_and_int32_topk():
    scales = [np.array([[1], [2], [3], [4]], np.float32), np.array([[5], [6], [7]], np.float32)]
    x8 = [np.arange(8, dtype=np.uint8).reshape(4, 2), np.arange(100, 106, dtype=np.uint8).reshape(3, 2)]
    topk32 = [t.astype(np.int32) for t in TOPK]
    r0 = reference.dispatch(x8, topk32, WEIGHTS, NUM_EXPERTS, 0, x_scales_list=scales)
    assert r0.recv_x.dtype == np.uint8 and r0.recv_x.tolist() == [[0, 1], [2, 3], [102, 103], [104, 105]]
    assert r0.recv_x_scales.tolist() == [[1], [2], [6], [7]]
    assert r0.recv_topk_idx.dtype == np.int32


def test_dispatch_zero_tokens_everywhere():
    empty_x = [np.zeros((0, 16), bfloat16)] * 2
    empty_k = [np.zeros((0, 3), np.int64)] * 2
    empty_w = [np.zeros((0, 3), np.float32)] * 2
    r = reference.dispatch(empty_x, empty_k, empty_w, 4, 1, expert_alignment=128, num_channels=2)
    assert r.recv_x.shape == (0, 16) and r.recv_topk_idx.shape == (0, 3) and r.recv_src_idx.shape == (0,)
    assert r.num_recv_tokens_per_expert_list == [0, 0]     # 0 stays 0 under any alignment
    assert r.rank_prefix_matrix.tolist() == [[0, 0], [0, 0]]
    assert r.channel_prefix_matrix.tolist() == [[0, 0], [0, 0]]
    assert r.recv_channel_prefix_matrix.tolist() == [[0, 0], [0, 0]]
    assert r.send_head.shape == (0, 2)


def test_dispatch_all_minus_one_on_one_rank():
    topk = [np.full((2, 2), -1, np.int64), np.array([[0, 1], [2, -1]])]
    x = [bf16([[1, 1], [2, 2]]), bf16([[3, 3], [4, 4]])]
    w = [np.ones((2, 2), np.float32)] * 2
    r0 = reference.dispatch(x, topk, w, 4, 0)
    assert r0.recv_src_idx.tolist() == [0]
    assert r0.recv_x.astype(np.float32).tolist() == [[3, 3]]
    assert r0.rank_prefix_matrix.tolist() == [[0, 0], [1, 1]]
    assert r0.num_recv_tokens_per_expert_list == [1, 1]


def test_local_remap_keeps_dtype():
    idx, w = reference.local_remap_topk(np.array([[4, 5, -1, 3]], np.int32), np.ones((1, 4), np.float32), 2, 2)
    assert idx.dtype == np.int32 and idx.tolist() == [[0, 1, -1, -1]]
    assert w.tolist() == [[1, 1, 0, 0]]


# ---- combine -----------------------------------------------------------------------------------------
def test_combine_rows():
    in_rank = [reference.token_rank_matrix(t, NUM_EXPERTS, 2) for t in TOPK]
    # rank 0's token t0 is row 0 at both ranks, t1 row 1 at rank 0, t3 row 1 at rank 1
    assert reference.combine_rows(in_rank, 0).tolist() == [[0, 0], [1, -1], [-1, -1], [-1, 1]]
    # rank 1's rows start after rank 0's block (2 rows at each rank)
    assert reference.combine_rows(in_rank, 1).tolist() == [[-1, 2], [2, -1], [3, 3]]


def test_combine_two_biases_single_bf16_rounding():
    in_rank = [reference.token_rank_matrix(t, NUM_EXPERTS, 2) for t in TOPK]
    e8, e9 = 2.0 ** -8, 2.0 ** -9
    big = 2.0 ** 24
    # the rows each rank returns (rows 2-3 belong to rank 1's tokens and do not reach rank 0)
    y = [bf16([[e8, 1], [3, 0.5], [100, 100], [100, 100]]),
         bf16([[e8, -big], [-7, 0.25], [100, 100], [100, 100]])]
    bias0 = bf16([[1, big], [0, 0.5], [5, -0.0], [1, 3]])
    bias1 = bf16([[0, 1], [e8, 0], [0, -0.0], [e9, 0]])
    out, out_w = reference.combine(y, in_rank, 0, bias=(bias0, bias1))
    assert out.dtype == bfloat16 and out_w is None
    # t0: 1 + 0 + 2^-8 + 2^-8 = 1 + 2^-7 (bf16 per step would give 1.0: each 1 + 2^-8 ties to even);
    #     2^24 + 1 + 1 - 2^24 = 0 in fp32 in this order (each +1 is lost), i.e. bias0, bias1, rank 0, rank 1
    # t1: 0 + 2^-8 + 3 = 3.00390625 -> 3.0;  0.5 + 0 + 0.5 = 1.0
    # t2: biases only: 5 + 0 = 5;  0 + (-0) + (-0) = +0 (the sum starts from +0)
    # t3: 1 + 2^-9 - 7 = -5.998046875 -> -6.0 (ulp 2^-5);  3 + 0 + 0.25 = 3.25
    assert bits(out) == [[0x3F81, 0x0000], [0x4040, 0x3F80], [0x40A0, 0x0000], [0xC0C0, 0x4050]]
    one_bias, _ = reference.combine(y, in_rank, 0, bias=bias0)
    # t0 col 0: 1 + 2^-8 + 2^-8 = 1 + 2^-7; col 1: 2^24 + 1 (lost) - 2^24 = 0
    assert bits(one_bias)[0] == [0x3F81, 0x0000]
    no_bias, _ = reference.combine(y, in_rank, 0)
    assert bits(no_bias) == [[0x3C00, 0xCB80], [0x4040, 0x3F00], [0x0000, 0x0000], [0xC0E0, 0x3E80]]


def test_combine_weights_sum_back_to_the_originals():
    in_rank = [reference.token_rank_matrix(t, NUM_EXPERTS, 2) for t in TOPK]
    recv_w = [_dispatch(0).recv_topk_weights, _dispatch(1).recv_topk_weights]
    y = [np.zeros((4, 2), bfloat16)] * 2
    _, w0 = reference.combine(y, in_rank, 0, recv_topk_weights_list=recv_w)
    _, w1 = reference.combine(y, in_rank, 1, recv_topk_weights_list=recv_w)
    # -1 slots come back as 0 (t2 is nowhere; t3's 2nd slot and u1's 2nd slot are -1)
    assert w0.dtype == np.float32
    assert w0.tolist() == [[0.5, 0.25], [1, 2], [0, 0], [0.125, 0]]
    assert w1.tolist() == [[1.5, 2.5], [0.75, 0], [5, 6]]


def test_float_to_bf16_bits_round_to_nearest_even():
    vals = np.array([1.0, 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 1 + 2.0 ** -8 + 2.0 ** -20, -2.5, np.inf],
                    dtype=np.float32)
    assert reference.float_to_bf16_bits(vals).tolist() == [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0xC020, 0x7F80]
    nan = reference.float_to_bf16_bits(np.array([np.nan], np.float32))[0]
    assert (nan & 0x7F80) == 0x7F80 and (nan & 0x007F) != 0
