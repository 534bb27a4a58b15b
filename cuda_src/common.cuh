// common.cuh: memory-order helpers, the one spin-wait helper (with timeout and diagnostics), warp and
// bf16 utilities. Included by every kernel file; it needs no CUDA header, so NVRTC compiles it alone.
#pragma once

namespace ep {

constexpr int kWarpSize = 32;
constexpr int kMaxNvlRanks = 8;          // ranks of one NVLink domain (mirrors config.MAX_NVL_RANKS)
constexpr int kMaxLocalExperts = 1024;   // experts per rank (mirrors config.MAX_LOCAL_EXPERTS)
constexpr int kMaxTopk = 32;             // mirrors config.MAX_TOPK

// ---------------------------------------------------------------------------------------------------
// Diagnostics: who waited for what. Python (cupy_ep/buffer.py) names the numbers.
// ---------------------------------------------------------------------------------------------------
enum KernelId : int {
    kKernelLayout = 1, kKernelNotifyDispatch = 2, kKernelCachedNotifyDispatch = 3, kKernelDispatch = 4,
    kKernelCachedNotifyCombine = 5, kKernelCombine = 6, kKernelBarrier = 7,
    kKernelLowLatencyDispatch = 8, kKernelLowLatencyCombine = 9,
    kKernelInternodeNotifyDispatch = 10, kKernelInternodeCachedNotify = 11, kKernelInternodeDispatch = 12,
    kKernelInternodeCombine = 13, kKernelDispatchDirect = 14, kKernelCombineDirect = 15,
};
// (5 was kRoleSignaller, the low-latency dispatch's count signallers, gone since its counts carry epochs)
enum Role : int { kRoleBarrier = 0, kRoleSender = 1, kRoleReceiver = 2, kRoleNotify = 3, kRoleCallCheck = 4,
                 kRoleBufferReuse = 6, kRoleZeroCopyCapacity = 7, kRoleEntry = 8 };
// kRoleEntry: a zero-copy kernel waiting for a peer to enter the same call (head = the epoch seen, expected =
// this call's epoch): the peer runs another operation, or is late by the timeout.
// kRoleBufferReuse: not a wait but a low-latency call whose send phase uses the same buffer (0/1) as the
// previous send phase of this rank (head = that buffer): a CUDA graph replaying an odd number of low-latency
// calls. Its receivers would find the previous replay's signals still set and read data that never came.

// kRoleZeroCopyCapacity: not a wait but a zero-copy dispatch whose rows do not fit a receiver's buffer (head =
// the rows, tail = the capacity, peer = that receiver); every rank sees the same counts and stops alike.

// Written once (by the first thread that times out) into host-mapped memory; the host turns it into
// cupy_ep.CommTimeoutError. Layout mirrored by buffer.py (_RECORD_FIELDS).
// role kRoleCallCheck: not a timeout but ranks that disagree about a call (head = my word, tail = the
// peer's word, expected = the word's index, see kCallWords in buffer.cuh).
struct TimeoutRecord {
    int flag;  // 0: nothing happened; 1: record valid
    int rank, kernel, role, channel, peer;
    long long head, tail, expected, elapsed_ns;
};

// Per-buffer context in device memory, filled once by the host.
struct DeviceCtx {
    unsigned long long timeout_ns;
    TimeoutRecord* record;  // host-mapped
    int* abort_flag;        // device memory: set by the first timeout; every later wait gives up at once
    int rank;
    int num_ranks;
    int* shrink_mask;       // [shrink] device memory, [num_ranks] int32, 1 = masked; null unless shrink mode
};

struct WaitSite {
    int kernel, role, channel, peer;
};

// ---------------------------------------------------------------------------------------------------
// Memory-order helpers. Peer-written data is never read with ld.global.nc (its cache is not coherent
// with NVLink writes); use ld_volatile*/ld_acquire_* for it. ld_nc_v4 is for this rank's own inputs only.
// ---------------------------------------------------------------------------------------------------
__device__ __forceinline__ int ld_acquire_sys(const int* p) {
    int v;
    asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ long long ld_acquire_sys(const long long* p) {  // one 8-byte load: single-copy atomic
    long long v;
    asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ int ld_relaxed_sys(const int* p) {
    int v;
    asm volatile("ld.relaxed.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ int ld_volatile(const int* p) {
    int v;
    asm volatile("ld.volatile.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ long long ld_volatile(const long long* p) {  // one 8-byte load: single-copy atomic
    long long v;
    asm volatile("ld.volatile.global.s64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ float ld_volatile(const float* p) {
    float v;
    asm volatile("ld.volatile.global.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ int4 ld_volatile_v4(const int4* p) {
    int4 v;
    asm volatile("ld.volatile.global.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}
// This rank's own read-only inputs: non-coherent path, no L1 allocation, 256-byte L2 prefetch (rows are
// read front to back, so the prefetch turns most loads into L2 hits).
__device__ __forceinline__ int4 ld_nc_v4(const int4* p) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
// Ring payload written by a peer, read after the tail was acquired (and a barrier): a relaxed gpu-scope
// load is served by L2 (never a stale L1 line), with the same 256-byte prefetch. Not .nc.
__device__ __forceinline__ int4 ld_ring_v4(const int4* p) {
    int4 v;
    asm volatile("ld.relaxed.gpu.global.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ uint2 ld_ring_v2(const uint2* p) {
    uint2 v;
    asm volatile("ld.relaxed.gpu.global.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release_sys(int* p, int v) {
    asm volatile("st.release.sys.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_release_gpu(int* p, int v) {
    asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys(int* p, int v) {
    asm volatile("st.relaxed.sys.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys(long long* p, long long v) {  // one 8-byte store: single-copy atomic
    asm volatile("st.relaxed.sys.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_volatile(int* p, int v) {
    asm volatile("st.volatile.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

__device__ __forceinline__ unsigned long long globaltimer_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Named barrier for a group of warps (id 0 is __syncthreads).
__device__ __forceinline__ void group_sync(int id, int num_threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(num_threads) : "memory");
}

// Stop this buffer: the first caller writes the record (host-mapped) and sets the abort flag, after which
// every wait gives up at once and the kernels exit; the host turns the record into an exception.
__device__ __forceinline__ void report_failure(const DeviceCtx* ctx, WaitSite site, long long head, long long tail,
                                               long long expected, long long elapsed_ns) {
    if (atomicCAS(ctx->abort_flag, 0, 1) != 0) return;
    TimeoutRecord* r = ctx->record;
    r->rank = ctx->rank; r->kernel = site.kernel; r->role = site.role;
    r->channel = site.channel; r->peer = site.peer;
    r->head = head; r->tail = tail; r->expected = expected;
    r->elapsed_ns = elapsed_ns;
    __threadfence_system();
    st_volatile(&r->flag, 1);
    __threadfence_system();
}

// True once any wait or check of this buffer failed (kernels launched after that return at once).
__device__ __forceinline__ bool buffer_aborted(const DeviceCtx* ctx) { return ld_volatile(ctx->abort_flag) != 0; }

// ---------------------------------------------------------------------------------------------------
// The one spin-wait helper. Spins until done() is true; returns false on timeout or when another wait
// of this buffer already timed out (abort flag), after writing the diagnostic record once. Callers must
// then leave their loops together (share the result through shared memory / a barrier).
// observe(head, tail, expected) fills the record's numbers; it is only called on failure.
// [shrink] kMaskPeer (the low-latency waits for site.peer): with ctx->shrink_mask set, the wait gives up
// once the peer is masked, and on timeout masks it instead of failing (no record, no abort); the caller
// then goes on as if the peer had sent nothing. Without shrink_mask it behaves as kMaskPeer = false.
// ---------------------------------------------------------------------------------------------------
template <bool kMaskPeer = false, typename Done, typename Observe>
__device__ __forceinline__ bool wait_until(const DeviceCtx* ctx, WaitSite site, Done done, Observe observe) {
    if (done()) return true;
    const unsigned long long start = globaltimer_ns();
    for (unsigned iter = 1;; ++iter) {
        if (done()) return true;
        if ((iter & 63) == 0) {
            const unsigned long long elapsed = globaltimer_ns() - start;
            const bool aborted = ld_volatile(ctx->abort_flag) != 0;
            if (kMaskPeer && !aborted && ctx->shrink_mask != nullptr) {  // [shrink]
                int* masked = ctx->shrink_mask + site.peer;
                if (ld_volatile(masked) != 0) return false;
                if (elapsed > ctx->timeout_ns) {
                    atomicExch(masked, 1);
                    return false;
                }
                continue;
            }
            if (aborted || elapsed > ctx->timeout_ns) {
                if (!aborted) {
                    long long head = -1, tail = -1, expected = -1;
                    observe(head, tail, expected);
                    report_failure(ctx, site, head, tail, expected, (long long)elapsed);
                }
                return false;
            }
        }
    }
}

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

// Contiguous token range of a channel: blocks of ceil(T / C) (mirrors reference.channel_ranges).
__device__ __forceinline__ void channel_range(int num_tokens, int num_channels, int channel, int& begin, int& end) {
    const int per = (num_tokens + num_channels - 1) / num_channels;
    begin = min(per * channel, num_tokens);
    end = min(begin + per, num_tokens);
}

// ---------------------------------------------------------------------------------------------------
// Bulk copies (TMA, sm_90): one thread moves a whole chunk global -> shared -> global without registers, so a
// warp keeps kTmaChunkBytes in flight instead of the 3 KB a register copy can. Loads complete on an
// mbarrier (expect_tx), stores are tracked by bulk groups. Addresses and sizes must be multiples of 16.
// The async proxy reads global memory: data published to this thread through the generic proxy (a ring
// filled by a peer, seen through an acquire) needs fence_proxy_async() before the bulk load reads it.
// ---------------------------------------------------------------------------------------------------
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbarrier_init(unsigned long long* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void mbarrier_expect_tx(unsigned long long* bar, int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
// One arrival (release at CTA scope: this thread's earlier writes are visible to a thread whose wait sees the phase
// complete).
__device__ __forceinline__ void mbarrier_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbarrier_wait(unsigned long long* bar, int phase) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" ::"r"(smem_addr(bar)), "r"(phase) : "memory");
}
// A barrier of the threads that share `bar` (mbarrier_init with their count; `phase` counts the
// completed phases, alike on every thread that uses it): arrive (release), then wait for
// the phase to complete (acquire).
__device__ __forceinline__ void group_mbarrier_sync(unsigned long long* bar, int& phase) {
    mbarrier_arrive(bar);
    mbarrier_wait(bar, phase & 1);
    ++phase;
}

__device__ __forceinline__ void tma_load(void* smem, const void* gmem, int bytes, unsigned long long* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_addr(smem)), "l"(gmem), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void tma_store(void* gmem, const void* smem, int bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 ::"l"(gmem), "r"(smem_addr(smem)), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// The shared source of every committed store has been read (the buffer may be refilled).
__device__ __forceinline__ void tma_store_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// Every committed store is complete (written to global memory).
__device__ __forceinline__ void tma_store_wait() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// cp.async (sm_80+): one 16-byte global -> shared copy that holds no register while it travels (through L2 only,
// .cg), so a thread can have many in flight; cp_async_wait_all: this thread's copies have landed (visible to it).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(smem)), "l"(gmem) : "memory");
}
// cp_async_small<N>: one N-byte (4 or 8) copy, through L1 (.ca: .cg takes 16 bytes only), for arrays of 4- or
// 8-byte elements that need not be 16-byte aligned.
template <int N>
__device__ __forceinline__ void cp_async_small(void* smem, const void* gmem) {
    static_assert(N == 4 || N == 8, "cp.async.ca copies 4, 8 or 16 bytes");
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(smem_addr(smem)), "l"(gmem), "n"(N) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

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

// ---------------------------------------------------------------------------------------------------
// bf16 <-> fp32 without cuda_bf16.h. Packing is one cvt per pair (round to nearest even, overflow to inf): the
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
