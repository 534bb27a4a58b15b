"""``python -m cupy_ep.bench --mode low-latency``: low-latency (decode) dispatch and combine latency.

Defaults follow the issue: 128 tokens per rank, hidden 7168, top-8 of 256 experts, FP8 dispatch, BF16 combine.
Per op: median and p99 over ``--iters`` (>= 200) iterations, as plain calls (CUDA events around the Python call)
and under CUDA-graph replay (device time), with NCCL grouped send/recv of the same per-peer bytes measured in
the same run. Results are verified against :mod:`cupy_ep.reference` before any timing (a mismatch aborts).
Records are written to ``<out>/bench_ll_gpu_ep<R>.json`` and ``.md``.
"""
from __future__ import annotations


import numpy as np

import cupy_ep
from cupy_ep import Buffer, reference
from cupy_ep import config as cfgmod
from cupy_ep.bench import GpuTimer, NcclAllToAll, write_report


class LatencyTimer(GpuTimer):
    """GpuTimer; its ``last`` holds the per-iteration times (slowest rank per iteration) for percentiles."""

    def p99(self) -> float:
        return float(np.percentile(self.last, 99))


def _bf16_dev(a):
    import cupy
    return cupy.asarray(a.view(np.uint16)).view(cupy_ep.interop.BF16)


