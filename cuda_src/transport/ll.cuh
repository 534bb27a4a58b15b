// transport/ll.cuh: how the low-latency kernels reach a peer they cannot store to. low_latency.cu stores straight
// into every peer whose buffer is mapped in this process (peer_bases[pe] != 0) and calls these for the others.
// Two builds of low_latency.cu, chosen by the host (cupy_ep/cuda/low_latency.py, Buffer(low_latency_transport=)):
//
//   NVSHMEM  (-DCUPY_EP_NVSHMEM; relocatable, linked with the wheel's libnvshmem_device.a by jit.py): the buffer is
//            NVSHMEM symmetric memory; NVLink peers are mapped (nvshmem_ptr), the others get these puts.
//   CUDA IPC (no define; no NVSHMEM header, not relocatable): the buffer is a cudaMalloc opened by every rank of
//            one node over CUDA IPC, so every peer is mapped and these are never called. They trap: reaching one
//            means the host passed a table with a 0 entry, a bug, and a trap ends the kernel instead of letting
//            it write through a null base (no wait is involved, so nothing can hang on it).
//
//   ll_put_int / ll_put_longlong(dst, value, pe)   one thread: a signal word at dst (an address of this PE's
//                                                  symmetric buffer) on PE pe
//   ll_put_warp(dst, src, bytes, pe)               warp-collective, non-blocking: bytes of local src to dst on pe
//   ll_quiet()                                     one thread: this PE's earlier puts have completed
//   ll_barrier_all_block()                         block-collective barrier over all PEs (clean_low_latency_buffer,
//                                                  the NVSHMEM link probe; NVSHMEM build only)
#pragma once

#ifdef CUPY_EP_NVSHMEM
#include "transport/nvshmem.cuh"

namespace ep {
__device__ __forceinline__ void ll_put_int(int* dst, int value, int pe) { nvshmem_int_p(dst, value, pe); }
__device__ __forceinline__ void ll_put_longlong(long long* dst, long long value, int pe) {
    nvshmem_longlong_p(dst, value, pe);
}
__device__ __forceinline__ void ll_put_warp(void* dst, const void* src, size_t bytes, int pe) {
    nvshmemx_putmem_nbi_warp(dst, src, bytes, pe);
}
__device__ __forceinline__ void ll_quiet() { nvshmem_quiet(); }
__device__ __forceinline__ void ll_barrier_all_block() { nvshmemx_barrier_all_block(); }
}  // namespace ep

#else

namespace ep {
__device__ __forceinline__ void ll_put_int(int*, int, int) { __trap(); }
__device__ __forceinline__ void ll_put_longlong(long long*, long long, int) { __trap(); }
__device__ __forceinline__ void ll_put_warp(void*, const void*, size_t, int) { __trap(); }
__device__ __forceinline__ void ll_quiet() { __trap(); }
}  // namespace ep

#endif
