// intranode/combine.cuh: the combines' token reduction (ring and zero-copy forms), and the ring combine's roles as
// member functions of its CombineContext; the role map is combine_role_of.
#pragma once
#include "common/wait.cuh"
#include "common/warp.cuh"
#include "common/layout.cuh"
#include "common/bf16.cuh"
#include "common/ring.cuh"
#include "intranode/groups.cuh"
#include "intranode/dispatch.cuh"  // kSendUnroll

namespace ep::intranode {

// kCombineTokensPerWarp: common/ids.cuh (cupy_ep/ids.py).

// First index i in [0, n) with a[i] >= key (n if none) of an ascending array; every lane returns it. Each
// step loads 32 evenly spaced probes at once and narrows [lo, hi) 32-fold (3 dependent loads for 32K rows).
__device__ __forceinline__ int warp_lower_bound(const int* a, int n, int key) {
    int lo = 0, hi = n;
    while (hi - lo > kWarpSize) {
        const int step = (hi - lo + kWarpSize - 1) / kWarpSize;
        const int probe = lo + lane_id() * step;
        const int below = __popc(__ballot_sync(0xffffffffu, probe < hi && a[probe] < key));  // a prefix of lanes
        const int first_not_below = lo + below * step;  // a probe >= key, if below < 32 and it is < hi
        if (below > 0) lo = lo + (below - 1) * step + 1;
        if (below < kWarpSize && first_not_below < hi) hi = first_not_below;
    }
    return lo + __popc(__ballot_sync(0xffffffffu, lo + lane_id() < hi && a[lo + lane_id()] < key));
}

// One token's sum by one warp: srcs[0 .. num_src) are the rows to add, in order; 0 + each in fp32, rounded once to
// bf16 into out (every lane returns when it is stored). The rows stream through the warp's shared buffer in column
// chunks: lane 0 bulk-loads one chunk of every source, all lanes wait on the mbarrier, then reduce the chunk from
// shared memory (register loads left the reduction latency bound: 29 against 56 GB/s of traffic per SM). Rows a
// peer wrote need lane 0's fence_proxy_async() after they were acquired.
__device__ __forceinline__ void warp_sum_rows(TmaCopier& tma, const int4* const volatile* srcs, int num_src, int4* out,
                                              int hidden_int4) {
    const int chunk_int4 = kTmaChunkBytes / 16 / max(num_src, 1);
    const int4* stage = static_cast<const int4*>(tma.buf);
    for (int c0 = 0; c0 < hidden_int4; c0 += chunk_int4) {
        const int n = min(chunk_int4, hidden_int4 - c0);
        if (lane_id() == 0) {
            mbarrier_expect_tx(tma.bar, n * 16 * num_src);
            for (int q = 0; q < num_src; ++q)
                tma_load(static_cast<int4*>(tma.buf) + q * chunk_int4, srcs[q] + c0, n * 16, tma.bar);
        }
        mbarrier_wait(tma.bar, tma.phase);
        tma.phase ^= 1;
        for (int i = lane_id(); i < n; i += kWarpSize) {
            float acc[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[e] = 0.0f;
            for (int q = 0; q < num_src; ++q) accumulate_bf16x8(acc, stage[q * chunk_int4 + i]);
            out[c0 + i] = make_int4((int)pack_bf16x2(acc[0], acc[1]), (int)pack_bf16x2(acc[2], acc[3]),
                                    (int)pack_bf16x2(acc[4], acc[5]), (int)pack_bf16x2(acc[6], acc[7]));
        }
        __syncwarp();  // every lane has read the buffer before lane 0 refills it
    }
}

// Both combines (ring and zero-copy) add a token's rows in one order, so that their results are the same bit for
// bit (and the reference's): bias0, bias1, then every rank holding the token, ascending. These two helpers keep
// that order in one place; rows[r] is the token's row from rank r (-1: none), and the caller says where it lies
// (a ring slot or an inbox row; the own rank's row is in x).

// Lane 0 lists the token's sources into srcs for warp_sum_rows, row_of(r, row) addressing rank r's row; every
// lane returns their count.
template <int kNumRanks, typename RowOf>
__device__ __forceinline__ int token_sources(const int4* volatile* srcs, const int4* bias0, const int4* bias1, int t,
                                             int hidden_int4, const volatile int* rows, RowOf row_of) {
    int num_src = 0;
    if (lane_id() == 0) {
        if (bias0 != nullptr) srcs[num_src++] = bias0 + (long long)t * hidden_int4;
        if (bias1 != nullptr) srcs[num_src++] = bias1 + (long long)t * hidden_int4;
        for (int r = 0; r < kNumRanks; ++r) {
            const int row = rows[r];
            if (row >= 0) srcs[num_src++] = row_of(r, row);
        }
    }
    return __shfl_sync(0xffffffffu, num_src, 0);
}

// The token's combined top-k weights into out[0 .. num_topk): 0 + the weight from each rank holding it, ascending;
// weight_of(r, row, k) loads weight k of rank r's row. One lane per k.
template <int kNumRanks, typename WeightOf>
__device__ __forceinline__ void sum_token_weights(float* out, int num_topk, const volatile int* rows,
                                                  WeightOf weight_of) {
    for (int k = lane_id(); k < num_topk; k += kWarpSize) {
        float w = 0.0f;
#pragma unroll
        for (int r = 0; r < kNumRanks; ++r) {
            const int row = rows[r];
            if (row < 0) continue;
            w += weight_of(r, row, k);
        }
        out[k] = w;
    }
}

// Block 2c: channel c's sender, its warps grouped per remote token owner (RemoteGroups; target: the owner, -1 for a
// warp without one: kIdle); block 2c + 1: the receiver, the whole block reducing the channel's tokens (target -1).
template <int kNumRanks>
__device__ __forceinline__ RoleOf combine_role_of(int sm, int rank) {
    if (sm % 2 == 1) return {kReceiver, -1};
    const int peer = RemoteGroups<kNumRanks>::peer_of_warp(rank);
    return {peer < 0 ? kIdle : kSender, peer};
}

// The combine's shared memory: per remote peer group its leader's abort flag; the receiver's ring counters needed by
// the batch, per warp its token's source rows (slots, pointers), the batch's send_head rows, per warp the mbarrier of
// its bulk copier.
template <int kNumRanks>
struct CombineShared {
    int abort[kNumRanks];
    int need[kNumRanks];
    int slot[Groups<kNumRanks>::kWarps][kNumRanks];
    const int4* src[Groups<kNumRanks>::kWarps][kNumRanks + 2];
    int heads[Groups<kNumRanks>::kWarps * kCombineTokensPerWarp][kNumRanks];
    unsigned long long tma_bar[Groups<kNumRanks>::kWarps];
};

template <int kNumRanks>
struct CombineContext {
    using G = Groups<kNumRanks>;
    // the kernel's arguments, in its order
    int4* combined_x;
    float* combined_topk_weights;
    const int4* x;
    const float* topk_weights;
    const int4* bias0;
    const int4* bias1;
    const int* rank_prefix_matrix;
    const int* recv_src_idx;
    const int* send_head;
    int num_tokens;
    int hidden_int4;
    int num_topk;
    void** buffer_ptrs;
    int rank;
    int num_max_send_tokens;
    int num_slots;
    const DeviceCtx* ctx;
    CombineShared<kNumRanks>& sh;
    unsigned char* tma_buf;  // dynamic shared memory: kTmaChunkBytes per warp (the receiver)
    // derived
    int num_channels = gridDim.x / 2;
    int channel = blockIdx.x / 2;
    CombineLayout layout = CombineLayout(num_channels, kNumRanks, num_slots, hidden_int4, num_topk);

    // kSender: the warps of peer's group send peer's rows of the channel back into its ring (c, rank), in order.
    __device__ __forceinline__ void sender(int peer) const {
        using RG = RemoteGroups<kNumRanks>;
        const int warp_in_group = RG::warp_in_group();
        const bool leader = warp_in_group == 0 && lane_id() == 0;
        const int bar_id = 1 + peer;
        void* dst_base = buffer_ptrs[peer];
        int4* ring_x = layout.x.on(dst_base, channel, rank);
        float* ring_weights = layout.topk_weights.on(dst_base, channel, rank);

        const int block_begin = peer > 0 ? rank_prefix_matrix[(peer - 1) * kNumRanks + rank] : 0;
        const int block_rows = rank_prefix_matrix[peer * kNumRanks + rank] - block_begin;
        const int owner_tokens = ld_volatile(NotifyArea().num_tokens.on(buffer_ptrs[rank]) + peer);
        int token_begin, token_end;
        channel_range(owner_tokens, num_channels, channel, token_begin, token_end);
        const int first = warp_lower_bound(recv_src_idx + block_begin, block_rows, token_begin);
        const int last = warp_lower_bound(recv_src_idx + block_begin, block_rows, token_end);
        const int row_begin = block_begin + first, row_end = block_begin + last;
        // Absolute counters: the ring starts at `first`; a head still 0 (nothing released yet) means `first`.
        const RingProducer<true> ring{layout.tail.on(dst_base, channel, rank), layout.head.on(dst_base, channel, rank),
                                      num_slots, first};
        int cached_tail = first, cached_head = first;
        for (int row = row_begin; row < row_end;) {
            const int n = min(num_max_send_tokens, row_end - row);
            if (leader) {
                bool ok = true;
                if (!ring.has_space(cached_tail, cached_head, n)) {
                    ok = ring.wait_for_space(ctx, WaitSite{kKernelCombine, kRoleSender, channel, peer}, cached_tail,
                                             cached_head, n, [&](long long& h, long long& tl, long long& ex) {
                                                 h = cached_head;
                                                 tl = cached_tail;
                                                 ex = n;
                                             });
                }
                sh.abort[peer] = !ok;
            }
            group_sync(bar_id, RG::kThreadsPerPeer);
            if (sh.abort[peer]) break;
            for (int i = warp_in_group; i < n; i += RG::kWarpsPerPeer) {
                const int slot = (cached_tail + i) % num_slots;
                warp_copy<false, kSendUnroll>(ring_x + (long long)slot * hidden_int4,
                                              x + (long long)(row + i) * hidden_int4, hidden_int4);
                if (topk_weights != nullptr)
                    for (int k = lane_id(); k < num_topk; k += kWarpSize)
                        ring_weights[slot * num_topk + k] = topk_weights[(long long)(row + i) * num_topk + k];
            }
            cached_tail += n;
            row += n;
            group_sync(bar_id, RG::kThreadsPerPeer);
            if (leader) ring.release(cached_tail);
        }
    }

    // kReceiver (the whole block): batches of the channel's tokens, each reduced once every ring holds its rows.
    __device__ __forceinline__ void receiver() const {
        void* mine = buffer_ptrs[rank];
        int begin, end;
        channel_range(num_tokens, num_channels, channel, begin, end);
        const int own_row_begin = rank > 0 ? rank_prefix_matrix[(rank - 1) * kNumRanks + rank] : 0;
        TmaCopier tma;  // only its buffer and mbarrier: the reduction needs the data in registers
        tma.init(tma_buf + warp_id() * kTmaChunkBytes, &sh.tma_bar[warp_id()]);
        constexpr int batch = G::kWarps * kCombineTokensPerWarp;  // = the rows of sh.heads
        int released = 0;                                         // thread r < R: slots of ring r already handed back
        for (int b = begin; b < end; b += batch) {
            const int b_end = min(b + batch, end);
            // The batch's send_head rows, staged by the whole block at once: one load latency per batch instead
            // of a chain of loads per rank before the wait and another load per token before its first copy.
            for (int i = threadIdx.x; i < (b_end - b) * kNumRanks; i += blockDim.x)
                sh.heads[0][i] = send_head[(long long)b * kNumRanks + i];
            __syncthreads();
            // Thread r < R: the ring counter the batch needs, then wait for it.
            bool ok = true;
            if (threadIdx.x < kNumRanks) {
                const int r = threadIdx.x;
                int need = 0;  // the own rank's rows are in x: nothing to wait for
                for (int i = 0; i < b_end - b && r != rank; ++i) need = max(need, sh.heads[i][r] + 1);
                sh.need[r] = need;
                if (need > 0) {
                    const RingConsumer ring{layout.tail.on(mine, channel, r), layout.head.on(mine, channel, r)};
                    int tail = 0;
                    ok = ring.wait_for_data(ctx, WaitSite{kKernelCombine, kRoleReceiver, channel, r}, need, tail,
                                            [&](long long& h, long long& tl, long long& ex) {
                                                h = released;
                                                tl = tail;
                                                ex = need;
                                            });
                }
            }
            if (!__syncthreads_and(ok)) break;
            if (lane_id() == 0) fence_proxy_async();  // the bulk loads read what the peers wrote
            for (int t = b + warp_id(); t < b_end; t += G::kWarps) {
                // This token's row in every source: a ring slot, or for the own rank a row of x (-1: not sent
                // there); kept in shared memory to leave the registers to the loads in flight.
                volatile int* slot = sh.slot[warp_id()];
                if (lane_id() < kNumRanks) {
                    const int h = sh.heads[t - b][lane_id()];
                    slot[lane_id()] = h < 0 ? -1 : lane_id() == rank ? own_row_begin + h : h % num_slots;
                }
                __syncwarp();
                const int4* volatile* srcs = sh.src[warp_id()];
                const auto row_of = [&](int r, int row) {
                    return (r == rank ? x : layout.x.on(mine, channel, r)) + (long long)row * hidden_int4;
                };
                const int num_src = token_sources<kNumRanks>(srcs, bias0, bias1, t, hidden_int4, slot, row_of);
                warp_sum_rows(tma, srcs, num_src, combined_x + (long long)t * hidden_int4, hidden_int4);
                const auto weight_of = [&](int r, int row, int k) {
                    return r == rank ? topk_weights[(long long)row * num_topk + k]
                                     : ld_volatile(layout.topk_weights.on(mine, channel, r) + row * num_topk + k);
                };
                if (combined_topk_weights != nullptr)
                    sum_token_weights<kNumRanks>(combined_topk_weights + (long long)t * num_topk, num_topk, slot,
                                                 weight_of);
                __syncwarp();  // the lanes are done with `slot` before the next token overwrites it
            }
            __syncthreads();  // the batch's slots are read
            if (threadIdx.x < kNumRanks && sh.need[threadIdx.x] > released) {
                released = sh.need[threadIdx.x];
                ring_release(layout.head.on(mine, channel, threadIdx.x), released);
            }
        }
    }
};

// The zero-copy combine's shared memory: per reducer warp its token's row from each rank (-1: none) and its sources
// in order; per warp its bulk copier's mbarrier.
template <int kNumRanks>
struct DirectCombineShared {
    int row[Groups<kNumRanks>::kWarps][kNumRanks];
    const int4* src[Groups<kNumRanks>::kWarps][kNumRanks + 2];
    unsigned long long tma_bar[Groups<kNumRanks>::kWarps];
};

// One block of combine_direct: the kernel's arguments and its two roles (the first num_sender_blocks blocks send,
// the others reduce).
template <int kNumRanks>
struct DirectCombineContext {
    using G = Groups<kNumRanks>;
    // the kernel's arguments, in its order
    int4* combined_x;
    float* combined_topk_weights;
    const int4* x;
    const float* topk_weights;
    const int4* bias0;
    const int4* bias1;
    const int* rank_prefix_matrix;
    const int* send_head;
    int num_tokens;
    int hidden_int4;
    int num_topk;
    void** buffer_ptrs;
    int rank;
    int capacity;
    int rows_per_flag;
    int num_sender_blocks;
    const DeviceCtx* ctx;
    DirectCombineShared<kNumRanks>& sh;
    unsigned char* tma_buf;  // dynamic shared memory: kTmaChunkBytes per warp (the reducers)
    // derived
    DirectCombineLayout layout = DirectCombineLayout(kNumRanks, capacity, hidden_int4, num_topk);

    // Every block of rows (expert rank, owner) must fit; every rank reads the same matrix and stops alike.
    __device__ __forceinline__ bool fits() const {
        // Every block of rows (expert rank, owner) must fit; every rank reads the same matrix and stops alike.
        for (int i = 0; i < kNumRanks * kNumRanks; ++i) {
            const int rows = rank_prefix_matrix[i] - (i >= kNumRanks ? rank_prefix_matrix[i - kNumRanks] : 0);
            if (rows > capacity) {
                if (blockIdx.x == 0 && threadIdx.x == 0)
                    report_failure(ctx, WaitSite{kKernelCombineDirect, kRoleZeroCopyCapacity, -1, i % kNumRanks}, rows,
                                   capacity, -1, 0);
                return false;
            }
        }
        return true;
    }

    // Sender: every warp takes chunks of rows_per_flag rows of this rank's x, for each owner in turn, stores them
    // (and their top-k weights) at their place in the owner's buffer, then releases the chunk with one flag.
    __device__ __forceinline__ void sender() const {
        const int warp = (int)blockIdx.x * G::kWarps + warp_id(), num_warps = num_sender_blocks * G::kWarps;
        int chunk_base = 0;  // chunks of the owners before this one (the warps deal all owners' chunks in turn)
        for (int step = 1; step < kNumRanks; ++step) {
            const int owner = (rank + step) % kNumRanks;
            const int first = owner > 0 ? rank_prefix_matrix[(owner - 1) * kNumRanks + rank] : 0;
            const int num_rows = rank_prefix_matrix[owner * kNumRanks + rank] - first;
            const int num_chunks = (num_rows + rows_per_flag - 1) / rows_per_flag;
            void* dst = buffer_ptrs[owner];
            int4* rows = layout.x.on(dst) + (long long)rank * capacity * hidden_int4;
            float* weights = layout.topk_weights.on(dst) + (long long)rank * capacity * num_topk;
            int* flags = layout.flags.on(dst) + rank;  // flag k at k * kNumRanks
            for (int k = ((warp - chunk_base) % num_warps + num_warps) % num_warps; k < num_chunks; k += num_warps) {
                const int j_end = min((k + 1) * rows_per_flag, num_rows);
                for (int j = k * rows_per_flag; j < j_end; ++j) {
                    warp_copy<false, kSendUnroll>(rows + (long long)j * hidden_int4,
                                                  x + (long long)(first + j) * hidden_int4, hidden_int4);
                    if (topk_weights != nullptr)
                        for (int i = lane_id(); i < num_topk; i += kWarpSize)
                            weights[(long long)j * num_topk + i] = topk_weights[(long long)(first + j) * num_topk + i];
                }
                __syncwarp();  // the lanes' stores are ordered before lane 0's release
                if (lane_id() == 0) st_release_sys(flags + (long long)k * kNumRanks, 1);
            }
            chunk_base += num_chunks;
        }
    }

    // Reducer: lane r waits for the flag of the token's row from rank r, then the warp sums the rows.
    __device__ __forceinline__ void reducer() const {
        // Reducers: all reducer warps walk the tokens together (token t goes to reducer warp t % their count), in
        // the order the senders' chunks land (row order), so no reducer waits for rows that come last while others
        // idle (contiguous shares per block measured 494 us against 260 for the ring combine at 24 SMs).
        const int num_reducer_warps = ((int)gridDim.x - num_sender_blocks) * G::kWarps;
        const int reducer_warp = ((int)blockIdx.x - num_sender_blocks) * G::kWarps + warp_id();
        const int own_first = rank > 0 ? rank_prefix_matrix[(rank - 1) * kNumRanks + rank] : 0;
        void* mine = buffer_ptrs[rank];
        const int4* inbox = layout.x.on(mine);
        const float* inbox_weights = layout.topk_weights.on(mine);
        TmaCopier tma;  // only its buffer and mbarrier: the reduction needs the data in registers
        tma.init(tma_buf + warp_id() * kTmaChunkBytes, &sh.tma_bar[warp_id()]);
        for (int t = reducer_warp; t < num_tokens; t += num_reducer_warps) {
            bool ok = true;
            if (lane_id() < kNumRanks) {
                const int r = lane_id();
                int row = send_head[(long long)t * kNumRanks + r];
                if (row >= 0 && r != rank) {
                    const int* flag = layout.flags.on(mine) + (long long)(row / rows_per_flag) * kNumRanks + r;
                    ok = wait_until(
                        ctx, WaitSite{kKernelCombineDirect, kRoleReceiver, t, r},
                        [&] { return ld_acquire_sys(flag) != 0; },
                        [&](long long& h, long long& tl, long long& ex) {
                            h = row;
                            tl = 0;
                            ex = 1;
                        });
                }
                sh.row[warp_id()][r] = row;
            }
            if (!__all_sync(0xffffffffu, ok)) return;  // the buffer is stopped; no block barrier follows
            const volatile int* rows = sh.row[warp_id()];
            if (lane_id() == 0) fence_proxy_async();  // the bulk loads read what the peers wrote (acquired above)
            const int4* volatile* srcs = sh.src[warp_id()];
            const auto row_of = [&](int r, int row) {
                return r == rank ? x + (long long)(own_first + row) * hidden_int4
                                 : inbox + ((long long)r * capacity + row) * hidden_int4;
            };
            const int num_src = token_sources<kNumRanks>(srcs, bias0, bias1, t, hidden_int4, rows, row_of);
            warp_sum_rows(tma, srcs, num_src, combined_x + (long long)t * hidden_int4, hidden_int4);
            const auto weight_of = [&](int r, int row, int k) {
                return r == rank ? topk_weights[(long long)(own_first + row) * num_topk + k]
                                 : ld_volatile(inbox_weights + ((long long)r * capacity + row) * num_topk + k);
            };
            if (combined_topk_weights != nullptr)
                sum_token_weights<kNumRanks>(combined_topk_weights + (long long)t * num_topk, num_topk, rows,
                                             weight_of);
            __syncwarp();  // the lanes are done with sh.row before the next token overwrites it
        }
    }
};

}  // namespace ep::intranode
