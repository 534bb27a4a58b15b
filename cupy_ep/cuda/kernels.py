"""One launcher per ``__global__`` of the intranode path (``cuda_src/layout.cu``, ``cuda_src/intranode.cu``).

Each kernel has an argument record (a NamedTuple: its fields are the kernel's parameters, in the kernel's order,
``tests/unit/test_mirrors.py`` compares them with the sources) and one function that launches it with its grid, block
size and dynamic shared memory rule on the runtime's communication stream (:meth:`.runtime.Runtime.launch`). A record
is a tuple: it is handed to CuPy as the argument tuple itself (building one costs what the tuple did).
"""
from __future__ import annotations

from typing import Any, NamedTuple

from .. import ids
from ..validate import intranode_warps

LAYOUT, INTRANODE = "layout.cu", "intranode.cu"
LAYOUT_THREADS = ids.LAYOUT_THREADS           # kLayoutThreads
NOTIFY_THREADS = 128                          # the notify kernels' block
TMA_BYTES_PER_WARP = ids.TMA_CHUNK_BYTES      # kTmaChunkBytes: a receiver warp's bulk-copy buffer


def data_threads(num_ranks: int) -> int:
    """The block of dispatch / combine (and their zero-copy kernels): ``Groups<kNumRanks>::kThreads``."""
    return intranode_warps(num_ranks) * 32


def data_shared_mem(num_ranks: int) -> int:
    """Their dynamic shared memory: one bulk-copy buffer per warp."""
    return intranode_warps(num_ranks) * TMA_BYTES_PER_WARP


def idx_ctype(idx_name: str) -> str:
    """The ``IdxT`` template argument of a ``topk_idx`` dtype name."""
    return "long long" if idx_name == "int64" else "int"


# ---- layout.cu ----------------------------------------------------------------------------------------------
class GetDispatchLayout(NamedTuple):
    topk_idx: Any
    num_tokens: Any
    num_topk: Any
    num_experts: Any
    num_ranks: Any
    ranks_per_node: Any
    num_tokens_per_rank: Any
    num_tokens_per_rdma_rank: Any
    num_tokens_per_expert: Any
    is_token_in_rank: Any
    workspace: Any


