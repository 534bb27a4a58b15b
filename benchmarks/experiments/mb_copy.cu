// Microbenchmark (single GPU): per-SM rates of local row copies and 2-source bf16 reductions, several ways.
#include "common.cuh"
namespace ep {

// A. register copy, every warp a row at a time
template <int U>
__global__ void __launch_bounds__(768, 1) copy_reg(int4* dst, const int4* src, int rows, int row_int4) {
    const int warps = gridDim.x * (blockDim.x / 32), w = blockIdx.x * (blockDim.x / 32) + warp_id();
    for (int r = w; r < rows; r += warps)
        warp_copy<false, U>(dst + (long long)r * row_int4, src + (long long)r * row_int4, row_int4);
}

// B. current receiver: TmaCopier per warp (8 KB, serialized load/store)
__global__ void __launch_bounds__(768, 1) copy_tma_warp(int4* dst, const int4* src, int rows, int row_int4) {
    __shared__ unsigned long long bars[24];
    extern __shared__ __align__(128) unsigned char sbuf[];
    TmaCopier tma;
    tma.init(sbuf + warp_id() * kTmaChunkBytes, &bars[warp_id()]);
    const int warps = gridDim.x * (blockDim.x / 32), w = blockIdx.x * (blockDim.x / 32) + warp_id();
    for (int r = w; r < rows; r += warps)
        if (lane_id() == 0) tma.copy(dst + (long long)r * row_int4, src + (long long)r * row_int4, row_int4 * 16LL);
    if (lane_id() == 0) tma.finish();
}

// C. pipelined whole-row TMA: kWarps warps per block, each lane 0 runs kStages row slots, loads P ahead.
template <int kStages>
__device__ void pipe_rows(int4* dst, const int4* src, int first, int step, int rows, int row_int4,
                          unsigned char* slots, unsigned long long* bars) {
    constexpr int P = kStages / 2;
    const int bytes = row_int4 * 16;
    int n = 0;
    for (int r = first; r < rows; r += step) ++n;
    auto row_of = [&](int i) { return first + i * step; };
    for (int s = 0; s < kStages; ++s) mbarrier_init(&bars[s], 1);
    for (int i = 0; i < P && i < n; ++i) {
        mbarrier_expect_tx(&bars[i], bytes);
        tma_load(slots + (long long)i * bytes, src + (long long)row_of(i) * row_int4, bytes, &bars[i]);
    }
    for (int i = 0; i < n; ++i) {
        const int s = i % kStages;
        mbarrier_wait(&bars[s], (i / kStages) & 1);
        tma_store(dst + (long long)row_of(i) * row_int4, slots + (long long)s * bytes, bytes);
        const int j = i + P;
        if (j < n) {
            asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kStages - P) : "memory");
            const int sj = j % kStages;
            mbarrier_expect_tx(&bars[sj], bytes);
            tma_load(slots + (long long)sj * bytes, src + (long long)row_of(j) * row_int4, bytes, &bars[sj]);
        }
    }
    tma_store_wait();
}
template <int kWarps, int kStages>
__global__ void copy_tma_pipe(int4* dst, const int4* src, int rows, int row_int4) {
    __shared__ unsigned long long bars[kWarps][kStages];
    extern __shared__ __align__(128) unsigned char sbuf[];
    if (lane_id() != 0) return;
    const int w = blockIdx.x * kWarps + warp_id();
    pipe_rows<kStages>(dst, src, w, gridDim.x * kWarps, rows, row_int4,
                       sbuf + (long long)warp_id() * kStages * row_int4 * 16, bars[warp_id()]);
}

