"""One launcher per ``__global__`` of the internode path (``cuda_src/internode.cu``).

As :mod:`.kernels` for the intranode path: each kernel has an argument record (a NamedTuple whose fields are the
kernel's parameters in the kernel's order; ``tests/unit/test_kernel_records.py`` compares them with the sources) and one
function with its grid and block rule. The path's kernels are templates over the node count N, the GPUs per node G
and the RDMA transport; a launcher names its instantiation and hands it to ``launch(name, grid, block, args)`` of
the :class:`~.internode.InternodeState` (the comm stream; NVSHMEM module set-up at first use).
"""
from __future__ import annotations

from typing import Any, NamedTuple

from .. import ids, jit

INTERNODE = "internode.cu"
NOTIFY_THREADS = ids.INTERNODE_NOTIFY_THREADS                       # kNotifyThreads
SENDER_WARPS = ids.INTERNODE_DISPATCH_SENDER_WARPS                   # kDispatchSenderWarps
COMBINE_RECV_WARPS = ids.INTERNODE_COMBINE_RECV_WARPS                # kCombineRecvWarps
MAX_COMBINE_FORWARDER_WARPS = ids.INTERNODE_MAX_COMBINE_FORWARDER_WARPS
#: the kernels' ``Rdma`` template argument of each transport
TRANSPORT_TYPES = {"nvshmem": "ep::NvshmemRdma", "ipc": "ep::IpcRdma"}
PUT_BANDWIDTH_THREADS = 32  # the put-ceiling kernel's warm-up launch: one warp


def threads(kind: str, num_nodes: int, gpus_per_node: int) -> int:
    """Block size of the dispatch / combine kernel (DispatchShape / CombineShape in internode/roles.cuh;
    tests/unit/test_mirrors.py compares at compile time)."""
    if kind == "dispatch":
        return (SENDER_WARPS + 1 + gpus_per_node) * 32
    even = gpus_per_node + COMBINE_RECV_WARPS + 1
    odd = min(num_nodes, MAX_COMBINE_FORWARDER_WARPS)
    return max(even, odd) * 32


def kernel_name(kind: str, num_nodes: int, gpus_per_node: int, transport: str, idx_ctype: str | None = None) -> str:
    """Name expression of one internode kernel instantiation."""
    t = TRANSPORT_TYPES[transport]
    if kind == "dispatch":
        return f"ep::internode_dispatch<{num_nodes}, {gpus_per_node}, {t}, {idx_ctype}>"
    return f"ep::internode_{kind}<{num_nodes}, {gpus_per_node}, {t}>"


class InternodeNotifyDispatch(NamedTuple):
    num_tokens_per_rank: Any
    num_tokens_per_rdma_rank: Any
    num_tokens_per_expert: Any
    num_experts: Any
    is_token_in_rank: Any
    num_tokens: Any
    num_channels: Any
    expert_alignment: Any
    rdma_channel_prefix_matrix: Any
    recv_rdma_rank_prefix_sum: Any
    gbl_channel_prefix_matrix: Any
    recv_gbl_rank_prefix_sum: Any
    host_counters: Any
    max_num_recv: Any
    max_num_rdma_recv: Any
    nvl_ptrs: Any
    rdma_base: Any
    rdma_peers: Any
    rank: Any
    num_rdma_slots: Any
    num_nvl_slots: Any
    hidden_int4: Any
    num_topk: Any
    num_scales: Any
    ctx: Any


def notify_dispatch(st, args: InternodeNotifyDispatch, num_nodes: int, gpus_per_node: int, transport: str) -> None:
    """Block 0 exchanges the counts; one block per node for its channel prefixes."""
    st.launch(kernel_name("notify_dispatch", num_nodes, gpus_per_node, transport), 1 + num_nodes, NOTIFY_THREADS,
              args)


class InternodeCachedNotify(NamedTuple):
    op: Any
    num_channels: Any
    num_rdma_slots: Any
    num_nvl_slots: Any
    hidden_int4: Any
    num_topk: Any
    num_scales: Any
    nvl_ptrs: Any
    rdma_base: Any
    rdma_peers: Any
    rank: Any
    ctx: Any


def cached_notify(st, args: InternodeCachedNotify, num_nodes: int, gpus_per_node: int, transport: str) -> None:
    """One block."""
    st.launch(kernel_name("cached_notify", num_nodes, gpus_per_node, transport), 1, NOTIFY_THREADS, args)


