"""Session 20: where the low-latency dispatch's fixed cost goes outside its own stamps. At one rank the *aligned*
timing gives 13.9 us per dispatch (S20H) while the stamps' span (first block start to last stamp) is 9.6 us flushed.
Each round replays one CUDA graph, right after a barrier:

    D(buffer a)  [flush]  zero stamps  clock(0)  D(buffer b, stamped)  clock(1)  twin(0)  clock(2)  twin(1)
    clock(3)  twin(2)  clock(4)  ll_carve_probe  clock(5)  twin(3)  clock(6)  clock(7)

``clock(i)`` is a 1-thread kernel writing %globaltimer into t[i]; ``twin(v)`` is an empty kernel of the dispatch's
shape (132 x 512 threads, 12 KB of static shared memory) stamping each block's start and end; v = 1 ends with the
dispatch's epoch counter (an atomicAdd per block), v = 2 starts with the dispatch's DeviceCtx load, v = 3 ends
with a system-scope fence; ``ll_carve_probe`` (132 x 512) is an almost empty kernel of the low-latency module itself
(relocatable, NVSHMEM-linked), timed clock to clock against twin(0). Per round:
  dispatch: pre = first block start - t0, span = last stamp - first block start, post = t1 - last stamp
  twin:     pre = first block start - t1, span = last block end - first start,   post = t2 - last end
  clock -> clock: t7 - t6 (S20I-S20L ran the version before twin(3) and the probe)
Medians over the rounds, with and without the L2 flush. One rank or more (each rank reports its own). Then the
same pre / span / post for the 24-bit combine (``combine_gap``; added after S20L, not run yet).

    mpirun -n 1 python3 benchmarks/experiments/s20/launch_gap.py [--tokens T]
"""
from __future__ import annotations

import cupy
import numpy as np
from mpi4py import MPI

from cupy_ep import bench, bench_ll, reference

