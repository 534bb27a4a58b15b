// internode/rdma_ring.cuh: the RDMA rings' three paths (own node, direct stores, puts).
#pragma once
#include "common/wait.cuh"
#include "common/warp.cuh"
#include "common/layout.cuh"

namespace ep::internode {

// Where the producer of node n's RDMA ring (dispatch: the sender warps; combine: forwarder warp n) writes it, ring
// [channel] of `data` (a SymBuffer of the RDMA carve):
//   own node                                 my receive half [channel][node], where the consumers read it
//   stores reach node n (Rdma::direct)       node n's receive half [channel][my node], the same slot: the
//                                            put-issuing warp only signals the tail
//   otherwise                                my send half [channel][n], which the put-issuing warp puts to that
//                                            same place in chunks (rdma_needs_put)
// Slot i is at the result + i * token int4s on every path, and every path is throttled by the same head: the
// consumer returns a slot after reading it in its receive half, so a slot is free on both halves at once.
template <typename Rdma>
__device__ __forceinline__ int4* rdma_ring_for(const Rdma& rdma, const SymBuffer<int4>& data, int channel, int node,
                                               int n) {
    int4* landing = data.recv(rdma.a.base, channel, node);
    if (n == node) return landing;
    char* peer = rdma.direct(offset_in(rdma.a.base, landing), n);
    return peer != nullptr ? reinterpret_cast<int4*>(peer) : data.send(rdma.a.base, channel, n);
}
template <typename Rdma>
__device__ __forceinline__ bool rdma_needs_put(const Rdma& rdma, int node, int n) {
    return n != node && rdma.direct(0, n) == nullptr;
}

// Hand `count` slots of the ring (channel, node -> n) from slot `first` on to node n (warp-collective): where
// n is not load/store reachable, put them from my send half to the same place in n's receive half; then lane
// 0 orders everything with rdma.fence() (system scope) and adds count to n's tail, which the consumer
// acquires. The caller orders the slots' own stores before this (fence_acq_rel_sys + __syncwarp).
template <typename Rdma>
__device__ __forceinline__ void rdma_publish_slots(const Rdma& rdma, const SymBuffer<int4>& data,
                                                   const AsymBuffer<int>& tail, int channel, int node, int n, int first,
                                                   int count, int token_int4s, int token_bytes) {
    if (rdma_needs_put(rdma, node, n))
        rdma.put_warp(offset_in(rdma.a.base, data.recv(rdma.a.base, channel, node) + (long long)first * token_int4s),
                      data.send(rdma.a.base, channel, n) + (long long)first * token_int4s, token_bytes * count, n);
    __syncwarp();
    if (lane_id() == 0) {
        rdma.fence();
        rdma.add(offset_in(rdma.a.base, tail.on(rdma.a.base, channel, node)), count, n);
    }
}

}  // namespace ep::internode
