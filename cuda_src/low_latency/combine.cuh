// low_latency/combine.cuh: the low-latency combine's send (expert side) and receive (owner side).
#pragma once
#include "low_latency/common.cuh"
#include "low_latency/dispatch.cuh"

namespace ep::low_latency {

// ---------------------------------------------------------------------------------------------------
// combine: each expert rank sends its token owner ONE partial sum per token (the weighted fp32 sum of its
// experts' rows of that token, rounded to 24 bits on the wire, or to bf16 when the owner asked for bf16 partials:
// store_partial) instead of one bf16 row per (token, k): at top-8 of 256 on 2 ranks ~4 rows per (token, rank)
// become one row of 1.5 times the width (bf16: the same width), under 40 % (25 %) of the bytes across NVLink. The
// weights live on the owner, so the owner first sends its top-k (experts and weights, a few KB: "meta") to every
// rank; the meta flag also says which wire format the owner reads.
//   send phase  (A) owner -> every other rank r: meta (int32 entry codes: the expert and its dispatch slot, or -1
//                   (entry_code); float weights; [M][kLLMaxTopk] each), then the meta flag (meta_flag_value:
//                   W, K and T + 1) at r's signal combine_meta_flag(me);
//               (B) expert rank, per owner s (itself first, from the call's own top-k: no wait; then the
//                   others from their meta) and token t of s (blocks stride over t): the rows of t's entries
//                   from their codes (prepare_batch), then
//                   P = 0 + sum over the kept k whose expert is here, k ascending, of w_k * row(e_k, s, slot_k)
//                   (fp32 products and sums, no FMA), rounded to s's wire format into s's partial_in [me][t], then
//                   flag 1 at s's signal combine_token_flag(me, t). Tokens with no kept entry here send nothing.
//   recv phase  (C) owner, token t: out = bf16(0 + sum over ranks r ascending that hold a kept entry of t of
//                   P_r[t]) in fp32, one bf16 rounding (reference.low_latency_combine: the same order and
//                   roundings, bit for bit; the own partial computed here is rounded as the wire would).
// Every block reads each meta flag in (B): the last of them zeroes it; (C) zeroes each token flag as it reads it.
// The combine runs kLLCombineThreads (512) threads per block; in (B) the last warp only flags the rows the others
// store (combine_reduce_owner).
// ---------------------------------------------------------------------------------------------------
constexpr int kSumInFlight = 2;  // (C) ranks' partials loaded at once per thread and chunk
// Tokens whose entries one block prepares at once (prepare_batch: a warp per token; the expert side has this many
// compute warps).
constexpr int kCombineBatch = kLLCombineThreads / kWarpSize - 1;

// A top-k entry as the combine sees it (the owner's meta carries these; this rank's own come from its arguments):
// the expert and the slot the dispatch gave it (the handle's topk_slots) in one int, slot << kEntrySlotShift |
// expert, or -1 when the entry has no expert or was not sent (slot -1). The slots are below M <= kLLMaxTokens
// (kEntrySlotShift comes from cupy_ep/layout.py, which derives LL_MAX_TOKENS the same way).
constexpr int kLLMaxTokens = 1 << (31 - kEntrySlotShift);
static_assert(kLLMaxExperts <= 1 << kEntrySlotShift, "an expert id must fit below the slot's bits");
__device__ __forceinline__ int entry_code(long long expert, int slot, int num_experts) {
    return expert >= 0 && expert < num_experts && slot >= 0 ? (slot << kEntrySlotShift) | (int)expert : -1;
}
// This rank's own entries (the call's arguments: the dispatch's top-k and the handle's slots), f = t * K + k.
template <typename TopkT>
struct OwnEntries {
    const TopkT* topk_idx;
    const int* topk_slots;
    int num_experts;
    __device__ __forceinline__ int operator()(long long f) const {
        return entry_code((long long)topk_idx[f], topk_slots[f], num_experts);
    }
};
// A remote owner's entries: its meta's codes (read after its meta flag was acquired).
struct MetaEntries {
    const volatile int* codes;
    __device__ __forceinline__ int operator()(long long f) const { return codes[f]; }
};

// kMaxTopk: the kernel's top-k bound (kLLTopkBounds), at least the call's K.
template <int kMaxTopk>
struct CombineShared {
    static constexpr int kTopkBound = kMaxTopk;
    // prepare_batch, per token j of the batch: what the sums need
    long long row[kCombineBatch][kMaxTopk];  // the kept entries on this rank, k order: rows in the expert input
    float weight[kCombineBatch][kMaxTopk];   //   and their weights, num_kept[j] of them
    int num_kept[kCombineBatch];
    unsigned long long has[kCombineBatch];      // bit r: rank r holds a kept entry of the token
    unsigned long long dropped[kCombineBatch];  // (C) shrink mode: bit r: rank r got masked waiting for its partial
    unsigned long long masked;                  // stage_masked: the ranks masked when the launch started
    int value;                                  // (B): the owner's meta flag
    int owner;                                  // (B) shrink mode: the owner served next (next_ready_owner)
    int failed;
    int flag_token[2];                        // (B) compute -> flagger, by handoff parity: the token, -1 = the end
    unsigned long long full, empty, compute;  // (B) combine_reduce_owner's mbarriers
};

// Per thread, what combine_reduce_owner's mbarriers have completed so far (the same counts on every thread that
// uses them), carried over the owners of one call.
struct HandoffPhases {
    int handoff = 0;  // rows handed to the flagger (full / empty)
    int sync = 0;     // group_mbarrier_sync barriers on sh.compute
};

// begin[l] = where owner s's rows start inside local expert l's R*M rows of the expert input (layout_range's
// begin), for every local expert; read by prepare_batch after a barrier.
__device__ __forceinline__ void stage_range_begins(const long long* layout_range, int s, const LowLatencyLayout& L,
                                                   int* begin) {
    for (int l = threadIdx.x; l < L.num_local; l += blockDim.x)
        begin[l] = (int)(layout_range[(long long)l * L.num_ranks + s] >> 32);
}

// The block's tokens t_j = t0 + j * stride (j < n <= kCombineBatch) of owner s, a warp each (warp j, lane k:
// entry (t_j, k)); `entries(f)` is the code of s's entry f = t * K + k (OwnEntries or MetaEntries), `weights` s's
// top-k weights. The codes carry the dispatch's slots, so a batch costs one round of loads and no counting.
// Writes, per j: sh.has[j]; the kept entries whose expert lives on this rank, compacted in k order: sh.row[j][i]
// (the row in the expert input [local expert][R*M]: begin[local] + slot, begin from stage_range_begins),
// sh.weight[j][i]; sh.num_kept[j]; sh.dropped[j] = 0. The caller syncs before reading them. Entries of a rank
// masked when the launch started (sh.masked) are not kept.
template <typename Entries, typename WeightT, typename Shared>
__device__ __forceinline__ void prepare_batch(Entries entries, const WeightT* weights, int K, int t0, int stride, int n,
                                              int rank, const LowLatencyLayout& L, const int* begin, Shared& sh) {
    const int j = warp_id(), k = lane_id();
    if (j >= n) return;  // uniform per warp
    const long long f = (long long)(t0 + j * stride) * K + k;
    const int code = k < K ? entries(f) : -1;
    const int ek = code & ((1 << kEntrySlotShift) - 1), slot = code >> kEntrySlotShift;
    const int at = code >= 0 ? ek / L.num_local : 0;
    const bool kept = code >= 0 && !has_rank(sh.masked, at);
    const unsigned lo = __reduce_or_sync(0xffffffffu, kept && at < 32 ? 1u << at : 0u);
    const unsigned hi = __reduce_or_sync(0xffffffffu, kept && at >= 32 ? 1u << (at - 32) : 0u);
    const bool here = kept && at == rank;
    const unsigned mask = __ballot_sync(0xffffffffu, here);
    if (here) {
        const int i = __popc(mask & ((1u << k) - 1u)), local = ek - rank * L.num_local;
        sh.row[j][i] = (long long)local * L.num_ranks * L.num_max_tokens + begin[local] + slot;
        sh.weight[j][i] = (float)weights[f];
    }
    if (k == 0) {
        sh.num_kept[j] = __popc(mask);
        sh.has[j] = (unsigned long long)hi << 32 | lo;
        sh.dropped[j] = 0;
    }
}

// The number of tokens t = index + i * count below T (the block's share of the tokens).
__device__ __forceinline__ int tokens_of_block(int T, int index, int count) {
    return index < T ? (T - index + count - 1) / count : 0;
}

// Each thread works on kCombineChunks chunks of a row at once (c and c + the threads): all their expert rows are
// copied at once into the thread's slots of the combine's dynamic shared memory by cp.async, which holds no
// registers while they travel (in registers, 2 chunks x 4 rows spilled), so a token's rows cost one round of
// loads per thread, not one per chunk and 4 rows. The slots: [entry i][chunk q][thread], 16 bytes each, for at
// most kCombineStageEntries entries (combine_stage_bytes on the host: kLLCombineThreads x kCombineChunks x
// min(K, kCombineStageEntries) x 16, 176 KB at 11; the first two from cupy_ep/ids.py); a kernel whose top-k bound is
// above that stages a token's rows kCombineStageEntries at a time (partial_sums).
// = cupy_ep/cuda/kernels_low_latency.py COMBINE_STAGE_ENTRIES (tests/unit/test_mirrors.py compares)
constexpr int kCombineStageEntries = 11;
__device__ __forceinline__ int4* stage_slot(int4* stage, int i, int q) {
    return stage + (i * kCombineChunks + q) * kLLCombineThreads + threadIdx.x;
}

// Entries [i0, i1) (at most kCombineStageEntries) into the stage: entry i's chunks at slot i - i0.
template <int kStride>
__device__ __forceinline__ void stage_rows(const int4* rows, const long long* row, int i0, int i1, int c, int row_int4,
                                           int4* stage) {
    for (int i = i0; i < i1; ++i) {
        const int4* src = rows + row[i] * row_int4 + c;
#pragma unroll
        for (int q = 0; q < kCombineChunks; ++q)
            if (c + q * kStride < row_int4) cp_async16(stage_slot(stage, i - i0, q), src + q * kStride);
    }
}
// acc[q] += fp32(weight[i] * staged row of entry i) for entries [i0, i1), i ascending (stage_rows' slots).
template <int kStride>
__device__ __forceinline__ void add_staged_rows(float (&acc)[kCombineChunks][8], const float* weight, int i0, int i1,
                                                int c, int row_int4, int4* stage) {
    for (int i = i0; i < i1; ++i) {
        const float wt = weight[i];
#pragma unroll
        for (int q = 0; q < kCombineChunks; ++q) {
            if (c + q * kStride >= row_int4) break;
            const int4 v = *stage_slot(stage, i - i0, q);
            const unsigned w[4] = {(unsigned)v.x, (unsigned)v.y, (unsigned)v.z, (unsigned)v.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                acc[q][2 * j] = __fadd_rn(acc[q][2 * j], __fmul_rn(wt, bf16_lo(w[j])));
                acc[q][2 * j + 1] = __fadd_rn(acc[q][2 * j + 1], __fmul_rn(wt, bf16_hi(w[j])));
            }
        }
    }
}

// For the chunks q < kCombineChunks, c_q = c + q * kStride (those below row_int4): acc[q] = 0 + sum over the n
// entries i (k order) of fp32(weight[i] * rows[row[i]][c_q]) (fp32 products, then fp32 sums, no FMA:
// reference.low_latency_combine). kMaxTopk (the kernel's top-k bound, n <= kMaxTopk) within the stage: all n rows in
// one round of loads; above it, kCombineStageEntries rows per round (each thread reads back only its own slots, so
// its next round may overwrite them).
template <int kStride, int kMaxTopk>
__device__ __forceinline__ void partial_sums(float (&acc)[kCombineChunks][8], const int4* rows, const long long* row,
                                             const float* weight, int n, int c, int row_int4, int4* stage) {
    if constexpr (kMaxTopk <= kCombineStageEntries) {
        stage_rows<kStride>(rows, row, 0, n, c, row_int4, stage);
#pragma unroll
        for (int q = 0; q < kCombineChunks; ++q)
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[q][j] = 0.0f;
        cp_async_wait_all();
        add_staged_rows<kStride>(acc, weight, 0, n, c, row_int4, stage);
    } else {
#pragma unroll
        for (int q = 0; q < kCombineChunks; ++q)
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[q][j] = 0.0f;
        for (int i0 = 0; i0 < n; i0 += kCombineStageEntries) {
            const int i1 = min(n, i0 + kCombineStageEntries);
            stage_rows<kStride>(rows, row, i0, i1, c, row_int4, stage);
            cp_async_wait_all();
            add_staged_rows<kStride>(acc, weight, i0, i1, c, row_int4, stage);
        }
    }
}

// The partials' wire formats (reference.low_latency_partial_wire), chosen by the owner for its tokens:
//   kWire24     each fp32 rounded to nearest even to 24 bits. Chunk c (8 values) of a partial row: the high 16 bits
//               of each at byte 16c (a bf16 plane of H values), the next 8 bits at byte 2H + 8c (a byte plane):
//               3 bytes per value instead of 4 across NVLink;
//   kWireBf16   (bf16_partials) rounded to nearest even to 16 bits: the bf16 plane alone, 2 bytes per value;
//   kWireLogFmt (use_logfmt) LogFMT-10: per 128 values (a division: 16 chunks, a half-warp's) a sign and a 9-bit
//               code on a log2 scale, 10 bits per value plus 8 bytes per division, 1.3125 bytes per value
//               (logfmt_encode).
enum Wire : int { kWire24 = 0, kWireBf16 = 1, kWireLogFmt = 2 };
__device__ __forceinline__ unsigned wire24(float v) {
    const unsigned b = __float_as_uint(v);
    return (b + 0x7fu + ((b >> 8) & 1u)) >> 8;
}
__device__ __forceinline__ unsigned wire16(float v) {
    const unsigned b = __float_as_uint(v);
    return (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
}

// LogFMT-10 (cupy_ep/logfmt.py, operation for operation: fp32 products, sums and quotients rounded to nearest,
// no FMA, constants given by their bits, so the reference reproduces every decoded value bit for bit). A division's
// meta is (lmin, step): its values' magnitudes a span [2^lmin, 2^(lmin + 510 step)], lmin = max(log2 amin,
// log2 amax - 32) over the nonzero (normal) a; code 0 is zero, code k > 0 is 2^(lmin + (k-1) step); a value takes
// the code nearest on the log2 scale. The relative error is at most 2^(step/2) - 1 (step <= 32/510: 2.2 %; a
// division whose values span 8 octaves: 0.5 %), plus ~1e-7 of the polynomials. Finite values below 2^127 only.
__device__ __forceinline__ float f32_bits(unsigned b) { return __uint_as_float(b); }
// log2 of a positive normal float: its exponent plus 2/ln2 atanh(s), s = (m-1)/(m+1), m the mantissa in [0.707, 1.414]
// (|s| < 0.172: four odd terms leave < 1e-7).
__device__ __forceinline__ float logfmt_log2(float a) {
    const unsigned bits = __float_as_uint(a);
    int e = (int)(bits >> 23) - 127;
    float m = f32_bits((bits & 0x7fffffu) | 0x3f800000u);
    if (m > f32_bits(0x3fb504f3u)) {  // sqrt(2)
        m = __fmul_rn(m, 0.5f);
        e += 1;
    }
    const float s = __fdiv_rn(__fadd_rn(m, -1.0f), __fadd_rn(m, 1.0f)), z = __fmul_rn(s, s);
    float poly = f32_bits(0x3e124925u);                           // 1/7
    poly = __fadd_rn(__fmul_rn(poly, z), f32_bits(0x3e4ccccdu));  // 1/5
    poly = __fadd_rn(__fmul_rn(poly, z), f32_bits(0x3eaaaaabu));  // 1/3
    poly = __fadd_rn(__fmul_rn(poly, z), 1.0f);
    return __fadd_rn((float)e, __fmul_rn(__fmul_rn(s, poly), f32_bits(0x4038aa3bu)));  // 2/ln2
}
// 2^y: 2^n e^(f ln2), n = floor(y + 1/2), |f| <= 1/2, e^x by its Taylor polynomial to x^7 (< 1e-8 left); 0 below
// 2^-126.
__device__ __forceinline__ float logfmt_exp2(float y) {
    const float n = floorf(__fadd_rn(y, 0.5f)), x = __fmul_rn(__fadd_rn(y, -n), f32_bits(0x3f317218u));  // ln2
    const unsigned inv_fact[7] = {0x39500d01u, 0x3ab60b61u, 0x3c088889u, 0x3d2aaaabu,
                                  0x3e2aaaabu, 0x3f000000u, 0x3f800000u};  // 1/7! .. 1/1!
    float p = f32_bits(inv_fact[0]);
#pragma unroll
    for (int i = 1; i < 7; ++i) p = __fadd_rn(__fmul_rn(p, x), f32_bits(inv_fact[i]));
    p = __fadd_rn(__fmul_rn(p, x), 1.0f);
    const int ni = (int)n;
    if (ni < -126) return 0.0f;
    return __fmul_rn(p, f32_bits((unsigned)(min(ni, 127) + 127) << 23));  // (capped as the reference: < 2^127.5)
}

// One chunk's LogFMT-10 bytes: lo = the codes' low 8 bits (value j in byte j), hi = their 9th bits (bit j) and
// signs (bit 8 + j); meta = the division's (lmin, step).
struct LogFmtChunk {
    uint2 lo;
    unsigned hi;
    float2 meta;
};
// Chunk c of a division (the 16 chunks of a division are 16 consecutive lanes' c: every caller strides the
// chunks by a multiple of 16 threads and hidden % 128 == 0, so a half-warp holds whole divisions and all 16 of its
// lanes come here together).
__device__ __forceinline__ LogFmtChunk logfmt_encode(const float (&p)[8]) {
    const unsigned half = lane_id() < 16 ? 0x0000ffffu : 0xffff0000u;
    float a[8], amax = 0.0f, amin = __int_as_float(0x7f800000);  // +inf
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const bool normal = ((__float_as_uint(p[j]) >> 23) & 0xffu) != 0;
        a[j] = normal ? fabsf(p[j]) : 0.0f;
        amax = fmaxf(amax, a[j]);
        if (a[j] > 0.0f) amin = fminf(amin, a[j]);
    }
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(half, amax, o));
        amin = fminf(amin, __shfl_xor_sync(half, amin, o));
    }
    LogFmtChunk out{make_uint2(0u, 0u), 0u, make_float2(0.0f, 0.0f)};
    if (amax == 0.0f) return out;  // (uniform over the division) all zero: codes 0
    const float lmax = logfmt_log2(amax), lmin = fmaxf(logfmt_log2(amin), __fadd_rn(lmax, -32.0f));
    const float step = __fdiv_rn(__fadd_rn(lmax, -lmin), 510.0f), inv_step = __fdiv_rn(1.0f, step);
    out.meta = make_float2(lmin, step);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        unsigned code = 0;
        if (a[j] > 0.0f) {
            if (step == 0.0f) {
                code = 1;
            } else {
                const float t = __fmul_rn(__fadd_rn(logfmt_log2(a[j]), -lmin), inv_step);
                code = (unsigned)fminf(fmaxf(__fadd_rn(floorf(__fadd_rn(t, 0.5f)), 1.0f), 0.0f), 511.0f);
            }
        }
        const unsigned sign = code != 0 && (__float_as_uint(p[j]) >> 31);
        (j < 4 ? out.lo.x : out.lo.y) |= (code & 0xffu) << (8 * (j & 3));
        out.hi |= ((code >> 8) << j) | (sign << (8 + j));
    }
    return out;
}
__device__ __forceinline__ float logfmt_decode(const LogFmtChunk& w, int j) {
    const unsigned code = (((j < 4 ? w.lo.x : w.lo.y) >> (8 * (j & 3))) & 0xffu) | (((w.hi >> j) & 1u) << 8);
    if (code == 0) return 0.0f;
    const float v = logfmt_exp2(__fadd_rn(w.meta.x, __fmul_rn((float)(code - 1), w.meta.y)));
    return (w.hi >> (8 + j)) & 1u ? -v : v;
}
// Where chunk c's LogFMT bytes sit in a partial row: the divisions' meta (8 bytes each, H/16 in all), then the low
// plane (8 bytes per chunk, H), then the high plane (2 bytes per chunk, H/4).
__device__ __forceinline__ long long logfmt_lo_offset(int hidden, int c) { return hidden / 16 + 8LL * c; }
__device__ __forceinline__ long long logfmt_hi_offset(int hidden, int c) {
    return hidden / 16 + (long long)hidden + 2LL * c;
}

