// probes/copy.cu: the benchmark's ceiling. A plain SM-driven copy where every rank writes `num_int4` int4 into
// every peer's buffer at once (as dispatch does), with plain 16-byte stores. Rank r writes into slot r
// of each peer's region starting at `dst_offset`.
#include "common/ptx.cuh"

namespace ep {

__global__ void __launch_bounds__(768)
    p2p_copy(const int4* src, void** buffer_ptrs, long long dst_offset, long long num_int4, int rank, int num_ranks) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (int step = 1; step < num_ranks; ++step) {
        const int peer = (rank + step) % num_ranks;  // every rank starts on a different peer
        int4* dst = reinterpret_cast<int4*>(static_cast<char*>(buffer_ptrs[peer]) + dst_offset) + rank * num_int4;
        long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
        for (; i + 3 * stride < num_int4; i += 4 * stride) {
            const int4 a = ld_nc_v4(src + i), b = ld_nc_v4(src + i + stride);
            const int4 c = ld_nc_v4(src + i + 2 * stride), d = ld_nc_v4(src + i + 3 * stride);
            dst[i] = a;
            dst[i + stride] = b;
            dst[i + 2 * stride] = c;
            dst[i + 3 * stride] = d;
        }
        for (; i < num_int4; i += stride) dst[i] = ld_nc_v4(src + i);
    }
}

}  // namespace ep
