// intranode/dispatch.cuh: the ring dispatch's parts (the own-row copies).
#pragma once
#include "common/wait.cuh"
#include "common/warp.cuh"
#include "common/layout.cuh"
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
            copy_own_row_meta(recv_topk_idx, recv_topk_weights, recv_x_scales, out, topk_idx, topk_weights, x_scales,
                              t, num_topk, rank, experts_per_rank, num_scales, scale_token_stride, scale_hidden_stride);
        }
        count += __popc(mask);
    }
}

}  // namespace ep::intranode
