"""The numpy oracle: what every operation of cupy_ep computes, written as plainly as possible.

Every test compares the GPU kernels and the host backend against these functions. The semantics are
DeepEP V1's:

* experts are owned contiguously: rank(e) = e // (E / R); ``-1`` in ``topk_idx`` means "no expert";
* dispatch output rows are ordered by (source rank, source token index);
* ``recv_topk_idx`` holds local expert ids (``e - rank * E/R``) or -1, weights are 0 where the id is -1;
* per-expert receive counts are rounded up to ``expert_alignment`` (the rows themselves are not padded);
* combine is an *unweighted* fp32 sum (bias0, then bias1, then the contributions in ascending source-rank
  order) rounded once to bf16; the top-k weights are summed the same way.

Channels: a rank's tokens are cut into ``C`` contiguous ranges, channel ``c`` owning
``[min(c*ceil(T/C), T), min((c+1)*ceil(T/C), T))``. The handle's prefix matrices are defined over those
ranges (see :func:`channel_ranges`); the intranode ``send_head`` is not (:func:`local_send_head`).

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


def local_channel_send_head(is_token_in_rank: np.ndarray, num_channels: int) -> np.ndarray:
    """``[T, R] int32``: the ring counter token t took in (its channel, rank r)'s queue, or -1 (the
    internode handle's rule).

    The counter starts at 0 in every channel and counts the channel's earlier tokens that went to r."""
    num_tokens, num_ranks = is_token_in_rank.shape
    out = np.full((num_tokens, num_ranks), -1, dtype=np.int32)
    for s, e in channel_ranges(num_tokens, num_channels):
        block = is_token_in_rank[s:e].astype(np.int64)
        counter = np.cumsum(block, axis=0) - block
        out[s:e] = np.where(is_token_in_rank[s:e], counter, -1)
    return out


def local_send_head(is_token_in_rank: np.ndarray) -> np.ndarray:
    """Intranode ``send_head [T, R] int32``: where token t landed inside rank r's block of rows from this
    rank (the count of this rank's earlier tokens that went to r), or -1 if not sent there.

    Independent of channels, so a combine may cut the tokens into other channels than its dispatch did."""
    block = np.asarray(is_token_in_rank).astype(np.int64)
    counter = np.cumsum(block, axis=0) - block
    return np.where(is_token_in_rank, counter, -1).astype(np.int32)


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
        send_head = local_send_head(itr_list[rank])
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


def combine_start(recv_x_list, num_tokens: int, bias=None) -> np.ndarray:
    """The fp32 accumulator a combine starts from: ``[T, H]`` zeros plus the bias(es) (None, one ``[T, H]``
    array or a pair, either may be None), H taken from the expert outputs."""
    hidden = np.asarray(recv_x_list[0]).shape[1] if len(recv_x_list) else 0
    acc = np.zeros((num_tokens, hidden), dtype=np.float32)
    biases = [] if bias is None else ([bias] if not isinstance(bias, (tuple, list)) else list(bias))
    for b in biases:
        if b is not None:
            acc += np.asarray(b).astype(np.float32)
    return acc


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
    acc = combine_start(recv_x_list, num_tokens, bias)
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


# ----------------------------------------------------------------------------------------------------------
# low-latency (decode) mode: FP8 cast, dispatch, combine
# ----------------------------------------------------------------------------------------------------------
#: Largest finite float8_e4m3fn value.
FP8_E4M3_MAX = np.float32(448.0)
#: ``1 / 448`` as the float32 constant DeepEP's kernels multiply by (``kFinfoAmaxInvE4M3``).
FP8_E4M3_MAX_INV = np.float32(1.0 / 448.0)
#: Lower clamp of the per-128-channel amax (``kFP8Margin``).
FP8_AMAX_MARGIN = np.float32(1e-4)
#: The low-latency kernels take at most this many top-k slots per token (DeepEP's take 11, ``kNumMaxTopK``).
LOW_LATENCY_MAX_TOPK = 32


