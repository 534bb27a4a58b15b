// intranode/dispatch.cuh: the ring dispatch's roles, as member functions of its DispatchContext (one block's view
// of the call: the kernel's arguments and what every role derives from them); the role map is dispatch_role_of.
#pragma once
#include "common/wait.cuh"
#include "common/warp.cuh"
#include "common/layout.cuh"
#include "common/ring.cuh"
#include "intranode/groups.cuh"

namespace ep::intranode {

// Senders copy rows of this rank's own input into a peer's ring with 6 loads per lane in flight (the most the
// 80 registers of a 768-thread block hold); the receivers' local copies are bulk copies.
constexpr int kSendUnroll = 6;

// The top-k ids of a row as `dst_rank` receives them (local expert id, or -1 and weight 0 if another rank
// owns the expert), and its FP8 scales; the lanes of a warp split the entries.
template <typename IdxT>
__device__ __forceinline__ void copy_own_row_meta(IdxT* recv_topk_idx, float* recv_topk_weights, float* recv_x_scales,
                                                  long long out, const IdxT* topk_idx, const float* topk_weights,
                                                  const float* x_scales, int t, int num_topk, int dst_rank,
                                                  int experts_per_rank, int num_scales, long long scale_token_stride,
                                                  long long scale_hidden_stride) {
    if (recv_topk_idx != nullptr) {
        for (int k = lane_id(); k < num_topk; k += kWarpSize) {
            const long long e = (long long)topk_idx[(long long)t * num_topk + k];
            const long long local = e - (long long)dst_rank * experts_per_rank;
            const bool owned = e >= 0 && local >= 0 && local < experts_per_rank;
            recv_topk_idx[out * num_topk + k] = (IdxT)(owned ? local : -1);
            recv_topk_weights[out * num_topk + k] =
                owned && topk_weights != nullptr ? topk_weights[(long long)t * num_topk + k] : 0.0f;
        }
    }
    for (int i = lane_id(); i < num_scales; i += kWarpSize)
        recv_x_scales[out * num_scales + i] = x_scales[t * scale_token_stride + i * scale_hidden_stride];
}

// Own-row block `own_block` of `num_own_blocks`: the blocks split the tokens into equal ranges of whole
// windows of 32. A token's row inside the own source block is the count of earlier own tokens (= its
// send_head); the count before the range comes from channel_prefix_matrix plus a scan of the part of the
// range's first channel that lies before it.
template <int kNumRanks, typename IdxT>
__device__ void copy_own_rows(int own_block, int num_own_blocks, TmaCopier& tma, int4* recv_x, float* recv_x_scales,
                              int* recv_src_idx, IdxT* recv_topk_idx, float* recv_topk_weights, int* send_head,
                              const int4* x, const float* x_scales, const IdxT* topk_idx, const float* topk_weights,
                              const bool* is_token_in_rank, const int* channel_prefix_matrix,
                              const int* rank_prefix_matrix, int num_tokens, int num_channels, int hidden_int4,
                              int num_topk, int num_experts, int num_scales, long long scale_token_stride,
                              long long scale_hidden_stride, int rank) {
    using G = Groups<kNumRanks>;
    const int num_windows = (num_tokens + kWarpSize - 1) / kWarpSize;
    const int per_block = (num_windows + num_own_blocks - 1) / num_own_blocks * kWarpSize;
    const int begin = min(own_block * per_block, num_tokens), end = min(begin + per_block, num_tokens);
    if (begin >= end) return;  // uniform over the block
    const int per_channel = (num_tokens + num_channels - 1) / num_channels;
    const int first_channel = begin / per_channel;
    int base = first_channel > 0 ? channel_prefix_matrix[rank * num_channels + first_channel - 1] : 0;
    for (int t0 = first_channel * per_channel; t0 < begin; t0 += blockDim.x) {
        const int t = t0 + threadIdx.x;
        base += __syncthreads_count(t < begin && is_token_in_rank[(long long)t * kNumRanks + rank]);
    }
    const int row_begin = (rank > 0 ? rank_prefix_matrix[(rank - 1) * kNumRanks + rank] : 0) + base;
    const int experts_per_rank = num_experts / kNumRanks;
    const long long row_bytes = (long long)hidden_int4 * 16;
    // Every warp scans every window (one load + ballot) and takes the selected tokens k with
    // (count + k) % warps == its index: no barriers, the same rows as a ring receiver would write.
    int count = 0;
    for (int w0 = begin, window = 0; w0 < end; w0 += kWarpSize, ++window) {
        const int t_lane = w0 + lane_id();
        const bool selected = t_lane < end && is_token_in_rank[(long long)t_lane * kNumRanks + rank];
        const unsigned mask = __ballot_sync(0xffffffffu, selected);
        if (send_head != nullptr && window % G::kWarps == warp_id() && t_lane < end)
            send_head[(long long)t_lane * kNumRanks + rank] =
                selected ? base + count + __popc(mask & ((1u << lane_id()) - 1u)) : -1;
        for (int j = (warp_id() - count % G::kWarps + G::kWarps) % G::kWarps; j < __popc(mask); j += G::kWarps) {
            const int t = w0 + nth_set_bit(mask, j);
            const long long out = row_begin + count + j;
            if (lane_id() == 0) tma.copy(recv_x + out * hidden_int4, x + (long long)t * hidden_int4, row_bytes);
            if (lane_id() == 0 && recv_src_idx != nullptr) recv_src_idx[out] = t;
            copy_own_row_meta(recv_topk_idx, recv_topk_weights, recv_x_scales, out, topk_idx, topk_weights, x_scales, t,
                              num_topk, rank, experts_per_rank, num_scales, scale_token_stride, scale_hidden_stride);
        }
        count += __popc(mask);
    }
}

// Blocks 2c, 2c + 1: channel c's sender and receiver, their warps grouped per remote peer (RemoteGroups; target: the
// peer, -1 for a warp without one: kIdle); blocks from 2C: the own rows (target: the block's index among them).
template <int kNumRanks>
__device__ __forceinline__ RoleOf dispatch_role_of(int sm, int num_channels, int rank) {
    if (sm >= 2 * num_channels) return {kOwnRows, sm - 2 * num_channels};
    const int peer = RemoteGroups<kNumRanks>::peer_of_warp(rank);
    if (peer < 0) return {kIdle, -1};
    return {sm % 2 == 0 ? kSender : kReceiver, peer};
}

// The dispatch's shared memory: per remote peer group the values its leader shares (abort, tail, start, count),
// and per warp the mbarrier of its bulk copier.
template <int kNumRanks>
struct DispatchShared {
    int value[kNumRanks];
    int abort[kNumRanks];
    int start[kNumRanks];
    int count[kNumRanks];
    unsigned long long tma_bar[Groups<kNumRanks>::kWarps];
};

template <int kNumRanks, typename IdxT>
struct DispatchContext {
    using G = Groups<kNumRanks>;
    using RG = RemoteGroups<kNumRanks>;
    // the kernel's arguments, in its order
    int4* recv_x;
    float* recv_x_scales;
    int* recv_src_idx;
    IdxT* recv_topk_idx;
    float* recv_topk_weights;
    int* recv_channel_prefix_matrix;
    int* send_head;
    const int4* x;
    const float* x_scales;
    const IdxT* topk_idx;
    const float* topk_weights;
    const bool* is_token_in_rank;
    const int* channel_prefix_matrix;
    const int* rank_prefix_matrix;
    int num_tokens;
    int num_worst_tokens;
    int hidden_int4;
    int num_topk;
    int num_experts;
    int num_scales;
    long long scale_token_stride;
    long long scale_hidden_stride;
    void** buffer_ptrs;
    int rank;
    int num_channels;
    int num_max_send_tokens;
    int num_slots;
    const DeviceCtx* ctx;
    DispatchShared<kNumRanks>& sh;
    unsigned char* tma_buf;  // dynamic shared memory: kTmaChunkBytes per warp (the receiving blocks)
    // derived
    int channel = blockIdx.x / 2;
    DispatchLayout layout = DispatchLayout(num_channels, kNumRanks, num_slots, hidden_int4, num_topk, num_scales);
    long long row_bytes = (long long)hidden_int4 * 16;

