// common/lock.cuh: a shared-memory spin lock for the threads of one block, written once.
#pragma once
#include "common/wait.cuh"

namespace ep {

// One shared word, 0 = free, 1 = held. acquire: compare-and-swap 0 -> 1 inside the one timed wait (a failed
// acquire reports expected = -2 and returns false: the caller must not touch what the lock guards), then a
// block fence, so that what the previous holder wrote before its release is visible (acquire semantics).
// release: a block fence, so that this holder's writes are visible before the word reads free (release
// semantics), then exchange to 0.
struct SharedLock {
    int* word;

    __device__ __forceinline__ bool acquire(const DeviceCtx* ctx, WaitSite site) const {
        if (!wait_until(
                ctx, site, [&] { return atomicCAS_block(word, 0, 1) == 0; },
                [&](long long&, long long&, long long& expected) { expected = -2; }))
            return false;
        __threadfence_block();
        return true;
    }
    __device__ __forceinline__ void release() const {
        __threadfence_block();
        atomicExch_block(word, 0);
    }
};

}  // namespace ep
