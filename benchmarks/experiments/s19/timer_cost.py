"""What a phase stamp costs (prepared in session 19, not run): the low-latency kernels' stamps read %globaltimer
and store it; S19D-F's diagnostic stamps put 0.3-1.0 us between stamps a few dozen ALU instructions apart, so a
stamp itself may be slow. This measures, in a grid shaped like the dispatch (132 x 512 threads, one block per SM),
the cycles per read of %globaltimer and of %clock64 (a dependent chain of reads by lane 0 of every warp, or of one
warp per block), per read + a global store (a stamp), and the SM clock over a spin (clock64 cycles per
globaltimer ns), so a future stamps build can choose clock64 deltas anchored by one %globaltimer read.

    python3 benchmarks/experiments/s19/timer_cost.py      (one GPU; no MPI)
"""
from __future__ import annotations

import numpy as np

import cupy

SOURCE = r"""
extern "C" __global__ void timer_cost(long long* out, int n, int which, int warps_reading) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane != 0 || warp >= warps_reading) return;
    long long acc = 0;
    long long* slot = out + ((long long)blockIdx.x * 32 + warp) * 4;
    __syncwarp();
    long long c0 = clock64(), g0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g0));
    for (int i = 0; i < n; ++i) {
        long long t;
        if (which == 0) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        else if (which == 1) t = clock64();
        else { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); slot[3] = t + acc; }
        acc += t & 1;
    }
    long long c1 = clock64(), g1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g1));
    slot[0] = c1 - c0;
    slot[1] = g1 - g0;
    slot[2] = acc;
    if (which == 0) {  // the timer's step: the smallest nonzero difference between two consecutive reads
        long long prev, step = 1LL << 62;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(prev));
        for (int i = 0; i < n; ++i) {
            long long t;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
            if (t != prev && t - prev < step) step = t - prev;
            prev = t;
        }
        slot[2] = step;
    }
}
"""


def main():
    kernel = cupy.RawKernel(SOURCE, "timer_cost")
    blocks = cupy.cuda.Device().attributes["MultiProcessorCount"]
    out = cupy.zeros((blocks, 32, 4), dtype=cupy.int64)
    n = 1000
    names = {0: "globaltimer", 1: "clock64", 2: "globaltimer + store (a stamp)"}
    for warps in (16, 1):
        for which in (0, 1, 2):
            for _ in range(3):  # warm-up, then the last one counts
                out.fill(0)
                kernel((blocks,), (512,), (out, np.int32(n), np.int32(which), np.int32(warps)))
                cupy.cuda.runtime.deviceSynchronize()
            o = out.get()[:, :warps]
            cycles, ns = o[..., 0].ravel(), o[..., 1].ravel()
            step = f"; smallest step between two reads {o[..., 2].min()} ns" if which == 0 else ""
            print(f"{names[which]:30s} warps reading per block {warps:2d}: {np.median(cycles) / n:8.1f} cycles "
                  f"per read, {np.median(ns) / n:7.1f} ns per read (median over warps; max "
                  f"{cycles.max() / n:.1f} cycles){step}")
    # the SM clock during a spin: clock64 cycles per globaltimer ns over ~20 us
    out.fill(0)
    kernel((blocks,), (512,), (out, np.int32(20000), np.int32(1), np.int32(16)))
    cupy.cuda.runtime.deviceSynchronize()
    o = out.get()[:, :16]
    ghz = o[..., 0].ravel() / np.maximum(o[..., 1].ravel(), 1)
    print(f"SM clock while spinning: median {np.median(ghz):.3f} GHz (min {ghz.min():.3f}, max {ghz.max():.3f})")


if __name__ == "__main__":
    main()
