// layout.cu: get_dispatch_layout. From topk_idx [T, K] (-1 = no expert) it computes
//   num_tokens_per_rank [R], num_tokens_per_rdma_rank [R / ranks_per_node] (optional),
//   num_tokens_per_expert [E] (a duplicated expert counts twice), is_token_in_rank [T, R] bool.
//
// One launch: every block histograms its slice of tokens in shared memory and writes a partial row
// into the workspace; the last block to finish (ticket counter) sums the partial rows. No output needs
// zeroing beforehand, so the whole call is one kernel.
#include "common.cuh"

namespace ep {

constexpr int kLayoutThreads = 128;

// workspace: [0] ticket (kept 0 between calls), then partial rows [gridDim.x][num_columns] at +32 ints.
template <typename IdxT>
__global__ void __launch_bounds__(kLayoutThreads) get_dispatch_layout(
    const IdxT* topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks, int ranks_per_node,
    int* num_tokens_per_rank, int* num_tokens_per_rdma_rank, int* num_tokens_per_expert,
    bool* is_token_in_rank, int* workspace) {
    extern __shared__ int s_hist[];  // [num_experts | num_ranks | num_nodes]
    const int num_nodes = num_tokens_per_rdma_rank != nullptr ? num_ranks / ranks_per_node : 0;
    const int num_columns = num_experts + num_ranks + num_nodes;
    const int experts_per_rank = num_experts / num_ranks;
    int* s_expert = s_hist;
    int* s_rank = s_hist + num_experts;
    int* s_node = s_rank + num_ranks;

    for (int i = threadIdx.x; i < num_columns; i += blockDim.x) s_hist[i] = 0;
    __syncthreads();

    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < num_tokens; t += gridDim.x * blockDim.x) {
        const IdxT* idx = topk_idx + (long long)t * num_topk;
        bool* row = is_token_in_rank + (long long)t * num_ranks;
        for (int r = 0; r < num_ranks; ++r) row[r] = false;
        for (int k = 0; k < num_topk; ++k) {
            const long long e = (long long)idx[k];
            if (e < 0 || e >= num_experts) continue;
            atomicAdd(&s_expert[e], 1);
            // Count the rank (and node) only at its first occurrence in the row: O(K^2), no local arrays.
            const int r = (int)(e / experts_per_rank);
            bool first_rank = true, first_node = true;
            for (int j = 0; j < k; ++j) {
                const long long f = (long long)idx[j];
                if (f < 0 || f >= num_experts) continue;
                const int rf = (int)(f / experts_per_rank);
                first_rank &= rf != r;
                if (num_nodes > 0) first_node &= rf / ranks_per_node != r / ranks_per_node;
            }
            if (first_rank) {
                row[r] = true;
                atomicAdd(&s_rank[r], 1);
            }
            if (num_nodes > 0 && first_node) atomicAdd(&s_node[r / ranks_per_node], 1);
        }
    }
    __syncthreads();

    // Partial row of this block, then take a ticket; the last block reduces.
    int* partials = workspace + 32;
    for (int i = threadIdx.x; i < num_columns; i += blockDim.x)
        partials[(long long)blockIdx.x * num_columns + i] = s_hist[i];
    __threadfence();
    __shared__ int s_is_last;
    __syncthreads();
    if (threadIdx.x == 0) s_is_last = atomicAdd(&workspace[0], 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!s_is_last) return;
    __threadfence();
    for (int i = threadIdx.x; i < num_columns; i += blockDim.x) {
        // L2 loads (this SM never cached these lines), unrolled so that many are in flight.
        int sum = 0;
#pragma unroll 8
        for (int b = 0; b < (int)gridDim.x; ++b) sum += __ldcg(&partials[(long long)b * num_columns + i]);
        if (i < num_experts) num_tokens_per_expert[i] = sum;
        else if (i < num_experts + num_ranks) num_tokens_per_rank[i - num_experts] = sum;
        else num_tokens_per_rdma_rank[i - num_experts - num_ranks] = sum;
    }
    if (threadIdx.x == 0) workspace[0] = 0;  // ready for the next call (stream order)
}

}  // namespace ep