def get_dispatch_layout(rt, args: GetDispatchLayout, ctype: str, num_tokens: int, num_topk: int, num_columns: int,
                        num_device_sms: int) -> None:
    """Grid: enough blocks for the tokens (a warp pass covers 32 / G tokens, G the next power of two >= K), at most
    two per SM; shared memory: one int per counted column (experts, ranks, nodes)."""
    tokens_per_block = (LAYOUT_THREADS // 32) * (32 // (1 << max(num_topk - 1, 0).bit_length()))
    grid = max(1, min(-(-num_tokens // tokens_per_block), 2 * num_device_sms))
    rt.launch(LAYOUT, f"ep::get_dispatch_layout<{ctype}>", grid, LAYOUT_THREADS, args, shared_mem=4 * num_columns)


# ---- intranode.cu -------------------------------------------------------------------------------------------
class Barrier(NamedTuple):
    buffer_ptrs: Any
    rank: Any
    ctx: Any


def barrier(rt, args: Barrier, num_ranks: int) -> None:
    """One warp."""
    rt.launch(INTRANODE, f"ep::barrier<{num_ranks}>", 1, 32, args)


class NotifyDispatch(NamedTuple):
    num_tokens_per_rank: Any
    num_tokens_per_expert: Any
    num_experts: Any
    is_token_in_rank: Any
    num_tokens: Any
    num_channels: Any
    expert_alignment: Any
    rank_prefix_matrix: Any
    channel_prefix_matrix: Any
    host_recv_counter: Any
    host_expert_counters: Any
    buffer_ptrs: Any
    rank: Any
    num_slots: Any
    hidden_int4: Any
    num_topk: Any
    num_scales: Any
    direct_capacity: Any
    ctx: Any


def notify_dispatch(rt, args: NotifyDispatch, num_ranks: int) -> None:
    """Block 0 meets the ranks and sums the counts; one block per destination rank for the channel prefixes."""
    rt.launch(INTRANODE, f"ep::notify_dispatch<{num_ranks}>", 1 + num_ranks, NOTIFY_THREADS, args)


class CachedNotifyDispatch(NamedTuple):
    buffer_ptrs: Any
    rank: Any
    num_channels: Any
    num_slots: Any
    hidden_int4: Any
    num_topk: Any
    num_scales: Any
    ctx: Any


def cached_notify_dispatch(rt, args: CachedNotifyDispatch, num_ranks: int) -> None:
    """One block."""
    rt.launch(INTRANODE, f"ep::cached_notify_dispatch<{num_ranks}>", 1, NOTIFY_THREADS, args)


class CachedNotifyCombine(NamedTuple):
    buffer_ptrs: Any
    rank: Any
    num_channels: Any
    num_slots: Any
    hidden_int4: Any
    num_topk: Any
    num_tokens: Any
    ctx: Any


def cached_notify_combine(rt, args: CachedNotifyCombine, num_ranks: int) -> None:
    """One block."""
    rt.launch(INTRANODE, f"ep::cached_notify_combine<{num_ranks}>", 1, NOTIFY_THREADS, args)


class Dispatch(NamedTuple):
    recv_x: Any
    recv_x_scales: Any
    recv_src_idx: Any
    recv_topk_idx: Any
    recv_topk_weights: Any
    recv_channel_prefix_matrix: Any
    send_head: Any
    x: Any
    x_scales: Any
    topk_idx: Any
    topk_weights: Any
    is_token_in_rank: Any
    channel_prefix_matrix: Any
    rank_prefix_matrix: Any
    num_tokens: Any
    num_worst_tokens: Any
    hidden_int4: Any
    num_topk: Any
    num_experts: Any
    num_scales: Any
    scale_token_stride: Any
    scale_hidden_stride: Any
    buffer_ptrs: Any
    rank: Any
    num_channels: Any
    num_max_send_tokens: Any
    num_slots: Any
    ctx: Any


def dispatch(rt, args: Dispatch, num_ranks: int, ctype: str, num_channels: int, num_own_blocks: int) -> None:
    """A sender and a receiver block per channel, then the blocks that copy the rank's own rows."""
    rt.launch(INTRANODE, f"ep::dispatch<{num_ranks}, {ctype}>", 2 * num_channels + num_own_blocks,
              data_threads(num_ranks), args, shared_mem=data_shared_mem(num_ranks))


class DispatchDirect(NamedTuple):
    recv_x_scales: Any
    recv_src_idx: Any
    recv_topk_idx: Any
    recv_topk_weights: Any
    recv_channel_prefix_matrix: Any
    send_head: Any
    x: Any
    x_scales: Any
    topk_idx: Any
    topk_weights: Any
    is_token_in_rank: Any
    channel_prefix_matrix: Any
    rank_prefix_matrix: Any
    num_tokens: Any
    num_out_rows: Any
    hidden_int4: Any
    num_topk: Any
    num_experts: Any
    num_scales: Any
    scale_token_stride: Any
    scale_hidden_stride: Any
    buffer_ptrs: Any
    rank: Any
    num_channels: Any
    capacity: Any
    num_local_blocks: Any
    enter: Any
    ctx: Any


def dispatch_direct(rt, args: DispatchDirect, num_ranks: int, ctype: str, num_sms: int) -> None:
    """``config.num_sms`` blocks (the config's split between the rank's own rows and the peers')."""
    rt.launch(INTRANODE, f"ep::dispatch_direct<{num_ranks}, {ctype}>", num_sms, data_threads(num_ranks), args,
              shared_mem=data_shared_mem(num_ranks))


class Combine(NamedTuple):
    combined_x: Any
    combined_topk_weights: Any
    x: Any
    topk_weights: Any
    bias0: Any
    bias1: Any
    rank_prefix_matrix: Any
    recv_src_idx: Any
    send_head: Any
    num_tokens: Any
    hidden_int4: Any
    num_topk: Any
    buffer_ptrs: Any
    rank: Any
    num_max_send_tokens: Any
    num_slots: Any
    ctx: Any


def combine(rt, args: Combine, num_ranks: int, num_channels: int) -> None:
    """A sender and a receiver block per channel."""
    rt.launch(INTRANODE, f"ep::combine<{num_ranks}>", 2 * num_channels, data_threads(num_ranks), args,
              shared_mem=data_shared_mem(num_ranks))


class CombineDirect(NamedTuple):
    combined_x: Any
    combined_topk_weights: Any
    x: Any
    topk_weights: Any
    bias0: Any
    bias1: Any
    rank_prefix_matrix: Any
    send_head: Any
    num_tokens: Any
    hidden_int4: Any
    num_topk: Any
    buffer_ptrs: Any
    rank: Any
    capacity: Any
    rows_per_flag: Any
    num_sender_blocks: Any
    ctx: Any


def combine_direct(rt, args: CombineDirect, num_ranks: int, num_sms: int) -> None:
    """``config.num_sms`` blocks: ``num_sender_blocks`` store, the rest reduce."""
    rt.launch(INTRANODE, f"ep::combine_direct<{num_ranks}>", num_sms, data_threads(num_ranks), args,
              shared_mem=data_shared_mem(num_ranks))


#: every record by its kernel's name (the mirror test reads the sources' signatures against these)
RECORDS = {"get_dispatch_layout": (LAYOUT, GetDispatchLayout), "barrier": (INTRANODE, Barrier),
           "notify_dispatch": (INTRANODE, NotifyDispatch), "cached_notify_dispatch": (INTRANODE, CachedNotifyDispatch),
           "cached_notify_combine": (INTRANODE, CachedNotifyCombine), "dispatch": (INTRANODE, Dispatch),
           "dispatch_direct": (INTRANODE, DispatchDirect), "combine": (INTRANODE, Combine),
           "combine_direct": (INTRANODE, CombineDirect)}