SRC = r'''
extern "C" __device__ __forceinline__ unsigned long long now() {
    unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}
extern "C" __global__ void clock(unsigned long long* t, int i) { t[i] = now(); }
// variant 0: empty; 1: ends as the dispatch did before b5ac501 (every block's thread 0 adds to one counter, the
// last one resets it and bumps an epoch); 2: starts as the dispatch does (thread 0 loads two ints of a struct in
// global memory, shares them through shared memory and a barrier) before its start stamp; 3: thread 0 ends with a
// system-scope fence
extern "C" __global__ void __launch_bounds__(512, 1) twin(unsigned long long* start, unsigned long long* end,
                                                          int variant, int* counter, const int* ctx) {
    __shared__ int pad[3072];  // 12 KB, as the dispatch's static shared memory
    if (variant == 2) {
        if (threadIdx.x == 0) { pad[0] = ctx[0]; pad[1] = ctx[1]; }
        __syncthreads();
    }
    if (threadIdx.x == 0) start[blockIdx.x] = now();
    if (threadIdx.x > 1) pad[threadIdx.x] = threadIdx.x;
    __syncthreads();
    if (threadIdx.x == 0) end[blockIdx.x] = now() + (pad[5] == 7) + (pad[0] == 12345);
    if (variant == 1 && threadIdx.x == 0 && atomicAdd(counter, 1) == (int)gridDim.x - 1) {
        counter[0] = 0;
        counter[1] += 1;
    }
    if (variant == 3 && threadIdx.x == 0) __threadfence_system();  // a system-scope fence on the way out
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
            t = cupy.zeros(8, dtype=cupy.uint64)
            ts, te = cupy.zeros((4, nb), dtype=cupy.uint64), cupy.zeros((4, nb), dtype=cupy.uint64)
            # an empty-ish kernel of the same shape from the low-latency module itself (relocatable, linked with
            # NVSHMEM's device library): does living there cost launch time?
            probe, probe_out = ll.kernel("ep::ll_carve_probe"), cupy.zeros(16, dtype=cupy.int64)
            probe_args = (np.int32(self.M), np.int32(a.hidden), np.int32(self.R), np.int32(a.experts), probe_out)
            counter, ctx = cupy.zeros(2, dtype=cupy.int32), cupy.arange(2, dtype=cupy.int32)
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
                    for v in range(3):
                        twin((nb,), (512,), (ts[v], te[v], np.int32(v), counter, ctx))
                        clock((1,), (1,), (t, np.int32(2 + v)))
                    probe((nb,), (512,), probe_args)
                    clock((1,), (1,), (t, np.int32(5)))
                    twin((nb,), (512,), (ts[3], te[3], np.int32(3), counter, ctx))
                    clock((1,), (1,), (t, np.int32(6)))
                    clock((1,), (1,), (t, np.int32(7)))
                def row():
                    tt = t.get().astype(np.int64)
                    a0, a1 = ts.get().astype(np.int64), te.get().astype(np.int64)
                    out = stamp_gaps(tt, stamps.get())
                    for v, (before, after) in enumerate(((1, 2), (2, 3), (3, 4), (5, 6))):
                        out += [a0[v].min() - tt[before], a1[v].max() - a0[v].min(), tt[after] - a1[v].max()]
                    return out + [tt[5] - tt[4], tt[2] - tt[1], tt[7] - tt[6]]

                def line(m):
                    return (f"dispatch pre {m[0]:.2f} span {m[1]:.2f} post {m[2]:.2f} | " + " | ".join(
                                f"{name} pre {m[3 + 3 * v]:.2f} span {m[4 + 3 * v]:.2f} post {m[5 + 3 * v]:.2f}"
                                for v, name in enumerate(("twin", "twin+atomic end", "twin+ctx start",
                                                          "twin+sys fence end")))
                            + f" | clock to clock around ll_carve_probe {m[15]:.2f}, around twin {m[16]:.2f}"
                            + f" | clock->clock {m[17]:.2f} us")
                self.medians_per_rank(one_round, row, line, flushed)
            self.combine_gap(clock, flush, x, idx)
        self.buf.destroy()

    def combine_gap(self, clock, flush, x, idx):
        """The 24-bit combine between two clocks, from its own stamps (pre / span / post as the dispatch's), with
        the handle of one plain dispatch; a round is D C D [flush] C (the calls alternate the two buffers, so a
        graph holds an even number of them)."""
        a, ll = self.args, self.buf._low_latency()
        rng = np.random.default_rng(7 + self.rank)
        y_np = rng.integers(-8, 9, size=(a.experts // self.R, self.R * self.M, a.hidden)).astype(np.float32)
        y = bench_ll._bf16_dev(y_np.astype(reference.bfloat16))
        w = cupy.asarray(rng.random(idx.shape, dtype=np.float32))
        handle = self.buf.low_latency_dispatch(x, idx, self.M, a.experts, use_fp8=True)[2]
        stamps, t = ll.stamps_of("combine"), cupy.zeros(2, dtype=cupy.uint64)
        cupy.cuda.runtime.deviceSynchronize()
        for flushed in (False, True):
            def one_round():
                self.buf.low_latency_dispatch(x, idx, self.M, a.experts, use_fp8=True)
                self.buf.low_latency_combine(y, idx, w, handle)
                self.buf.low_latency_dispatch(x, idx, self.M, a.experts, use_fp8=True)
                if flushed:
                    flush.fill(1)
                stamps.fill(0)
                clock((1,), (1,), (t, np.int32(0)))
                self.buf.low_latency_combine(y, idx, w, handle)
                clock((1,), (1,), (t, np.int32(1)))
            self.medians_per_rank(one_round, lambda: stamp_gaps(t.get().astype(np.int64), stamps.get()),
                                  lambda m: f"combine pre {m[0]:.2f} span {m[1]:.2f} post {m[2]:.2f} us", flushed)

    def medians_per_rank(self, one_round, row, line, flushed: bool, rounds: int = 60, skip: int = 10):
        """``one_round`` captured in one CUDA graph, replayed ``rounds`` times right after a barrier; ``row()``
        (ns) read after each; every rank's medians past the first ``skip`` rounds logged (us) by ``line``."""
        stream = bench.warm_stream(self.comm, one_round)
        with stream:
            graph = bench.capture_graph(stream, one_round)
        rows = []
        for _ in range(rounds):
            cupy.cuda.runtime.deviceSynchronize()
            self.comm.Barrier()
            graph.launch(stream)
            stream.synchronize()
            rows.append(row())
        med = np.median(np.array(rows[skip:], dtype=np.float64), axis=0) / 1e3
        for r in range(self.R):
            m = self.comm.bcast(med if self.rank == r else None, root=r)
            self.log(f"  rank {r} L2 {'flushed' if flushed else 'warm   '}: {line(m)}")


def stamp_gaps(tt, stamps) -> list:
    """``[pre, span, post]`` ns of a stamped low-latency kernel between clocks ``tt[0]`` and ``tt[1]``: its first
    block's first stamp after the first clock, its last stamp after that, the second clock after its last stamp."""
    s0, s1 = stamps[:, 0][stamps[:, 0] > 0].min(), stamps.max()
    return [s0 - tt[0], s1 - s0, tt[1] - s1]


if __name__ == "__main__":
    import sys
    LaunchGap(bench.parse_args(["--mode", "low-latency", "--tokens", "128"] + sys.argv[1:]), MPI.COMM_WORLD).run()
