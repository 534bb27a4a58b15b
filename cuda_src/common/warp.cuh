// common/warp.cuh: warp indices, reductions and bit tricks, and the warp copies (register and bulk).
#pragma once
#include "common/ptx.cuh"

namespace ep {

constexpr int kWarpSize = 32;

// ---------------------------------------------------------------------------------------------------
// Warp helpers
// ---------------------------------------------------------------------------------------------------
__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }
__device__ __forceinline__ int warp_id() { return threadIdx.x >> 5; }

__device__ __forceinline__ int warp_reduce_sum(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ int warp_reduce_max(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Warp copy of n int4 with kUnroll independent 16-B loads per lane in flight before the stores (a copy is
// bound by the bytes it keeps in flight). kPeerSource: the source was written by another GPU or SM (relaxed L2
// loads, never .nc); otherwise it is this rank's own input. N: int, or long long for byte counts past 2^31.
template <bool kPeerSource, int kUnroll, typename N>
__device__ __forceinline__ void warp_copy(int4* dst, const int4* src, N n) {
    N i = lane_id();
    for (; i + (kUnroll - 1) * kWarpSize < n; i += kUnroll * kWarpSize) {
        int4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) v[u] = kPeerSource ? ld_ring_v4(src + i + u * kWarpSize) : ld_nc_v4(src + i + u * kWarpSize);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) dst[i + u * kWarpSize] = v[u];
    }
    for (; i < n; i += kWarpSize) dst[i] = kPeerSource ? ld_ring_v4(src + i) : ld_nc_v4(src + i);
}

// Lane index of the n-th (0-based) set bit of mask (n < popc(mask)).
__device__ __forceinline__ int nth_set_bit(unsigned mask, int n) {
    for (int i = 0; i < n; ++i) mask &= mask - 1u;
    return __ffs(mask) - 1;
}

// First set bit of mask at or after `from` (cyclic); mask != 0.
__device__ __forceinline__ int next_set_bit(unsigned mask, int from) {
    const unsigned high = from > 0 ? mask & ~((1u << from) - 1u) : mask;
    return __ffs(high != 0 ? high : mask) - 1;
}

constexpr int kTmaChunkBytes = 8192;  // per warp (dynamic shared memory); mirrors cuda_backend._TMA_BYTES_PER_WARP

// One warp's bulk copier: lane 0 drives it, the other lanes are free for the row's small fields.
struct TmaCopier {
    void* buf;                  // kTmaChunkBytes of shared memory, this warp's own
    unsigned long long* bar;    // this warp's mbarrier
    int phase;

    // Call with the whole warp once, before the first copy.
    __device__ void init(void* buffer, unsigned long long* barrier) {
        buf = buffer;
        bar = barrier;
        phase = 0;
        if (lane_id() == 0) mbarrier_init(bar, 1);
        __syncwarp();
    }
    // Lane 0 only: copy `bytes` from src to dst through the buffer, one chunk at a time (the previous chunk's
    // store must have read the buffer before the next load overwrites it).
    __device__ void copy(void* dst, const void* src, long long bytes) {
        for (long long off = 0; off < bytes; off += kTmaChunkBytes) {
            const int n = (int)min((long long)kTmaChunkBytes, bytes - off);
            tma_store_wait_read();
            mbarrier_expect_tx(bar, n);
            tma_load(buf, static_cast<const char*>(src) + off, n, bar);
            mbarrier_wait(bar, phase);
            phase ^= 1;
            tma_store(static_cast<char*>(dst) + off, buf, n);
        }
    }
    // Lane 0 only: every store issued so far is in global memory.
    __device__ void finish() { tma_store_wait(); }
};

}  // namespace ep
