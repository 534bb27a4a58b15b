// intranode/dispatch_direct.cuh: the zero-copy dispatch's parts.
#pragma once
#include "common/wait.cuh"
#include "common/warp.cuh"
#include "common/layout.cuh"

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

}  // namespace ep::intranode
