// intranode/combine.cuh: the combines' token reduction (ring and zero-copy forms).
#pragma once
#include "common/wait.cuh"
#include "common/warp.cuh"
#include "common/layout.cuh"
#include "common/bf16.cuh"

namespace ep::intranode {

constexpr int kCombineTokensPerWarp = 2;

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

}  // namespace ep::intranode
