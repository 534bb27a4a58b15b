"""Session 21: does a kernel cost more launch time because it lives in a relocatable, NVSHMEM-linked module?

S21A (launch_gap.py, one rank) timed ``ll_carve_probe`` (the low-latency module's near-empty kernel, 132 x 512)
2.69 us clock to clock against 2.08 for an empty kernel of the same shape from a plain module, and the dispatch's
own "pre" is 0.6 us above that plain kernel's. But ``ll_carve_probe`` has every thread store the same 11 words, so
it is no clean test. Here one empty kernel (the dispatch's shape: 132 x 512 threads, 12 KB of static shared memory,
each block's thread 0 stamps its start and end) is compiled three ways from the same source:

    plain   NVRTC, not relocatable (as cupy.RawModule)
    rdc     -rdc=true, linked by nvJitLink with NVSHMEM's device library (nothing of it referenced)
    nvshmem -rdc=true with nvshmem.cuh and a call of nvshmem_ptr in a branch the launch never takes, linked the
            same way and initialised with nvshmemx_cumodule_init, as the low-latency kernels are

and one graph replays clock, plain, clock, rdc, clock, nvshmem, clock, plain, clock (then the same with the three
in the other order), right after a barrier, 60 rounds; the medians of each kernel's clock-to-clock time and of its
pre (first block start - clock) and post (clock - last block end) are printed per rank.

    mpirun -n 1 python3 benchmarks/experiments/s21/module_gap.py
"""
from __future__ import annotations

import cupy
import numpy as np
from mpi4py import MPI

from cupy_ep import bench, bench_ll, jit

SRC = r'''
%(include)s
extern "C" __device__ __forceinline__ unsigned long long now() {
    unsigned long long t; asm volatile("mov.u64 %%0, %%%%globaltimer;" : "=l"(t)); return t;
}
extern "C" __global__ void clock(unsigned long long* t, int i) { t[i] = now(); }
extern "C" __global__ void __launch_bounds__(512, 1) twin(unsigned long long* start, unsigned long long* end,
                                                          int never, void* sym) {
    __shared__ int pad[3072];  // 12 KB, as the dispatch's static shared memory
    if (threadIdx.x == 0) start[blockIdx.x] = now();
    if (threadIdx.x > 1) pad[threadIdx.x] = threadIdx.x;
    %(use)s
    __syncthreads();
    if (threadIdx.x == 0) end[blockIdx.x] = now() + (pad[5] == 7);
}'''

VARIANTS = {
    "plain": dict(include="", use="", options=(), link=False),
    "rdc": dict(include="", use="", options=("-rdc=true",), link=True),
    "nvshmem": dict(include='#include "nvshmem.cuh"',
                    use="if (never == 12345 && threadIdx.x == 0) pad[0] = (nvshmem_ptr(sym, 0) != nullptr);",
                    options=None, link=True),
}


def build(name: str, nv) -> tuple:
    v = VARIANTS[name]
    arch = jit.device_arch()
    options = jit._OPTIONS + (f"-arch={arch}", f"-I{jit.source_dir()}")
    options += jit._nvshmem_options() if v["options"] is None else v["options"]
    source = SRC % {"include": v["include"], "use": v["use"]}
    cubin, _, _ = jit._nvrtc().compile(source, f"module_gap_{name}.cu", [], list(options))
    if v["link"]:
        cubin = jit.link_with_nvshmem(cubin, arch)
    module = cupy.cuda.function.Module()
    module.load(cubin)
    if v["options"] is None:
        nv.init_module(module.ptr)
    return module, module.get_function("clock"), module.get_function("twin")


class ModuleGap(bench_ll.LowLatencyBench):
    def run(self):
        with cupy.cuda.Device(self.buf.device_id):
            ll = self.buf._low_latency()
            built = {name: build(name, ll.nv) for name in VARIANTS}
            clock = built["plain"][1]
            nb = ll.num_blocks
            sym = ll.memory  # any symmetric address (nvshmem_ptr is never called)
            for order in (("plain", "rdc", "nvshmem", "plain"), ("nvshmem", "rdc", "plain", "nvshmem")):
                t = cupy.zeros(len(order) + 1, dtype=cupy.uint64)
                ts = cupy.zeros((len(order), nb), dtype=cupy.uint64)
                te = cupy.zeros((len(order), nb), dtype=cupy.uint64)

                def one_round():
                    clock((1,), (1,), (t, np.int32(0)))
                    for i, name in enumerate(order):
                        built[name][2]((nb,), (512,), (ts[i], te[i], np.int32(0), np.uint64(sym.ptr)))
                        clock((1,), (1,), (t, np.int32(i + 1)))

                stream = bench.warm_stream(self.comm, one_round)
                with stream:
                    graph = bench.capture_graph(stream, one_round)
                rows = []
                for _ in range(60):
                    cupy.cuda.runtime.deviceSynchronize()
                    self.comm.Barrier()
                    graph.launch(stream)
                    stream.synchronize()
                    tt = t.get().astype(np.int64)
                    a0, a1 = ts.get().astype(np.int64), te.get().astype(np.int64)
                    row = []
                    for i in range(len(order)):
                        row += [tt[i + 1] - tt[i], a0[i].min() - tt[i], tt[i + 1] - a1[i].max()]
                    rows.append(row)
                med = np.median(np.array(rows[10:], dtype=np.float64), axis=0) / 1e3
                for r in range(self.R):
                    m = self.comm.bcast(med if self.rank == r else None, root=r)
                    self.log(f"  rank {r}: " + " | ".join(
                        f"{name} clock-to-clock {m[3 * i]:.2f} pre {m[3 * i + 1]:.2f} post {m[3 * i + 2]:.2f}"
                        for i, name in enumerate(order)) + " us")
        self.buf.destroy()


if __name__ == "__main__":
    import sys
    ModuleGap(bench.parse_args(["--mode", "low-latency", "--tokens", "128"] + sys.argv[1:]), MPI.COMM_WORLD).run()
