"""Session 20: where the low-latency dispatch's fixed cost goes outside its own stamps. At one rank the *aligned*
timing gives 13.9 us per dispatch (S20H) while the stamps' span (first block start to last stamp) is 9.6 us flushed.
Each round replays one CUDA graph, right after a barrier:

    D(buffer a)  [flush]  zero stamps  clock(0)  D(buffer b, stamped)  clock(1)  twin  clock(2)  clock(3)

``clock(i)`` is a 1-thread kernel writing %globaltimer into t[i]; ``twin`` is an empty kernel of the dispatch's
shape (132 x 512 threads, 12 KB of static shared memory) stamping each block's start and end. Per round:
  dispatch: pre = first block start - t0, span = last stamp - first block start, post = t1 - last stamp
  twin:     pre = first block start - t1, span = last block end - first start,   post = t2 - last end
  clock -> clock: t3 - t2
Medians over the rounds, with and without the L2 flush. One rank or more (each rank reports its own).

    mpirun -n 1 python3 benchmarks/experiments/s20/launch_gap.py [--tokens T]
"""
from __future__ import annotations

import cupy
import numpy as np
from mpi4py import MPI

from cupy_ep import bench, bench_ll

SRC = r'''
extern "C" __device__ __forceinline__ unsigned long long now() {
    unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}
extern "C" __global__ void clock(unsigned long long* t, int i) { t[i] = now(); }
extern "C" __global__ void __launch_bounds__(512, 1) twin(unsigned long long* start, unsigned long long* end) {
    __shared__ int pad[3072];  // 12 KB, as the dispatch's static shared memory
    if (threadIdx.x == 0) start[blockIdx.x] = now();
    pad[threadIdx.x] = threadIdx.x;
    __syncthreads();
    if (threadIdx.x == 0) end[blockIdx.x] = now() + (pad[5] == 7);
}'''


class LaunchGap(bench_ll.LowLatencyBench):
    def run(self):
        a = self.args
        mod = cupy.RawModule(code=SRC)
        clock, twin = mod.get_function("clock"), mod.get_function("twin")
        with cupy.cuda.Device(self.buf.device_id):
            x_np, idx_np, _ = self.inputs(a.tokens)
            x, idx = bench_ll._bf16_dev(x_np), cupy.asarray(idx_np)
            ll = self.buf._low_latency()
            ll.enable_stamps()
            stamps = ll.stamps_of("dispatch")
            nb = ll.num_blocks
            t = cupy.zeros(4, dtype=cupy.uint64)
            ts, te = cupy.zeros(nb, dtype=cupy.uint64), cupy.zeros(nb, dtype=cupy.uint64)
            flush = cupy.empty(256 << 20, dtype=cupy.uint8)
            fn = lambda: self.buf.low_latency_dispatch(x, idx, self.M, a.experts, use_fp8=True)  # noqa: E731
            cupy.cuda.runtime.deviceSynchronize()
            for flushed in (False, True):
                def one_round():
                    fn()
                    if flushed:
                        flush.fill(1)
                    stamps.fill(0)
                    clock((1,), (1,), (t, np.int32(0)))
                    fn()
                    clock((1,), (1,), (t, np.int32(1)))
                    twin((nb,), (512,), (ts, te))
                    clock((1,), (1,), (t, np.int32(2)))
                    clock((1,), (1,), (t, np.int32(3)))
                stream = bench.warm_stream(self.comm, one_round)
                with stream:
                    graph = bench.capture_graph(stream, one_round)
                rows = []
                for _ in range(60):
                    cupy.cuda.runtime.deviceSynchronize()
                    self.comm.Barrier()
                    graph.launch(stream)
                    stream.synchronize()
                    tt, st = t.get().astype(np.int64), stamps.get()
                    s0 = st[:, 0][st[:, 0] > 0].min()
                    s1 = st.max()
                    a0, a1 = ts.get().astype(np.int64), te.get().astype(np.int64)
                    rows.append((s0 - tt[0], s1 - s0, tt[1] - s1, a0.min() - tt[1], a1.max() - a0.min(),
                                 tt[2] - a1.max(), tt[3] - tt[2]))
                med = np.median(np.array(rows[10:], dtype=np.float64), axis=0) / 1e3
                for r in range(self.R):
                    line = self.comm.bcast(med if self.rank == r else None, root=r)
                    self.log(f"  rank {r} L2 {'flushed' if flushed else 'warm   '}: dispatch pre {line[0]:.2f} span "
                             f"{line[1]:.2f} post {line[2]:.2f} | twin pre {line[3]:.2f} span {line[4]:.2f} post "
                             f"{line[5]:.2f} | clock->clock {line[6]:.2f} us")
        self.buf.destroy()


if __name__ == "__main__":
    import sys
    LaunchGap(bench.parse_args(["--mode", "low-latency", "--tokens", "128"] + sys.argv[1:]), MPI.COMM_WORLD).run()
