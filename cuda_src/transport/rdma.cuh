// transport/rdma.cuh: the RDMA-domain transport of the internode kernels, one small device interface with two
// implementations chosen at compile time (a template parameter of every internode kernel):
//
//   put_warp(dst_offset, src, bytes, pe)  warp-collective: copy `bytes` (multiple of 16) of local memory `src` to
//                                         byte offset dst_offset of PE pe's RDMA buffer (non-blocking)
//   add(dst_offset, value, pe)            one thread: atomic add of an int at dst_offset on PE pe
//   fence()                               one thread: this PE's earlier puts to a PE land before its later
//                                         add to the same PE (a tail signal never overtakes its data); also a
//                                         system-scope memory fence (both transports), which the direct path
//                                         below relies on
//   quiet()                               one thread: every earlier put / add of this PE has completed
//   direct(offset, pe)                    the address at which this GPU reaches byte `offset` of PE pe's RDMA
//                                         buffer by plain loads / stores, or nullptr when only puts reach it
//
// Offsets are from the base of the RDMA buffer, which has the same layout on every PE (common/layout.cuh). PE = node
// index: the RDMA domain of a rank is the ranks with its GPU index, one per node.
//
// Direct path: where direct() is not null (always with IpcRdma; with NVSHMEM when nvshmem_ptr() maps the peer,
// i.e. the same box over NVLink) the kernels' many data warps store a ring slot straight into the peer's receive
// half and the one put-issuing warp only signals the tail (fence + add), as they do for their own node. A put
// here would be a synchronous copy by that one warp (IPC stores; NVSHMEM's P2P transport is a warp memcpy too),
// which caps a channel at one warp's copy rate. Over a real NIC direct() is null and the put is asynchronous
// hardware work. The host passes a table without direct addresses in force_put mode
// (CUPY_EP_INTERNODE_FORCE_PUT=1), so the put path stays testable on one box.
//
//   IpcRdma      CUDA-IPC stores into a table of peer base pointers: for testing several "nodes" on one box
//                (2 nodes x 2 ranks on 2 GPUs). No NVSHMEM header, so its instantiations compile without -rdc.
//   NvshmemRdma  NVSHMEM device API (the path for real clusters; over NVLink on one box when
//                NVSHMEM_REMOTE_TRANSPORT=none). Only defined when compiled with -DCUPY_EP_NVSHMEM, which
//                cupy_ep/jit.py pairs with -rdc and the link against libnvshmem_device.a.
// Nothing else differs between the two: the kernels see only this interface.
#pragma once
#include "common/warp.cuh"
#include "common/layout.cuh"  // kMaxRdmaRanks

namespace ep {

// What a kernel gets from the host: its own base address (NVSHMEM: the symmetric address), the peer table and its
// PE index. peer_bases is uint64 [2][kMaxRdmaRanks] (cupy_ep/cuda/internode.py, rdma_peer_table):
//   [0][pe]  where puts and adds to PE pe write: pe's buffer as mapped in this process (IPC; NVSHMEM: unused, 0)
//   [1][pe]  pe's buffer as reachable by loads / stores from this GPU, or 0 when only puts reach it (IPC: as row 0;
//            NVSHMEM: nvshmem_ptr); all 0 in force_put mode
struct RdmaArgs {
    char* base;
    const unsigned long long* peer_bases;
    int pe;
};

__device__ __forceinline__ char* rdma_direct(const RdmaArgs& a, long long offset, int pe) {
    const unsigned long long peer = __ldg(a.peer_bases + kMaxRdmaRanks + pe);  // the table is constant in a launch
    return peer != 0 ? reinterpret_cast<char*>(peer) + offset : nullptr;
}

// Ranks sharing a GPU (the 2 nodes x 2 ranks tests on one or two GPUs): every spin-wait in the internode kernels
// then depends on the other process's kernel running concurrently (time slicing or CUDA MPS), as the intranode
// kernels' waits do at 4 ranks on 2 GPUs.
struct IpcRdma {
    RdmaArgs a;
    __device__ explicit IpcRdma(RdmaArgs args) : a(args) {}
    // Row 0 of the table: where puts and adds go (filled in force_put mode too).
    __device__ char* remote(long long offset, int pe) const {
        return reinterpret_cast<char*>(a.peer_bases[pe]) + offset;
    }
    __device__ char* direct(long long offset, int pe) const { return rdma_direct(a, offset, pe); }
    __device__ void put_warp(long long dst_offset, const void* src, long long bytes, int pe) const {
        int4* dst = reinterpret_cast<int4*>(remote(dst_offset, pe));
        // src was written by other warps of this block (made visible by the caller's fence): L2 loads, four in
        // flight per lane (as internode's copies) instead of one: a put is latency-bound otherwise.
        warp_copy<true, 4>(dst, static_cast<const int4*>(src), bytes / 16);
    }
    __device__ void add(long long dst_offset, int value, int pe) const {
        atomicAdd_system(reinterpret_cast<int*>(remote(dst_offset, pe)), value);
    }
    // The put's stores were made by the whole warp; the caller runs __syncwarp() first, and a system-scope
    // fence is cumulative over what this thread observed through it.
    __device__ void fence() const { __threadfence_system(); }
    __device__ void quiet() const { __threadfence_system(); }
};

}  // namespace ep

#ifdef CUPY_EP_NVSHMEM
#include "transport/nvshmem.cuh"

namespace ep {

struct NvshmemRdma {
    RdmaArgs a;
    __device__ explicit NvshmemRdma(RdmaArgs args) : a(args) {}
    // nvshmem_ptr(), looked up by the host (device code could ask nvshmem_ptr too, but the host table is what
    // force_put switches off)
    __device__ char* direct(long long offset, int pe) const { return rdma_direct(a, offset, pe); }
    __device__ void put_warp(long long dst_offset, const void* src, long long bytes, int pe) const {
        nvshmemx_putmem_nbi_warp(a.base + dst_offset, src, (size_t)bytes, pe);
    }
    __device__ void add(long long dst_offset, int value, int pe) const {
        nvshmem_int_atomic_add(reinterpret_cast<int*>(a.base + dst_offset), value, pe);
    }
    // nvshmem_fence() ends with __threadfence_system() (NVSHMEM 3.x: "for data visibility in case of intra-node
    // GPU transfers"), so it is also the system-scope fence the direct path needs before the add.
    __device__ void fence() const { nvshmem_fence(); }
    __device__ void quiet() const { nvshmem_quiet(); }
};

}  // namespace ep
#endif
