"""The numpy oracle: what every operation of cupy_ep computes, written as plainly as possible.

Every test compares the GPU kernels and the host backend against these functions. The semantics are
DeepEP V1's (research/deepep.md §1.4-1.6, §1.5b):

* experts are owned contiguously: rank(e) = e // (E / R); ``-1`` in ``topk_idx`` means "no expert";
* dispatch output rows are ordered by (source rank, source token index);
* ``recv_topk_idx`` holds local expert ids (``e - rank * E/R``) or -1, weights are 0 where the id is -1;
* per-expert receive counts are rounded up to ``expert_alignment`` (the rows themselves are not padded);
* combine is an *unweighted* fp32 sum (bias0, then bias1, then the contributions in ascending source-rank
  order) rounded once to bf16; the top-k weights are summed the same way.

Channels: a rank's tokens are cut into ``C`` contiguous ranges, channel ``c`` owning
``[min(c*ceil(T/C), T), min((c+1)*ceil(T/C), T))``. The handle's prefix matrices and ``send_head`` are
defined over those ranges (see :func:`channel_ranges`).

Functions named ``local_*`` need only one rank's data (the host backend uses them); the others take lists
with one entry per rank (the global view that tests build with an all-gather).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import ml_dtypes

bfloat16 = np.dtype(ml_dtypes.bfloat16)
float8_e4m3 = np.dtype(ml_dtypes.float8_e4m3fn)


# ----------------------------------------------------------------------------------------------------------
# layout
# ----------------------------------------------------------------------------------------------------------
def token_rank_matrix(topk_idx: np.ndarray, num_experts: int, num_ranks: int) -> np.ndarray:
    """``is_token_in_rank [T, R] bool``: token t selects at least one expert owned by rank r."""
    topk_idx = np.asarray(topk_idx).astype(np.int64)
    experts_per_rank = num_experts // num_ranks
    out = np.zeros((topk_idx.shape[0], num_ranks), dtype=bool)
    rows, cols = np.nonzero(topk_idx >= 0)
    out[rows, topk_idx[rows, cols] // experts_per_rank] = True
    return out


def get_dispatch_layout(topk_idx: np.ndarray, num_experts: int, num_ranks: int,
                        num_ranks_per_node: int | None = None):
    """Counts of one rank's routing.

    Args:
        topk_idx: ``[T, K]`` integer, -1 = no expert.
        num_experts: E, a multiple of ``num_ranks``.
        num_ranks: R.
        num_ranks_per_node: GPUs per node; when given and R > it, the per-node counts are returned too.

    Returns:
        ``(num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank [N] int32 or None,
        num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool)``. A duplicated expert in one row
        counts twice in ``num_tokens_per_expert`` and once in the per-rank counts.
    """
    topk_idx = np.asarray(topk_idx).astype(np.int64)
    valid = topk_idx[topk_idx >= 0]
    num_tokens_per_expert = np.bincount(valid, minlength=num_experts).astype(np.int32)
    is_token_in_rank = token_rank_matrix(topk_idx, num_experts, num_ranks)
    num_tokens_per_rank = is_token_in_rank.sum(axis=0).astype(np.int32)
    num_tokens_per_rdma_rank = None
    if num_ranks_per_node is not None and num_ranks > num_ranks_per_node:
        num_nodes = num_ranks // num_ranks_per_node
        in_node = is_token_in_rank.reshape(-1, num_nodes, num_ranks_per_node).any(axis=2)
        num_tokens_per_rdma_rank = in_node.sum(axis=0).astype(np.int32)
    return num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank


# ----------------------------------------------------------------------------------------------------------
# channels and the dispatch handle
# ----------------------------------------------------------------------------------------------------------
def channel_ranges(num_tokens: int, num_channels: int) -> list[tuple[int, int]]:
    """Token range ``[start, end)`` of every channel: contiguous blocks of ``ceil(T / C)`` tokens."""
    per = -(-num_tokens // num_channels) if num_channels > 0 else 0
    return [(min(per * c, num_tokens), min(per * c + per, num_tokens)) for c in range(num_channels)]


def local_channel_counts(is_token_in_rank: np.ndarray, num_channels: int) -> np.ndarray:
    """``[R, C] int32``: how many of this rank's tokens in channel c go to rank r."""
    ranges = channel_ranges(is_token_in_rank.shape[0], num_channels)
    counts = np.zeros((is_token_in_rank.shape[1], num_channels), dtype=np.int64)
    for c, (s, e) in enumerate(ranges):
        counts[:, c] = is_token_in_rank[s:e].sum(axis=0)
    return counts.astype(np.int32)