    // A sender block, thread 0: the own source's channel start (what a ring receiver learns from its sender's
    // start value).
    __device__ __forceinline__ void publish_own_channel_start() const {
        if (threadIdx.x == 0 && recv_channel_prefix_matrix != nullptr)
            recv_channel_prefix_matrix[rank * num_channels + channel] =
                channel > 0 ? channel_prefix_matrix[rank * num_channels + channel - 1] : 0;
    }

    // kSender: the warps of peer's group write the channel's tokens for peer into its ring (c, rank).
    __device__ __forceinline__ void sender(int peer) const {
        const int experts_per_rank = num_experts / kNumRanks;
        int begin, end;
        channel_range(num_tokens, num_channels, channel, begin, end);
        const int warp_in_group = RG::warp_in_group();
        const bool leader = warp_in_group == 0 && lane_id() == 0;
        const int bar_id = 1 + peer;
        void* dst_base = buffer_ptrs[peer];
        const RingProducer<> ring{layout.tail.on(dst_base, channel, rank), layout.head.on(dst_base, channel, rank),
                                  num_slots};
        int4* ring_x = layout.x.on(dst_base, channel, rank);
        int* ring_src = layout.src_idx.on(dst_base, channel, rank);
        int* ring_topk = layout.topk_idx.on(dst_base, channel, rank);
        float* ring_weights = layout.topk_weights.on(dst_base, channel, rank);
        float* ring_scales = layout.scales.on(dst_base, channel, rank);
        // Tokens of earlier channels sent to peer: the first row of this channel in peer's block.
        const int sent_before = channel > 0 ? channel_prefix_matrix[peer * num_channels + channel - 1] : 0;

        if (leader) {  // -v-1 so that 0 keeps meaning "not written yet"
            st_relaxed_sys(layout.start.on(dst_base, channel, rank), -sent_before - 1);
            st_relaxed_sys(layout.end.on(dst_base, channel, rank),
                           -channel_prefix_matrix[peer * num_channels + channel] - 1);
        }
        // Tokens are scanned in windows of 32: one load + ballot gives the window's selected tokens and
        // their ring counters; the k-th selected token goes to warp (counter % warps). Every warp computes
        // the same counters, so the group only meets to claim slots (per batch) and to publish the tail.
        int cached_tail = 0, cached_head = 0, published = 0;  // cached_head: leader only
        for (int b0 = begin; b0 < end; b0 += RG::kBatchTokens) {
            if (leader) {
                bool ok = true;
                if (!ring.has_space(cached_tail, cached_head, RG::kBatchTokens)) {
                    ok = ring.wait_for_space(ctx, WaitSite{kKernelDispatch, kRoleSender, channel, peer}, cached_tail,
                                             cached_head, RG::kBatchTokens,
                                             [&](long long& h, long long& tl, long long& ex) {
                                                 h = cached_head;
                                                 tl = cached_tail;
                                                 ex = RG::kBatchTokens;
                                             });
                }
                sh.abort[peer] = !ok;
            }
            group_sync(bar_id, RG::kThreadsPerPeer);
            if (sh.abort[peer]) break;
            const int b_end = min(b0 + RG::kBatchTokens, end);
            for (int w0 = b0; w0 < b_end; w0 += kWarpSize) {
                const int window = (w0 - begin) / kWarpSize;
                const int t_lane = w0 + lane_id();
                const bool selected = t_lane < end && is_token_in_rank[(long long)t_lane * kNumRanks + peer];
                const unsigned mask = __ballot_sync(0xffffffffu, selected);
                const int num_selected = __popc(mask);
                if (send_head != nullptr && window % RG::kWarpsPerPeer == warp_in_group && t_lane < end)
                    send_head[(long long)t_lane * kNumRanks + peer] =
                        selected ? sent_before + cached_tail + __popc(mask & ((1u << lane_id()) - 1u)) : -1;
                int j = (warp_in_group - cached_tail % RG::kWarpsPerPeer + RG::kWarpsPerPeer) % RG::kWarpsPerPeer;
                for (; j < num_selected; j += RG::kWarpsPerPeer) {
                    const int t = w0 + nth_set_bit(mask, j);
                    const int slot = (cached_tail + j) % num_slots;
                    warp_copy<false, kSendUnroll>(ring_x + (long long)slot * hidden_int4,
                                                  x + (long long)t * hidden_int4, hidden_int4);
                    if (lane_id() == 0) ring_src[slot] = t;
                    if (topk_idx != nullptr) {
                        for (int k = lane_id(); k < num_topk; k += kWarpSize) {
                            const long long e = (long long)topk_idx[(long long)t * num_topk + k];
                            const long long local = e - (long long)peer * experts_per_rank;
                            const bool owned = e >= 0 && local >= 0 && local < experts_per_rank;
                            ring_topk[slot * num_topk + k] = owned ? (int)local : -1;
                            ring_weights[slot * num_topk + k] =
                                owned && topk_weights != nullptr ? topk_weights[(long long)t * num_topk + k] : 0.0f;
                        }
                    }
                    for (int i = lane_id(); i < num_scales; i += kWarpSize)
                        ring_scales[slot * num_scales + i] = x_scales[t * scale_token_stride + i * scale_hidden_stride];
                }
                cached_tail += num_selected;
            }
            // Publish once a chunk has accumulated (and at the end): all warps of the group wrote their rows.
            if (cached_tail - published >= num_max_send_tokens || b_end >= end) {
                group_sync(bar_id, RG::kThreadsPerPeer);
                if (leader) ring.release(cached_tail);
                published = cached_tail;
            }
        }
    }

