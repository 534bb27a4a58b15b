// intranode/handshake.cuh: the barrier, the call agreement of the notify kernels, the zero-copy kernels' entry
// handshake, and the ring reset.
#pragma once
#include "common/wait.cuh"
#include "common/warp.cuh"
#include "common/layout.cuh"

namespace ep::intranode {

// ---------------------------------------------------------------------------------------------------
// barrier: thread i < R adds 1 to its own slot i and subtracts 1 from peer i's slot `rank`; slot i then
// reads (my arrivals - i's arrivals), and we wait until it is <= 0. Reusable without any reset.
// Returns false (for the whole block) if the wait timed out.
// ---------------------------------------------------------------------------------------------------
template <int kNumRanks>
__device__ bool barrier_block(void** buffer_ptrs, int rank, const DeviceCtx* ctx, int kernel) {
    __syncthreads();
    bool ok = true;
    const int i = threadIdx.x;
    if (i < kNumRanks) {
        fence_acq_rel_sys();  // everything this block wrote before is visible to the peers
        int* mine = barrier_signals(buffer_ptrs[rank]) + i;
        atomicAdd_system(mine, 1);
        atomicSub_system(barrier_signals(buffer_ptrs[i]) + rank, 1);
        ok = wait_until(
            ctx, WaitSite{kernel, kRoleBarrier, -1, i}, [&] { return ld_volatile(mine) <= 0; },
            [&](long long& head, long long& tail, long long& expected) {
                head = ld_volatile(mine);
                expected = 0;
            });
        fence_acq_rel_sys();
    }
    return __syncthreads_and(ok) != 0;
}

__device__ __forceinline__ void zero_ints(int* p, long long n) {
    for (long long i = threadIdx.x; i < n; i += blockDim.x) p[i] = 0;
}

// ---------------------------------------------------------------------------------------------------
// Call agreement. Ranks that disagree about a call (another num_sms, hidden size, ring size or top-k, or
// a cached dispatch on one rank and a normal one on another) would carve the rings differently and then
// corrupt data or hang. So every notify kernel writes what it thinks the call is into each peer's
// call_words[my rank] between its first two barriers, and after the second compares every row with its
// own; any difference stops the buffer on every rank (the comparison is symmetric) with a record that the
// host raises as CallMismatchError. Nothing of the call has touched a ring by then.
// The first word is the CallOp (common/ids.cuh: cupy_ep/ids.py owns the values and names them in messages).
// ---------------------------------------------------------------------------------------------------

struct CallWords {
    int w[kCallWords];
};

// A dispatch's call words; direct_capacity > 0: a zero-copy dispatch (the last word is its row capacity).
__device__ __forceinline__ CallWords dispatch_call_words(bool cached, int num_channels, int num_slots, int hidden_int4,
                                                         int num_topk, int num_scales, int num_experts,
                                                         int direct_capacity) {
    const bool direct = direct_capacity > 0;
    const int op =
        cached ? (direct ? kOpCachedDirectDispatch : kOpCachedDispatch) : (direct ? kOpDirectDispatch : kOpDispatch);
    return CallWords{{op, num_channels, num_slots, hidden_int4, num_topk, num_scales, num_experts, direct_capacity}};
}

// The dispatch meta that the notify kernels zero, as offsets [begin, end): the rings' counters, or the zero-copy
// counter and channel starts.
__device__ __forceinline__ void dispatch_meta_range(int num_ranks, int num_channels, int num_slots, int hidden_int4,
                                                    int num_topk, int num_scales, int direct_capacity, long long& begin,
                                                    long long& end) {
    if (direct_capacity > 0) {
        const DirectDispatchLayout d(num_channels, direct_capacity, hidden_int4, num_topk, num_scales);
        begin = d.begin, end = d.meta_end;
    } else {
        const DispatchLayout d(num_channels, num_ranks, num_slots, hidden_int4, num_topk, num_scales);
        begin = d.begin, end = d.meta_end;
    }
}

// One thread writes, or compares, one rank's row of words (constant indices: the words stay in registers).
__device__ __forceinline__ void write_call_words(int* row, const CallWords& words) {
#pragma unroll
    for (int k = 0; k < kCallWords; ++k) row[k] = words.w[k];
}

// True iff `row` (a peer's words) equals ours; otherwise reports the first word that differs (stops the buffer).
__device__ __forceinline__ bool same_call_words(const int* row, const CallWords& words, const DeviceCtx* ctx,
                                                int kernel, int peer) {
    int bad = -1, mine = 0, theirs = 0;
#pragma unroll
    for (int k = kCallWords - 1; k >= 0; --k) {
        const int w = ld_volatile(&row[k]);
        if (w != words.w[k]) bad = k, mine = words.w[k], theirs = w;
    }
    if (bad < 0) return true;
    report_failure(ctx, WaitSite{kernel, kRoleCallCheck, -1, peer}, mine, theirs, bad, 0);
    return false;
}

template <int kNumRanks>
__device__ void publish_call_words(void** buffer_ptrs, int rank, const CallWords& words) {
    for (int peer = threadIdx.x; peer < kNumRanks; peer += blockDim.x)
        write_call_words(NotifyArea().call_words.on(buffer_ptrs[peer]) + rank * kCallWords, words);
}

// Call after the barrier that follows publish_call_words. False (for the whole block) on disagreement.
template <int kNumRanks>
__device__ bool check_call_words(void** buffer_ptrs, int rank, const CallWords& words, const DeviceCtx* ctx,
                                 int kernel) {
    const int* rows = NotifyArea().call_words.on(buffer_ptrs[rank]);
    bool ok = true;
    for (int peer = threadIdx.x; peer < kNumRanks; peer += blockDim.x)
        ok = same_call_words(rows + peer * kCallWords, words, ctx, kernel, peer) && ok;
    return __syncthreads_and(ok) != 0;
}

// ---------------------------------------------------------------------------------------------------
// Entry handshake of the zero-copy kernels: half a round trip inside the kernel instead of a notify kernel
// with two barriers before it. A zero-copy kernel stores into a buffer only once every rank has entered the
// same call: entering means that rank's earlier kernels on the buffer have finished (stream order), so
// nothing of an earlier call (a ring's late head update, a count still arriving) meets this call's stores.
//   open (every block, before its own set-up work): read the call's epoch; block 0 zeroes the meta that the
//        ranks will count into in this rank's buffer, writes this call's words into every rank's
//        entry_words[parity][my rank], then releases entry[my rank] = epoch to every rank (this one too);
//   wait (every block, before its first store): entry[s] has reached the epoch for every rank s, and s's
//        words equal ours (any difference stops the buffer on every rank, as check_call_words does).
// The epoch counts the zero-copy calls begun on the buffer (entry_epoch: the block that reads it last advances
// it), so it is the same on every rank, in every replay of a CUDA graph. A peer is at most one call ahead (its
// next call needs rows or flags from this one), hence entry_words by the epoch's parity.
// ---------------------------------------------------------------------------------------------------
template <int kNumRanks>
__device__ int open_direct_call(void** buffer_ptrs, int rank, const CallWords& words, long long zero_begin,
                                long long zero_end) {
    const NotifyArea notify;
    void* mine = buffer_ptrs[rank];
    __shared__ int s_epoch;
    if (threadIdx.x == 0) {
        const int epoch = ld_volatile(notify.entry_epoch.on(mine)) + 1;
        s_epoch = epoch;
        __threadfence();  // the read above comes before this block's arrival, so before the last one's update
        int* arrivals = notify.entry_arrivals.on(mine);
        if (atomicAdd(arrivals, 1) == (int)gridDim.x - 1) {
            st_volatile(arrivals, 0);
            st_volatile(notify.entry_epoch.on(mine), epoch);
        }
    }
    __syncthreads();
    const int epoch = s_epoch;
    if (blockIdx.x == 0) {
        zero_ints(at_offset<int>(mine, zero_begin), (zero_end - zero_begin) / 4);
        if (threadIdx.x < kNumRanks)
            write_call_words(
                notify.entry_words.on(buffer_ptrs[threadIdx.x]) + ((epoch & 1) * kMaxNvlRanks + rank) * kCallWords,
                words);
        __syncthreads();
        if (threadIdx.x < kNumRanks) {
            fence_acq_rel_sys();  // the block's zeroes and words before the entry
            st_release_sys(notify.entry.on(buffer_ptrs[threadIdx.x]) + rank, epoch);
        }
    }
    return epoch;
}

// False (for the whole block) on a timeout or a disagreement.
template <int kNumRanks>
__device__ bool wait_direct_call(void** buffer_ptrs, int rank, const CallWords& words, int epoch, const DeviceCtx* ctx,
                                 int kernel) {
    bool ok = true;
    if (threadIdx.x < kNumRanks) {
        const int s = threadIdx.x;
        const NotifyArea notify;
        const int* entry = notify.entry.on(buffer_ptrs[rank]) + s;
        int seen = 0;
        ok = wait_until(
            ctx, WaitSite{kernel, kRoleEntry, -1, s}, [&] { return (seen = ld_acquire_sys(entry)) - epoch >= 0; },
            [&](long long& h, long long& tl, long long& ex) {
                h = seen;
                tl = seen;
                ex = epoch;
            });
        if (ok)
            ok = same_call_words(
                notify.entry_words.on(buffer_ptrs[rank]) + ((epoch & 1) * kMaxNvlRanks + s) * kCallWords, words, ctx,
                kernel, s);
    }
    return __syncthreads_and(ok) != 0;
}

// Zero a layout's ring meta (start/end/head/tail) in my buffer between two barriers, and check that all
// ranks agree about the call. num_tokens >= 0: also tell every peer my token count (notify.num_tokens).
template <int kNumRanks>
__device__ void reset_rings(void** buffer_ptrs, int rank, long long begin, long long meta_end, const CallWords& words,
                            const DeviceCtx* ctx, int kernel, int num_tokens = -1) {
    if (!barrier_block<kNumRanks>(buffer_ptrs, rank, ctx, kernel)) return;
    publish_call_words<kNumRanks>(buffer_ptrs, rank, words);
    if (num_tokens >= 0 && threadIdx.x < kNumRanks)
        NotifyArea().num_tokens.on(buffer_ptrs[threadIdx.x])[rank] = num_tokens;
    zero_ints(at_offset<int>(buffer_ptrs[rank], begin), (meta_end - begin) / 4);
    if (!barrier_block<kNumRanks>(buffer_ptrs, rank, ctx, kernel)) return;
    check_call_words<kNumRanks>(buffer_ptrs, rank, words, ctx, kernel);
}

}  // namespace ep::intranode
