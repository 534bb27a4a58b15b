// internode/handshake.cuh: the NVLink and RDMA barriers, the call agreement, the notify vectors' puts.
#pragma once
#include "common/wait.cuh"
#include "common/warp.cuh"
#include "common/layout.cuh"
#include "internode/roles.cuh"

namespace ep::internode {

// ---------------------------------------------------------------------------------------------------
// Barriers. NVLink domain: the intranode scheme (own slot +1, peer's slot -1, wait <= 0) on the signals at the
// start of every node peer's NVLink buffer. RDMA domain: arrivals[i] is only ever added to by PE i (remote
// atomics through a NIC are not atomic with the GPU's own atomics), my epoch counts my own barriers; wait
// until every arrivals[i] reaches my epoch. Both reusable without reset. False (block-wide) on timeout.
// ---------------------------------------------------------------------------------------------------
template <int kNumNvlRanks>
__device__ bool nvl_barrier(void** nvl_ptrs, int nvl_rank, const DeviceCtx* ctx, int kernel) {
    __syncthreads();
    bool ok = true;
    const int i = threadIdx.x;
    if (i < kNumNvlRanks) {
        fence_acq_rel_sys();
        int* mine = barrier_signals(nvl_ptrs[nvl_rank]) + i;
        atomicAdd_system(mine, 1);
        atomicSub_system(barrier_signals(nvl_ptrs[i]) + nvl_rank, 1);
        ok = wait_until(
            ctx, WaitSite{kernel, kRoleNvlBarrier, -1, i}, [&] { return ld_volatile(mine) <= 0; },
            [&](long long& h, long long& t, long long& e) {
                h = ld_volatile(mine);
                e = 0;
            });
        fence_acq_rel_sys();
    }
    return __syncthreads_and(ok) != 0;
}

template <int kNumRdmaRanks, typename Rdma>
__device__ bool rdma_barrier(const Rdma& rdma, int node, const DeviceCtx* ctx, int kernel) {
    __shared__ int s_epoch;
    __syncthreads();
    int* arrivals = reinterpret_cast<int*>(rdma.a.base);  // InternodeRdmaNotify::barrier is at offset 0
    if (threadIdx.x == 0) {
        s_epoch = ld_volatile(arrivals + kMaxRdmaRanks) + 1;
        st_volatile(arrivals + kMaxRdmaRanks, s_epoch);
    }
    __syncthreads();
    bool ok = true;
    const int i = threadIdx.x;
    if (i < kNumRdmaRanks) {
        rdma.quiet();  // this thread's earlier RDMA traffic has landed (callers quiet their own puts too)
        fence_acq_rel_sys();
        rdma.add(4LL * node, 1, i);
        const int epoch = s_epoch;
        ok = wait_until(
            ctx, WaitSite{kernel, kRoleRdmaBarrier, -1, i}, [&] { return ld_volatile(arrivals + i) >= epoch; },
            [&](long long& h, long long& t, long long& e) {
                h = ld_volatile(arrivals + i);
                e = epoch;
            });
        fence_acq_rel_sys();
    }
    return __syncthreads_and(ok) != 0;
}

template <int kNumRdmaRanks, int kNumNvlRanks, typename Rdma>
__device__ bool both_barriers(const Rdma& rdma, void** nvl_ptrs, int node, int nvl_rank, const DeviceCtx* ctx,
                              int kernel) {
    if (!rdma_barrier<kNumRdmaRanks>(rdma, node, ctx, kernel)) return false;
    return nvl_barrier<kNumNvlRanks>(nvl_ptrs, nvl_rank, ctx, kernel);
}

__device__ __forceinline__ void zero_range(void* base, long long begin, long long end) {
    int* p = at_offset<int>(base, begin);
    for (long long i = threadIdx.x; i < (end - begin) / 4; i += blockDim.x) p[i] = 0;
}

// Call agreement (as intranode.cu): the words ride at the start of the notify vectors; every rank compares
// those of its RDMA peers and of its node peers with its own. A difference stops the buffer with a
// kRoleCallCheck record (peer = the global rank that disagreed). The first word is an InternodeCallOp
// (common/ids.cuh, from cupy_ep/ids.py).

__device__ bool check_words(const int* theirs, const int* mine, int peer, const DeviceCtx* ctx, int kernel) {
    bool ok = true;
    for (int k = 0; k < kCallWords; ++k) {
        const int v = ld_volatile(theirs + k);
        if (v != mine[k]) {
            ok = false;
            report_failure(ctx, WaitSite{kernel, kRoleCallCheck, -1, peer}, mine[k], v, k, 0);
        }
    }
    return ok;
}

// Puts the first `ints` of my send-half vector for every node into that node's receive half (slot = my node);
// the own node's vector was written straight into the receive half. Warp w serves nodes w, w + W, ...
template <int kNumRdmaRanks, typename Rdma>
__device__ void put_notify_vectors(const Rdma& rdma, const SymBuffer<int>& counts, int node, int ints) {
    const int num_warps = blockDim.x / kWarpSize;
    const long long bytes = align_up(4LL * ints, 16);
    bool put = false;
    for (int n = warp_id(); n < kNumRdmaRanks; n += num_warps) {
        if (n == node) continue;
        rdma.put_warp(offset_in(rdma.a.base, counts.recv(rdma.a.base, 0, node)), counts.send(rdma.a.base, 0, n), bytes,
                      n);
        put = true;
    }
    __syncwarp();
    if (put && lane_id() == 0) rdma.quiet();
}

}  // namespace ep::internode
