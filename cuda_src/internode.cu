// internode.cu: the hierarchical normal (high-throughput) path across nodes (DeepEP V1's internode design).
//
// A token crosses the RDMA domain once per destination node, to the GPU with the same local index, which
// forwards it over NVLink to the destination GPUs of its node. Combine goes back the same way: each
// forwarder reduces the rows of its node's GPUs, sends one row per token over RDMA, and the token's owner
// reduces over nodes.
//
// Kernels (templated on kNumRdmaRanks N (nodes), kNumNvlRanks G (GPUs per node), the RDMA transport
// (transport/rdma.cuh: IpcRdma or NvshmemRdma) and, for dispatch, the top-k index type):
//   internode_notify_dispatch   count exchange (per node over RDMA, per GPU over NVLink) -> the prefix matrices
//                               of DeepEP's internode handle + receive counts to the host; zeroes the dispatch rings
//   internode_cached_notify     barriers + zero the dispatch or combine rings (cached dispatch, every combine)
//   internode_dispatch          channels = SM pairs; warp roles below
//   internode_combine           the reverse path; warp roles below
//   internode_carve_probe       writes the layout sums (a GPU test compares them with cupy_ep/config.py)
//
// The roles below are member functions of DispatchContext (internode/dispatch.cuh) and CombineContext
// (internode/combine.cuh); dispatch_role_of / combine_role_of map a warp to its role.
//
// Dispatch, channel c = SM pair (2c, 2c+1):
//   odd SM:  kRDMASender x kDispatchSenderWarps: token t of the channel is written by warp (t - begin) % S into
//              its slot for every destination node, then released in order through a 32-token window per node
//              under a shared-memory lock (s_lock/s_window/s_released). Two paths per node (rdma_ring_for): where
//              stores reach the node's buffer (own node; a peer the transport maps, Rdma::direct) straight into
//              its receive half, else into my send half, from which the coordinator puts
//            kRDMASenderCoordinator: takes the released slots in chunks (<= rdma_send, never across the ring's
//              wrap), puts a chunk only on the put path, and signals the destination's tail with fence + atomic add
//            kNVLReceivers x G: warp j drains the NVLink ring from forwarder GPU j into recv_x (rows by source rank)
//   even SM: kRDMAAndNVLForwarder x G: warp j reads every RDMA token of the channel (all source nodes, round robin)
//              and copies those for GPU j into GPU j's NVLink ring
//            kForwarderCoordinator: min over the forwarder warps of what they consumed per source node, returned
//              to the source as its head, lazily (chunks of rdma_send; hence rdma_recv >= 2 * rdma_send)
// Combine, channel c:
//   even SM: kNVLSender x G: warp k sends my rows that came through forwarder GPU k back to it, into the sub-ring
//              of the token's origin node; kRDMAReceiver x kCombineRecvWarps: reduce a token over the origin's
//              nodes; kCoordinator: returns RDMA heads of those receivers, lazily
//   odd SM:  kNVLAndRDMAForwarder x N: warp n reduces the rows of origin node n over my node's GPUs and writes the
//              sum into its RDMA slot, by the same two paths as the dispatch (straight into node n's receive half
//              where stores reach it, else my send half and a put per chunk), then signals node n's tail per chunk;
//              it returns the NVLink sub-ring heads itself (one consumer per sub-ring, in order), so this SM needs
//              no coordinator
//
// Deterministic combine: partial_n = bf16(sum over GPUs j = 0..G-1 of row_j) in fp32 at the forwarder of node n
// (the wire is bf16, as DeepEP's), then combined = bf16(0 + bias0 + bias1 + sum over nodes n = 0..N-1 of partial_n)
// in fp32 at the token's owner; weights the same in fp32 without rounding. The order never depends on timing.
//
// Flow control everywhere: the ring protocol of common/ring.cuh (RingProducer / RingConsumer: monotonic tail and
// head counters; the producer waits for space, writes, publishes the tail; the consumer acquires the tail, reads,
// returns the head); the RDMA rings publish and return through the transport (fence + atomic add). Every spin
// goes through the one timed wait (common/wait.cuh); on timeout the kernels return.
//
// STATUS: both the direct path to peers (the default wherever Rdma::direct is not null) and the put path
// (CUPY_EP_INTERNODE_FORCE_PUT=1) pass the GPU tests on both transports (2 x 1 and 2 x 2, H200 box; record in
// benchmarks/results/gpu_tests_h200x2.md).
#include "common/wait.cuh"
#include "common/layout.cuh"
#include "common/lock.cuh"
#include "common/ring.cuh"
#include "transport/rdma.cuh"
#include "internode/roles.cuh"
#include "internode/reduce.cuh"
#include "internode/rdma_ring.cuh"
#include "internode/handshake.cuh"
#include "internode/notify.cuh"
#include "internode/dispatch.cuh"
#include "internode/combine.cuh"

