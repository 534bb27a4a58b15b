// low_latency.cu: the low-latency (decode) path on NVSHMEM symmetric memory (issue 6; in progress).
//
// So far: clean_low_latency_buffer, which zeroes the two signal regions of the double-buffered layout
// between two NVSHMEM barriers (every rank must have left its previous low-latency kernel before any
// signal is reset, and every reset must be done before any rank signals again).
#include "common.cuh"
#include "nvshmem.cuh"

namespace ep {

__global__ void clean_low_latency_buffer(int* signals0, int num_signals0, int* signals1, int num_signals1) {
    nvshmemx_barrier_all_block();
    for (int i = threadIdx.x; i < num_signals0; i += blockDim.x) signals0[i] = 0;
    for (int i = threadIdx.x; i < num_signals1; i += blockDim.x) signals1[i] = 0;
    nvshmemx_barrier_all_block();
}

}  // namespace ep
