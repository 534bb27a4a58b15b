// low_latency/common.cuh: the low-latency kernels' shapes, workspace words, phase stamps and shared helpers.
#pragma once
#include "common/wait.cuh"
#include "common/warp.cuh"
#include "common/layout.cuh"
#include "common/bf16.cuh"
#include "transport/ll.cuh"

namespace ep::low_latency {

// The dispatch runs 512 threads per block: against 1024 its kernel ends ~1 us earlier and a 0-token call costs ~1 us
// less. A token's row takes two passes of the block (TokenLoads holds both).
constexpr int kLLThreads = 512;
constexpr int kLLWarps = kLLThreads / kWarpSize;
// The combine runs 512 threads per block: 128 registers each (its owner loop spills at 64), and its token rows
// (H/8 columns) take two passes of the block.
constexpr int kLLCombineThreads = 512;
constexpr int kLLMaxExperts = 4096;  // mirrors config.LL_MAX_EXPERTS (two shared-memory histograms)
constexpr int kLLMaxRanks = 64;      // mirrors config.LL_MAX_RANKS
constexpr int kPhaseSend = 1, kPhaseRecv = 2;
// workspace (int32, zeroed once by the host): kWsLastSend = 1 + the buffer index of this rank's previous send
// phase (0 = none yet); kWsEpoch + i: the dispatches on buffer i whose receive phase finished (a dispatch's epoch
// is that + 1: its counts and index entries carry it); kWsRecvDone: blocks of the running dispatch receive
// phase that finished (the last one advances the epoch and resets it); from kWsMetaReaders per owner rank the
// blocks that have read its combine meta flag (the last one zeroes the flag and the count)
constexpr int kWsLastSend = 2, kWsEpoch = 4, kWsRecvDone = 6, kWsMetaReaders = 32;

// Optional phase stamps (profiling; built only with -DCUPY_EP_LL_STAMPS=1, cuda_low_latency.STAMPS_OPTION, and
// then written where stamps != nullptr): per block kLLStamps int64 %globaltimer values, written by thread 0 (most
// right after a block-wide barrier, so they mark when the whole block got there). Without the option the stamping
// code compiles away: its branches and barriers take registers from the kernels' common paths.
#ifdef CUPY_EP_LL_STAMPS
constexpr bool kStampsBuilt = true;
#else
constexpr bool kStampsBuilt = false;
#endif
// What each marks, per kernel (cupy_ep/bench_ll.py's report says the same):
//   dispatch: routed = the last token's destinations known; prepared = histograms built; encoded = its bytes
//             stored; written = thread 0 past its index entry (released); recv_prepared = the counts read and
//             prefixed; recv_first_data = the block's first row in.
//             The receive side's first row, finer (at one rank it comes 1.7 us after the prefix
//             although every entry is released before it): recv_copy_start = the warp of the block's first unit
//             starts waiting for its row (past the per-expert outputs); recv_row_seen = its lane 0 has the row's
//             index entry (recv_first_data follows after the warp's shuffle and __syncwarp). send_first_stored =
//             thread 0's part of the block's first message stored (before the histograms).
//   combine:  prepared = the own tokens' partials flagged (hook mode); routed = the first remote owner's meta in;
//             encoded = the last partial row stored; written = its flag sent; recv_prepared = the block's own
//             partials computed (one launch); recv_first_data = the first token's partials in.
constexpr int kLLStamps = 13;
enum LLStamp : int {
    kStampSendStart = 0, kStampSendPrepared = 1, kStampSendRouted = 2, kStampSendEncoded = 3,
    kStampSendWritten = 4, kStampSendEnd = 5, kStampRecvStart = 6, kStampRecvPrepared = 7,
    kStampRecvFirstData = 8, kStampRecvEnd = 9, kStampSendFirstStored = 10, kStampRecvCopyStart = 11,
    kStampRecvRowSeen = 12,
};
__device__ __forceinline__ void stamp_by(long long* stamps, int which, bool writer) {
    if (kStampsBuilt && stamps != nullptr && writer) stamps[blockIdx.x * kLLStamps + which] = (long long)globaltimer_ns();
}
__device__ __forceinline__ void stamp(long long* stamps, int which) { stamp_by(stamps, which, threadIdx.x == 0); }
// A block barrier only when stamping (the condition is uniform over the block).
__device__ __forceinline__ void stamp_after_barrier(long long* stamps, int which) {
    if (!kStampsBuilt || stamps == nullptr) return;
    __syncthreads();
    stamp(stamps, which);
}

// Wait-time statistics (the API's dispatch_wait_recv_cost_stats / combine_wait_recv_cost_stats, [R] int64, as
// DeepEP's): the SM clock cycles (clock64) a receiver spent waiting for each source rank's data, added into
// stats[source] by a reduction whose result nobody waits for. With stats == nullptr (the default) no clock is read.
// The dispatch counts each (local expert, source) count's wait once (block 0's counters); the combine each token's
// partials flag (per block and source, summed in a register first).
__device__ __forceinline__ long long wait_clock(const long long* stats) { return stats != nullptr ? clock64() : 0; }
__device__ __forceinline__ long long waited_since(const long long* stats, long long since) {
    return stats != nullptr ? clock64() - since : 0;
}
__device__ __forceinline__ void add_wait_cost(long long* stats, int source, long long cycles) {
    if (stats != nullptr && cycles > 0)
        atomicAdd(reinterpret_cast<unsigned long long*>(stats + source), static_cast<unsigned long long>(cycles));
}

// Two floats -> two e4m3 bytes (lo at the lower address), round to nearest even, saturating to +-448.
__device__ __forceinline__ unsigned int cvt_e4m3x2(float lo, float hi) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

// DeepEP's calculate_fp8_scales (mirrors reference.fp8_scales).
__device__ __forceinline__ void fp8_scales(float amax, bool round_scale, float& scale, float& scale_inv) {
    const float ratio = amax * (1.0f / 448.0f);
    if (!round_scale) {
        scale = 448.0f / amax;
        scale_inv = ratio;
        return;
    }
    const unsigned bits = __float_as_uint(ratio);
    const int exponent = (int)((bits >> 23) & 0xffu) - 127 + ((bits & 0x7fffffu) != 0u);
    scale_inv = __int_as_float((exponent + 127) << 23);
    scale = __int_as_float((127 - exponent) << 23);
}

// One int to PE `pe`'s symmetric buffer at `offset`, ordered after everything this thread has observed.
__device__ __forceinline__ void send_signal(char* base, const unsigned long long* peer_bases, int pe,
                                            long long offset, int value) {
    char* direct = reinterpret_cast<char*>(peer_bases[pe]);
    if (direct != nullptr) {
        st_release_sys(reinterpret_cast<int*>(direct + offset), value);
    } else {
        fence_acq_rel_sys();
        ll_put_int(reinterpret_cast<int*>(base + offset), value, pe);
    }
}

// log2 of a power of two, at compile time.
__host__ __device__ constexpr int log2_exact(int v) { return v > 1 ? 1 + log2_exact(v >> 1) : 0; }

// x / d and x % d (x >= 0) for a divisor fixed per call (the rank count, the experts per rank), by shifts when d
// is a power of two (the usual case: 2, 4, 8 ranks; 256 experts over them) and by division otherwise; `shift` =
// log2(d) or -1 (a uniform branch). An integer division is a dependent chain of ~15 instructions (~70 cycles), and
// the dispatch's bookkeeping on its critical path had several.
struct FastDiv {
    int d, shift;
    __device__ __forceinline__ explicit FastDiv(int d_) : d(d_), shift((d_ & (d_ - 1)) == 0 ? __ffs(d_) - 1 : -1) {}
    __device__ __forceinline__ int div(int x) const { return shift >= 0 ? x >> shift : x / d; }
    __device__ __forceinline__ int mod(int x) const { return shift >= 0 ? x & (d - 1) : x % d; }
};

// Shrink mode: warp 0 stages the ranks masked when the launch starts into `masked` (bit r = rank r; 0 without
// shrink mode), read by the block after a barrier.
__device__ __forceinline__ void stage_masked(const int* shrink_mask, int num_ranks, unsigned long long& masked) {
    if (warp_id() != 0) return;
    const int lane = lane_id();
    if (shrink_mask == nullptr) {
        if (lane == 0) masked = 0;
        return;
    }
    const unsigned lo = __ballot_sync(0xffffffffu, lane < num_ranks && ld_volatile(shrink_mask + lane) != 0);
    const unsigned hi = __ballot_sync(0xffffffffu, lane + 32 < num_ranks && ld_volatile(shrink_mask + lane + 32) != 0);
    if (lane == 0) masked = (unsigned long long)hi << 32 | lo;
}
// Bit r of a set of ranks (`masked`, a combine's owners to serve, ...).
__device__ __forceinline__ bool has_rank(unsigned long long ranks, int r) { return (ranks >> r) & 1ull; }
// A failed wait_until<true> for `peer`: true when shrink mode masked the peer (go on without it), false for a failure
// that stops the buffer.
__device__ __forceinline__ bool peer_dropped(const int* shrink_mask, int peer) {
    return shrink_mask != nullptr && ld_volatile(shrink_mask + peer) != 0;
}

}  // namespace ep::low_latency
