// layout.cu: get_dispatch_layout. From topk_idx [T, K] (-1 = no expert) it computes
//   num_tokens_per_rank [R], num_tokens_per_rdma_rank [R / ranks_per_node] (optional),
//   num_tokens_per_expert [E] (a duplicated expert counts twice), is_token_in_rank [T, R] bool.
//
// One launch. A token's K choices sit in K adjacent lanes of a warp (a lane group of G = the next power of
// two >= K lanes, so one warp pass covers 32 / G tokens with one coalesced load); __match_any_sync finds the
// first lane of each (token, rank) and (token, node), which counts it. Every block histograms in shared
// memory and adds its non-zero counts into an accumulator in the workspace (L2 atomics); the last block to
// finish (ticket counter) copies the accumulator to the outputs and zeroes it for the next call. No output
// needs zeroing beforehand.
#include "common/warp.cuh"

namespace ep {

// workspace: [0] ticket, then the accumulator [num_columns] at +32 ints; both 0 between calls.
template <typename IdxT>
__global__ void __launch_bounds__(kLayoutThreads)
    get_dispatch_layout(const IdxT* topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks,
                        int ranks_per_node, int* num_tokens_per_rank, int* num_tokens_per_rdma_rank,
                        int* num_tokens_per_expert, bool* is_token_in_rank, int* workspace) {
    extern __shared__ int s_hist[];  // [num_experts | num_ranks | num_nodes]
    const int num_nodes = num_tokens_per_rdma_rank != nullptr ? num_ranks / ranks_per_node : 0;
    const int num_columns = num_experts + num_ranks + num_nodes;
    const int experts_per_rank = num_experts / num_ranks;
    int* s_expert = s_hist;
    int* s_rank = s_hist + num_experts;
    int* s_node = s_rank + num_ranks;

    for (int i = threadIdx.x; i < num_columns; i += blockDim.x) s_hist[i] = 0;
    __syncthreads();

    int group = 1;
    while (group < num_topk) group <<= 1;
    const int tokens_per_pass = kWarpSize / group;
    const int sub = lane_id() / group, k = lane_id() % group;
    const int num_warps = gridDim.x * (blockDim.x / kWarpSize);
    for (int t0 = (blockIdx.x * (blockDim.x / kWarpSize) + warp_id()) * tokens_per_pass; t0 < num_tokens;
         t0 += num_warps * tokens_per_pass) {
        const int t = t0 + sub;
        const long long e = t < num_tokens && k < num_topk ? (long long)topk_idx[(long long)t * num_topk + k] : -1;
        const bool valid = e >= 0 && e < num_experts;
        const int r = valid ? (int)e / experts_per_rank : 0;
        bool* row = is_token_in_rank + (long long)t * num_ranks;
        if (t < num_tokens)
            for (int j = k; j < num_ranks; j += group) row[j] = false;
        __syncwarp();  // the group's zeros land before its trues
        if (valid) atomicAdd(&s_expert[(int)e], 1);
        // Keys unique per (token of the pass, rank); lanes without an expert get unique negative keys.
        const unsigned same_rank = __match_any_sync(0xffffffffu, valid ? (sub << 24) | r : -1 - lane_id());
        if (valid && nth_set_bit(same_rank, 0) == lane_id()) {
            row[r] = true;
            atomicAdd(&s_rank[r], 1);
        }
        if (num_nodes > 0) {
            const int node = r / ranks_per_node;
            const unsigned same_node = __match_any_sync(0xffffffffu, valid ? (sub << 24) | node : -1 - lane_id());
            if (valid && nth_set_bit(same_node, 0) == lane_id()) atomicAdd(&s_node[node], 1);
        }
    }
    __syncthreads();

    // Add this block's counts into the accumulator, then take a ticket; the last block publishes.
    int* accumulator = workspace + 32;
    for (int i = threadIdx.x; i < num_columns; i += blockDim.x)
        if (s_hist[i] != 0) atomicAdd(&accumulator[i], s_hist[i]);
    __threadfence();
    __shared__ int s_is_last;
    __syncthreads();
    if (threadIdx.x == 0) s_is_last = atomicAdd(&workspace[0], 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!s_is_last) return;
    __threadfence();
    for (int i = threadIdx.x; i < num_columns; i += blockDim.x) {
        const int sum = __ldcg(&accumulator[i]);  // L2, where the atomics were performed
        accumulator[i] = 0;                       // ready for the next call (stream order)
        if (i < num_experts)
            num_tokens_per_expert[i] = sum;
        else if (i < num_experts + num_ranks)
            num_tokens_per_rank[i - num_experts] = sum;
        else
            num_tokens_per_rdma_rank[i - num_experts - num_ranks] = sum;
    }
    if (threadIdx.x == 0) workspace[0] = 0;
}

}  // namespace ep
