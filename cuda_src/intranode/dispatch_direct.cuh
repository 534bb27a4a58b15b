// intranode/dispatch_direct.cuh: the zero-copy dispatch's parts.
#pragma once
#include "common/wait.cuh"
#include "common/warp.cuh"
#include "common/layout.cuh"
#include "intranode/groups.cuh"
#include "intranode/handshake.cuh"

namespace ep::intranode {

constexpr int kDirectUnroll = 4;  // 16-byte loads per lane in flight (a 7168-wide bf16 row is 7 rounds of 4)

// Copy one row (n int4) to every rank in `targets` (bit d: rank d gets it at row `row` of lane d, in dst_x[d]).
// The rows travel by shuffle, not in a per-rank register array: the kernel is at its 80-register limit. So the
// loop runs the same rounds on every lane (a lane past the row's end is masked, it still shuffles): a lane-strided
// loop left the lanes past a short row's end out of the shuffle and hung (hidden 128: 16 int4).
template <int kNumRanks>
__device__ __forceinline__ void warp_copy_to_targets(int4* const* dst_x, int row, unsigned targets, const int4* src,
                                                     int n) {
    for (int i0 = 0; i0 < n; i0 += kDirectUnroll * kWarpSize) {
        const int i = i0 + lane_id();
        int4 v[kDirectUnroll];
#pragma unroll
        for (int u = 0; u < kDirectUnroll; ++u)
            if (i + u * kWarpSize < n) v[u] = ld_nc_v4(src + i + u * kWarpSize);
#pragma unroll
        for (int d = 0; d < kNumRanks; ++d) {
            if (!((targets >> d) & 1u)) continue;
            int4* dst = dst_x[d] + (long long)__shfl_sync(0xffffffffu, row, d) * n + i;
#pragma unroll
            for (int u = 0; u < kDirectUnroll; ++u)
                if (i + u * kWarpSize < n) dst[u * kWarpSize] = v[u];
        }
    }
}

// The zero-copy dispatch's shared memory: per destination rank this block's first position in its rank's block of
// rows there, the same as a row of rank d's output, and rank d's zero-copy rows; per warp its bulk copier's mbarrier.
template <int kNumRanks>
struct DirectDispatchShared {
    int base[kNumRanks];
    int first_row[kNumRanks];
    int4* dst_x[kNumRanks];
    unsigned long long tma_bar[Groups<kNumRanks>::kWarps];
};

// One block of dispatch_direct: the kernel's arguments, the block's role (plan) and its steps.
template <int kNumRanks, typename IdxT>
struct DirectDispatchContext {
    using G = Groups<kNumRanks>;
    // the kernel's arguments, in its order
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
    int num_out_rows;
    int hidden_int4;
    int num_topk;
    int num_experts;
    int num_scales;
    long long scale_token_stride;
    long long scale_hidden_stride;
    void** buffer_ptrs;
    int rank;
    int num_channels;
    int capacity;
    int num_local_blocks;
    int enter;
    const DeviceCtx* ctx;
    DirectDispatchShared<kNumRanks>& sh;
    // derived
    DirectDispatchLayout layout = DirectDispatchLayout(num_channels, capacity, hidden_int4, num_topk, num_scales);
    const int* totals = rank_prefix_matrix + (kNumRanks - 1) * kNumRanks;  // rows each rank receives
    // the block's role and tokens (plan)
    bool split = false, local_role = false;
    int role_blocks = 0, role_index = 0, begin = 0, end = 0;
    unsigned role_targets = 0;

    // Every rank reads the same matrix, so all ranks stop alike (no block is left waiting for skipped rows).
    __device__ __forceinline__ bool fits() const {
        for (int d = 0; d < kNumRanks; ++d) {
            if (totals[d] > capacity) {
                if (blockIdx.x == 0 && threadIdx.x == 0)
                    report_failure(ctx, WaitSite{kKernelDispatchDirect, kRoleZeroCopyCapacity, -1, d}, totals[d],
                                   capacity, -1, 0);
                return false;
            }
        }
        return true;
    }