// Chunk c of a partial row in `wire`. The LogFMT code is a separate instantiation (kLogFmt: wire is kWireLogFmt),
// so that the 24-bit and bf16 paths compile as they did without it (one runtime branch on the wire cost the
// stamped combine ~1 us). With kLogFmt every lane of a half-warp must call it together (the division's amax /
// amin are exchanged by shuffles).
template <bool kLogFmt>
__device__ __forceinline__ void store_partial(char* row, int hidden, int c, const float (&p)[8], int wire) {
    if constexpr (kLogFmt) {
        const LogFmtChunk w = logfmt_encode(p);
        if ((c & 15) == 0) reinterpret_cast<float2*>(row)[c >> 4] = w.meta;
        *reinterpret_cast<uint2*>(row + logfmt_lo_offset(hidden, c)) = w.lo;
        *reinterpret_cast<unsigned short*>(row + logfmt_hi_offset(hidden, c)) = (unsigned short)w.hi;
        return;
    }
    const bool bf16 = wire == kWireBf16;
    unsigned hi[4], lo[2] = {0u, 0u};
    if (bf16) {
#pragma unroll
        for (int q = 0; q < 4; ++q) hi[q] = wire16(p[2 * q]) | (wire16(p[2 * q + 1]) << 16);
    } else {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const unsigned a = wire24(p[2 * q]), b = wire24(p[2 * q + 1]);
            hi[q] = (a >> 8) | ((b >> 8) << 16);
            lo[q >> 1] |= ((a & 0xffu) | ((b & 0xffu) << 8)) << (16 * (q & 1));
        }
    }
    reinterpret_cast<int4*>(row)[c] = make_int4((int)hi[0], (int)hi[1], (int)hi[2], (int)hi[3]);
    if (!bf16) reinterpret_cast<uint2*>(row + 2LL * hidden)[c] = make_uint2(lo[0], lo[1]);
}

