// common/bf16.cuh: bf16 <-> fp32 without cuda_bf16.h.
#pragma once
namespace ep {

// ---------------------------------------------------------------------------------------------------
// Packing is one cvt per pair (round to nearest even, overflow to inf): the
// combine receivers are instruction bound, and a software rounding cost ~8 instructions per value. A NaN becomes
// the canonical bf16 NaN 0x7fff (the reference keeps a NaN a NaN; sign and payload may differ).
// ---------------------------------------------------------------------------------------------------
__device__ __forceinline__ float bf16_lo(unsigned int pair) { return __uint_as_float(pair << 16); }
__device__ __forceinline__ float bf16_hi(unsigned int pair) { return __uint_as_float(pair & 0xffff0000u); }
// lo at the lower address
__device__ __forceinline__ unsigned int pack_bf16x2(float lo, float hi) {
    unsigned int r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ void accumulate_bf16x8(float (&acc)[8], int4 v) {
    const unsigned int w[4] = {(unsigned)v.x, (unsigned)v.y, (unsigned)v.z, (unsigned)v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc[2 * i] += bf16_lo(w[i]);
        acc[2 * i + 1] += bf16_hi(w[i]);
    }
}

}  // namespace ep
