// common/ptx.cuh: memory-order loads and stores (global and shared), fences, timers, named barriers, and the
// sm_90 bulk-copy (TMA), mbarrier and cp.async instructions. It needs no CUDA header, so NVRTC compiles it alone.
#pragma once
namespace ep {

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
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}
// This rank's own read-only inputs: non-coherent path, no L1 allocation, 256-byte L2 prefetch (rows are
// read front to back, so the prefetch turns most loads into L2 hits).
__device__ __forceinline__ int4 ld_nc_v4(const int4* p) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}
// Ring payload written by a peer, read after the tail was acquired (and a barrier): a relaxed gpu-scope
// load is served by L2 (never a stale L1 line), with the same 256-byte prefetch. Not .nc.
__device__ __forceinline__ int4 ld_ring_v4(const int4* p) {
    int4 v;
    asm volatile("ld.relaxed.gpu.global.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}
__device__ __forceinline__ uint2 ld_ring_v2(const uint2* p) {
    uint2 v;
    asm volatile("ld.relaxed.gpu.global.L1::no_allocate.v2.u32 {%0, %1}, [%2];"
                 : "=r"(v.x), "=r"(v.y)
                 : "l"(p)
                 : "memory");
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

// Shared-memory words that other warps of the block write while this one polls (no caching in registers).
__device__ __forceinline__ int ld_shared_volatile(const int* p) { return *reinterpret_cast<const volatile int*>(p); }
__device__ __forceinline__ void st_shared_volatile(int* p, int v) { *reinterpret_cast<volatile int*>(p) = v; }

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
        "}\n" ::"r"(smem_addr(bar)),
        "r"(phase)
        : "memory");
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
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_addr(smem)),
                 "l"(gmem), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
}
__device__ __forceinline__ void tma_store(void* gmem, const void* smem, int bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem), "r"(smem_addr(smem)),
                 "r"(bytes)
                 : "memory");
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

}  // namespace ep