// Chunk c of a partial row (peer-written, read after its flag was acquired, or this thread's own): its wire bytes,
// then as 8 floats. 24 / 16 bits: the bf16 plane's 16 bytes in `high`, the byte plane's 8 in `low` (zero with
// bf16); LogFMT: the division's meta in high.x / high.y, the low plane's 8 bytes in `low`, the high plane's 2 in
// high.z.
struct PartialChunk {
    int4 high;
    uint2 low;
};
__device__ __forceinline__ unsigned short ld_ring_u16(const unsigned short* p) {
    unsigned short v;
    asm volatile("ld.relaxed.gpu.global.L1::no_allocate.u16 %0, [%1];" : "=h"(v) : "l"(p) : "memory");
    return v;
}
template <bool kLogFmt>
__device__ __forceinline__ PartialChunk load_partial(const char* row, int hidden, int c, int wire) {
    PartialChunk w;
    if constexpr (kLogFmt) {
        const uint2 meta = ld_ring_v2(reinterpret_cast<const uint2*>(row) + (c >> 4));
        const unsigned hi = ld_ring_u16(reinterpret_cast<const unsigned short*>(row + logfmt_hi_offset(hidden, c)));
        w.high = make_int4((int)meta.x, (int)meta.y, (int)hi, 0);
        w.low = ld_ring_v2(reinterpret_cast<const uint2*>(row + logfmt_lo_offset(hidden, c)));
        return w;
    }
    w.high = ld_ring_v4(reinterpret_cast<const int4*>(row) + c);
    w.low = wire == kWireBf16 ? make_uint2(0u, 0u) : ld_ring_v2(reinterpret_cast<const uint2*>(row + 2LL * hidden) + c);
    return w;
}
template <bool kLogFmt>
__device__ __forceinline__ void add_partial(float (&acc)[8], const PartialChunk& w) {
    if constexpr (kLogFmt) {
        const LogFmtChunk chunk{w.low, (unsigned)w.high.z,
                                make_float2(__int_as_float(w.high.x), __int_as_float(w.high.y))};
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] = __fadd_rn(acc[j], logfmt_decode(chunk, j));
        return;
    }
    const unsigned hi[4] = {(unsigned)w.high.x, (unsigned)w.high.y, (unsigned)w.high.z, (unsigned)w.high.w};
    const unsigned lo[2] = {w.low.x, w.low.y};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const unsigned high = (hi[j >> 1] >> (16 * (j & 1))) & 0xffffu, low = (lo[j >> 2] >> (8 * (j & 3))) & 0xffu;
        acc[j] = __fadd_rn(acc[j], __uint_as_float((high << 16) | (low << 8)));
    }
}

