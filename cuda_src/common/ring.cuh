// common/ring.cuh: the ring protocol, written once. A ring is num_slots slots and two monotonic int counters;
// counter c is slot c % num_slots.
//   producer: wait until num_slots - (tail - head) >= n (head loaded volatile: the consumer returns it with a
//             release), write the slots, release the new tail
//   consumer: acquire the tail, read the slots, return the head (release: the reads are done before the slots
//             may be overwritten)
// The NVLink rings release both counters with st.release.sys (ring_release). The RDMA rings of the internode path
// publish their tail and return their head through the transport instead (fence + atomic add:
// internode/rdma_ring.cuh, the coordinators); their waits are these.
// Waits go through the one timed wait (common/wait.cuh) as one thread or as a warp (WaitBy): a lane with no ring
// to wait for (active = false) votes idle_lane_vote().
#pragma once
#include "common/ptx.cuh"
#include "common/wait.cuh"

namespace ep {

// Publish a ring counter (a tail after the slots' stores, a head after the slots' reads).
__device__ __forceinline__ void ring_release(int* counter, int value) { st_release_sys(counter, value); }

// The producer's view of one ring. kHeadFloor: the counters start at head_floor, not 0 (a head still 0 means
// nothing returned yet).
template <bool kHeadFloor = false>
struct RingProducer {
    int* tail;        // the consumer's tail word (NVLink rings: released here)
    const int* head;  // the head word the consumer returns
    int num_slots;
    int head_floor = 0;

    __device__ __forceinline__ bool has_space(int tail_now, int head_seen, int n) const {
        return num_slots - (tail_now - head_seen) >= n;
    }
    __device__ __forceinline__ int load_head() const {
        return kHeadFloor ? max(ld_volatile(head), head_floor) : ld_volatile(head);
    }
    // Until n slots after tail_now are free. head_seen: the head as last loaded (updated). kSeenFirst: test head_seen
    // before the first reload (a producer that keeps it across waits saves loads); false: reload on every poll (the
    // internode combine's producers: there the extra test costs the loops registers).
    template <int kBy = kByThread, bool kSeenFirst = true, typename Observe>
    __device__ __forceinline__ bool wait_for_space(const DeviceCtx* ctx, WaitSite site, int tail_now, int& head_seen,
                                                   int n, Observe observe, bool active = true) const {
        return wait_by<kBy>(
            ctx, site,
            [&] {
                if (!active) return idle_lane_vote<kBy>();
                if (kSeenFirst && has_space(tail_now, head_seen, n)) return true;
                head_seen = load_head();
                return has_space(tail_now, head_seen, n);
            },
            observe);
    }
    __device__ __forceinline__ void release(int tail_now) const { ring_release(tail, tail_now); }
};

// The consumer's view of one ring.
struct RingConsumer {
    const int* tail;  // the tail word the producer releases
    int* head;        // the producer's head word (NVLink rings: returned here)

    __device__ __forceinline__ int acquire_tail() const { return ld_acquire_sys(tail); }
    // Until the tail reaches `need` (acquire: the slots below it are visible). tail_seen: the tail as last loaded.
    template <int kBy = kByThread, typename Observe>
    __device__ __forceinline__ bool wait_for_data(const DeviceCtx* ctx, WaitSite site, int need, int& tail_seen,
                                                  Observe observe, bool active = true) const {
        return wait_by<kBy>(
            ctx, site,
            [&] {
                if (!active) return idle_lane_vote<kBy>();
                return (tail_seen = acquire_tail()) >= need;
            },
            observe);
    }
    __device__ __forceinline__ void release(int head_now) const { ring_release(head, head_now); }
};

}  // namespace ep