def fp8_scales(amax: np.ndarray, round_scale: bool = False):
    """DeepEP's ``calculate_fp8_scales`` on float32 ``amax`` (any shape): returns ``(scale, scale_inv)``.

    Without ``round_scale``: ``scale = 448 / amax`` (fp32 division) and ``scale_inv = amax * fp32(1/448)``
    (an fp32 product, as the kernel computes it; it can differ from ``amax / 448`` by one ulp). With
    ``round_scale``: ``scale_inv = 2**ceil(log2(amax * fp32(1/448)))``, the ceiling read off the float's
    bits (exponent, plus one when any mantissa bit is set), and ``scale = 1 / scale_inv`` (both exact
    powers of two).
    """
    amax = np.asarray(amax, dtype=np.float32)
    ratio = (amax * FP8_E4M3_MAX_INV).astype(np.float32)
    if not round_scale:
        return (FP8_E4M3_MAX / amax).astype(np.float32), ratio
    bits = ratio.view(np.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(np.int32) - 127 + ((bits & 0x7FFFFF) != 0)
    one = np.float32(1.0)
    return np.ldexp(one, -exponent).astype(np.float32), np.ldexp(one, exponent).astype(np.float32)


def pack_ue8m0(scale_inv: np.ndarray) -> np.ndarray:
    """``[T, S] float32`` power-of-two scales -> ``[T, S/4] int32``: the exponent byte (bits 23..30) of
    group ``4i + j`` in byte ``j`` (bits ``8j .. 8j+7``) of word ``i``. S must be a multiple of 4."""
    exps = (np.asarray(scale_inv, dtype=np.float32).view(np.uint32) >> 23) & 0xFF
    exps = exps.reshape(exps.shape[0], exps.shape[1] // 4, 4)
    words = exps[..., 0] | (exps[..., 1] << 8) | (exps[..., 2] << 16) | (exps[..., 3] << 24)
    return words.astype(np.uint32).view(np.int32)


def unpack_ue8m0(packed: np.ndarray) -> np.ndarray:
    """Inverse of :func:`pack_ue8m0`: ``[T, S/4] int32`` -> ``[T, S] float32`` (``byte << 23`` as a float)."""
    words = np.asarray(packed).astype(np.int32).view(np.uint32)
    exps = np.stack([(words >> (8 * j)) & 0xFF for j in range(4)], axis=-1)
    return (exps.reshape(words.shape[0], words.shape[1] * 4).astype(np.uint32) << 23).view(np.float32)


def per_token_cast_to_fp8(x: np.ndarray, round_scale: bool = False, use_ue8m0: bool = False):
    """The FP8 cast of DeepEP's low-latency dispatch (``ptp128c``: one scale per 128 channels of a token).

    Args:
        x: ``[T, H]`` bf16, ``H % 128 == 0`` (``H % 512 == 0`` with ``use_ue8m0``).
        round_scale: power-of-two scales (see :func:`fp8_scales`).
        use_ue8m0: pack the scales' exponent bytes (needs ``round_scale``; see :func:`pack_ue8m0`).

    Returns:
        ``(x_e4m3 [T, H] uint8, scales)``: per group of 128 channels ``amax = max(1e-4, max |x|)`` in fp32,
        values ``e4m3(clip(fp32(x) * scale, -448, 448))`` rounded to nearest even (the kernel converts with
        ``__NV_SATFINITE``), as raw bytes; ``scales`` = ``scale_inv`` ``[T, H/128] float32``, or with
        ``use_ue8m0`` ``[T, H/512] int32``. Non-finite inputs are not defined.
    """
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] % 128:
        raise ValueError(f"x: must be [T, H] with H % 128 == 0, got shape {x.shape}")
    if use_ue8m0 and not round_scale:
        raise ValueError("use_ue8m0: needs round_scale=True")
    if use_ue8m0 and x.shape[1] % 512:
        raise ValueError(f"x: use_ue8m0 packs 4 scales per int, so H must be a multiple of 512, got {x.shape[1]}")
    num_tokens, hidden = x.shape
    groups = x.astype(np.float32).reshape(num_tokens, hidden // 128, 128)
    amax = np.maximum(np.abs(groups).max(axis=2, initial=0.0), FP8_AMAX_MARGIN)
    scale, scale_inv = fp8_scales(amax, round_scale)
    scaled = (groups * scale[:, :, None]).astype(np.float32)
    values = np.clip(scaled, -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(float8_e4m3)
    data = values.reshape(num_tokens, hidden).view(np.uint8)
    return data, (pack_ue8m0(scale_inv) if use_ue8m0 else scale_inv)


def per_token_cast_back(x_e4m3: np.ndarray, scales: np.ndarray, use_ue8m0: bool = False) -> np.ndarray:
    """``[T, H] float32``: the FP8 values times their group's ``scale_inv`` (an fp32 product).

    ``x_e4m3`` is ``[T, H]`` raw e4m3 bytes (uint8 or float8_e4m3fn); ``scales`` ``[T, H/128] float32``, or
    packed UE8M0 ``[T, H/512] int32`` (taken as UE8M0 when ``use_ue8m0`` or when its dtype is an integer,
    as DeepEP's ``per_token_cast_back``)."""
    data = np.asarray(x_e4m3)
    scales = np.asarray(scales)
    if use_ue8m0 or np.issubdtype(scales.dtype, np.integer):
        scales = unpack_ue8m0(scales)
    num_tokens, hidden = data.shape
    values = data.view(np.uint8).view(float8_e4m3).astype(np.float32).reshape(num_tokens, hidden // 128, 128)
    return (values * scales.astype(np.float32)[:, :, None]).astype(np.float32).reshape(num_tokens, hidden)


class LowLatencyDispatchResult(NamedTuple):
    recv_x: np.ndarray               # [L, R*M, H] bf16, or uint8 e4m3 bytes (use_fp8)
    recv_x_scales: np.ndarray | None  # [L, R*M, H/128] float32 | [L, R*M, H/512] int32 (ue8m0) | None (bf16)
    recv_count: np.ndarray           # [L] int32
    src_info: np.ndarray             # [L, R*M] int32: token index at the source rank
    layout_range: np.ndarray         # [L, R] int64: (begin << 32) | count of each source rank's block


def low_latency_partial_wire(partial: np.ndarray, bf16: bool = False, logfmt: bool = False) -> np.ndarray:
    """An fp32 partial sum as the low-latency combine carries it between ranks: rounded to nearest even to 24 bits
    (sign, 8 exponent bits, 15 mantissa bits; the low byte of the fp32 pattern dropped), i.e. a relative error of
    at most 2^-16, far below the bf16 output's 2^-8. The wire holds 3 bytes per value instead of 4 (a bf16
    plane of the high halves and a byte plane of the next 8 bits); the combine's summation is over these values.
    ``bf16=True`` (the owner's ``bf16_partials``): rounded to nearest even to bf16 (2 bytes per value, a relative
    error of at most 2^-9; finite values, by the kernels' integer rounding). ``logfmt=True`` (the owner's
    ``use_logfmt``): LogFMT-10 per 128 values of the last axis (:mod:`cupy_ep.logfmt`, 1.3125 bytes per value).

    Args:
        partial: float32 array. Returns: float32 array of the same shape, the low 8 (bf16: 16) bits of each
        pattern zero (LogFMT: the decoded values)."""
    if logfmt:
        from . import logfmt as _logfmt
        return _logfmt.roundtrip(partial)
    bits = np.asarray(partial, dtype=np.float32).view(np.uint32).astype(np.uint64)
    drop = 16 if bf16 else 8
    half, keep = (1 << (drop - 1)) - 1, (0xFFFFFFFF >> drop) << drop
    bits = (bits + half + ((bits >> drop) & 1)) & keep
    return bits.astype(np.uint32).view(np.float32)


def low_latency_rows(topk_idx_list, expert: int) -> list[tuple[int, int, int]]:
    """The rows global expert ``expert`` receives in low-latency dispatch, in order: one ``(source rank,
    token, k)`` per top-k slot selecting it, by source rank, then token, then k (all ascending)."""
    rows = []
    for src, topk_idx in enumerate(topk_idx_list):
        tokens, ks = np.nonzero(np.asarray(topk_idx).astype(np.int64) == expert)  # row-major: (t, k) order
        rows += [(src, int(t), int(k)) for t, k in zip(tokens, ks)]
    return rows


def low_latency_slots(topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int) -> np.ndarray:
    """The slot low-latency dispatch gives each top-k entry of one source rank (``handle.topk_slots``).

    Args:
        topk_idx: ``[T, K]`` int32/int64, -1 = none.
        num_max_dispatch_tokens_per_rank, num_experts: M and E.

    Returns:
        ``[T, K] int32``: entry (t, k)'s place among the entries before it (row-major) that select the same expert,
        i.e. its row inside the block its expert receives from this rank (:func:`low_latency_rows`); -1 when it
        names no expert in ``[0, E)`` or its slot is M or more (the kernels drop such an entry).
    """
    idx = np.asarray(topk_idx).astype(np.int64)
    flat = idx.reshape(-1)
    slots = np.full(flat.shape, -1, dtype=np.int32)
    valid = np.flatnonzero((flat >= 0) & (flat < num_experts))
    order = valid[np.argsort(flat[valid], kind="stable")]        # by expert, row-major inside each
    experts = flat[order]
    place = np.arange(order.size) - np.searchsorted(experts, experts, side="left")
    slots[order] = np.where(place < num_max_dispatch_tokens_per_rank, place, -1)
    return slots.reshape(idx.shape)


def mask_ranks(topk_idx, masked, num_experts: int, num_ranks: int) -> np.ndarray:
    """Shrink mode's routing: ``topk_idx`` with every entry naming an expert of a masked rank set to -1 (rank r owns
    experts ``[r*L, (r+1)*L)``, L = E/R). A low-latency call of a Buffer with ``enable_shrink=True`` gives the
    reference's answer on these inputs, a masked rank contributing no tokens.

    Args:
        topk_idx: ``[T, K]`` int32/int64, -1 = none.
        masked: the masked ranks: their numbers (ints), or a ``[R]`` bool mask.
        num_experts, num_ranks: E and R.

    Returns:
        a new ``[T, K]`` array of ``topk_idx``'s dtype.
    """
    idx = np.array(topk_idx, copy=True)
    masked = np.asarray(masked)
    if masked.dtype == np.bool_:
        masked = np.flatnonzero(masked)
    owner = np.where(idx >= 0, idx.astype(np.int64) // (num_experts // num_ranks), -1)
    idx[np.isin(owner, masked.astype(np.int64)) & (idx >= 0)] = -1
    return idx


def low_latency_pack_range(begin, count):
    """``layout_range`` entries: ``(begin << 32) | count`` as int64 (begin/count broadcast)."""
    return (np.asarray(begin, dtype=np.int64) << 32) | np.asarray(count, dtype=np.int64)


def low_latency_unpack_range(layout_range):
    """``(begin, count)`` int64 arrays from ``layout_range`` entries."""
    packed = np.asarray(layout_range, dtype=np.int64)
    return packed >> 32, packed & 0xFFFFFFFF


def low_latency_dispatch(x_list, topk_idx_list, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                         rank: int, use_fp8: bool = True, round_scale: bool = False,
                         use_ue8m0: bool = False) -> LowLatencyDispatchResult:
    """What rank ``rank`` receives from DeepEP's ``low_latency_dispatch`` (global view).

    Args:
        x_list: per rank ``[T_r, H]`` bf16, ``T_r <= M``.
        topk_idx_list: per rank ``[T_r, K]`` int32/int64, -1 = none.
        num_max_dispatch_tokens_per_rank: M (the same on every rank).
        num_experts: E, a multiple of R = ``len(x_list)``; rank r owns experts ``[r*L, (r+1)*L)``, L = E/R.
        rank: the receiving rank.
        use_fp8, round_scale, use_ue8m0: the cast (:func:`per_token_cast_to_fp8` of each source's x; each
            source token is cast once, every row it sends carries the same bytes).

    Returns:
        :class:`LowLatencyDispatchResult`. Rows ``[0, recv_count[e])`` of local expert e are
        :func:`low_latency_rows` of global expert ``rank*L + e``; ``layout_range[e, s]`` packs the begin row
        and count of source s's block (begin = rows of earlier sources, also when the count is 0). Rows
        past ``recv_count`` (and their scales and src_info) are zero here; the GPU leaves them undefined.
    """
    num_ranks = len(x_list)
    num_local = num_experts // num_ranks
    rows_per_expert = num_ranks * num_max_dispatch_tokens_per_rank
    hidden = np.asarray(x_list[0]).shape[1]
    if use_fp8:
        casts = [per_token_cast_to_fp8(x, round_scale, use_ue8m0) for x in x_list]
        sources = [c[0] for c in casts]
        scales_list = [c[1] for c in casts]
        recv_x = np.zeros((num_local, rows_per_expert, hidden), dtype=np.uint8)
        recv_scales = np.zeros((num_local, rows_per_expert) + scales_list[0].shape[1:], dtype=scales_list[0].dtype)
    else:
        sources = [np.asarray(x) for x in x_list]
        scales_list = None
        recv_x = np.zeros((num_local, rows_per_expert, hidden), dtype=bfloat16)
        recv_scales = None
    recv_count = np.zeros(num_local, dtype=np.int32)
    src_info = np.zeros((num_local, rows_per_expert), dtype=np.int32)
    layout_range = np.zeros((num_local, num_ranks), dtype=np.int64)
    for e in range(num_local):
        rows = low_latency_rows(topk_idx_list, rank * num_local + e)
        for i, (src, t, _) in enumerate(rows):
            recv_x[e, i] = sources[src][t]
            if recv_scales is not None:
                recv_scales[e, i] = scales_list[src][t]
            src_info[e, i] = t
        recv_count[e] = len(rows)
        counts = np.array([sum(1 for r in rows if r[0] == s) for s in range(num_ranks)], dtype=np.int64)
        layout_range[e] = low_latency_pack_range(np.cumsum(counts) - counts, counts)
    return LowLatencyDispatchResult(recv_x, recv_scales, recv_count, src_info, layout_range)


def low_latency_combine(y_list, topk_idx_list, topk_weights_list, num_max_dispatch_tokens_per_rank: int,
                        num_experts: int, rank: int, bf16_partials: bool = False,
                        use_logfmt: bool = False) -> np.ndarray:
    """What rank ``rank`` gets back from DeepEP's ``low_latency_combine`` (global view): a *weighted* sum.

    Args:
        y_list: per rank r ``[L, R*M, H]`` bf16: rank r's expert outputs, laid out as its dispatch output
            (row i of local expert e answers the i-th of :func:`low_latency_rows`).
        topk_idx_list, topk_weights_list: per rank ``[T_r, K]`` (the dispatch's routing) and float32 weights.
        num_max_dispatch_tokens_per_rank, num_experts: M and E, as in the dispatch.
        rank: the token owner we compute for.
        bf16_partials: that owner's choice: its partials are rounded to bf16 instead of 24 bits.
        use_logfmt: that owner's choice: its partials cross as LogFMT-10 (:mod:`cupy_ep.logfmt`) instead.

    Returns:
        ``[T, H] bf16``. The reduction order (deterministic; the GPU kernel follows it bit for bit): per expert
        rank r, ascending, that holds an entry of token t, a partial sum ``P_r = 0 + sum over k ascending
        with expert e_k on r of fp32(w[t, k] * y_r[e_k][row of (rank, t, k)])`` (an fp32 product, then an fp32
        sum), rounded to 24 bits (or bf16) as the wire carries it (:func:`low_latency_partial_wire`, the owner's
        own partial too); then ``acc = 0 + P_r`` over those r ascending in fp32, and one bf16 rounding at the end. A
        token with no expert gives zeros.
    """
    num_ranks = len(y_list)
    num_local = num_experts // num_ranks
    topk_idx = np.asarray(topk_idx_list[rank]).astype(np.int64)
    weights = np.asarray(topk_weights_list[rank], dtype=np.float32)
    num_tokens, num_topk = topk_idx.shape
    hidden = np.asarray(y_list[0]).shape[2]
    row = np.full((num_tokens, num_topk), -1, dtype=np.int64)  # row of (t, k) in its expert's [R*M] rows
    for expert in np.unique(topk_idx[topk_idx >= 0]):
        for i, (src, t, k) in enumerate(low_latency_rows(topk_idx_list, int(expert))):
            if src == rank:
                row[t, k] = i
    partial = np.zeros((num_ranks, num_tokens, hidden), dtype=np.float32)
    has = np.zeros((num_ranks, num_tokens), dtype=bool)
    for k in range(num_topk):
        for t in np.nonzero(row[:, k] >= 0)[0]:
            owner, e = divmod(int(topk_idx[t, k]), num_local)
            value = np.asarray(y_list[owner])[e, row[t, k]].astype(np.float32)
            partial[owner, t] = partial[owner, t] + (weights[t, k] * value).astype(np.float32)
            has[owner, t] = True
    partial = low_latency_partial_wire(partial, bf16=bf16_partials, logfmt=use_logfmt)
    acc = np.zeros((num_tokens, hidden), dtype=np.float32)
    for r in range(num_ranks):
        acc[has[r]] = acc[has[r]] + partial[r, has[r]]
    return acc.astype(bfloat16)
