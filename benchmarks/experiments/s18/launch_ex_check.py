"""Branch s17-pdl's launch path on one GPU (session 18, while only one-GPU machines were lent): ``jit.Kernel(...,
pdl=True)`` (``cupy_ep.launch_ex``, cuLaunchKernelEx through ctypes) launches with CuPy arrays and numpy scalars,
reads what a slow plain kernel right before it wrote (``wait_previous_grid``), works inside a CUDA graph, and what
one launch costs the host against CuPy's own kernel call.

    PYTHONPATH=<s17-pdl tree> python3 benchmarks/experiments/s18/launch_ex_check.py
"""
from __future__ import annotations

import time

import cupy
import numpy as np

from cupy_ep import jit

SOURCE = r"""
extern "C" __global__ void slow_fill(float* x, int n, float value, long long spin_ns) {
    unsigned long long t0; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    for (;;) { unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); if (t - t0 > spin_ns) break; }
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) x[i] = value + i;
}
extern "C" __global__ void axpi(const float* x, float* y, int n, float a) {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) y[i] = a * x[i] + 1.0f;
}
"""


def main():
    module = cupy.RawModule(code=SOURCE)
    fill, axpi = module.get_function("slow_fill"), module.get_function("axpi")
    k = jit.Kernel(module, axpi.kernel, "axpi")  # the CUfunction wrapper, as jit.get_kernel holds
    n = 1 << 20
    x, y = cupy.zeros(n, cupy.float32), cupy.zeros(n, cupy.float32)
    idx = np.arange(n, dtype=np.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    bad = 0
    with stream:
        for r in range(20):  # a slow 8-block fill, then the PDL kernel with no sync between
            fill((8,), (256,), (x, np.int32(n), np.float32(r), np.int64(20000)))
            k((132,), (256,), (x, y, np.int32(n), np.float32(2.0)), pdl=True)
            got = y.get()
            bad += int(np.count_nonzero(got != 2.0 * (r + idx) + 1.0))
        print(f"eager: 20 rounds, {bad} wrong values")
        stream.begin_capture()
        for r in range(4):
            fill((8,), (256,), (x, np.int32(n), np.float32(100 + r), np.int64(20000)))
            k((132,), (256,), (x, y, np.int32(n), np.float32(3.0)), pdl=True)
        graph = stream.end_capture()
        gbad = 0
        for _ in range(5):
            y.fill(0)
            graph.launch(stream)
            gbad += int(np.count_nonzero(y.get() != 3.0 * (103 + idx) + 1.0))
        print(f"graph: 5 replays, {gbad} wrong values")
        for label, call in (("cupy RawKernel call", lambda: axpi((132,), (256,), (x, y, np.int32(n), np.float32(2.0)))),
                            ("jit.Kernel pdl=True", lambda: k((132,), (256,), (x, y, np.int32(n), np.float32(2.0)),
                                                              pdl=True))):
            for _ in range(50):
                call()
            stream.synchronize()
            t0 = time.perf_counter()
            for _ in range(2000):
                call()
            host = (time.perf_counter() - t0) / 2000 * 1e6
            stream.synchronize()
            print(f"host cost per launch, {label}: {host:.1f} us")
    print("RESULT", "OK" if bad == 0 and gbad == 0 else "FAILED")


if __name__ == "__main__":
    main()