def local_channel_prefix_matrix(is_token_in_rank: np.ndarray, num_channels: int) -> np.ndarray:
    """Sender side ``channel_prefix_matrix [R, C] int32``: inclusive prefix over channels of the counts."""
    return np.cumsum(local_channel_counts(is_token_in_rank, num_channels), axis=1).astype(np.int32)


def local_send_head(is_token_in_rank: np.ndarray, num_channels: int) -> np.ndarray:
    """``send_head [T, R] int32``: the ring counter token t took in (its channel, rank r)'s queue, or -1.

    The counter starts at 0 in every channel and counts the channel's earlier tokens that went to r."""
    num_tokens, num_ranks = is_token_in_rank.shape
    out = np.full((num_tokens, num_ranks), -1, dtype=np.int32)
    for s, e in channel_ranges(num_tokens, num_channels):
        block = is_token_in_rank[s:e].astype(np.int64)
        counter = np.cumsum(block, axis=0) - block
        out[s:e] = np.where(is_token_in_rank[s:e], counter, -1)
    return out


def rank_prefix_matrix(num_tokens_per_rank_list: Sequence[np.ndarray]) -> np.ndarray:
    """``[R, R] int32``: entry [i][j] = tokens sent to rank j by ranks 0..i (inclusive prefix over sources)."""
    mat = np.stack([np.asarray(v, dtype=np.int64) for v in num_tokens_per_rank_list])
    return np.cumsum(mat, axis=0).astype(np.int32)


def recv_channel_prefix_matrix(channel_counts_to_me: Sequence[np.ndarray]) -> np.ndarray:
    """Receiver side ``[R, C] int32``: entry [s][c] = start of (source s, channel c) inside s's block of
    ``recv_x`` (exclusive prefix over channels). ``channel_counts_to_me[s]`` is ``[C]``: what s sends me."""
    counts = np.stack([np.asarray(v, dtype=np.int64) for v in channel_counts_to_me])
    return (np.cumsum(counts, axis=1) - counts).astype(np.int32)


def local_remap_topk(topk_idx: np.ndarray, topk_weights: np.ndarray | None, dst_rank: int,
                     experts_per_rank: int):
    """The top-k of rows as ``dst_rank`` receives them: local expert ids or -1, weights 0 where -1."""
    idx = np.asarray(topk_idx)
    lo = dst_rank * experts_per_rank
    owned = (idx >= lo) & (idx < lo + experts_per_rank)
    new_idx = np.where(owned, idx - lo, -1).astype(idx.dtype)
    new_w = None
    if topk_weights is not None:
        new_w = np.where(owned, np.asarray(topk_weights, dtype=np.float32), np.float32(0)).astype(np.float32)
    return new_idx, new_w


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


# ----------------------------------------------------------------------------------------------------------
# dispatch / combine (global view)
# ----------------------------------------------------------------------------------------------------------
class DispatchResult(NamedTuple):
    recv_x: np.ndarray                     # [N, H] dtype of x (raw bytes moved)
    recv_x_scales: np.ndarray | None       # [N, S] float32 (FP8 only)
    recv_topk_idx: np.ndarray | None       # [N, K] dtype of topk_idx
    recv_topk_weights: np.ndarray | None   # [N, K] float32
    num_recv_tokens_per_expert_list: list  # [E/R] python ints, aligned
    recv_src_idx: np.ndarray               # [N] int32
    rank_prefix_matrix: np.ndarray         # [R, R] int32
    channel_prefix_matrix: np.ndarray | None       # [R, C] int32 (this rank as sender)
    recv_channel_prefix_matrix: np.ndarray | None  # [R, C] int32 (this rank as receiver)
    is_token_in_rank: np.ndarray           # [T, R] bool (this rank's tokens)
    send_head: np.ndarray | None           # [T, R] int32