// D. reductions out = bf16(a + b)
__device__ __forceinline__ int4 add2(int4 a, int4 b) {
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.0f;
    accumulate_bf16x8(acc, a);
    accumulate_bf16x8(acc, b);
    return make_int4((int)pack_bf16x2(acc[0], acc[1]), (int)pack_bf16x2(acc[2], acc[3]),
                     (int)pack_bf16x2(acc[4], acc[5]), (int)pack_bf16x2(acc[6], acc[7]));
}
template <int U>
__global__ void __launch_bounds__(768, 1) reduce_reg(int4* out, const int4* a, const int4* b, int rows, int row_int4) {
    const int warps = gridDim.x * (blockDim.x / 32), w = blockIdx.x * (blockDim.x / 32) + warp_id();
    for (int r = w; r < rows; r += warps) {
        const long long o = (long long)r * row_int4;
        for (int i = lane_id(); i < row_int4; i += U * 32) {
            int4 va[U], vb[U];
#pragma unroll
            for (int u = 0; u < U; ++u) if (i + u * 32 < row_int4) { va[u] = ld_nc_v4(a + o + i + u * 32); vb[u] = ld_nc_v4(b + o + i + u * 32); }
#pragma unroll
            for (int u = 0; u < U; ++u) if (i + u * 32 < row_int4) out[o + i + u * 32] = add2(va[u], vb[u]);
        }
    }
}
// current combine receiver: per warp 8 KB, 4 KB per source, serialized
__global__ void __launch_bounds__(768, 1) reduce_tma_warp(int4* out, const int4* a, const int4* b, int rows, int row_int4) {
    __shared__ unsigned long long bars[24];
    extern __shared__ __align__(128) unsigned char sbuf[];
    TmaCopier tma;
    tma.init(sbuf + warp_id() * kTmaChunkBytes, &bars[warp_id()]);
    const int warps = gridDim.x * (blockDim.x / 32), w = blockIdx.x * (blockDim.x / 32) + warp_id();
    const int chunk = kTmaChunkBytes / 16 / 2;
    const int4* stage = static_cast<const int4*>(tma.buf);
    for (int r = w; r < rows; r += warps) {
        const long long o = (long long)r * row_int4;
        for (int c0 = 0; c0 < row_int4; c0 += chunk) {
            const int n = min(chunk, row_int4 - c0);
            if (lane_id() == 0) {
                mbarrier_expect_tx(tma.bar, n * 32);
                tma_load(tma.buf, a + o + c0, n * 16, tma.bar);
                tma_load(static_cast<int4*>(tma.buf) + chunk, b + o + c0, n * 16, tma.bar);
            }
            mbarrier_wait(tma.bar, tma.phase);
            tma.phase ^= 1;
            for (int i = lane_id(); i < n; i += 32) out[o + c0 + i] = add2(stage[i], stage[chunk + i]);
            __syncwarp();
        }
    }
}
// per warp kStages chunk slots of kChunk bytes per source; lane 0 keeps kStages-1 chunks loading ahead
template <int kWarps, int kStages, int kChunk>
__global__ void __launch_bounds__(kWarps * 32, 1) reduce_tma_pipe(int4* out, const int4* a, const int4* b, int rows, int row_int4) {
    __shared__ unsigned long long bars[kWarps][kStages];
    extern __shared__ __align__(128) unsigned char sbuf[];
    int4* slots = reinterpret_cast<int4*>(sbuf + (long long)warp_id() * kStages * 2 * kChunk);
    constexpr int C = kChunk / 16;
    if (lane_id() == 0) for (int s = 0; s < kStages; ++s) mbarrier_init(&bars[warp_id()][s], 1);
    __syncwarp();
    const int warps = gridDim.x * kWarps, w = blockIdx.x * kWarps + warp_id();
    const int chunks_per_row = (row_int4 + C - 1) / C;
    int my_rows = 0;
    for (int r = w; r < rows; r += warps) ++my_rows;
    const int n = my_rows * chunks_per_row;  // this warp's chunk sequence
    auto issue = [&](int i) {
        const int r = w + (i / chunks_per_row) * warps, c0 = (i % chunks_per_row) * C;
        const int len = min(C, row_int4 - c0);
        const long long o = (long long)r * row_int4 + c0;
        int4* dst = slots + (i % kStages) * 2 * C;
        mbarrier_expect_tx(&bars[warp_id()][i % kStages], len * 32);
        tma_load(dst, a + o, len * 16, &bars[warp_id()][i % kStages]);
        tma_load(dst + C, b + o, len * 16, &bars[warp_id()][i % kStages]);
    };
    if (lane_id() == 0) for (int i = 0; i < kStages - 1 && i < n; ++i) issue(i);
    for (int i = 0; i < n; ++i) {
        const int s = i % kStages;
        mbarrier_wait(&bars[warp_id()][s], (i / kStages) & 1);
        const int r = w + (i / chunks_per_row) * warps, c0 = (i % chunks_per_row) * C;
        const int len = min(C, row_int4 - c0);
        const int4* st = slots + s * 2 * C;
        for (int j = lane_id(); j < len; j += 32) out[(long long)r * row_int4 + c0 + j] = add2(st[j], st[C + j]);
        __syncwarp();  // slot (i-1)%kStages is free again: refill it with chunk i + kStages - 1
        if (lane_id() == 0 && i + kStages - 1 < n) issue(i + kStages - 1);
    }
}
}  // namespace ep