def _selections_per_rank(idx: np.ndarray, num_experts: int, num_ranks: int) -> np.ndarray:
    """Top-k slots of this rank's tokens per destination rank (one message each)."""
    valid = idx[idx >= 0]
    return np.bincount(valid // (num_experts // num_ranks), minlength=num_ranks)


class LowLatencyBench:
    def __init__(self, args, comm):
        self.args, self.comm = args, comm
        self.rank, self.R = comm.Get_rank(), comm.Get_size()
        a = args
        self.M = a.tokens
        rdma = cfgmod.low_latency_rdma_size_hint(self.M, a.hidden, self.R, a.experts)
        self.buf = Buffer(comm, num_rdma_bytes=rdma, low_latency_mode=True, check_values=False, backend="cuda")
        self.records: list[dict] = []

    def log(self, *a):
        if self.rank == 0:
            print(*a, flush=True)

    def inputs(self):
        a = self.args
        rng = np.random.default_rng(4321 + self.rank)
        x = rng.standard_normal((a.tokens, a.hidden), dtype=np.float32).astype(reference.bfloat16)
        scores = rng.random((a.tokens, a.experts), dtype=np.float32)
        idx = np.argsort(-scores, axis=1)[:, :a.topk].astype(np.int64)
        w = rng.random((a.tokens, a.topk), dtype=np.float32)
        return x, idx, w

    def verify(self, x, idx, w, dispatch_out, combined, y):
        """Abort the job unless dispatch and combine equal the reference bit for bit."""
        a = self.args
        (data, scales), count, handle = dispatch_out
        gathered = self.comm.allgather((x, idx, w, y))
        want = reference.low_latency_dispatch([g[0] for g in gathered], [g[1] for g in gathered], self.M,
                                              a.experts, self.rank, use_fp8=True)
        ok = np.array_equal(count.get(), want.recv_count)
        data, scales, src = data.get(), scales.get(), handle[0].get()
        for e, n in enumerate(want.recv_count):
            ok &= np.array_equal(data[e, :n].view(np.uint8), want.recv_x[e, :n])
            ok &= np.array_equal(scales[e, :n], want.recv_x_scales[e, :n])
            ok &= np.array_equal(src[e, :n], want.src_info[e, :n])
        want_c = reference.low_latency_combine([g[3] for g in gathered], [g[1] for g in gathered],
                                               [g[2] for g in gathered], self.M, a.experts, self.rank)
        ok &= np.array_equal(combined.view(np.uint16).get() if hasattr(combined, "get") else combined,
                             want_c.view(np.uint16))
        if not self.comm.allreduce(bool(ok), op=__import__("mpi4py").MPI.LAND):
            self.log("cupy_ep.bench_ll: VERIFICATION FAILED against cupy_ep.reference")
            self.comm.Abort(2)
        self.log("  verified against cupy_ep.reference: low-latency dispatch (fp8) and combine: OK")

    def run(self):
        import cupy
        a, R, buf = self.args, self.R, self.buf
        self.log(f"cupy_ep.bench --mode low-latency: ranks={R} tokens={a.tokens} hidden={a.hidden} topk={a.topk} "
                 f"experts={a.experts} iters={a.iters}")
        L = a.experts // R
        with cupy.cuda.Device(buf.device_id):
            x_np, idx_np, w_np = self.inputs()
            x, idx, w = _bf16_dev(x_np), cupy.asarray(idx_np), cupy.asarray(w_np)
            rng = np.random.default_rng(99 + self.rank)
            y_np = rng.integers(-8, 9, size=(L, R * self.M, a.hidden)).astype(np.float32).astype(reference.bfloat16)
            y = _bf16_dev(y_np)
            out = buf.low_latency_dispatch(x, idx, self.M, a.experts, use_fp8=True)
            combined, _, _ = buf.low_latency_combine(y, idx, w, out[2])
            cupy.cuda.runtime.deviceSynchronize()
            self.verify(x_np, idx_np, w_np, out[:3], combined, y_np)
            handle = out[2]

            timer = LatencyTimer(self.comm, a.iters, a.warmup)
            nccl = NcclAllToAll(self.comm)
            per_rank = _selections_per_rank(idx_np, a.experts, R)
            recv_per_rank = np.array(self.comm.alltoall([int(v) for v in per_rank]))
            msg_fp8 = a.hidden + a.hidden // 128 * 4 + 16
            runs = {
                "ll_dispatch": (lambda: buf.low_latency_dispatch(x, idx, self.M, a.experts, use_fp8=True),
                                nccl.make(per_rank * msg_fp8, recv_per_rank * msg_fp8), "fp8"),
                "ll_combine": (lambda: buf.low_latency_combine(y, idx, w, handle),
                               nccl.make(recv_per_rank * 2 * a.hidden, per_rank * 2 * a.hidden), "bf16"),
            }
            for op, (fn, nccl_fn, dtype) in runs.items():
                nccl_t = timer.graph(nccl_fn)
                nccl_p99 = timer.p99()
                for graph in (False, True):
                    t = timer.graph(fn) if graph else timer(fn)
                    rec = {"op": op, "graph": graph, "time_us_median": t.median_us, "time_us_p99": timer.p99(),
                           "time_us_min": t.min_us, "nccl_time_us": nccl_t.median_us, "nccl_time_us_p99": nccl_p99,
                           "dtype": dtype, "tokens": a.tokens, "hidden": a.hidden, "topk": a.topk,
                           "experts": a.experts, "num_ranks": R}
                    self.records.append(rec)
                    self.log(f"  {op:11s} graph={str(graph):5s} median {t.median_us:7.1f} us  p99 "
                             f"{rec['time_us_p99']:7.1f} us  (NCCL same bytes {nccl_t.median_us:7.1f} us)")
        buf.destroy()
        if self.rank == 0:
            self.write()

    def write(self):
        def lines(common):
            out = [f"# cupy_ep low-latency benchmark (EP{self.R}, {common['gpu']})", "",
                   f"commit `{common['commit']}`; {self.args.tokens} tokens/rank, hidden {self.args.hidden}, "
                   f"top-{self.args.topk} of {self.args.experts}; {self.args.iters} iterations; graph = CUDA-graph "
                   "replay (device time), call = CUDA events around the Python call.", "",
                   "| op | dtype | graph | median us | p99 us | NCCL us (same bytes) | ours/NCCL |",
                   "|---|---|---|---|---|---|---|"]
            for r in self.records:
                out.append(f"| {r['op']} | {r['dtype']} | {r['graph']} | {r['time_us_median']:.1f} | "
                           f"{r['time_us_p99']:.1f} | {r['nccl_time_us']:.1f} | "
                           f"{r['time_us_median'] / r['nccl_time_us']:.2f} |")
            return out
        write_report(self.args.out, f"bench_ll_gpu_ep{self.R}", self.records,
                     dict(num_ranks=self.R, args={k: v for k, v in vars(self.args).items()}), lines, "low-latency")


def main(args, comm) -> None:
    """Entry from :func:`cupy_ep.bench.main` (``--mode low-latency``); needs a GPU."""
    if not cupy_ep.gpu_available():
        raise SystemExit("cupy_ep.bench --mode low-latency needs a GPU (the host backend has no latency to measure)")
    args.iters = max(args.iters, 200)
    LowLatencyBench(args, comm).run()
