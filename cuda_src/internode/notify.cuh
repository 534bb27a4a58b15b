// internode/notify.cuh: internode_notify_dispatch's two block kinds, as member functions of its NotifyContext.
#pragma once
#include "common/wait.cuh"
#include "common/warp.cuh"
#include "common/layout.cuh"
#include "internode/roles.cuh"
#include "internode/handshake.cuh"

namespace ep::internode {

// One block of internode_notify_dispatch: the kernel's arguments and what its blocks derive from them;
// block 0 and the others are its two member functions.
template <int kNumRdmaRanks, int kNumNvlRanks, typename Rdma>
struct NotifyContext {
    static constexpr int N = kNumRdmaRanks, G = kNumNvlRanks, R = N * G;
    // the kernel's arguments, in its order
    const int* num_tokens_per_rank;
    const int* num_tokens_per_rdma_rank;
    const int* num_tokens_per_expert;
    int num_experts;
    const bool* is_token_in_rank;
    int num_tokens;
    int num_channels;
    int expert_alignment;
    int* rdma_channel_prefix_matrix;
    int* recv_rdma_rank_prefix_sum;
    int* gbl_channel_prefix_matrix;
    int* recv_gbl_rank_prefix_sum;
    int* host_counters;
    int max_num_recv;
    int max_num_rdma_recv;
    void** nvl_ptrs;
    char* rdma_base;
    const unsigned long long* rdma_peers;
    int rank;
    int num_rdma_slots;
    int num_nvl_slots;
    int hidden_int4;
    int num_topk;
    int num_scales;
    const DeviceCtx* ctx;
    // derived
    int node = rank / G, nvl_rank = rank % G;

    // Block 0: the count exchanges over RDMA and NVLink, the prefix sums and the host's counts, the ring
    // reset, between barriers.
    __device__ __forceinline__ void count_exchange() const {
        if (block_aborted(ctx)) return;
        const Rdma rdma(RdmaArgs{rdma_base, rdma_peers, node});
        const InternodeRdmaNotify rnotify(N, G);
        const InternodeNvlNotify nnotify(G);
        const int experts_per_rank = num_experts / R, experts_per_node = experts_per_rank * G;
        const int words[kCallWords] = {kOpInternodeDispatch, num_channels, num_rdma_slots, num_nvl_slots,
                                       hidden_int4,          num_topk,     num_scales,     num_experts};
        const int kRdmaHead = kCallWords + G + 1;  // where the expert counts start in an RDMA vector
        if (!both_barriers<N, G>(rdma, nvl_ptrs, node, nvl_rank, ctx, kKernelInternodeNotifyDispatch)) return;

        // RDMA vectors
        for (int n = 0; n < N; ++n) {
            int* vec = n == node ? rnotify.counts.recv(rdma_base, 0, node) : rnotify.counts.send(rdma_base, 0, n);
            for (int i = threadIdx.x; i < kRdmaHead + experts_per_node; i += blockDim.x) {
                int v;
                if (i < kCallWords)
                    v = words[i];
                else if (i < kCallWords + G)
                    v = num_tokens_per_rank[n * G + i - kCallWords];
                else if (i == kCallWords + G)
                    v = num_tokens_per_rdma_rank[n];
                else
                    v = num_tokens_per_expert[n * experts_per_node + i - kRdmaHead];
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
                for (int g = 0; g < G; ++g)
                    sum += ld_volatile(rows + g * kNvlNotifyInts + kCallWords + kMaxRdmaRanks + e);
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
                report_failure(ctx, WaitSite{kKernelInternodeNotifyDispatch, kRoleCapacity, -1, -1}, sum, max_num_recv,
                               0, 0);
            if (host_counters != nullptr) {
                __threadfence_system();
                st_volatile(host_counters, sum);
                __threadfence_system();
            }
        }
        both_barriers<N, G>(rdma, nvl_ptrs, node, nvl_rank, ctx, kKernelInternodeNotifyDispatch);
    }

    // Block 1 + n: the channel prefix matrices of destination node n (sender side).
    __device__ __forceinline__ void channel_prefix() const {
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
};

}  // namespace ep::internode