    // The block's role and tokens; warps d < R stage rank d's bases in shared memory (read after a barrier).
    __device__ __forceinline__ void plan() {
        // Roles: with num_local_blocks > 0 the last num_local_blocks blocks copy only the rows this rank keeps (local
        // HBM copies) and the others only the rows for its peers (NVLink stores); 0: every block writes both.
        split = num_local_blocks > 0 && num_local_blocks < (int)gridDim.x && kNumRanks > 1;
        local_role = split && (int)blockIdx.x >= (int)gridDim.x - num_local_blocks;
        role_blocks = !split ? (int)gridDim.x : local_role ? num_local_blocks : (int)gridDim.x - num_local_blocks;
        role_index = local_role ? (int)blockIdx.x - ((int)gridDim.x - num_local_blocks) : (int)blockIdx.x;
        role_targets = !split ? 0xffffffffu : local_role ? (1u << rank) : ~(1u << rank);
        // This block's tokens: equal shares of whole windows of 32 among its role's blocks. Warp d < R counts the
        // tokens of the range's first channel that lie before it (channel_prefix_matrix: the count before it).
        const int num_windows = (num_tokens + kWarpSize - 1) / kWarpSize;
        const int per_block = (num_windows + role_blocks - 1) / role_blocks * kWarpSize;
        begin = min(role_index * per_block, num_tokens);
        end = min(begin + per_block, num_tokens);
        if (warp_id() < kNumRanks) {
            const int d = warp_id();
            int base = 0;
            if (begin < end) {
                const int per_channel = (num_tokens + num_channels - 1) / num_channels;
                const int first_channel = begin / per_channel;
                // independent loads (no ballot chain): up to a channel of tokens costs one load latency, not one per 32
                int before = 0;
#pragma unroll 8
                for (int t = first_channel * per_channel + lane_id(); t < begin; t += kWarpSize)
                    before += is_token_in_rank[(long long)t * kNumRanks + d];
                base = warp_reduce_sum(before) +
                       (first_channel > 0 ? channel_prefix_matrix[d * num_channels + first_channel - 1] : 0);
            }
            if (lane_id() == 0) {
                sh.base[d] = base;
                sh.first_row[d] = (rank > 0 ? rank_prefix_matrix[(rank - 1) * kNumRanks + d] : 0) + base;
                sh.dst_x[d] = layout.x.on(buffer_ptrs[d]);
            }
        }
    }

    // Block 0: where each of my channels starts in every rank's block of rows from me.
    __device__ __forceinline__ void publish_channel_starts() const {
        if (blockIdx.x == 0) {
            for (int i = threadIdx.x; i < kNumRanks * num_channels; i += blockDim.x) {
                const int d = i / num_channels, c = i % num_channels;
                layout.channel_starts.on(buffer_ptrs[d])[rank * num_channels + c] =
                    c > 0 ? channel_prefix_matrix[d * num_channels + c - 1] : 0;
            }
        }
    }

    // The block's rows to their final rows on every rank of its role; returns how many it selected per lane d (the
    // count of rank d's rows, lane d < R).
    __device__ __forceinline__ int write_rows(TmaCopier& tma) const {
        // Every warp scans every window (R loads + ballots) and takes the tokens j with j % warps == its index.
        // Lane d < R keeps rank d's numbers: the window's selection mask and the count of earlier windows.
        const int experts_per_rank = num_experts / kNumRanks;
        const int my_rank_lane = min(lane_id(), kNumRanks - 1);
        int my_count = 0;
        for (int w0 = begin; w0 < end; w0 += kWarpSize) {
            const int t_lane = w0 + lane_id();
            unsigned my_mask = 0;
#pragma unroll
            for (int d = 0; d < kNumRanks; ++d) {
                const unsigned m =
                    __ballot_sync(0xffffffffu, t_lane < end && is_token_in_rank[(long long)t_lane * kNumRanks + d]);
                if (lane_id() == d) my_mask = m;
            }
            const int j0 = w0 - begin;
            for (int l = (warp_id() - j0 % G::kWarps + G::kWarps) % G::kWarps; l < kWarpSize && w0 + l < end;
                 l += G::kWarps) {
                const int t = w0 + l;
                const bool selected = lane_id() < kNumRanks && ((my_mask >> l) & 1u);
                const int pos = my_count + __popc(my_mask & ((1u << l) - 1u));  // inside this block's share
                const int row = sh.first_row[my_rank_lane] + pos;               // lane d: the row on rank d
                if (send_head != nullptr && lane_id() < kNumRanks && ((role_targets >> lane_id()) & 1u))
                    send_head[(long long)t * kNumRanks + lane_id()] = selected ? sh.base[lane_id()] + pos : -1;
                const unsigned targets = __ballot_sync(0xffffffffu, selected) & role_targets;
                if (targets == 0) continue;
                const int4* src = x + (long long)t * hidden_int4;
                // A row only for this rank is a local copy (HBM to HBM): a bulk copy keeps 8 KB per warp in flight where
                // the register path keeps 2 KB (own-row blocks at 24 SMs: 6 of them 212.5 us, against 230.7 with
                // register copies). A row also for peers goes through registers to all its ranks: one load feeds every
                // store (a bulk copy of the own row next to it took the fused 8-SM dispatch from ~310 to 336.5 us).
                if (targets == (1u << rank)) {
                    const long long own_row = __shfl_sync(0xffffffffu, row, rank);
                    if (lane_id() == 0)
                        tma.copy(sh.dst_x[rank] + own_row * hidden_int4, src, (long long)hidden_int4 * 16);
                } else {
                    warp_copy_to_targets<kNumRanks>(sh.dst_x, row, targets, src, hidden_int4);
                }
#pragma unroll 1
                for (int d = 0; d < kNumRanks; ++d) {
                    if (!((targets >> d) & 1u)) continue;
                    void* dst = buffer_ptrs[d];
                    const long long r = __shfl_sync(0xffffffffu, row, d);
                    if (send_head != nullptr && lane_id() == 0) layout.src_idx.on(dst)[r] = t;
                    if (topk_idx != nullptr) {
                        for (int k = lane_id(); k < num_topk; k += kWarpSize) {
                            const long long e = (long long)topk_idx[(long long)t * num_topk + k];
                            const long long local = e - (long long)d * experts_per_rank;
                            const bool owned = e >= 0 && local >= 0 && local < experts_per_rank;
                            layout.topk_idx.on(dst)[r * num_topk + k] = owned ? (int)local : -1;
                            layout.topk_weights.on(dst)[r * num_topk + k] =
                                owned && topk_weights != nullptr ? topk_weights[(long long)t * num_topk + k] : 0.0f;
                        }
                    }
                    for (int i = lane_id(); i < num_scales; i += kWarpSize)
                        layout.scales.on(dst)[r * num_scales + i] =
                            x_scales[t * scale_token_stride + i * scale_hidden_stride];
                }
            }
            my_count += __popc(my_mask);
        }
        return my_count;
    }

