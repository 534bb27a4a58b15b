"""The numpy oracle of what is specific to the internode path: DeepEP's internode handle and the two-level
(deterministic) combine. Dispatch outputs themselves (rows, order, top-k remapping, per-expert counts) are
exactly :func:`cupy_ep.reference.dispatch`'s; only the handle differs.

Topology: ``R = N * G`` ranks, node ``n = rank // G``, GPU index ``g = rank % G``. A token of rank (n, g) that
selects any GPU of node m travels once over RDMA to (m, g) and is forwarded over NVLink to the GPUs of node m
it selects. Channels are :func:`cupy_ep.reference.channel_ranges` of each source's tokens.

Functions take the global view (one entry per rank, as tests build with an all-gather).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from . import reference


class InternodeHandle(NamedTuple):
    """DeepEP's internode handle , as this rank holds it."""
    is_token_in_rank: np.ndarray                 # [T, R] bool (my tokens)
    rdma_channel_prefix_matrix: np.ndarray       # [N, C] int32: inclusive prefix over channels of my tokens per node
    gbl_channel_prefix_matrix: np.ndarray        # [R, C] int32: the same per destination rank
    recv_rdma_channel_prefix_matrix: np.ndarray  # [N, C] int32: inclusive prefix of what (n, g) sends my node
    recv_rdma_rank_prefix_sum: np.ndarray        # [N] int32: inclusive prefix over source nodes of those totals
    recv_gbl_channel_prefix_matrix: np.ndarray   # [R, C] int32: absolute first recv_x row of (source, channel)
    recv_gbl_rank_prefix_sum: np.ndarray         # [R] int32: inclusive prefix over sources of rows for me
    recv_src_meta: np.ndarray                    # [num_recv, 2] int32: (source node, bit mask of my node's GPUs)
    send_rdma_head: np.ndarray                   # [T, N] int32: ring counter in (channel, node n) or -1
    send_nvl_head: np.ndarray                    # [num_rdma_recv, G] int32: counter in (channel, src node, GPU j) or -1