// The partial row's bytes on the wire (what an NVSHMEM put moves).
__device__ __forceinline__ long long partial_wire_bytes(const LowLatencyLayout& L, int wire) {
    return wire == kWireLogFmt ? (long long)L.hidden / 16 * 21 : wire == kWireBf16 ? 2LL * L.hidden : L.part_bytes;
}

// Meta flag: W << kMetaWireShift | K << kMetaTopkShift | T + 1 (W the owner's Wire < 4, K <= kLLMaxTopk < 64,
// T + 1 <= kLLMaxTokens + 1 < 2^kMetaTopkShift): never 0 ("not arrived"), never negative.
constexpr int kMetaTopkShift = 20, kMetaWireShift = 26;
static_assert(kLLMaxTokens + 1 < (1 << kMetaTopkShift) && kLLMaxTopk < (1 << (kMetaWireShift - kMetaTopkShift)),
              "the meta flag's fields overlap");
__device__ __forceinline__ int meta_flag_value(int num_topk, int num_tokens, int wire) {
    return (wire << kMetaWireShift) | (num_topk << kMetaTopkShift) | (num_tokens + 1);
}
__device__ __forceinline__ int meta_flag_topk(int v) {
    return (v >> kMetaTopkShift) & ((1 << (kMetaWireShift - kMetaTopkShift)) - 1);
}
__device__ __forceinline__ int meta_flag_tokens(int v) { return (v & ((1 << kMetaTopkShift) - 1)) - 1; }
__device__ __forceinline__ int meta_flag_wire(int v) { return (v >> kMetaWireShift) & 3; }