    // kReceiver: the warps of peer's group drain the ring (c, peer) into the outputs with bulk copies.
    __device__ __forceinline__ void receiver(TmaCopier& tma, int peer) const {
        const int warp_in_group = RG::warp_in_group();
        const bool leader = warp_in_group == 0 && lane_id() == 0;
        const int bar_id = 1 + peer;
        void* mine = buffer_ptrs[rank];
        int* start_ptr = layout.start.on(mine, channel, peer);
        int* end_ptr = layout.end.on(mine, channel, peer);
        const RingConsumer ring{layout.tail.on(mine, channel, peer), layout.head.on(mine, channel, peer)};
        const int4* ring_x = layout.x.on(mine, channel, peer);
        const int* ring_src = layout.src_idx.on(mine, channel, peer);
        const int* ring_topk = layout.topk_idx.on(mine, channel, peer);
        const float* ring_weights = layout.topk_weights.on(mine, channel, peer);
        const float* ring_scales = layout.scales.on(mine, channel, peer);

        if (leader) {
            int start = 0, stop = 0;
            const bool ok = wait_until(
                ctx, WaitSite{kKernelDispatch, kRoleReceiver, channel, peer},
                [&] {
                    start = ld_volatile(start_ptr);
                    stop = ld_volatile(end_ptr);
                    return start != 0 && stop != 0;
                },
                [&](long long& h, long long& tl, long long& ex) {
                    h = start;
                    tl = stop;
                    ex = -1;
                });
            sh.abort[peer] = !ok;
            sh.start[peer] = -start - 1;
            sh.count[peer] = (-stop - 1) - (-start - 1);
            if (ok && recv_channel_prefix_matrix != nullptr)
                recv_channel_prefix_matrix[peer * num_channels + channel] = -start - 1;
        }
        group_sync(bar_id, RG::kThreadsPerPeer);
        const bool aborted = sh.abort[peer];
        const int num_to_recv = sh.count[peer];
        int row = (peer > 0 ? rank_prefix_matrix[(peer - 1) * kNumRanks + rank] : 0) + sh.start[peer];
        group_sync(bar_id, RG::kThreadsPerPeer);  // everyone has read sh.abort before the leader reuses it
        if (!aborted) {
            int cached_head = 0;
            while (cached_head < num_to_recv) {
                if (leader) {
                    int tail = cached_head;
                    const bool ok =
                        ring.wait_for_data(ctx, WaitSite{kKernelDispatch, kRoleReceiver, channel, peer},
                                           cached_head + 1, tail, [&](long long& h, long long& tl, long long& ex) {
                                               h = cached_head;
                                               tl = tail;
                                               ex = num_to_recv;
                                           });
                    sh.abort[peer] = !ok;
                    sh.value[peer] = tail;
                }
                group_sync(bar_id, RG::kThreadsPerPeer);
                if (sh.abort[peer]) break;
                const int tail = sh.value[peer];
                if (lane_id() == 0) fence_proxy_async();  // the bulk loads read what the peer wrote
                for (int i = warp_in_group; i < tail - cached_head; i += RG::kWarpsPerPeer) {
                    const int slot = (cached_head + i) % num_slots;
                    const long long out = row + i;
                    if (lane_id() == 0)
                        tma.copy(recv_x + out * hidden_int4, ring_x + (long long)slot * hidden_int4, row_bytes);
                    if (lane_id() == 0 && recv_src_idx != nullptr) recv_src_idx[out] = ld_volatile(&ring_src[slot]);
                    if (recv_topk_idx != nullptr) {
                        for (int k = lane_id(); k < num_topk; k += kWarpSize) {
                            recv_topk_idx[out * num_topk + k] = (IdxT)ld_volatile(&ring_topk[slot * num_topk + k]);
                            recv_topk_weights[out * num_topk + k] = ld_volatile(&ring_weights[slot * num_topk + k]);
                        }
                    }
                    for (int s = lane_id(); s < num_scales; s += kWarpSize)
                        recv_x_scales[out * num_scales + s] = ld_volatile(&ring_scales[slot * num_scales + s]);
                }
                row += tail - cached_head;
                cached_head = tail;
                group_sync(bar_id, RG::kThreadsPerPeer);  // all reads of the slots are done
                if (leader) ring.release(cached_head);
            }
        }
    }

