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
    constexpr int N = kNumRdmaRanks, G = kNumNvlRanks, R = N * G;
    const int node = rank / G, nvl_rank = rank % G;
    if (blockIdx.x == 0) {
        if (block_aborted(ctx)) return;
        const Rdma rdma(RdmaArgs{rdma_base, rdma_peers, node});
        const InternodeRdmaNotify rnotify(N, G);
        const InternodeNvlNotify nnotify(G);
        const int experts_per_rank = num_experts / R, experts_per_node = experts_per_rank * G;
        const int words[kCallWords] = {kOpInternodeDispatch, num_channels, num_rdma_slots, num_nvl_slots,
                                       hidden_int4, num_topk, num_scales, num_experts};
        const int kRdmaHead = kCallWords + G + 1;  // where the expert counts start in an RDMA vector
        if (!both_barriers<N, G>(rdma, nvl_ptrs, node, nvl_rank, ctx, kKernelInternodeNotifyDispatch)) return;

        // RDMA vectors
        for (int n = 0; n < N; ++n) {
            int* vec = n == node ? rnotify.counts.recv(rdma_base, 0, node) : rnotify.counts.send(rdma_base, 0, n);
            for (int i = threadIdx.x; i < kRdmaHead + experts_per_node; i += blockDim.x) {
                int v;
                if (i < kCallWords) v = words[i];
                else if (i < kCallWords + G) v = num_tokens_per_rank[n * G + i - kCallWords];
                else if (i == kCallWords + G) v = num_tokens_per_rdma_rank[n];
                else v = num_tokens_per_expert[n * experts_per_node + i - kRdmaHead];
                vec[i] = v;
            }
        }
        __syncthreads();
        fence_acq_rel_sys();
        put_notify_vectors<N>(rdma, rnotify.counts, node, kRdmaHead + experts_per_node);
        if (!rdma_barrier<N>(rdma, node, ctx, kKernelInternodeNotifyDispatch)) return;

        // Check the RDMA peers' words; prefix over source nodes; NVLink vectors for my node's GPUs.
        bool ok = true;
        if (threadIdx.x < N && threadIdx.x != node)
            ok = check_words(rnotify.counts.recv(rdma_base, 0, threadIdx.x), words, threadIdx.x * G + nvl_rank, ctx,
                             kKernelInternodeNotifyDispatch);
        if (!__syncthreads_and(ok)) return;
        if (threadIdx.x == 0) {
            int sum = 0;
            for (int n = 0; n < N; ++n) {
                sum += ld_volatile(rnotify.counts.recv(rdma_base, 0, n) + kCallWords + G);
                recv_rdma_rank_prefix_sum[n] = sum;
            }
            if (host_counters != nullptr) host_counters[1] = sum;
            if (max_num_rdma_recv >= 0 && sum > max_num_rdma_recv)
                report_failure(ctx, WaitSite{kKernelInternodeNotifyDispatch, kRoleCapacity, -1, -1}, sum,
                               max_num_rdma_recv, 1, 0);
        }
        for (int j = 0; j < G; ++j) {
            int* vec = nnotify.counts.on(nvl_ptrs[j], 0, nvl_rank);
            for (int i = threadIdx.x; i < kCallWords + kMaxRdmaRanks + experts_per_rank; i += blockDim.x) {
                int v = 0;
                if (i < kCallWords) {
                    v = words[i];
                } else if (i < kCallWords + kMaxRdmaRanks) {
                    const int n = i - kCallWords;
                    if (n < N) v = ld_volatile(rnotify.counts.recv(rdma_base, 0, n) + kCallWords + j);
                } else {
                    const int e = j * experts_per_rank + i - kCallWords - kMaxRdmaRanks;
                    for (int n = 0; n < N; ++n) v += ld_volatile(rnotify.counts.recv(rdma_base, 0, n) + kRdmaHead + e);
                }
                vec[i] = v;
            }
        }
        const InternodeDispatchRdma rl(N, G, num_channels, num_rdma_slots,
                                       TokenFormat(hidden_int4, num_scales, num_topk, true).int4s);
        const InternodeDispatchNvl nl(N, G, num_channels, num_nvl_slots,
                                      TokenFormat(hidden_int4, num_scales, num_topk, true).int4s);
        zero_range(rdma_base, rl.begin, rl.meta_end);
        zero_range(nvl_ptrs[nvl_rank], nl.begin, nl.meta_end);
        __syncthreads();
        if (!nvl_barrier<G>(nvl_ptrs, nvl_rank, ctx, kKernelInternodeNotifyDispatch)) return;

        const int* rows = nnotify.counts.on(nvl_ptrs[nvl_rank], 0, 0);  // [G][kNvlNotifyInts]
        if (threadIdx.x < G && threadIdx.x != nvl_rank)
            ok = check_words(rows + threadIdx.x * kNvlNotifyInts, words, node * G + threadIdx.x, ctx,
                             kKernelInternodeNotifyDispatch);
        if (!__syncthreads_and(ok)) return;
        if (host_counters != nullptr) {
            for (int e = threadIdx.x; e < experts_per_rank; e += blockDim.x) {
                int sum = 0;
                for (int g = 0; g < G; ++g) sum += ld_volatile(rows + g * kNvlNotifyInts + kCallWords + kMaxRdmaRanks + e);
                host_counters[2 + e] = (sum + expert_alignment - 1) / expert_alignment * expert_alignment;
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int sum = 0;
            for (int n = 0; n < N; ++n)
                for (int g = 0; g < G; ++g) {
                    sum += ld_volatile(rows + g * kNvlNotifyInts + kCallWords + n);
                    recv_gbl_rank_prefix_sum[n * G + g] = sum;
                }
            if (max_num_recv >= 0 && sum > max_num_recv)
                report_failure(ctx, WaitSite{kKernelInternodeNotifyDispatch, kRoleCapacity, -1, -1}, sum,
                               max_num_recv, 0, 0);
            if (host_counters != nullptr) {
                __threadfence_system();
                st_volatile(host_counters, sum);
                __threadfence_system();
            }
        }
        both_barriers<N, G>(rdma, nvl_ptrs, node, nvl_rank, ctx, kKernelInternodeNotifyDispatch);
    } else {
        // Channel prefix matrices of destination node n (sender side).
        const int n = blockIdx.x - 1;
        const int num_warps = blockDim.x / kWarpSize;
        for (int c = warp_id(); c < num_channels; c += num_warps) {
            int begin, end;
            channel_range(num_tokens, num_channels, c, begin, end);
            int per_gpu[G], any = 0;
#pragma unroll
            for (int j = 0; j < G; ++j) per_gpu[j] = 0;
            for (int t = begin + lane_id(); t < end; t += kWarpSize) {
                bool in_node = false;
#pragma unroll
                for (int j = 0; j < G; ++j) {
                    const bool in = is_token_in_rank[(long long)t * R + n * G + j];
                    per_gpu[j] += in;
                    in_node |= in;
                }
                any += in_node;
            }
#pragma unroll
            for (int j = 0; j < G; ++j) per_gpu[j] = warp_reduce_sum(per_gpu[j]);
            any = warp_reduce_sum(any);
            if (lane_id() == 0) {
#pragma unroll
                for (int j = 0; j < G; ++j) gbl_channel_prefix_matrix[(n * G + j) * num_channels + c] = per_gpu[j];
                rdma_channel_prefix_matrix[n * num_channels + c] = any;
            }
        }
        __syncthreads();
        if (threadIdx.x <= G) {  // thread j < G: GPU j of node n; thread G: the node
            int* row = threadIdx.x < G ? gbl_channel_prefix_matrix + (n * G + threadIdx.x) * num_channels
                                       : rdma_channel_prefix_matrix + n * num_channels;
            for (int c = 1; c < num_channels; ++c) row[c] += row[c - 1];
        }
    }
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
    const int words[kCallWords] = {op, num_channels, num_rdma_slots, num_nvl_slots, hidden_int4, num_topk,
                                   num_scales, 0};
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
        ok = check_words(nnotify.counts.on(nvl_ptrs[nvl_rank], 0, threadIdx.x - 32), words,
                         node * G + threadIdx.x - 32, ctx, kKernelInternodeCachedNotify);
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
                   int* send_rdma_head, int* send_nvl_head, const int4* x, const float* x_scales, const IdxT* topk_idx,
                   const float* topk_weights, const bool* is_token_in_rank, const int* rdma_channel_prefix_matrix,
                   const int* recv_rdma_rank_prefix_sum, const int* gbl_channel_prefix_matrix,
                   const int* recv_gbl_rank_prefix_sum, int num_tokens, int num_worst_tokens, int hidden_int4,
                   int num_topk, int num_experts, int num_scales, long long scale_token_stride,
                   long long scale_hidden_stride, void** nvl_ptrs, char* rdma_base,
                   const unsigned long long* rdma_peers, int rank, int num_rdma_send, int num_rdma_slots,
                   int num_nvl_send, int num_nvl_slots, const DeviceCtx* ctx) {
    constexpr int N = kNumRdmaRanks, G = kNumNvlRanks, R = N * G, S = kDispatchSenderWarps;
    const int node = rank / G, nvl_rank = rank % G;
    const int num_channels = gridDim.x / 2, channel = blockIdx.x / 2;
    const bool is_sender_sm = (blockIdx.x % 2) == 1;
    const int warp = warp_id(), lane = lane_id();
    const Rdma rdma(RdmaArgs{rdma_base, rdma_peers, node});
    const TokenFormat fmt(hidden_int4, num_scales, num_topk, true);
    const InternodeDispatchRdma rl(N, G, num_channels, num_rdma_slots, fmt.int4s);
    const InternodeDispatchNvl nl(N, G, num_channels, num_nvl_slots, fmt.int4s);
    void* my_nvl = nvl_ptrs[nvl_rank];

    __shared__ int s_lock[kMaxRdmaRanks], s_released[kMaxRdmaRanks];
    __shared__ unsigned s_window[kMaxRdmaRanks];
    __shared__ int s_fwd_head[kMaxNvlRanks][kMaxRdmaRanks];
    __shared__ int s_retired[kMaxNvlRanks];
    for (int i = threadIdx.x; i < kMaxRdmaRanks; i += blockDim.x) s_lock[i] = s_released[i] = s_window[i] = 0;
    for (int i = threadIdx.x; i < kMaxNvlRanks * kMaxRdmaRanks; i += blockDim.x) s_fwd_head[i / kMaxRdmaRanks][i % kMaxRdmaRanks] = 0;
    for (int i = threadIdx.x; i < kMaxNvlRanks; i += blockDim.x) s_retired[i] = 0;
    // num_worst_tokens: rows past the real count carry recv_topk_idx = -1 (nobody else writes them).
    if (num_worst_tokens > 0 && recv_topk_idx != nullptr) {
        const long long num_recv = recv_gbl_rank_prefix_sum[R - 1];
        const long long stride = (long long)gridDim.x * blockDim.x;
        for (long long i = num_recv * num_topk + (long long)blockIdx.x * blockDim.x + threadIdx.x;
             i < (long long)num_worst_tokens * num_topk; i += stride)
            recv_topk_idx[i] = (IdxT)-1;
    }
    if (block_aborted(ctx)) return;

    if (is_sender_sm && warp < S) {
        // ---- kRDMASender --------------------------------------------------------------------------
        int begin, end;
        channel_range(num_tokens, num_channels, channel, begin, end);
        // Meta for every destination node (-v-1 encoded: 0 keeps meaning "not written yet").
        for (int n = warp; n < N; n += S) {
            int* meta = n == node ? rl.meta.recv(rdma_base, channel, node) : rl.meta.send(rdma_base, channel, n);
            const int prev = channel - 1;
            if (lane < G) {
                const int* row = gbl_channel_prefix_matrix + (n * G + lane) * num_channels;
                meta[lane] = -(prev >= 0 ? row[prev] : 0) - 1;
                meta[G + lane] = -row[channel] - 1;
            }
            if (lane == 0) {
                const int* row = rdma_channel_prefix_matrix + n * num_channels;
                meta[2 * G] = -(prev >= 0 ? row[prev] : 0) - 1;
                meta[2 * G + 1] = -row[channel] - 1;
            }
            __syncwarp();
            if (n != node) {
                fence_acq_rel_sys();
                rdma.put_warp(offset_in(rdma_base, rl.meta.recv(rdma_base, channel, node)), meta,
                              4LL * rdma_meta_ints(G), n);
            }
        }
        __syncwarp();
        if (lane == 0 && warp < N) rdma.quiet();  // every put of this kernel completes inside it
        // Every sender warp scans every token so that lane n knows the node-n ring counter (`tail`).
        int tail = 0, cached_head = 0;  // lane n < N
        // node n's ring: its tail is published by the coordinator (rdma_publish_slots)
        const RingProducer<> ring{nullptr, rl.head.on(rdma_base, channel, lane < N ? lane : 0), num_rdma_slots};
        const SharedLock window_lock{&s_lock[lane < N ? lane : 0]};
        bool ok = true;
        for (int t = begin; t < end && ok; ++t) {
            unsigned bits = 0;
            if (lane < N) {
#pragma unroll
                for (int j = 0; j < G; ++j) bits |= is_token_in_rank[(long long)t * R + lane * G + j] ? (1u << j) : 0u;
            }
            const bool in_node = bits != 0;
            const unsigned node_mask = __ballot_sync(kFullMask, in_node);
            if ((t - begin) % S == warp) {
                if (lane < N && send_rdma_head != nullptr) send_rdma_head[(long long)t * N + lane] = in_node ? tail : -1;
                ok = ring.wait_for_space<kByWarpAll>(
                    ctx, WaitSite{kKernelInternodeDispatch, kRDMASender, channel, lane}, tail, cached_head, 1,
                    [&](long long& h, long long& tl, long long& e) { h = cached_head; tl = tail; e = num_rdma_slots; },
                    in_node);
                if (!ok) break;
                for (unsigned m = node_mask; m != 0; m &= m - 1) {
                    const int n = __ffs(m) - 1;
                    const int slot = __shfl_sync(kFullMask, tail, n) % num_rdma_slots;
                    const unsigned n_bits = __shfl_sync(kFullMask, bits, n);
                    int4* token = rdma_ring_for(rdma, rl.data, channel, node, n) + (long long)slot * fmt.int4s;
                    char* tb = reinterpret_cast<char*>(token);
                    warp_copy<false, kCopyUnroll>(token, x + (long long)t * hidden_int4, hidden_int4);
                    for (int s = lane; s < num_scales; s += kWarpSize)
                        reinterpret_cast<float*>(tb + fmt.scales_off)[s] =
                            x_scales[t * scale_token_stride + s * scale_hidden_stride];
                    if (lane == 0) *reinterpret_cast<int2*>(tb + fmt.meta_off) = make_int2(node, (int)n_bits);
                    for (int k = lane; k < num_topk; k += kWarpSize) {
                        reinterpret_cast<int*>(tb + fmt.idx_off)[k] =
                            topk_idx != nullptr ? (int)topk_idx[(long long)t * num_topk + k] : -1;
                        reinterpret_cast<float*>(tb + fmt.weights_off)[k] =
                            topk_weights != nullptr ? topk_weights[(long long)t * num_topk + k] : 0.0f;
                    }
                }
                __syncwarp();
                // Release in order: lane n marks its slot in node n's window; the run of ready slots at the
                // window's start moves s_released, which the coordinator reads.
                bool released = true;
                if (in_node) {
                    __threadfence_block();
                    released = wait_until(ctx, WaitSite{kKernelInternodeDispatch, kRDMASender, channel, lane},
                                          [&] { return tail - ld_shared_volatile(&s_released[lane]) < kSendWindow; },
                                          [&](long long& h, long long& tl, long long& e) {
                                              h = ld_shared_volatile(&s_released[lane]); tl = tail; e = kSendWindow;
                                          });
                    released = released &&
                               window_lock.acquire(ctx, WaitSite{kKernelInternodeDispatch, kRDMASender, channel, lane});
                    if (released) {
                        const int offset = tail - s_released[lane];
                        unsigned window = s_window[lane] | (1u << offset);
                        if (offset == 0) {
                            const int run = window == kFullMask ? 32 : __ffs(~window) - 1;
                            window = run == 32 ? 0u : window >> run;
                            st_shared_volatile(&s_released[lane], s_released[lane] + run);
                        }
                        s_window[lane] = window;
                        window_lock.release();
                    }
                }
                ok = __all_sync(kFullMask, released) != 0;
            }
            if (in_node) ++tail;
        }
    } else if (is_sender_sm && warp == S) {
        // ---- kRDMASenderCoordinator ---------------------------------------------------------------
        int total = 0, issued = 0;  // lane n < N
        if (lane < N) {
            const int* row = rdma_channel_prefix_matrix + lane * num_channels;
            total = row[channel] - (channel > 0 ? row[channel - 1] : 0);
        }
        int ready = 0;
        while (__any_sync(kFullMask, issued < total)) {
            const bool ok = warp_wait_any(
                ctx, WaitSite{kKernelInternodeDispatch, kRDMASenderCoordinator, channel, lane},
                [&] {
                    ready = issued < total ? ld_shared_volatile(&s_released[lane < N ? lane : 0]) - issued : 0;
                    return ready >= num_rdma_send || (ready > 0 && issued + ready == total);
                },
                [&](long long& h, long long& tl, long long& e) { h = issued; tl = issued + ready; e = total; });
            if (!ok) break;
            int count = 0;
            if (ready >= num_rdma_send || (ready > 0 && issued + ready == total))
                count = min(min(ready, num_rdma_send), num_rdma_slots - issued % num_rdma_slots);
            // Ordering of a slot written straight into its receive half (own node, direct peer), and of the send
            // half a put reads: the sender warp's stores -> __syncwarp + __threadfence_block + s_released (shared,
            // same CTA) -> lane n of this warp observes s_released -> fence.acq_rel.sys below -> __syncwarp ->
            // lane 0's rdma.fence() (a system-scope fence on both transports) -> the atomic tail add, which the
            // consumer acquires. Causality order is transitive, so the consumer sees the slot wherever it was
            // stored; a put only adds its own data, ordered by rdma.fence().
            fence_acq_rel_sys();
            for (unsigned m = __ballot_sync(kFullMask, count > 0); m != 0; m &= m - 1) {
                const int n = __ffs(m) - 1;
                const int cnt = __shfl_sync(kFullMask, count, n);
                const int first = __shfl_sync(kFullMask, issued, n) % num_rdma_slots;
                rdma_publish_slots(rdma, rl.data, rl.tail, channel, node, n, first, cnt, fmt.int4s, fmt.bytes);
            }
            issued += count;
        }
        __syncwarp();
        if (lane == 0) rdma.quiet();
    } else if (is_sender_sm && warp < S + 1 + G) {
        // ---- kNVLReceivers: warp j drains forwarder GPU j's ring (tokens of source ranks (n, j)) ----------
        const int j = warp - S - 1;
        int start = 0, stop = 0;
        const int* start_ptr = nl.prefix_start.on(my_nvl, channel, j);
        const int* end_ptr = nl.prefix_end.on(my_nvl, channel, j);
        bool ok = warp_wait_all(ctx, WaitSite{kKernelInternodeDispatch, kNVLReceivers, channel, j},
                                [&] {
                                    if (lane >= N) return true;
                                    start = ld_volatile(start_ptr + lane);
                                    stop = ld_volatile(end_ptr + lane);
                                    return start != 0 && stop != 0;
                                },
                                [&](long long& h, long long& tl, long long& e) { h = start; tl = stop; e = -1; });
        int next_row = 0, count = 0;  // lane n: next output row of source rank (n, j)
        if (ok && lane < N) {
            start = -start - 1;
            stop = -stop - 1;
            const int src = lane * G + j;
            next_row = (src > 0 ? recv_gbl_rank_prefix_sum[src - 1] : 0) + start;
            count = stop - start;
            if (recv_gbl_channel_prefix_matrix != nullptr) recv_gbl_channel_prefix_matrix[src * num_channels + channel] = next_row;
        }
        const int num_to_recv = warp_reduce_sum(count);
        const int experts_per_rank = num_experts / R;
        const int4* ring = nl.x.on(my_nvl, channel, j);
        const RingConsumer counters{nl.tail.on(my_nvl, channel, j), nl.head.on(nvl_ptrs[j], channel, nvl_rank)};
        int head = 0;
        while (ok && head < num_to_recv) {
            int tl = head;
            ok = counters.wait_for_data<kByWarpAll>(
                ctx, WaitSite{kKernelInternodeDispatch, kNVLReceivers, channel, j}, head + 1, tl,
                [&](long long& h, long long& t2, long long& e) { h = head; t2 = tl; e = num_to_recv; });
            if (!ok) break;
            // Every lane loaded the tail itself; take lane 0's value so that the token loop below
            // (full-mask __shfl_sync inside) has one trip count for the whole warp even if the loads differed;
            // __syncwarp orders lane 0's acquire before every lane's slot loads.
            __syncwarp();
            tl = __shfl_sync(kFullMask, tl, 0);
            for (int i = head; i < tl; ++i) {
                const char* tb = reinterpret_cast<const char*>(ring + (long long)(i % num_nvl_slots) * fmt.int4s);
                const int src_node = ld_volatile(reinterpret_cast<const int*>(tb + fmt.meta_off));
                const int src_bits = ld_volatile(reinterpret_cast<const int*>(tb + fmt.meta_off) + 1);
                const long long row = __shfl_sync(kFullMask, next_row, src_node);
                if (lane == src_node) ++next_row;
                warp_copy<true, kCopyUnroll>(recv_x + row * hidden_int4, reinterpret_cast<const int4*>(tb), hidden_int4);
                for (int s = lane; s < num_scales; s += kWarpSize)
                    recv_x_scales[row * num_scales + s] = ld_volatile(reinterpret_cast<const float*>(tb + fmt.scales_off) + s);
                if (lane == 0 && recv_src_meta != nullptr) recv_src_meta[row] = make_int2(src_node, src_bits);
                if (recv_topk_idx != nullptr) {
                    for (int k = lane; k < num_topk; k += kWarpSize) {
                        const int e = ld_volatile(reinterpret_cast<const int*>(tb + fmt.idx_off) + k);
                        const int local = e - rank * experts_per_rank;
                        const bool owned = e >= 0 && local >= 0 && local < experts_per_rank;
                        recv_topk_idx[row * num_topk + k] = (IdxT)(owned ? local : -1);
                        recv_topk_weights[row * num_topk + k] =
                            owned ? ld_volatile(reinterpret_cast<const float*>(tb + fmt.weights_off) + k) : 0.0f;
                    }
                }
            }
            head = tl;
            __syncwarp();
            if (lane == 0) counters.release(head);
        }
    } else if (!is_sender_sm && warp < G) {
        // ---- kRDMAAndNVLForwarder: warp j forwards every RDMA token meant for GPU j of my node --------------
        const int j = warp;
        const int* meta = rl.meta.recv(rdma_base, channel, lane < N ? lane : 0);
        bool ok = warp_wait_all(ctx, WaitSite{kKernelInternodeDispatch, kRDMAAndNVLForwarder, channel, lane},
                                [&] {
                                    return lane >= N || (ld_volatile(meta + j) < 0 && ld_volatile(meta + G + j) < 0 &&
                                                         ld_volatile(meta + 2 * G) < 0 && ld_volatile(meta + 2 * G + 1) < 0);
                                },
                                [&](long long& h, long long& tl, long long& e) { h = ld_volatile(meta + j); e = -1; });
        int consumed = 0, num_rdma = 0, forwarded = 0, row_base = 0;  // lane n: source node n
        if (ok && lane < N) {
            st_relaxed_sys(nl.prefix_start.on(nvl_ptrs[j], channel, nvl_rank) + lane, ld_volatile(meta + j));
            st_relaxed_sys(nl.prefix_end.on(nvl_ptrs[j], channel, nvl_rank) + lane, ld_volatile(meta + G + j));
            const int rdma_start = -ld_volatile(meta + 2 * G) - 1, rdma_end = -ld_volatile(meta + 2 * G + 1) - 1;
            num_rdma = rdma_end - rdma_start;
            row_base = (lane > 0 ? recv_rdma_rank_prefix_sum[lane - 1] : 0) + rdma_start;
            if (j == 0 && recv_rdma_channel_prefix_matrix != nullptr)
                recv_rdma_channel_prefix_matrix[lane * num_channels + channel] = rdma_end;
        }
        // consumer of node n's RDMA ring (lane n; its head goes back through the coordinator), producer of GPU j's
        // NVLink ring (the whole warp)
        const RingConsumer rdma_ring{rl.tail.on(rdma_base, channel, lane < N ? lane : 0), nullptr};
        const RingProducer<> nvl{nl.tail.on(nvl_ptrs[j], channel, nvl_rank), nl.head.on(my_nvl, channel, j), num_nvl_slots};
        int4* nvl_ring = nl.x.on(nvl_ptrs[j], channel, nvl_rank);
        int nvl_tail = 0, nvl_head = 0, rr = 0, avail = 0;
        while (ok && __any_sync(kFullMask, consumed < num_rdma)) {
            ok = nvl.wait_for_space<kByWarpAll>(
                ctx, WaitSite{kKernelInternodeDispatch, kRDMAAndNVLForwarder, channel, N + j}, nvl_tail, nvl_head,
                num_nvl_send, [&](long long& h, long long& tl, long long& e) { h = nvl_head; tl = nvl_tail; e = num_nvl_send; });
            int rdma_tail = consumed;
            ok = ok && rdma_ring.wait_for_data<kByWarpAny>(
                ctx, WaitSite{kKernelInternodeDispatch, kRDMAAndNVLForwarder, channel, lane}, consumed + 1, rdma_tail,
                [&](long long& h, long long& tl, long long& e) { h = consumed; tl = rdma_tail; e = num_rdma; },
                lane < N && consumed < num_rdma);
            avail = min(rdma_tail, num_rdma) - consumed;
            if (!ok) break;
            // Only lane n acquired node n's tail; ballot/shfl are not memory-ordering operations, so
            // the other lanes' slot loads below are ordered after that acquire by this warp barrier.
            __syncwarp();
            const unsigned mask = __ballot_sync(kFullMask, lane < N && consumed < num_rdma && avail > 0);
            const int n = next_set_bit(mask, rr);
            rr = n + 1 < N ? n + 1 : 0;
            const int cnt = __shfl_sync(kFullMask, avail, n), first = __shfl_sync(kFullMask, consumed, n);
            const int base_row = __shfl_sync(kFullMask, row_base, n);
            int fwd = __shfl_sync(kFullMask, forwarded, n);
            const int4* src_ring = rl.data.recv(rdma_base, channel, n);
            int used = 0, sent = 0;
            for (; used < cnt && sent < num_nvl_send; ++used) {
                const int4* token = src_ring + (long long)((first + used) % num_rdma_slots) * fmt.int4s;
                const int bits = ld_volatile(reinterpret_cast<const int*>(reinterpret_cast<const char*>(token) + fmt.meta_off) + 1);
                const bool to_j = (bits >> j) & 1;
                if (lane == 0 && send_nvl_head != nullptr)
                    send_nvl_head[(long long)(base_row + first + used) * G + j] = to_j ? fwd : -1;
                if (to_j) {
                    warp_copy<true, kCopyUnroll>(nvl_ring + (long long)(nvl_tail % num_nvl_slots) * fmt.int4s, token, fmt.int4s);
                    ++nvl_tail;
                    ++fwd;
                    ++sent;
                }
            }
            __syncwarp();
            if (lane == 0) nvl.release(nvl_tail);
            if (lane == n) {
                consumed += used;
                forwarded = fwd;
                __threadfence_block();  // my reads of the slots before the coordinator may return them
                st_shared_volatile(&s_fwd_head[j][n], consumed);
            }
        }
        __syncwarp();
        if (lane == 0) {
            __threadfence_block();
            st_shared_volatile(&s_retired[j], 1);
        }
    } else if (!is_sender_sm && warp == G) {
        // ---- kForwarderCoordinator: lazy RDMA head return (lane n: source node n) --------------------------
        int returned = 0, min_head = 0;
        while (true) {
            bool all_retired = false;
            const bool ok = warp_wait_any(
                ctx, WaitSite{kKernelInternodeDispatch, kForwarderCoordinator, channel, lane},
                [&] {
                    all_retired = true;
                    for (int w = 0; w < G; ++w) all_retired &= ld_shared_volatile(&s_retired[w]) != 0;
                    __threadfence_block();
                    min_head = 0x7fffffff;
                    for (int w = 0; w < G; ++w) min_head = min(min_head, ld_shared_volatile(&s_fwd_head[w][lane < N ? lane : 0]));
                    return all_retired || (lane < N && min_head - returned >= num_rdma_send);
                },
                [&](long long& h, long long& tl, long long& e) { h = returned; tl = min_head; e = num_rdma_send; });
            if (!ok) break;
            all_retired = __all_sync(kFullMask, all_retired) != 0;
            if (lane < N && min_head > returned && (all_retired || min_head - returned >= num_rdma_send)) {
                rdma.add(offset_in(rdma_base, rl.head.on(rdma_base, channel, node)), min_head - returned, lane);
                returned = min_head;
            }
            if (all_retired) break;
        }
        if (lane < N) rdma.quiet();
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
    constexpr int N = kNumRdmaRanks, G = kNumNvlRanks, W = kCombineRecvWarps;
    const int node = rank / G, nvl_rank = rank % G;
    const int num_channels = gridDim.x / 2, channel = blockIdx.x / 2;
    const bool is_forwarder_sm = (blockIdx.x % 2) == 1;
    const int warp = warp_id(), lane = lane_id();
    const Rdma rdma(RdmaArgs{rdma_base, rdma_peers, node});
    const TokenFormat fmt(hidden_int4, 0, num_topk, false);
    const InternodeCombineRdma rl(N, G, num_channels, num_rdma_slots, fmt.int4s);
    const InternodeCombineNvl nl(N, G, num_channels, num_nvl_slots, fmt.int4s);
    void* my_nvl = nvl_ptrs[nvl_rank];
    const int sub_slots = num_nvl_slots / N;  // NVLink sub-ring per origin node

    __shared__ int s_next[W];                                  // RDMA receivers: next token of each warp
    // Per reducing warp and source: the source row's offset (int4) from the first source's ring, or -1. In shared
    // memory so that the reductions keep one base pointer in registers instead of one per source.
    __shared__ long long s_slot[CombineShape<N, G>::kWarps][kMaxRdmaRanks];
    int begin, end;
    channel_range(num_tokens, num_channels, channel, begin, end);
    for (int i = threadIdx.x; i < W; i += blockDim.x) s_next[i] = begin + i;
    if (block_aborted(ctx)) return;

    if (!is_forwarder_sm && warp < G) {
        // ---- kNVLSender: my rows that came through forwarder GPU k go back to it, sub-ring = origin node ---
        const int k = warp;
        int row = 0, row_end = 0, sent = 0;  // lane n: rows of source rank (n, k) in this channel
        if (lane < N) {
            const int src = lane * G + k;
            row = recv_gbl_channel_prefix_matrix[src * num_channels + channel];
            row_end = channel + 1 < num_channels ? recv_gbl_channel_prefix_matrix[src * num_channels + channel + 1]
                                                 : recv_gbl_rank_prefix_sum[src];
        }
        int4* ring = nl.x.on(nvl_ptrs[k], channel, nvl_rank);
        int* tail_ptr = nl.tail.on(nvl_ptrs[k], channel, nvl_rank);
        // lane n: producer of the sub-ring of origin node n
        const RingProducer<> sub{tail_ptr + lane, nl.head.on(my_nvl, channel, k) + lane, sub_slots};
        int rr = 0, head = 0;
        bool ok = true;
        while (ok && __any_sync(kFullMask, row < row_end)) {
            ok = sub.wait_for_space<kByWarpAny, false>(
                ctx, WaitSite{kKernelInternodeCombine, kNVLSender, channel, lane}, sent, head,
                min(num_nvl_send, row_end - row),
                [&](long long& h, long long& tl, long long& e) { h = head; tl = sent; e = sub_slots; },
                lane < N && row < row_end);
            if (!ok) break;
            const bool ready = lane < N && row < row_end && sub.has_space(sent, head, min(num_nvl_send, row_end - row));
            const int n = next_set_bit(__ballot_sync(kFullMask, ready), rr);
            rr = n + 1 < N ? n + 1 : 0;
            const int r0 = __shfl_sync(kFullMask, row, n), s0 = __shfl_sync(kFullMask, sent, n);
            const int cnt = min(num_nvl_send, __shfl_sync(kFullMask, row_end, n) - r0);
            for (int i = 0; i < cnt; ++i) {
                int4* token = ring + (long long)(n * sub_slots + (s0 + i) % sub_slots) * fmt.int4s;
                warp_copy<false, kCopyUnroll>(token, x + (long long)(r0 + i) * hidden_int4, hidden_int4);
                for (int kk = lane; kk < num_topk; kk += kWarpSize)
                    reinterpret_cast<float*>(reinterpret_cast<char*>(token) + fmt.weights_off)[kk] =
                        topk_weights != nullptr ? topk_weights[(long long)(r0 + i) * num_topk + kk] : 0.0f;
            }
            __syncwarp();
            if (lane == 0) ring_release(tail_ptr + n, s0 + cnt);  // sub-ring n's tail (lane n's ring)
            if (lane == n) {
                row += cnt;
                sent += cnt;
            }
        }
    } else if (!is_forwarder_sm && warp < G + W) {
        // ---- kRDMAReceiver: reduce my token t over the nodes that hold a partial sum of it -------------
        const int w = warp - G;
        long long* slot = s_slot[warp];
        const int4* ring0 = rl.data.recv(rdma_base, channel, 0);   // source n's ring: + n * elems_per_rank
        for (int t = begin + w; t < end; t += W) {
            const int h = lane < N ? send_rdma_head[(long long)t * N + lane] : -1;
            int seen = 0;
            const bool ok = RingConsumer{rl.tail.on(rdma_base, channel, lane), nullptr}.wait_for_data<kByWarpAll>(
                ctx, WaitSite{kKernelInternodeCombine, kRDMAReceiver, channel, lane}, h + 1, seen,
                [&](long long& hh, long long& tl, long long& e) {
                    hh = h; tl = ld_volatile(rl.tail.on(rdma_base, channel, lane)); e = h + 1;
                },
                h >= 0);
            if (!ok) break;
            if (lane < N) slot[lane] = h >= 0 ? lane * rl.data.elems_per_rank + (long long)(h % num_rdma_slots) * fmt.int4s : -1;
            __syncwarp();
            const long long row = (long long)t * hidden_int4;
            reduce_rows<N>(combined_x + row, ring0, slot, bias0 != nullptr ? bias0 + row : nullptr,
                           bias1 != nullptr ? bias1 + row : nullptr, hidden_int4);
            if (combined_topk_weights != nullptr) {
                for (int kk = lane; kk < num_topk; kk += kWarpSize)
                    combined_topk_weights[(long long)t * num_topk + kk] = sum_token_weight<N>(ring0, slot, fmt.weights_off, kk);
            }
            __syncwarp();
            if (lane == 0) {
                __threadfence_block();  // the slot reads before the coordinator may return them
                st_shared_volatile(&s_next[w], t + W);
            }
        }
        __syncwarp();
        if (lane == 0) st_shared_volatile(&s_next[w], end);  // retired (also after a failed wait)
    } else if (!is_forwarder_sm && warp == G + W) {
        // ---- kCoordinator: every token below min(s_next) is fully reduced; lane n returns node n's slots ----
        int cursor = begin, released = 0, returned = 0, tmin = begin;
        while (true) {
            const bool ok = warp_wait_any(ctx, WaitSite{kKernelInternodeCombine, kCoordinator, channel, lane},
                                          [&] {
                                              tmin = 0x7fffffff;
                                              for (int w = 0; w < W; ++w) tmin = min(tmin, ld_shared_volatile(&s_next[w]));
                                              return tmin > cursor || tmin >= end;
                                          },
                                          [&](long long& h, long long& tl, long long& e) { h = cursor; tl = tmin; e = end; });
            if (!ok) break;
            tmin = min(__shfl_sync(kFullMask, tmin, 0), end);
            if (lane < N) {
                for (int t = cursor; t < tmin; ++t) {
                    const int h = send_rdma_head[(long long)t * N + lane];
                    if (h >= 0) released = h + 1;
                }
                if (released > returned && (released - returned >= num_rdma_send || tmin >= end)) {
                    rdma.add(offset_in(rdma_base, rl.head.on(rdma_base, channel, node)), released - returned, lane);
                    returned = released;
                }
            }
            cursor = tmin;
            if (tmin >= end) break;
        }
        if (lane < N) rdma.quiet();
    } else if (is_forwarder_sm && warp < CombineShape<N, G>::kOddWarps) {
        // ---- kNVLAndRDMAForwarder: warp n reduces origin node n's tokens over my node's GPUs -------------
        // (nodes w, w + 16, ... one after the other: every node's warp w takes them in the same order, so the
        // lower node never waits for a higher one and the chain cannot close into a cycle)
      bool ok = true;
      for (int n = warp; ok && n < N; n += CombineShape<N, G>::kOddWarps) {
        const int* row = recv_rdma_channel_prefix_matrix + n * num_channels;
        const int total = row[channel] - (channel > 0 ? row[channel - 1] : 0);
        const int row_base = (n > 0 ? recv_rdma_rank_prefix_sum[n - 1] : 0) + (channel > 0 ? row[channel - 1] : 0);
        int4* ring = rdma_ring_for(rdma, rl.data, channel, node, n);
        // producer of node n's RDMA ring (its tail is published by rdma_publish_slots)
        const RingProducer<> out{nullptr, rl.head.on(rdma_base, channel, n), num_rdma_slots};
        long long* slot = s_slot[warp];
        const int4* nvl0 = nl.x.on(my_nvl, channel, 0);   // GPU j's ring: + j * elems_per_rank
        int issued = 0, head = 0;
        while (ok && issued < total) {
            const int chunk = min(min(num_rdma_send, total - issued), num_rdma_slots - issued % num_rdma_slots);
            ok = out.wait_for_space<kByWarpAll, false>(
                ctx, WaitSite{kKernelInternodeCombine, kNVLAndRDMAForwarder, channel, n}, issued, head, chunk,
                [&](long long& h, long long& tl, long long& e) { h = head; tl = issued; e = chunk; });
            for (int i = issued; ok && i < issued + chunk; ++i) {
                const int h = lane < G ? send_nvl_head[(long long)(row_base + i) * G + lane] : -1;
                int seen = 0;  // lane j: consumer of sub-ring n of GPU j's ring
                ok = RingConsumer{nl.tail.on(my_nvl, channel, lane) + n, nullptr}.wait_for_data<kByWarpAll>(
                    ctx, WaitSite{kKernelInternodeCombine, kNVLAndRDMAForwarder, channel, N + lane}, h + 1, seen,
                    [&](long long& hh, long long& tl, long long& e) {
                        hh = h; tl = ld_volatile(nl.tail.on(my_nvl, channel, lane) + n); e = h + 1;
                    },
                    h >= 0);
                if (!ok) break;
                if (lane < G)
                    slot[lane] = h >= 0 ? lane * nl.x.elems_per_rank + (long long)(n * sub_slots + h % sub_slots) * fmt.int4s : -1;
                __syncwarp();
                int4* dst = ring + (long long)(i % num_rdma_slots) * fmt.int4s;
                reduce_rows<G>(dst, nvl0, slot, nullptr, nullptr, hidden_int4);
                for (int kk = lane; kk < num_topk; kk += kWarpSize)
                    reinterpret_cast<float*>(reinterpret_cast<char*>(dst) + fmt.weights_off)[kk] =
                        sum_token_weight<G>(nvl0, slot, fmt.weights_off, kk);
                __syncwarp();
                // One consumer per sub-ring, in order: the slot is free again.
                if (lane < G && h >= 0) ring_release(nl.head.on(nvl_ptrs[lane], channel, nvl_rank) + n, h + 1);
            }
            if (!ok) break;
            // Every lane's slot stores (into node n's receive half on the direct path, my send half for a put)
            // -> its fence.acq_rel.sys -> __syncwarp -> lane 0's rdma.fence() (system scope) -> the tail add.
            __syncwarp();
            fence_acq_rel_sys();
            rdma_publish_slots(rdma, rl.data, rl.tail, channel, node, n, issued % num_rdma_slots, chunk, fmt.int4s,
                               fmt.bytes);
            issued += chunk;
        }
      }
        __syncwarp();
        if (lane == 0) rdma.quiet();
    }
}

// ---------------------------------------------------------------------------------------------------
// internode_put_bandwidth: the transport's ceiling for the benchmark (cupy_ep/bench_internode.py). Region at
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

// Layout sums for the size test (mirrors cupy_ep.config.internode_layout):
// out[0] RDMA channel-area start, out[1] RDMA dispatch end, out[2] RDMA combine end, out[3] NVLink channel-area
// start, out[4] NVLink dispatch end, out[5] NVLink combine end, out[6] dispatch token bytes, out[7] combine
// token bytes.
__global__ void internode_carve_probe(int num_rdma_ranks, int num_nvl_ranks, int num_channels, int num_rdma_slots,
                                      int num_nvl_slots, int hidden_int4, int num_scales, int num_topk, long long* out) {
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