// The blocks that share one role of the combine: this block is number `index` of `count` (all blocks of the
// launch, or one side of the split in combine()).
struct Blocks {
    int index, count;
};

// (A) blocks b < R: the meta for rank b (not for this rank itself, nor a masked rank).
template <typename TopkT>
__device__ void combine_send_meta(OwnEntries<TopkT> own, const float* topk_weights, int num_tokens, int num_topk,
                                  int wire, char* base, const unsigned long long* peer_bases, const LowLatencyLayout& L,
                                  int rank, int buffer_idx, unsigned long long masked, Blocks blocks) {
    for (int r = blocks.index; r < L.num_ranks; r += blocks.count) {
        if (r == rank || has_rank(masked, r)) continue;  // (B) reads this rank's own top-k from the arguments
        const long long dst = L.recv_offset(buffer_idx) + L.combine_meta_in(rank);
        char* direct = reinterpret_cast<char*>(peer_bases[r]);
        char* meta = direct != nullptr ? direct + dst : base + L.recv_offset(buffer_idx) + L.combine_meta_out(r);
        int* experts = reinterpret_cast<int*>(meta);  // entry codes
        float* weights = reinterpret_cast<float*>(meta + L.meta_weights());
        for (int i = threadIdx.x; i < num_tokens * num_topk; i += blockDim.x) {
            experts[i] = own(i);
            weights[i] = topk_weights[i];
        }
        __syncthreads();
        if (direct == nullptr && warp_id() == 0) {
            ll_put_warp(base + dst, meta, (size_t)L.meta_bytes, r);
            __syncwarp();
            if (lane_id() == 0) ll_quiet();
        }
        if (threadIdx.x == 0)
            send_signal(base, peer_bases, r, L.signal_offset(buffer_idx) + 4LL * L.combine_meta_flag(rank),
                        meta_flag_value(num_topk, num_tokens, wire));
        __syncthreads();
    }
}

// (B) compute side: publish token t (or -1, the end) to the flagger; its previous one must have been read.
template <typename Shared>
__device__ __forceinline__ void hand_to_flagger(int t, Shared& sh, HandoffPhases& ph) {
    if (ph.handoff > 0) mbarrier_wait(&sh.empty, (ph.handoff - 1) & 1);
    if (threadIdx.x == 0) sh.flag_token[ph.handoff & 1] = t;
    group_mbarrier_sync(&sh.compute, ph.sync);  // flag_token written
    mbarrier_arrive(&sh.full);
    ++ph.handoff;
}