    // kOwnRows: this rank's own tokens straight from x into their final rows.
    __device__ __forceinline__ void own_rows(TmaCopier& tma, int own_block) const {
        copy_own_rows<kNumRanks, IdxT>(own_block, gridDim.x - 2 * num_channels, tma, recv_x, recv_x_scales,
                                       recv_src_idx, recv_topk_idx, recv_topk_weights, send_head, x, x_scales, topk_idx,
                                       topk_weights, is_token_in_rank, channel_prefix_matrix, rank_prefix_matrix,
                                       num_tokens, num_channels, hidden_int4, num_topk, num_experts, num_scales,
                                       scale_token_stride, scale_hidden_stride, rank);
    }

    // Every block, last: rows past the real count carry recv_topk_idx = -1 (num_worst_tokens; the rest is left as
    // is).
    __device__ __forceinline__ void mark_worst_rows() const {
        if (num_worst_tokens > 0 && recv_topk_idx != nullptr) {
            const long long num_recv = rank_prefix_matrix[(kNumRanks - 1) * kNumRanks + rank];
            const long long stride = (long long)gridDim.x * blockDim.x;
            for (long long i = num_recv * num_topk + (long long)blockIdx.x * blockDim.x + threadIdx.x;
                 i < (long long)num_worst_tokens * num_topk; i += stride)
                recv_topk_idx[i] = (IdxT)-1;
        }
    }
};

}  // namespace ep::intranode
