// intranode/notify.cuh: notify_dispatch's two block kinds, as member functions of its NotifyContext.
#pragma once
#include "common/wait.cuh"
#include "common/warp.cuh"
#include "common/layout.cuh"
#include "intranode/handshake.cuh"

namespace ep::intranode {

// One block of notify_dispatch: the kernel's arguments and what its blocks derive from them;
// block 0 and the others are its two member functions.
template <int kNumRanks>
struct NotifyContext {
    // the kernel's arguments, in its order
    const int* num_tokens_per_rank;
    const int* num_tokens_per_expert;
    int num_experts;
    const bool* is_token_in_rank;
    int num_tokens;
    int num_channels;
    int expert_alignment;
    int* rank_prefix_matrix;
    int* channel_prefix_matrix;
    int* host_recv_counter;
    int* host_expert_counters;
    void** buffer_ptrs;
    int rank;
    int num_slots;
    int hidden_int4;
    int num_topk;
    int num_scales;
    int direct_capacity;
    const DeviceCtx* ctx;

    // Block 0: the count exchange, the prefix matrix and the host's counts, the ring reset.
    __device__ __forceinline__ void count_exchange() const {
        const NotifyArea notify;
        const int experts_per_rank = num_experts / kNumRanks;
        if (!barrier_block<kNumRanks>(buffer_ptrs, rank, ctx, kKernelNotifyDispatch)) return;
        const CallWords words = dispatch_call_words(false, num_channels, num_slots, hidden_int4, num_topk, num_scales,
                                                    num_experts, direct_capacity);
        publish_call_words<kNumRanks>(buffer_ptrs, rank, words);
        for (int i = threadIdx.x; i < kNumRanks * kNumRanks; i += blockDim.x) {
            const int peer = i / kNumRanks, dst = i % kNumRanks;
            notify.rank_matrix.on(buffer_ptrs[peer])[rank * kNumRanks + dst] = num_tokens_per_rank[dst];
        }
        for (int i = threadIdx.x; i < num_experts; i += blockDim.x) {
            const int peer = i / experts_per_rank, e = i % experts_per_rank;
            notify.expert_counts.on(buffer_ptrs[peer])[rank * kMaxLocalExperts + e] = num_tokens_per_expert[i];
        }
        if (!barrier_block<kNumRanks>(buffer_ptrs, rank, ctx, kKernelNotifyDispatch)) return;
        if (!check_call_words<kNumRanks>(buffer_ptrs, rank, words, ctx, kKernelNotifyDispatch)) return;

        void* mine = buffer_ptrs[rank];
        const int* matrix = notify.rank_matrix.on(mine);
        if (threadIdx.x < kNumRanks) {
            const int dst = threadIdx.x;
            int sum = 0;
            for (int src = 0; src < kNumRanks; ++src) {
                sum += ld_volatile(&matrix[src * kNumRanks + dst]);
                rank_prefix_matrix[src * kNumRanks + dst] = sum;
            }
        }
        if (host_expert_counters != nullptr) {
            const int* counts = notify.expert_counts.on(mine);
            for (int e = threadIdx.x; e < experts_per_rank; e += blockDim.x) {
                int sum = 0;
                for (int src = 0; src < kNumRanks; ++src) sum += ld_volatile(&counts[src * kMaxLocalExperts + e]);
                host_expert_counters[e] = (sum + expert_alignment - 1) / expert_alignment * expert_alignment;
            }
        }
        long long meta_begin, meta_end;
        dispatch_meta_range(kNumRanks, num_channels, num_slots, hidden_int4, num_topk, num_scales, direct_capacity,
                            meta_begin, meta_end);
        zero_ints(at_offset<int>(mine, meta_begin), (meta_end - meta_begin) / 4);
        __threadfence_system();
        __syncthreads();
        // A zero-copy dispatch that does not fit a receiver stops here on every rank (all see the same matrix),
        // before the host learns its count: the host raises instead of launching the dispatch.
        if (direct_capacity > 0 && threadIdx.x == 0) {
            for (int dst = 0; dst < kNumRanks; ++dst) {
                int total = 0;
                for (int src = 0; src < kNumRanks; ++src) total += ld_volatile(&matrix[src * kNumRanks + dst]);
                if (total > direct_capacity) {
                    report_failure(ctx, WaitSite{kKernelNotifyDispatch, kRoleZeroCopyCapacity, -1, dst}, total,
                                   direct_capacity, -1, 0);
                    break;
                }
            }
        }
        if (threadIdx.x == 0 && host_recv_counter != nullptr) {
            int total = 0;
            for (int src = 0; src < kNumRanks; ++src) total += ld_volatile(&matrix[src * kNumRanks + rank]);
            st_volatile(host_recv_counter, total);
            __threadfence_system();
        }
        barrier_block<kNumRanks>(buffer_ptrs, rank, ctx, kKernelNotifyDispatch);
    }

    // Block 1 + dst: channel_prefix_matrix[dst][c], the inclusive prefix over channels of my tokens to dst.
    __device__ __forceinline__ void channel_prefix() const {
        const int dst = blockIdx.x - 1;
        const int num_warps = blockDim.x / kWarpSize;
        for (int c = warp_id(); c < num_channels; c += num_warps) {
            int begin, end;
            channel_range(num_tokens, num_channels, c, begin, end);
            int count = 0;
            for (int t = begin + lane_id(); t < end; t += kWarpSize)
                count += is_token_in_rank[(long long)t * kNumRanks + dst];
            count = warp_reduce_sum(count);
            if (lane_id() == 0) channel_prefix_matrix[dst * num_channels + c] = count;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int c = 1; c < num_channels; ++c)
                channel_prefix_matrix[dst * num_channels + c] += channel_prefix_matrix[dst * num_channels + c - 1];
        }
    }
};

}  // namespace ep::intranode
