// common/wait.cuh: the one timed wait and the failure record it writes (kernel ids and roles name the site).
#pragma once
#include "common/ptx.cuh"

namespace ep {

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
// peer's word, expected = the word's index, see kCallWords in common/layout.cuh).
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

// Uniform over the block: a kernel launched after a failed wait or check returns at once.
__device__ __forceinline__ bool block_aborted(const DeviceCtx* ctx) {
    return __syncthreads_or(threadIdx.x == 0 && buffer_aborted(ctx)) != 0;
}

// ---------------------------------------------------------------------------------------------------
// Warp-level waits through the one wait helper. Every lane runs wait_until; done() is a warp vote, and the
// other inputs of the exit decision (the global timer, the abort flag) are read by one warp instruction at one
// address, so all lanes leave together. cond() runs in every lane on every poll.
// ---------------------------------------------------------------------------------------------------
template <typename Cond, typename Observe>
__device__ __forceinline__ bool warp_wait_all(const DeviceCtx* ctx, WaitSite site, Cond cond, Observe observe) {
    return wait_until(ctx, site, [&] { return __all_sync(0xffffffffu, cond()) != 0; }, observe);
}
template <typename Cond, typename Observe>
__device__ __forceinline__ bool warp_wait_any(const DeviceCtx* ctx, WaitSite site, Cond cond, Observe observe) {
    return wait_until(ctx, site, [&] { return __any_sync(0xffffffffu, cond()) != 0; }, observe);
}

// Who waits: one thread, or a warp that leaves when all (kByWarpAll) or any (kByWarpAny) of its lanes' conditions
// hold. A lane with nothing to wait for votes idle_lane_vote(): true under an all-vote (it never holds the warp
// back), false under an any-vote (it never lets the warp go).
enum WaitBy : int { kByThread = 0, kByWarpAll = 1, kByWarpAny = 2 };
template <int kBy, typename Cond, typename Observe>
__device__ __forceinline__ bool wait_by(const DeviceCtx* ctx, WaitSite site, Cond cond, Observe observe) {
    if constexpr (kBy == kByWarpAll) return warp_wait_all(ctx, site, cond, observe);
    else if constexpr (kBy == kByWarpAny) return warp_wait_any(ctx, site, cond, observe);
    else return wait_until(ctx, site, cond, observe);
}
template <int kBy>
__device__ __forceinline__ constexpr bool idle_lane_vote() { return kBy == kByWarpAll; }

}  // namespace ep
