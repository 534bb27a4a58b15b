// internode/reduce.cuh: the combine's deterministic reductions of ring rows.
#pragma once
#include "common/wait.cuh"
#include "common/warp.cuh"
#include "common/layout.cuh"
#include "common/bf16.cuh"

namespace ep::internode {

// Warp copies here keep 4 loads per lane in flight (common/warp.cuh warp_copy): the role loops hold more state.
constexpr int kCopyUnroll = 4;

// dst[c] = bf16(fp32 sum) for the warp's int4 columns c < n (8 bf16 each) of: bias0[c], bias1[c] (rows of this
// rank's inputs, skipped when null), then src0[slot[k] + c] for k = 0 .. kSources - 1 with slot[k] >= 0 (rings
// written by peers). The additions per element keep this order (the combine is deterministic). kCols columns per
// lane per step, so each source has kCols loads in flight instead of one.
template <int kSources, int kCols>
__device__ __forceinline__ void reduce_columns(int4* dst, const int4* src0, const long long* slot, const int4* bias0,
                                               const int4* bias1, int c) {
    float acc[kCols][8];
#pragma unroll
    for (int u = 0; u < kCols; ++u)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[u][e] = 0.0f;
    int4 v[kCols];
    if (bias0 != nullptr) {
#pragma unroll
        for (int u = 0; u < kCols; ++u) v[u] = ld_nc_v4(bias0 + c + u * kWarpSize);
#pragma unroll
        for (int u = 0; u < kCols; ++u) accumulate_bf16x8(acc[u], v[u]);
    }
    if (bias1 != nullptr) {
#pragma unroll
        for (int u = 0; u < kCols; ++u) v[u] = ld_nc_v4(bias1 + c + u * kWarpSize);
#pragma unroll
        for (int u = 0; u < kCols; ++u) accumulate_bf16x8(acc[u], v[u]);
    }
    for (int k = 0; k < kSources; ++k) {
        const long long s = slot[k];
        if (s < 0) continue;
#pragma unroll
        for (int u = 0; u < kCols; ++u) v[u] = ld_ring_v4(src0 + s + c + u * kWarpSize);
#pragma unroll
        for (int u = 0; u < kCols; ++u) accumulate_bf16x8(acc[u], v[u]);
    }
#pragma unroll
    for (int u = 0; u < kCols; ++u)
        dst[c + u * kWarpSize] =
            make_int4((int)pack_bf16x2(acc[u][0], acc[u][1]), (int)pack_bf16x2(acc[u][2], acc[u][3]),
                      (int)pack_bf16x2(acc[u][4], acc[u][5]), (int)pack_bf16x2(acc[u][6], acc[u][7]));
}
// Top-k weight k of a token summed over its sources' ring copies (slot < 0: the source does not hold it), in
// source order like reduce_rows; the weights sit at weights_off bytes into each ring token.
template <int kSources>
__device__ __forceinline__ float sum_token_weight(const int4* src0, const long long* slot, long long weights_off,
                                                  int k) {
    float sum = 0.0f;
    for (int j = 0; j < kSources; ++j) {
        if (slot[j] < 0) continue;
        const char* token = reinterpret_cast<const char*>(src0 + slot[j]);
        sum += ld_volatile(reinterpret_cast<const float*>(token + weights_off) + k);
    }
    return sum;
}
template <int kSources>
__device__ __forceinline__ void reduce_rows(int4* dst, const int4* src0, const long long* slot, const int4* bias0,
                                            const int4* bias1, int n) {
    constexpr int kCols = 4;  // 12 * kCols registers (acc + loads) whatever kSources is
    int c = lane_id();
    for (; c + (kCols - 1) * kWarpSize < n; c += kCols * kWarpSize)
        reduce_columns<kSources, kCols>(dst, src0, slot, bias0, bias1, c);
    for (; c < n; c += kWarpSize) reduce_columns<kSources, 1>(dst, src0, slot, bias0, bias1, c);
}

}  // namespace ep::internode