// (B), one owner s: the partial sums of its tokens t = index + j * count (T tokens, K entries each:
// `entries` / `weights` are the owner's meta, or this rank's own arguments when s is this rank; begin: s's
// stage_range_begins), in s's wire format (Wire: the one the owner asked for).
// Warp roles: the first blockDim - 32 threads (compute) prepare the block's tokens a batch at a time
// (prepare_batch) and store each token's partial row; the last warp (flagger) flags each stored row, so the
// system-scope release, which waits for the row's NVLink stores to be acknowledged, overlaps the next token's
// loads instead of holding up the block. The handoff is a pair of mbarriers (combine_reduce sets them up; `phase`
// counts the handoffs, alike on both sides): `full` (the compute threads arrive once a token's row is stored:
// release at CTA scope; the flagger's wait acquires, so its release at system scope covers those stores) and
// `empty` (the flagger has read the token number: the compute side may publish the next one, at most one row
// ahead of the flagger). Token -1 ends the owner. The compute warps sync among themselves on a third mbarrier
// (group_mbarrier_sync), not a named barrier: with `bar.sync 1, n` racecheck reported a race across the next
// __syncthreads, most likely counting the flagger warp, which skips the named barrier, as a warp behind on
// block barriers; with the mbarrier it reports none.
template <bool kLogFmt, typename Entries, typename WeightT, typename Shared>
__device__ __forceinline__ void combine_reduce_owner(int s, Entries entries, const WeightT* weights, int T, int K,
                                                     int wire, const int4* rows, const int* begin, int4* stage,
                                                     char* base, const unsigned long long* peer_bases,
                                                     const LowLatencyLayout& L, int rank, int buffer_idx, Shared& sh,
                                                     HandoffPhases& ph, Blocks blocks, long long* stamps) {
    const int row_int4 = L.hidden / 8;  // bf16 input row: chunks of 8 values
    constexpr int compute_threads = kLLCombineThreads - kWarpSize;
    char* recv = base + L.recv_offset(buffer_idx);
    char* direct = reinterpret_cast<char*>(peer_bases[s]);
    if ((int)threadIdx.x >= compute_threads) {  // the flagger warp
        for (;;) {
            mbarrier_wait(&sh.full, ph.handoff & 1);
            const int t = sh.flag_token[ph.handoff & 1];
            mbarrier_arrive(&sh.empty);
            ++ph.handoff;
            if (t < 0) break;
            const long long dst = L.recv_offset(buffer_idx) + L.combine_partial_in(rank, t);
            if (direct == nullptr) {
                ll_put_warp(base + dst, recv + L.combine_partial_out(s, t), (size_t)partial_wire_bytes(L, wire), s);
                __syncwarp();
                if (lane_id() == 0) ll_quiet();
            }
            if (lane_id() == 0) {
                send_signal(base, peer_bases, s, L.signal_offset(buffer_idx) + 4LL * L.combine_token_flag(rank, t), 1);
                stamp_by(stamps, kStampSendWritten, true);
            }
        }
    } else {
        const auto sync = [&] { group_mbarrier_sync(&sh.compute, ph.sync); };
        const int mine = tokens_of_block(T, blocks.index, blocks.count);
        for (int j0 = 0; j0 < mine; j0 += kCombineBatch) {
            const int n = min(kCombineBatch, mine - j0), t0 = blocks.index + j0 * blocks.count;
            prepare_batch(entries, weights, K, t0, blocks.count, n, rank, L, begin, sh);
            sync();
            for (int j = 0; j < n; ++j) {
                if (sh.num_kept[j] == 0) continue;  // uniform: nothing to send for this token
                const int t = t0 + j * blocks.count;
                char* out = direct != nullptr ? direct + L.recv_offset(buffer_idx) + L.combine_partial_in(rank, t)
                                              : recv + L.combine_partial_out(s, t);
                for (int c = threadIdx.x; c < row_int4; c += kCombineChunks * compute_threads) {
                    float acc[kCombineChunks][8];
                    partial_sums<compute_threads, Shared::kTopkBound>(acc, rows, sh.row[j], sh.weight[j],
                                                                      sh.num_kept[j], c, row_int4, stage);
#pragma unroll
                    for (int q = 0; q < kCombineChunks; ++q)
                        if (c + q * compute_threads < row_int4)
                            store_partial<kLogFmt>(out, L.hidden, c + q * compute_threads, acc[q], wire);
                }
                stamp(stamps, kStampSendEncoded);
                hand_to_flagger(t, sh, ph);
            }
            sync();  // the batch's entries are read: the next batch may overwrite them
        }
        hand_to_flagger(-1, sh, ph);
    }
    __syncthreads();  // both roles are done with the shared entries (the next owner reuses them)
}

// combine_reduce_owner in owner s's wire: the LogFMT instantiation or the 24-bit / bf16 one (store_partial).
template <typename... Args>
__device__ __forceinline__ void reduce_owner_as(bool logfmt, Args&&... args) {
    if (logfmt)
        combine_reduce_owner<true>(static_cast<Args&&>(args)...);
    else
        combine_reduce_owner<false>(static_cast<Args&&>(args)...);
}

// (B), thread 0: owner s's meta flag, acquired with value v, into sh.value; consumed once every block of this role
// has read it (the readers' acquires precede their adds).
template <typename Shared>
__device__ __forceinline__ void take_meta(int* flag, int v, int s, int* meta_readers, Blocks blocks, Shared& sh) {
    sh.value = v;
    if (atomicAdd(meta_readers + s, 1) == blocks.count - 1) {
        meta_readers[s] = 0;
        *flag = 0;
    }
}

// (B) shrink mode, thread 0: the next owner to serve among `todo` (bit r: owner r, not served yet), the first from
// rank + 1 on whose meta flag is in (its value into v), so that an owner that never sends delays none that does
// (their partials are waited for with the same timeout). One wait covers them all: its timeout masks the first of
// them (wait_until), which is dropped with any other masked meanwhile, and the rest are waited for again. Returns
// -1 once none is left, -2 on a failure that stops the buffer.
__device__ __forceinline__ int next_ready_owner(const int* signals, const LowLatencyLayout& L, int rank,
                                                unsigned long long& todo, const int* shrink_mask, const DeviceCtx* ctx,
                                                int& v) {
    const int R = L.num_ranks;
    for (;;) {
        int first = -1;
        for (int i = 1; i < R; ++i) {
            const int r = (rank + i) % R;
            if (has_rank(todo, r) && ld_volatile(shrink_mask + r) != 0) todo &= ~(1ull << r);
            if (has_rank(todo, r) && first < 0) first = r;
        }
        if (first < 0) return -1;
        int s = -1;
        const bool ok = wait_until<true>(
            ctx, WaitSite{kKernelLowLatencyCombine, kRoleReceiver, -1, first},
            [&] {
                for (int i = 1; i < R; ++i) {
                    const int r = (rank + i) % R;
                    if (!has_rank(todo, r)) continue;
                    if ((v = ld_acquire_sys(signals + L.combine_meta_flag(r))) != 0) {
                        s = r;
                        return true;
                    }
                }
                return false;
            },
            [&](long long& head, long long& tail, long long& expected) {
                head = ld_volatile(signals + L.combine_meta_flag(first));
                tail = 0;
                expected = 1;
            });
        if (ok) {
            todo &= ~(1ull << s);
            return s;
        }
        if (!peer_dropped(shrink_mask, first)) return -2;
    }
}