def dispatch(x_list, topk_idx_list, topk_weights_list, num_experts: int, rank: int,
             expert_alignment: int = 1, x_scales_list=None, num_channels: int | None = None) -> DispatchResult:
    """What rank ``rank`` receives when every rank r dispatches ``x_list[r]`` routed by ``topk_idx_list[r]``.

    Args:
        x_list: per rank ``[T_r, H]`` (bf16, or fp8/uint8 raw bytes).
        topk_idx_list: per rank ``[T_r, K]`` int32/int64, -1 = none.
        topk_weights_list: per rank ``[T_r, K]`` float32, or None.
        num_experts: E.
        rank: the receiving rank.
        expert_alignment: rounding of the per-expert counts.
        x_scales_list: per rank ``[T_r, S]`` float32 FP8 scales, or None.
        num_channels: when given, the channel-dependent handle fields are computed for it.
    """
    num_ranks = len(x_list)
    epr = num_experts // num_ranks
    itr_list = [token_rank_matrix(t, num_experts, num_ranks) for t in topk_idx_list]
    rows = [np.nonzero(itr[:, rank])[0] for itr in itr_list]
    recv_x = np.concatenate([np.asarray(x)[r] for x, r in zip(x_list, rows)], axis=0) if rows else None
    recv_src_idx = np.concatenate(rows).astype(np.int32)
    recv_scales = None
    if x_scales_list is not None:
        recv_scales = np.concatenate([np.asarray(s, dtype=np.float32)[r] for s, r in zip(x_scales_list, rows)])
    recv_topk_idx = recv_topk_weights = None
    if topk_idx_list is not None and topk_weights_list is not None:
        parts = [local_remap_topk(np.asarray(t)[r], np.asarray(w)[r], rank, epr)
                 for t, w, r in zip(topk_idx_list, topk_weights_list, rows)]
        recv_topk_idx = np.concatenate([p[0] for p in parts])
        recv_topk_weights = np.concatenate([p[1] for p in parts])
    counts = np.zeros(epr, dtype=np.int64)
    for t in topk_idx_list:
        t = np.asarray(t).astype(np.int64)
        mine = t[(t >= rank * epr) & (t < (rank + 1) * epr)] - rank * epr
        counts += np.bincount(mine, minlength=epr)
    per_expert = [align_up(int(c), expert_alignment) for c in counts]
    rpm = rank_prefix_matrix([itr.sum(axis=0) for itr in itr_list])
    cpm = rcpm = send_head = None
    if num_channels is not None:
        cpm = local_channel_prefix_matrix(itr_list[rank], num_channels)
        rcpm = recv_channel_prefix_matrix(
            [local_channel_counts(itr, num_channels)[rank] for itr in itr_list])
        send_head = local_send_head(itr_list[rank], num_channels)
    return DispatchResult(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert, recv_src_idx,
                          rpm, cpm, rcpm, itr_list[rank], send_head)


def combine_rows(is_token_in_rank_list: Sequence[np.ndarray], rank: int) -> np.ndarray:
    """``[T, R] int64``: the row of rank ``rank``'s token t inside rank r's ``recv_x`` (or -1)."""
    num_ranks = len(is_token_in_rank_list)
    mine = is_token_in_rank_list[rank]
    rpm = rank_prefix_matrix([itr.sum(axis=0) for itr in is_token_in_rank_list])
    out = np.full(mine.shape, -1, dtype=np.int64)
    for r in range(num_ranks):
        base = int(rpm[rank - 1, r]) if rank > 0 else 0
        sel = np.nonzero(mine[:, r])[0]
        out[sel, r] = base + np.arange(sel.size)
    return out


def combine(recv_x_list, is_token_in_rank_list, rank: int, recv_topk_weights_list=None, bias=None):
    """What rank ``rank`` gets back from combine.

    Args:
        recv_x_list: per rank r, ``[N_r, H]`` bf16: the expert outputs rank r returns (one row per row of
            its dispatch output).
        is_token_in_rank_list: per rank ``[T_r, R]`` bool (from the dispatch handle).
        rank: the token owner we compute for.
        recv_topk_weights_list: per rank ``[N_r, K]`` float32, or None.
        bias: None, one ``[T, H]`` array, or a pair; added first, in fp32.

    Returns:
        ``(combined_x [T, H] bf16, combined_topk_weights [T, K] float32 or None)``.
    """
    rows = combine_rows(is_token_in_rank_list, rank)
    num_tokens, num_ranks = rows.shape
    hidden = np.asarray(recv_x_list[0]).shape[1] if len(recv_x_list) else 0
    acc = np.zeros((num_tokens, hidden), dtype=np.float32)
    biases = [] if bias is None else ([bias] if not isinstance(bias, (tuple, list)) else list(bias))
    for b in biases:
        if b is not None:
            acc += np.asarray(b).astype(np.float32)
    for r in range(num_ranks):
        sel = np.nonzero(rows[:, r] >= 0)[0]
        acc[sel] += np.asarray(recv_x_list[r])[rows[sel, r]].astype(np.float32)
    out_w = None
    if recv_topk_weights_list is not None:
        k = np.asarray(recv_topk_weights_list[0]).shape[1]
        out_w = np.zeros((num_tokens, k), dtype=np.float32)
        for r in range(num_ranks):
            sel = np.nonzero(rows[:, r] >= 0)[0]
            out_w[sel] += np.asarray(recv_topk_weights_list[r], dtype=np.float32)[rows[sel, r]]
    return acc.astype(bfloat16), out_w


def float_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even fp32 -> bf16, as uint16 bit patterns (NaN stays NaN)."""
    return np.asarray(x, dtype=np.float32).astype(bfloat16).view(np.uint16)
