"""A/B of low-latency dispatch kernels at one rank (S19; one H200 lent): the benchmark's verification against the
reference, then only the dispatch's graph and steady timings (no NCCL) and its phase stamps, warm and L2 flushed.
Run once per source tree (PYTHONPATH picks the tree; its own CUPY_EP_CACHE_DIR keeps the builds apart):

    mpirun -n 1 python3 benchmarks/experiments/s19/ll_ab.py [--tokens 128] [--iters 200]
"""
from __future__ import annotations

import sys

from mpi4py import MPI

from cupy_ep import bench, bench_ll


class DispatchAB(bench_ll.LowLatencyBench):
    def run(self):
        import cupy
        a = self.args
        with cupy.cuda.Device(self.buf.device_id):
            x_np, idx_np, w_np = self.inputs(a.tokens)
            x, idx, w = bench_ll._bf16_dev(x_np), cupy.asarray(idx_np), cupy.asarray(w_np)
            import numpy as np
            from cupy_ep import reference
            L = a.experts // self.R
            rng = np.random.default_rng(99 + self.rank)
            y_np = rng.integers(-8, 9, size=(L, self.R * self.M, a.hidden)).astype(np.float32).astype(reference.bfloat16)
            y = bench_ll._bf16_dev(y_np)
            out = self.buf.low_latency_dispatch(x, idx, self.M, a.experts, use_fp8=True)
            combined, _, _ = self.buf.low_latency_combine(y, idx, w, out[2])
            combined_bf16p, _, _ = self.buf.low_latency_combine(y, idx, w, out[2], bf16_partials=True)
            cupy.cuda.runtime.deviceSynchronize()
            self.verify(x_np, idx_np, w_np, out[:3], combined, y_np, combined_bf16p)
            timer = bench_ll.LatencyTimer(self.comm, a.iters, a.warmup)
            fn = lambda: self.buf.low_latency_dispatch(x, idx, self.M, a.experts, use_fp8=True)
            runs = {"ll_dispatch": (fn, None, "fp8")}
            self.time_ops(timer, runs, a.tokens, ("graph", "steady"), with_nccl=False)
            self.host_overhead(runs, a.tokens)
            self.phases(runs, a.tokens)
            self.phases(runs, a.tokens, flush=timer.flush)
        self.buf.destroy()


if __name__ == "__main__":
    argv = sys.argv[1:]
    if not any(a.startswith("--tokens") for a in argv):
        argv += ["--tokens", "128"]  # (cupy_ep.bench.main's low-latency default; parse_args keeps 4096)
    args = bench.parse_args(["--mode", "low-latency", "--ll-stamps"] + argv)
    args.iters = max(args.iters, 200)
    DispatchAB(args, MPI.COMM_WORLD).run()