// (B) the partial sums of every owner's tokens: this rank's own first (its top-k are the kernel's arguments: no
// wait), meanwhile the remote owners' meta arrives. own_in_recv (both phases in one launch): the own tokens'
// partials are left to (C), which computes them before waiting for the peers' (no flag, and the remote owners'
// rows go first); a hook's receive phase runs later, when the caller may already reuse x, so there they are sent
// here like the others. begin: shared memory for stage_range_begins. The remote owners in the order
// (rank + 1, rank + 2, ...), or in shrink mode as their meta comes in (next_ready_owner), the masked ones skipped.
template <typename TopkT, typename Shared>
__device__ __forceinline__ void combine_reduce(const int4* x, bool zero_copy, const long long* layout_range,
                                               OwnEntries<TopkT> own, const float* topk_weights, int num_tokens,
                                               int num_topk, int wire, char* base, const unsigned long long* peer_bases,
                                               const LowLatencyLayout& L, int rank, int buffer_idx, int* meta_readers,
                                               const int* shrink_mask, const DeviceCtx* ctx, int* begin, int4* stage,
                                               Shared& sh, bool own_in_recv, Blocks blocks, long long* stamps) {
    const int R = L.num_ranks;
    int* signals = reinterpret_cast<int*>(base + L.signal_offset(buffer_idx));
    const char* recv = base + L.recv_offset(buffer_idx);
    const int4* rows = zero_copy ? reinterpret_cast<const int4*>(base + L.send_offset(buffer_idx)) : x;
    if (threadIdx.x == 0) {  // combine_reduce_owner's mbarriers, for all owners of this call (ph counts on)
        mbarrier_init(&sh.full, kLLCombineThreads - kWarpSize);  // the compute threads (the launch's blockDim)
        mbarrier_init(&sh.empty, kWarpSize);
        mbarrier_init(&sh.compute, kLLCombineThreads - kWarpSize);
    }
    if (!own_in_recv) stage_range_begins(layout_range, rank, L, begin);
    __syncthreads();
    HandoffPhases ph;
    if (!own_in_recv)
        reduce_owner_as(wire == kWireLogFmt, rank, own, topk_weights, num_tokens, num_topk, wire, rows, begin, stage,
                        base, peer_bases, L, rank, buffer_idx, sh, ph, blocks, stamps);
    stamp(stamps, kStampSendPrepared);  // the own tokens' partials are written and flagged (hook mode)
    unsigned long long todo = 0;        // shrink mode, thread 0: the remote owners not served yet (next_ready_owner)
    for (int r = 0; shrink_mask != nullptr && r < R; ++r)
        if (r != rank && !has_rank(sh.masked, r)) todo |= 1ull << r;
    for (int i = 1; i < R; ++i) {
        int s = (rank + i) % R;
        if (shrink_mask == nullptr) {
            // while the meta travels (the previous owner ended with a block barrier, so begin is free)
            stage_range_begins(layout_range, s, L, begin);
            if (threadIdx.x == 0) {
                int* flag = signals + L.combine_meta_flag(s);
                int v = 0;
                const bool ok = wait_until(
                    ctx, WaitSite{kKernelLowLatencyCombine, kRoleReceiver, -1, s},
                    [&] { return (v = ld_acquire_sys(flag)) != 0; },
                    [&](long long& head, long long& tail, long long& expected) {
                        head = ld_volatile(flag);
                        tail = 0;
                        expected = 1;
                    });
                if (ok)
                    take_meta(flag, v, s, meta_readers, blocks, sh);
                else
                    sh.failed = 1;
            }
            __syncthreads();
        } else {  // (uniform)
            if (threadIdx.x == 0) {
                int v = 0;
                const int next = next_ready_owner(signals, L, rank, todo, shrink_mask, ctx, v);
                if (next >= 0) take_meta(signals + L.combine_meta_flag(next), v, next, meta_readers, blocks, sh);
                if (next == -2) sh.failed = 1;
                sh.owner = next;
            }
            __syncthreads();
            s = sh.owner;
            if (s >= 0) stage_range_begins(layout_range, s, L, begin);  // read after the barrier below
        }
        if (i == 1) stamp(stamps, kStampSendRouted);  // the first remote owner's meta is in
        if (sh.failed) return;                        // uniform
        if (s < 0) break;                             // (shrink mode) no owner left
        const int K = meta_flag_topk(sh.value), T = meta_flag_tokens(sh.value);
        const int owner_wire = meta_flag_wire(sh.value);  // the wire format owner s reads
        __syncthreads();  // sh.value is read by every thread before thread 0 waits for the next owner
        const char* meta = recv + L.combine_meta_in(s);
        reduce_owner_as(owner_wire == kWireLogFmt, s, MetaEntries{reinterpret_cast<const volatile int*>(meta)},
                        reinterpret_cast<const volatile float*>(meta + L.meta_weights()), T, K, owner_wire, rows, begin,
                        stage, base, peer_bases, L, rank, buffer_idx, sh, ph, blocks, stamps);
    }
}

template <typename TopkT, typename Shared>
__device__ void combine_send(const int4* x, bool zero_copy, const long long* layout_range, OwnEntries<TopkT> own,
                             const float* topk_weights, int num_tokens, int num_topk, int wire, char* base,
                             const unsigned long long* peer_bases, const LowLatencyLayout& L, int rank, int buffer_idx,
                             int* workspace, const int* shrink_mask, const DeviceCtx* ctx, int* begin, int4* stage,
                             Shared& sh, bool own_in_recv, Blocks blocks, long long* stamps) {
    stamp(stamps, kStampSendStart);
    combine_send_meta(own, topk_weights, num_tokens, num_topk, wire, base, peer_bases, L, rank, buffer_idx, sh.masked,
                      blocks);
    combine_reduce(x, zero_copy, layout_range, own, topk_weights, num_tokens, num_topk, wire, base, peer_bases, L, rank,
                   buffer_idx, workspace + kWsMetaReaders, shrink_mask, ctx, begin, stage, sh, own_in_recv, blocks,
                   stamps);
    stamp_after_barrier(stamps, kStampSendEnd);
}