    // Release this block's rows to each rank with one add (block 0 adds one more: its channel starts; the caller's
    // barrier orders the other threads' stores before thread d's system-scope fence), then wait until every row of
    // this rank's output is in. False (block-wide) on timeout.
    __device__ __forceinline__ bool release_and_wait(int my_count) const {
        if (threadIdx.x < kNumRanks) {
            const int n = ((role_targets >> threadIdx.x) & 1u ? my_count : 0) + (blockIdx.x == 0);
            if (n > 0) {
                fence_acq_rel_sys();
                atomicAdd_system(layout.done.on(buffer_ptrs[threadIdx.x]), n);
            }
        }
        // Wait until every row of this rank's output is in: the rows from all ranks plus one per source's block 0.
        void* mine = buffer_ptrs[rank];
        const int num_recv = totals[rank];
        bool ok = true;
        if (threadIdx.x == 0) {
            const int* done = layout.done.on(mine);
            const int expected = num_recv + kNumRanks;
            int seen = 0;
            ok = wait_until(
                ctx, WaitSite{kKernelDispatchDirect, kRoleReceiver, (int)blockIdx.x, -1},
                [&] { return (seen = ld_acquire_sys(done)) >= expected; },
                [&](long long& h, long long& tl, long long& ex) {
                    h = seen;
                    tl = seen;
                    ex = expected;
                });
        }
        return __syncthreads_and(ok) != 0;
    }

    // The small outputs: this block's share of the rows, from the buffer into the caller's arrays.
    __device__ __forceinline__ void copy_outputs() const {
        void* mine = buffer_ptrs[rank];
        const int rows_out = min(totals[rank], num_out_rows);
        const long long gid = (long long)blockIdx.x * blockDim.x + threadIdx.x,
                        stride = (long long)gridDim.x * blockDim.x;
        if (recv_src_idx != nullptr)
            for (long long i = gid; i < rows_out; i += stride)
                recv_src_idx[i] = ld_volatile(layout.src_idx.on(mine) + i);
        if (recv_topk_idx != nullptr) {
            for (long long i = gid; i < (long long)num_out_rows * num_topk; i += stride) {
                const bool real = i < (long long)rows_out * num_topk;  // rows past the real count: expert -1
                recv_topk_idx[i] = real ? (IdxT)ld_volatile(layout.topk_idx.on(mine) + i) : (IdxT)-1;
                if (real) recv_topk_weights[i] = ld_volatile(layout.topk_weights.on(mine) + i);
            }
        }
        if (recv_x_scales != nullptr)
            for (long long i = gid; i < (long long)rows_out * num_scales; i += stride)
                recv_x_scales[i] = ld_volatile(layout.scales.on(mine) + i);
        if (recv_channel_prefix_matrix != nullptr && blockIdx.x == 0)
            for (int i = threadIdx.x; i < kNumRanks * num_channels; i += blockDim.x)
                recv_channel_prefix_matrix[i] = ld_volatile(layout.channel_starts.on(mine) + i);
    }
};

}  // namespace ep::intranode
