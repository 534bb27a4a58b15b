"""Session 20: why did branch s19-prologue's dispatch time worse under graph replay (16.1 / 17.0 us against 14.7 /
14.8, S20A) while its stamps' kernel end was 0.4 us earlier? The benchmark's *graph* timing records the start event
on an idle stream and then calls cudaGraphLaunch, so the host's submission latency falls inside the timed span.
This times the dispatch (fp8, 128 tokens, one rank or more) three ways, 1000 replays each, L2 flushed before each:

  graph2   the benchmark's: 2 dispatches per replay, start event on an idle stream, / 2
  graph20  20 dispatches per replay, / 20 (the submission latency spread over 20 ops; no flush between them)
  queued2  2 dispatches per replay behind a 30 us spin kernel: the replay is queued before the start event fires,
           so the span is the device's alone (the dispatch following a model's kernel, as in a decode step), / 2

and prints p10 / p50 / p90 / p99 of each. Run once per tree (PYTHONPATH picks it):

    mpirun -n 1 python3 benchmarks/experiments/s20/graph_ab.py
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from cupy_ep import bench, bench_ll

SPIN = r'''
extern "C" __global__ void spin(long long ns) {
    long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}'''


def pct(a) -> str:
    return " / ".join(f"{np.percentile(a, q):5.1f}" for q in (10, 50, 90, 99))


class GraphAB(bench_ll.LowLatencyBench):
    def queued(self, timer, fn, per_replay=2, spin_ns=30_000):
        import cupy
        spin = cupy.RawKernel(SPIN, "spin")
        def ops():
            for _ in range(per_replay):
                fn()
        stream = bench.warm_stream(self.comm, ops)
        with stream:
            graph = bench.capture_graph(stream, ops)
        times = []
        for i in range(timer.warmup + timer.iters):
            timer.flush.fill(i & 0xff)
            cupy.cuda.runtime.deviceSynchronize()
            self.comm.Barrier()
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            spin((1,), (1,), (np.int64(spin_ns),), stream=stream)
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
            end.synchronize()
            if i >= timer.warmup:
                times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / per_replay)
        return np.max(np.array(self.comm.allgather(times)), axis=0)

    def run(self):
        import cupy
        a = self.args
        with cupy.cuda.Device(self.buf.device_id):
            x_np, idx_np, _ = self.inputs(a.tokens)
            x, idx = bench_ll._bf16_dev(x_np), cupy.asarray(idx_np)
            fn = lambda: self.buf.low_latency_dispatch(x, idx, self.M, a.experts, use_fp8=True)
            timer = bench_ll.LatencyTimer(self.comm, 1000, 50)
            self.log("  ll_dispatch p10 / p50 / p90 / p99 us per op")
            for name, n in (("graph2", 2), ("graph20", 20)):
                timer.graph(fn, n)
                self.log(f"  {name:8s} {pct(timer.last)}")
            self.log(f"  {'queued2':8s} {pct(self.queued(timer, fn))}")
        self.buf.destroy()


if __name__ == "__main__":
    args = bench.parse_args(["--mode", "low-latency", "--tokens", "128"])
    GraphAB(args, MPI.COMM_WORLD).run()