namespace ep {

using namespace internode;

// ---------------------------------------------------------------------------------------------------
// internode_notify_dispatch: grid 1 + N blocks of kNotifyThreads.
// Block 0: barriers; RDMA: to each node n the vector [words | tokens to each GPU of n | tokens needing n |
//   tokens per expert of n]; barrier; recv_rdma_rank_prefix_sum; NVLink: to each GPU j of my node
//   [words | per source node: its tokens (GPU index mine) to j | per local expert of j: sum over source nodes];
//   zero the dispatch ring meta (RDMA and NVLink); barrier; recv_gbl_rank_prefix_sum, per-expert counts and the
//   receive counts to the host; barriers (nobody writes a ring before every rank zeroed its own).
// Block 1 + n: gbl_channel_prefix_matrix rows of node n's GPUs and rdma_channel_prefix_matrix[n].
// host_counters (host-mapped, nullptr with num_worst_tokens): [0] num_recv (written last), [1] num_rdma_recv,
// [2 + e] aligned tokens of local expert e. max_num_recv / max_num_rdma_recv (>= 0 with num_worst_tokens): the
// rows the host allocated; more stops the buffer (kRoleCapacity) before any dispatch writes out of bounds.
// ---------------------------------------------------------------------------------------------------
template <int kNumRdmaRanks, int kNumNvlRanks, typename Rdma>
__global__ void __launch_bounds__(kNotifyThreads, 1)
    internode_notify_dispatch(const int* num_tokens_per_rank, const int* num_tokens_per_rdma_rank,
                              const int* num_tokens_per_expert, int num_experts, const bool* is_token_in_rank,
                              int num_tokens, int num_channels, int expert_alignment, int* rdma_channel_prefix_matrix,
                              int* recv_rdma_rank_prefix_sum, int* gbl_channel_prefix_matrix,
                              int* recv_gbl_rank_prefix_sum, int* host_counters, int max_num_recv,
                              int max_num_rdma_recv, void** nvl_ptrs, char* rdma_base,
                              const unsigned long long* rdma_peers, int rank, int num_rdma_slots, int num_nvl_slots,
                              int hidden_int4, int num_topk, int num_scales, const DeviceCtx* ctx) {
    const NotifyContext<kNumRdmaRanks, kNumNvlRanks, Rdma> c{num_tokens_per_rank,
                                                             num_tokens_per_rdma_rank,
                                                             num_tokens_per_expert,
                                                             num_experts,
                                                             is_token_in_rank,
                                                             num_tokens,
                                                             num_channels,
                                                             expert_alignment,
                                                             rdma_channel_prefix_matrix,
                                                             recv_rdma_rank_prefix_sum,
                                                             gbl_channel_prefix_matrix,
                                                             recv_gbl_rank_prefix_sum,
                                                             host_counters,
                                                             max_num_recv,
                                                             max_num_rdma_recv,
                                                             nvl_ptrs,
                                                             rdma_base,
                                                             rdma_peers,
                                                             rank,
                                                             num_rdma_slots,
                                                             num_nvl_slots,
                                                             hidden_int4,
                                                             num_topk,
                                                             num_scales,
                                                             ctx};
    if (blockIdx.x == 0)
        c.count_exchange();
    else
        c.channel_prefix();
}

// ---------------------------------------------------------------------------------------------------
// internode_cached_notify: 1 block. Barriers, exchange of the call words (RDMA and NVLink), zero the ring
// meta of `op` (dispatch or combine layouts) in my buffers, barriers, compare the words.
// ---------------------------------------------------------------------------------------------------
template <int kNumRdmaRanks, int kNumNvlRanks, typename Rdma>
__global__ void __launch_bounds__(kNotifyThreads, 1)
    internode_cached_notify(int op, int num_channels, int num_rdma_slots, int num_nvl_slots, int hidden_int4,
                            int num_topk, int num_scales, void** nvl_ptrs, char* rdma_base,
                            const unsigned long long* rdma_peers, int rank, const DeviceCtx* ctx) {
    constexpr int N = kNumRdmaRanks, G = kNumNvlRanks;
    const int node = rank / G, nvl_rank = rank % G;
    if (block_aborted(ctx)) return;
    const Rdma rdma(RdmaArgs{rdma_base, rdma_peers, node});
    const InternodeRdmaNotify rnotify(N, G);
    const InternodeNvlNotify nnotify(G);
    const int words[kCallWords] = {op,          num_channels, num_rdma_slots, num_nvl_slots,
                                   hidden_int4, num_topk,     num_scales,     0};
    if (!both_barriers<N, G>(rdma, nvl_ptrs, node, nvl_rank, ctx, kKernelInternodeCachedNotify)) return;
    for (int n = 0; n < N; ++n) {
        int* vec = n == node ? rnotify.counts.recv(rdma_base, 0, node) : rnotify.counts.send(rdma_base, 0, n);
        if (threadIdx.x < kCallWords) vec[threadIdx.x] = words[threadIdx.x];
    }
    for (int i = threadIdx.x; i < G * kCallWords; i += blockDim.x)
        nnotify.counts.on(nvl_ptrs[i / kCallWords], 0, nvl_rank)[i % kCallWords] = words[i % kCallWords];
    __syncthreads();
    fence_acq_rel_sys();
    put_notify_vectors<N>(rdma, rnotify.counts, node, kCallWords);
    if (op == kOpInternodeCombine) {
        const int int4s = TokenFormat(hidden_int4, 0, num_topk, false).int4s;
        const InternodeCombineRdma rl(N, G, num_channels, num_rdma_slots, int4s);
        const InternodeCombineNvl nl(N, G, num_channels, num_nvl_slots, int4s);
        zero_range(rdma_base, rl.begin, rl.meta_end);
        zero_range(nvl_ptrs[nvl_rank], nl.begin, nl.meta_end);
    } else {
        const int int4s = TokenFormat(hidden_int4, num_scales, num_topk, true).int4s;
        const InternodeDispatchRdma rl(N, G, num_channels, num_rdma_slots, int4s);
        const InternodeDispatchNvl nl(N, G, num_channels, num_nvl_slots, int4s);
        zero_range(rdma_base, rl.begin, rl.meta_end);
        zero_range(nvl_ptrs[nvl_rank], nl.begin, nl.meta_end);
    }
    if (!both_barriers<N, G>(rdma, nvl_ptrs, node, nvl_rank, ctx, kKernelInternodeCachedNotify)) return;
    bool ok = true;
    if (threadIdx.x < N && threadIdx.x != node)
        ok = check_words(rnotify.counts.recv(rdma_base, 0, threadIdx.x), words, threadIdx.x * G + nvl_rank, ctx,
                         kKernelInternodeCachedNotify);
    else if (threadIdx.x >= 32 && threadIdx.x - 32 < G && threadIdx.x - 32 != nvl_rank)
        ok = check_words(nnotify.counts.on(nvl_ptrs[nvl_rank], 0, threadIdx.x - 32), words, node * G + threadIdx.x - 32,
                         ctx, kKernelInternodeCachedNotify);
    __syncthreads_and(ok);
}

// ---------------------------------------------------------------------------------------------------
// internode_dispatch: grid 2C, DispatchShape<G>::kThreads threads.
// ---------------------------------------------------------------------------------------------------
// Launch bound 512 (blocks are at most 480 threads): caps registers at 128, as the compile test demands.
template <int kNumRdmaRanks, int kNumNvlRanks, typename Rdma, typename IdxT>
__global__ void __launch_bounds__(512, 1)
    internode_dispatch(int4* recv_x, float* recv_x_scales, IdxT* recv_topk_idx, float* recv_topk_weights,
                       int2* recv_src_meta, int* recv_rdma_channel_prefix_matrix, int* recv_gbl_channel_prefix_matrix,
                       int* send_rdma_head, int* send_nvl_head, const int4* x, const float* x_scales,
                       const IdxT* topk_idx, const float* topk_weights, const bool* is_token_in_rank,
                       const int* rdma_channel_prefix_matrix, const int* recv_rdma_rank_prefix_sum,
                       const int* gbl_channel_prefix_matrix, const int* recv_gbl_rank_prefix_sum, int num_tokens,
                       int num_worst_tokens, int hidden_int4, int num_topk, int num_experts, int num_scales,
                       long long scale_token_stride, long long scale_hidden_stride, void** nvl_ptrs, char* rdma_base,
                       const unsigned long long* rdma_peers, int rank, int num_rdma_send, int num_rdma_slots,
                       int num_nvl_send, int num_nvl_slots, const DeviceCtx* ctx) {
    __shared__ DispatchShared sh;
    const DispatchContext<kNumRdmaRanks, kNumNvlRanks, Rdma, IdxT> c{recv_x,
                                                                     recv_x_scales,
                                                                     recv_topk_idx,
                                                                     recv_topk_weights,
                                                                     recv_src_meta,
                                                                     recv_rdma_channel_prefix_matrix,
                                                                     recv_gbl_channel_prefix_matrix,
                                                                     send_rdma_head,
                                                                     send_nvl_head,
                                                                     x,
                                                                     x_scales,
                                                                     topk_idx,
                                                                     topk_weights,
                                                                     is_token_in_rank,
                                                                     rdma_channel_prefix_matrix,
                                                                     recv_rdma_rank_prefix_sum,
                                                                     gbl_channel_prefix_matrix,
                                                                     recv_gbl_rank_prefix_sum,
                                                                     num_tokens,
                                                                     num_worst_tokens,
                                                                     hidden_int4,
                                                                     num_topk,
                                                                     num_experts,
                                                                     num_scales,
                                                                     scale_token_stride,
                                                                     scale_hidden_stride,
                                                                     nvl_ptrs,
                                                                     rdma_base,
                                                                     rdma_peers,
                                                                     rank,
                                                                     num_rdma_send,
                                                                     num_rdma_slots,
                                                                     num_nvl_send,
                                                                     num_nvl_slots,
                                                                     ctx,
                                                                     sh};
    c.prepare();
    if (block_aborted(ctx)) return;
    const RoleOf role = dispatch_role_of<kNumNvlRanks>(blockIdx.x, c.warp);
    switch (role.role) {
        case kRDMASender:
            c.rdma_sender();
            break;
        case kRDMASenderCoordinator:
            c.rdma_sender_coordinator();
            break;
        case kNVLReceivers:
            c.nvl_receivers(role.target);
            break;
        case kRDMAAndNVLForwarder:
            c.rdma_and_nvl_forwarder(role.target);
            break;
        case kForwarderCoordinator:
            c.forwarder_coordinator();
            break;
        default:
            break;  // kIdle
    }
}

// ---------------------------------------------------------------------------------------------------
// internode_combine: grid 2C (the handle's channel count), CombineShape<N, G>::kThreads threads.
// ---------------------------------------------------------------------------------------------------
template <int kNumRdmaRanks, int kNumNvlRanks, typename Rdma>
__global__ void __launch_bounds__(512, 1)  // blocks have at most 16 warps: caps registers at 128
    internode_combine(int4* combined_x, float* combined_topk_weights, const int4* x, const float* topk_weights,
                      const int4* bias0, const int4* bias1, const int* recv_gbl_channel_prefix_matrix,
                      const int* recv_gbl_rank_prefix_sum, const int* recv_rdma_channel_prefix_matrix,
                      const int* recv_rdma_rank_prefix_sum, const int* send_rdma_head, const int* send_nvl_head,
                      int num_tokens, int hidden_int4, int num_topk, void** nvl_ptrs, char* rdma_base,
                      const unsigned long long* rdma_peers, int rank, int num_rdma_send, int num_rdma_slots,
                      int num_nvl_send, int num_nvl_slots, const DeviceCtx* ctx) {
    __shared__ CombineShared<kNumRdmaRanks, kNumNvlRanks> sh;
    const CombineContext<kNumRdmaRanks, kNumNvlRanks, Rdma> c{combined_x,
                                                              combined_topk_weights,
                                                              x,
                                                              topk_weights,
                                                              bias0,
                                                              bias1,
                                                              recv_gbl_channel_prefix_matrix,
                                                              recv_gbl_rank_prefix_sum,
                                                              recv_rdma_channel_prefix_matrix,
                                                              recv_rdma_rank_prefix_sum,
                                                              send_rdma_head,
                                                              send_nvl_head,
                                                              num_tokens,
                                                              hidden_int4,
                                                              num_topk,
                                                              nvl_ptrs,
                                                              rdma_base,
                                                              rdma_peers,
                                                              rank,
                                                              num_rdma_send,
                                                              num_rdma_slots,
                                                              num_nvl_send,
                                                              num_nvl_slots,
                                                              ctx,
                                                              sh};
    c.prepare();
    if (block_aborted(ctx)) return;
    // The targets are recomputed from the warp here: carried out of combine_role_of they cost the forwarder's
    // reduction five registers.
    const int role = combine_role_of<kNumRdmaRanks, kNumNvlRanks>(blockIdx.x, c.warp).role;
    switch (role) {
        case kNVLSender:
            c.nvl_sender(c.warp);
            break;
        case kRDMAReceiver:
            c.rdma_receiver(c.warp - kNumNvlRanks);
            break;
        case kCoordinator:
            c.coordinator();
            break;
        case kNVLAndRDMAForwarder:
            c.nvl_and_rdma_forwarder(c.warp);
            break;
        default:
            break;  // kIdle
    }
}

// ---------------------------------------------------------------------------------------------------
// internode_put_bandwidth: the transport's ceiling for the benchmark (cupy_ep/tools/bench_internode.py). Region at
// region_offset of every PE's RDMA buffer: [source: bytes_per_peer][landing slot per PE: num_pes x bytes_per_peer];
// every warp puts chunks of the source into its slot on the other PEs, then quiets. Bytes leaving this GPU:
// (num_pes - 1) * bytes_per_peer. Offsets and sizes multiples of 16. Not a communication primitive: scratch use
// of the RDMA buffer's channel area between calls.
// ---------------------------------------------------------------------------------------------------
template <typename Rdma>
__global__ void internode_put_bandwidth(char* rdma_base, const unsigned long long* rdma_peers, int pe, int num_pes,
                                        long long region_offset, long long bytes_per_peer, long long chunk_bytes) {
    const Rdma rdma(RdmaArgs{rdma_base, rdma_peers, pe});
    const long long chunks = (bytes_per_peer + chunk_bytes - 1) / chunk_bytes;
    const long long num_warps = (long long)gridDim.x * (blockDim.x / kWarpSize);
    const long long gwarp = (long long)blockIdx.x * (blockDim.x / kWarpSize) + warp_id();
    const int others = num_pes - 1;
    for (long long i = gwarp; others > 0 && i < others * chunks; i += num_warps) {
        const int k = (int)(i % others);
        const int peer = k >= pe ? k + 1 : k;
        const long long c = i / others;
        const long long bytes = min(chunk_bytes, bytes_per_peer - c * chunk_bytes);
        rdma.put_warp(region_offset + (1LL + pe) * bytes_per_peer + c * chunk_bytes,
                      rdma_base + region_offset + c * chunk_bytes, bytes, peer);
    }
    __syncwarp();
    if (lane_id() == 0) rdma.quiet();
}

// Layout sums for the GPU size test (the same as cupy_ep.config.internode_layout):
// out[0] RDMA channel-area start, out[1] RDMA dispatch end, out[2] RDMA combine end, out[3] NVLink channel-area
// start, out[4] NVLink dispatch end, out[5] NVLink combine end, out[6] dispatch token bytes, out[7] combine
// token bytes.
__global__ void internode_carve_probe(int num_rdma_ranks, int num_nvl_ranks, int num_channels, int num_rdma_slots,
                                      int num_nvl_slots, int hidden_int4, int num_scales, int num_topk,
                                      long long* out) {
    const TokenFormat d(hidden_int4, num_scales, num_topk, true), c(hidden_int4, 0, num_topk, false);
    out[0] = InternodeRdmaNotify(num_rdma_ranks, num_nvl_ranks).end;
    out[1] = InternodeDispatchRdma(num_rdma_ranks, num_nvl_ranks, num_channels, num_rdma_slots, d.int4s).total_end;
    out[2] = InternodeCombineRdma(num_rdma_ranks, num_nvl_ranks, num_channels, num_rdma_slots, c.int4s).total_end;
    out[3] = InternodeNvlNotify(num_nvl_ranks).end;
    out[4] = InternodeDispatchNvl(num_rdma_ranks, num_nvl_ranks, num_channels, num_nvl_slots, d.int4s).total_end;
    out[5] = InternodeCombineNvl(num_rdma_ranks, num_nvl_ranks, num_channels, num_nvl_slots, c.int4s).total_end;
    out[6] = d.bytes;
    out[7] = c.bytes;
}

}  // namespace ep