// (C) the owner's sum of the partials, a batch of the block's tokens at a time (prepare_batch: which ranks hold a
// kept entry of each). own_in_recv: first this rank's own partials of the batch's tokens are computed here from x
// (while the peers' partials are on their way) into this rank's own partial_in slots in the wire format (what a
// peer's would carry); each thread reads back only the chunks it wrote. Then per token: wait for the peers'
// flags, sum. wire: the format of this rank's partials (its own and the peers'), as its meta flag asked. Shrink
// mode: a rank masked while this rank waits for its partial of a token (sh.dropped) is left out of the token's sum.
template <bool kLogFmt, typename TopkT, typename Shared>
__device__ void combine_recv(int4* combined_x, const int4* x, bool zero_copy, const long long* layout_range,
                             OwnEntries<TopkT> own, const float* topk_weights, int num_tokens, int num_topk, int wire,
                             char* base, const LowLatencyLayout& L, int rank, int buffer_idx, const int* shrink_mask,
                             const DeviceCtx* ctx, int* begin, int4* stage, Shared& sh, bool own_in_recv, Blocks blocks,
                             long long* wait_stats, long long* stamps) {
    stamp_after_barrier(stamps, kStampRecvStart);
    long long waited = 0;  // thread r < R: the cycles spent waiting for rank r's flags (wait_stats)
    const int R = L.num_ranks, row_int4 = L.hidden / 8;
    constexpr int threads = kLLCombineThreads;
    int* signals = reinterpret_cast<int*>(base + L.signal_offset(buffer_idx));
    char* recv = base + L.recv_offset(buffer_idx);
    const int4* rows = zero_copy ? reinterpret_cast<const int4*>(base + L.send_offset(buffer_idx)) : x;
    stage_range_begins(layout_range, rank, L, begin);
    __syncthreads();  // begin is read by prepare_batch (racecheck reports a race without it)
    const int mine = tokens_of_block(num_tokens, blocks.index, blocks.count);
    for (int j0 = 0; j0 < mine; j0 += kCombineBatch) {
        const int n = min(kCombineBatch, mine - j0), t0 = blocks.index + j0 * blocks.count;
        prepare_batch(own, topk_weights, num_topk, t0, blocks.count, n, rank, L, begin, sh);
        __syncthreads();
        if (own_in_recv) {
            for (int j = 0; j < n; ++j) {
                if (sh.num_kept[j] == 0) continue;  // uniform: this rank holds no kept entry of the token
                char* own = recv + L.combine_partial_in(rank, t0 + j * blocks.count);
                // the same chunks per thread as the sums' reads below
                for (int c = threadIdx.x; c < row_int4; c += kCombineChunks * threads) {
                    float p[kCombineChunks][8];
                    partial_sums<threads, Shared::kTopkBound>(p, rows, sh.row[j], sh.weight[j], sh.num_kept[j], c,
                                                              row_int4, stage);
#pragma unroll
                    for (int q = 0; q < kCombineChunks; ++q)
                        if (c + q * threads < row_int4)
                            store_partial<kLogFmt>(own, L.hidden, c + q * threads, p[q], wire);
                }
            }
            stamp_after_barrier(stamps, kStampRecvPrepared);  // the block's own partials (of this batch) are computed
        }
        for (int j = 0; j < n; ++j) {
            const int t = t0 + j * blocks.count;
            const unsigned long long has = sh.has[j];
            if ((int)threadIdx.x < R) {
                const int r = threadIdx.x;
                if ((has >> r & 1ull) && !(own_in_recv && r == rank)) {
                    int* flag = signals + L.combine_token_flag(r, t);
                    const long long waiting_since = wait_clock(wait_stats);
                    const bool ok = wait_until<true>(
                        ctx, WaitSite{kKernelLowLatencyCombine, kRoleReceiver, t, r},
                        [&] { return ld_acquire_sys(flag) != 0; },
                        [&](long long& head, long long& tail, long long& expected) {
                            head = ld_volatile(flag);
                            tail = t;
                            expected = 1;
                        });
                    waited += waited_since(wait_stats, waiting_since);
                    if (ok)
                        *flag = 0;  // consumed
                    else if (peer_dropped(shrink_mask, r))
                        atomicOr(&sh.dropped[j], 1ull << r);
                    else
                        sh.failed = 1;
                }
            }
            __syncthreads();
            const unsigned long long got = has & ~sh.dropped[j];        // the ranks whose partials are summed
            if (t == blocks.index) stamp(stamps, kStampRecvFirstData);  // the first token's partials are in
            if (sh.failed) {  // uniform: every thread read it after the barrier
                if ((int)threadIdx.x < R) add_wait_cost(wait_stats, threadIdx.x, waited);
                return;
            }
            for (int c = threadIdx.x; c < row_int4; c += kCombineChunks * threads) {
                float acc[kCombineChunks][8] = {};
                // ranks ascending (the reference's order); kSumInFlight ranks' partials in flight per chunk
                for (int r0 = 0; r0 < R; r0 += kSumInFlight) {
                    PartialChunk w[kCombineChunks][kSumInFlight];
#pragma unroll
                    for (int q = 0; q < kCombineChunks; ++q)
#pragma unroll
                        for (int u = 0; u < kSumInFlight; ++u)
                            if (r0 + u < R && (got >> (r0 + u) & 1ull) && c + q * threads < row_int4)
                                w[q][u] = load_partial<kLogFmt>(recv + L.combine_partial_in(r0 + u, t), L.hidden,
                                                                c + q * threads, wire);
#pragma unroll
                    for (int q = 0; q < kCombineChunks; ++q)
#pragma unroll
                        for (int u = 0; u < kSumInFlight; ++u)
                            if (r0 + u < R && (got >> (r0 + u) & 1ull)) add_partial<kLogFmt>(acc[q], w[q][u]);
                }
#pragma unroll
                for (int q = 0; q < kCombineChunks; ++q)
                    if (c + q * threads < row_int4)
                        combined_x[(long long)t * row_int4 + c + q * threads] =
                            make_int4((int)pack_bf16x2(acc[q][0], acc[q][1]), (int)pack_bf16x2(acc[q][2], acc[q][3]),
                                      (int)pack_bf16x2(acc[q][4], acc[q][5]), (int)pack_bf16x2(acc[q][6], acc[q][7]));
            }
        }
        __syncthreads();  // the batch's entries are read: the next batch may overwrite them
    }
    if ((int)threadIdx.x < R) add_wait_cost(wait_stats, threadIdx.x, waited);
    stamp(stamps, kStampRecvEnd);  // the loop ends with a block barrier
}

// combine_recv in this rank's wire: the LogFMT instantiation or the 24-bit / bf16 one (store_partial).
template <typename... Args>
__device__ __forceinline__ void combine_recv_as(bool logfmt, Args&&... args) {
    if (logfmt)
        combine_recv<true>(static_cast<Args&&>(args)...);
    else
        combine_recv<false>(static_cast<Args&&>(args)...);
}

}  // namespace ep::low_latency