class InternodeDispatch(NamedTuple):
    recv_x: Any
    recv_x_scales: Any
    recv_topk_idx: Any
    recv_topk_weights: Any
    recv_src_meta: Any
    recv_rdma_channel_prefix_matrix: Any
    recv_gbl_channel_prefix_matrix: Any
    send_rdma_head: Any
    send_nvl_head: Any
    x: Any
    x_scales: Any
    topk_idx: Any
    topk_weights: Any
    is_token_in_rank: Any
    rdma_channel_prefix_matrix: Any
    recv_rdma_rank_prefix_sum: Any
    gbl_channel_prefix_matrix: Any
    recv_gbl_rank_prefix_sum: Any
    num_tokens: Any
    num_worst_tokens: Any
    hidden_int4: Any
    num_topk: Any
    num_experts: Any
    num_scales: Any
    scale_token_stride: Any
    scale_hidden_stride: Any
    nvl_ptrs: Any
    rdma_base: Any
    rdma_peers: Any
    rank: Any
    num_rdma_send: Any
    num_rdma_slots: Any
    num_nvl_send: Any
    num_nvl_slots: Any
    ctx: Any


def dispatch(st, args: InternodeDispatch, num_nodes: int, gpus_per_node: int, transport: str, idx_ctype: str,
             num_channels: int) -> None:
    """Two blocks per channel (RDMA side, NVLink side), :func:`threads` of the dispatch."""
    st.launch(kernel_name("dispatch", num_nodes, gpus_per_node, transport, idx_ctype), 2 * num_channels,
              threads("dispatch", num_nodes, gpus_per_node), args)


class InternodeCombine(NamedTuple):
    combined_x: Any
    combined_topk_weights: Any
    x: Any
    topk_weights: Any
    bias0: Any
    bias1: Any
    recv_gbl_channel_prefix_matrix: Any
    recv_gbl_rank_prefix_sum: Any
    recv_rdma_channel_prefix_matrix: Any
    recv_rdma_rank_prefix_sum: Any
    send_rdma_head: Any
    send_nvl_head: Any
    num_tokens: Any
    hidden_int4: Any
    num_topk: Any
    nvl_ptrs: Any
    rdma_base: Any
    rdma_peers: Any
    rank: Any
    num_rdma_send: Any
    num_rdma_slots: Any
    num_nvl_send: Any
    num_nvl_slots: Any
    ctx: Any


def combine(st, args: InternodeCombine, num_nodes: int, gpus_per_node: int, transport: str,
            num_channels: int) -> None:
    """Two blocks per channel of the handle, :func:`threads` of the combine."""
    st.launch(kernel_name("combine", num_nodes, gpus_per_node, transport), 2 * num_channels,
              threads("combine", num_nodes, gpus_per_node), args)


class InternodePutBandwidth(NamedTuple):
    rdma_base: Any
    rdma_peers: Any
    pe: Any
    num_pes: Any
    region_offset: Any
    bytes_per_peer: Any
    chunk_bytes: Any


def put_bandwidth_name(transport: str) -> str:
    """Name expression of the put-ceiling kernel of ``transport``."""
    return f"ep::internode_put_bandwidth<{TRANSPORT_TYPES[transport]}>"


def put_bandwidth_warm_up(st, args: InternodePutBandwidth, transport: str) -> None:
    """One warp on the comm stream (loads the module, and with NVSHMEM initialises it, outside any timing)."""
    st.launch(put_bandwidth_name(transport), 1, PUT_BANDWIDTH_THREADS, args)


def put_bandwidth(kernel, args: InternodePutBandwidth, num_blocks: int, threads_per_block: int, stream) -> None:
    """``num_blocks`` x ``threads_per_block`` on ``stream`` (the benchmark's: its timer brackets that stream);
    ``kernel`` the one :func:`put_bandwidth_warm_up` loaded."""
    kernel((num_blocks,), (threads_per_block,), args, stream=stream)


class InternodeCarveProbe(NamedTuple):
    num_rdma_ranks: Any
    num_nvl_ranks: Any
    num_channels: Any
    num_rdma_slots: Any
    num_nvl_slots: Any
    hidden_int4: Any
    num_scales: Any
    num_topk: Any
    out: Any


def carve_probe(args: InternodeCarveProbe) -> None:
    """One thread on the current stream (it reads no buffer: the IPC build serves either transport)."""
    jit.get_kernel(INTERNODE, "ep::internode_carve_probe")((1,), (1,), args)


#: every record by its kernel's name (tests/unit/test_kernel_records.py reads the sources' signatures against these)
RECORDS = {"internode_notify_dispatch": (INTERNODE, InternodeNotifyDispatch),
           "internode_cached_notify": (INTERNODE, InternodeCachedNotify),
           "internode_dispatch": (INTERNODE, InternodeDispatch), "internode_combine": (INTERNODE, InternodeCombine),
           "internode_put_bandwidth": (INTERNODE, InternodePutBandwidth),
           "internode_carve_probe": (INTERNODE, InternodeCarveProbe)}