def node_matrix(is_token_in_rank: np.ndarray, gpus_per_node: int) -> np.ndarray:
    """``[T, N] bool``: the token selects at least one GPU of node n."""
    t, r = is_token_in_rank.shape
    return is_token_in_rank.reshape(t, r // gpus_per_node, gpus_per_node).any(axis=2)


def _counter(selected: np.ndarray, num_channels: int) -> np.ndarray:
    """Per column, the running count of selected rows inside each channel (or -1): send_head's rule."""
    return reference.local_channel_send_head(selected, num_channels)


def handle(is_token_in_rank_list: Sequence[np.ndarray], rank: int, gpus_per_node: int,
           num_channels: int) -> InternodeHandle:
    """The internode handle rank ``rank`` gets from a dispatch where rank r routed ``is_token_in_rank_list[r]``."""
    itr = [np.asarray(a, dtype=bool) for a in is_token_in_rank_list]
    num_ranks, G, C = len(itr), gpus_per_node, num_channels
    N = num_ranks // G
    node, g = divmod(rank, G)
    mine = itr[rank]
    in_node = node_matrix(mine, G)
    rdma_cpm = np.cumsum(reference.local_channel_counts(in_node, C), axis=1).astype(np.int32)
    gbl_cpm = reference.local_channel_prefix_matrix(mine, C)
    # what source (n, g) sends my node, per channel
    from_node = [reference.local_channel_counts(node_matrix(itr[n * G + g], G), C)[node] for n in range(N)]
    recv_rdma_cpm = np.cumsum(np.stack(from_node), axis=1).astype(np.int32)
    recv_rdma_rank_prefix_sum = np.cumsum([int(v.sum()) for v in from_node]).astype(np.int32)
    rpm = reference.rank_prefix_matrix([a.sum(axis=0) for a in itr])
    block_start = np.concatenate([[0], rpm[:-1, rank]]).astype(np.int64)
    rcpm = reference.recv_channel_prefix_matrix([reference.local_channel_counts(a, C)[rank] for a in itr])
    recv_gbl_cpm = (rcpm + block_start[:, None]).astype(np.int32)
    recv_gbl_rank_prefix_sum = rpm[:, rank].astype(np.int32)
    metas = []
    for src in range(num_ranks):
        rows = np.nonzero(itr[src][:, rank])[0]
        bits = (itr[src][rows, node * G:(node + 1) * G].astype(np.int64) << np.arange(G)).sum(axis=1)
        metas.append(np.stack([np.full(rows.size, src // G), bits], axis=1))
    recv_src_meta = np.concatenate(metas).astype(np.int32) if metas else np.zeros((0, 2), np.int32)
    send_rdma_head = _counter(in_node, C)
    # send_nvl_head: rows ordered (source node n, channel c, token), counters per (n, c, GPU j)
    blocks = []
    for n in range(N):
        src = itr[n * G + g]
        sel = node_matrix(src, G)[:, node]
        for s, e in reference.channel_ranges(src.shape[0], C):
            rows = np.nonzero(sel[s:e])[0] + s
            to_gpu = src[rows, node * G:(node + 1) * G]
            counter = np.cumsum(to_gpu, axis=0) - to_gpu
            blocks.append(np.where(to_gpu, counter, -1))
    send_nvl_head = np.concatenate(blocks).astype(np.int32) if blocks else np.zeros((0, G), np.int32)
    return InternodeHandle(mine, rdma_cpm, gbl_cpm, recv_rdma_cpm, recv_rdma_rank_prefix_sum, recv_gbl_cpm,
                           recv_gbl_rank_prefix_sum, recv_src_meta, send_rdma_head, send_nvl_head)


def combine(recv_x_list, is_token_in_rank_list, rank: int, gpus_per_node: int, recv_topk_weights_list=None,
            bias=None):
    """What rank ``rank`` gets back from the internode combine (deterministic, fixed order):

        partial[t, n] = bf16(sum over GPUs j = 0..G-1 of node n holding t of y_(n, j)[row])   (fp32 sum)
        out[t]        = bf16(0 + bias0 + bias1 + sum over nodes n = 0..N-1 of partial[t, n])  (fp32 sum)

    i.e. :func:`cupy_ep.reference.combine` with one extra bf16 rounding per node (the RDMA wire is bf16, as
    DeepEP's). Exact whenever every partial sum is representable in bf16 (e.g. small integers). Weights are
    summed the same way in fp32 without rounding.

    Returns:
        ``(combined_x [T, H] bf16, combined_topk_weights [T, K] float32 or None)``.
    """
    G = gpus_per_node
    rows = reference.combine_rows(is_token_in_rank_list, rank)
    num_tokens, num_ranks = rows.shape
    N = num_ranks // G
    acc = reference.combine_start(recv_x_list, num_tokens, bias)
    hidden = acc.shape[1]
    out_w = None
    if recv_topk_weights_list is not None:
        out_w = np.zeros((num_tokens, np.asarray(recv_topk_weights_list[0]).shape[1]), dtype=np.float32)
    for n in range(N):
        partial = np.zeros((num_tokens, hidden), dtype=np.float32)
        partial_w = None if out_w is None else np.zeros_like(out_w)
        for j in range(G):
            r = n * G + j
            sel = np.nonzero(rows[:, r] >= 0)[0]
            partial[sel] += np.asarray(recv_x_list[r])[rows[sel, r]].astype(np.float32)
            if partial_w is not None:
                partial_w[sel] += np.asarray(recv_topk_weights_list[r], dtype=np.float32)[rows[sel, r]]
        held = (rows[:, n * G:(n + 1) * G] >= 0).any(axis=1)
        acc[held] += partial[held].astype(reference.bfloat16).astype(np.float32)
        if out_w is not None:
            out_w[held] += partial_w[held]
    return acc.astype(reference.bfloat16), out_w


def src_meta_bytes(recv_src_meta: np.ndarray) -> np.ndarray:
    """``[num_recv, 8] uint8``: the handle's raw form of ``recv_src_meta`` (little-endian int32 pairs)."""
    return np.ascontiguousarray(np.asarray(recv_src_meta, dtype="<i4")).view(np.uint8).reshape(-1, 8)
