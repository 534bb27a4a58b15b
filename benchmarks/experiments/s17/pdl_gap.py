"""The gap between back-to-back kernels shaped like the low-latency ones, with and without programmatic dependent
launch (PDL). Prepared in session 17; first run in session 18 (one GPU is enough).

Why: a 0-token low-latency dispatch is ~4.7 us of kernel (stamps) but 7.0-7.8 us per call in the steady timing,
so ~2.5-3 us of every call sits between kernels. PDL (``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``
on the launch, ``griddepcontrol.wait`` in the kernel before it touches anything the previous kernel wrote) lets
the next grid's blocks be scheduled while the previous grid drains, so its launch overlaps that tail.

What it runs: N kernels of 132 x 512 threads (one block per SM: ~120 KB of dynamic shared memory each, as the
dispatch's 128 registers x 512 threads fill an SM) that each spin --busy-us on %globaltimer, captured in one
CUDA graph, timed over --reps replays (median). Per kernel it also records the grid's first block start and last
block end, so the gap between kernel i's last end and kernel i+1's first start is measured directly.

Variants: ``plain`` (cuLaunchKernelEx without attributes, one stream); ``pdl`` (the attribute, every kernel
waits first and triggers its dependents at its start); ``pdl_no_trigger`` (the attribute and the wait, no
trigger: the implicit trigger at block exit); ``pdl_after_plain`` (plain and PDL launches alternate, only a
plain kernel's end -> the next PDL kernel's start counted: the low-latency call after a model's kernel or the
steady timing's L2 flush); ``events`` and ``pdl_events`` (each launch on a second stream
bracketed by event record / wait pairs with the capturing stream, as cupy_ep's calls do: comm stream waits for
the compute stream, launch, compute waits for the comm stream).

    python3 benchmarks/experiments/s17/pdl_gap.py [--n 20] [--busy-us 5] [--reps 50]
"""
from __future__ import annotations

import argparse
import ctypes

import cupy
import numpy as np

SOURCE = r"""
__device__ __forceinline__ unsigned long long now() {
    unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}
extern "C" __global__ void __launch_bounds__(512, 1)
spin(unsigned long long* stamps, int index, long long busy_ns, int mode) {
    extern __shared__ int smem[];
    const unsigned long long start = now();
    if (mode & 2) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (mode & 1) asm volatile("griddepcontrol.wait;" ::: "memory");
    smem[threadIdx.x] = threadIdx.x;  // touch the shared memory the launch reserved
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned long long waited = now();
        while (now() - waited < (unsigned long long)busy_ns) { }
        atomicMin(stamps + 3 * index, start);
        atomicMin(stamps + 3 * index + 1, waited);
        atomicMax(stamps + 3 * index + 2, now());
    }
}
"""

CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
SMEM = 120 * 1024


class LaunchAttributeValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("i", ctypes.c_int)]


class LaunchAttribute(ctypes.Structure):  # id at offset 0, the value union at offset 8
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", LaunchAttributeValue)]


class LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


assert ctypes.sizeof(LaunchAttribute) == 72 and ctypes.sizeof(LaunchConfig) == 56
libcuda = ctypes.CDLL("libcuda.so.1")
libcuda.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                     ctypes.c_void_p]


def launch(function_ptr: int, grid: int, block: int, smem: int, stream, params, pdl: bool) -> None:
    attr = LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value.i = 1
    cfg = LaunchConfig(grid, 1, 1, block, 1, 1, smem, stream.ptr, ctypes.pointer(attr) if pdl else None,
                       1 if pdl else 0)
    ptrs = (ctypes.c_void_p * len(params))(*[ctypes.addressof(p) for p in params])
    rc = libcuda.cuLaunchKernelEx(ctypes.byref(cfg), function_ptr, ptrs, None)
    if rc != 0:
        raise RuntimeError(f"cuLaunchKernelEx returned {rc}")


def run_variant(kernel, name: str, n: int, busy_ns: int, reps: int, sms: int):
    # pdl_after_plain: every other kernel is a plain launch that never waits or triggers (as the steady timing's
    # L2 flush before each op, or a model's own kernel), the next one a PDL launch; only those pairs are measured.
    alternate = name == "pdl_after_plain"
    mode = {"plain": 0, "events": 0, "pdl": 3, "pdl_events": 3, "pdl_no_trigger": 1, "pdl_after_plain": 1}[name]
    with_events = name.endswith("events")
    compute = cupy.cuda.Stream(non_blocking=True)
    comm = cupy.cuda.Stream(non_blocking=True)
    stamps = cupy.empty((n, 3), dtype=cupy.uint64)
    keep = []
    fork, join = cupy.cuda.Event(disable_timing=True), cupy.cuda.Event(disable_timing=True)

    def body():
        for i in range(n):
            pdl = name.startswith("pdl") and (not alternate or i % 2 == 1)
            params = [ctypes.c_void_p(stamps.data.ptr), ctypes.c_int(i), ctypes.c_longlong(busy_ns),
                      ctypes.c_int(mode if pdl else 0)]
            keep.append(params)
            if with_events:
                fork.record(compute)
                comm.wait_event(fork)
                launch(kernel.kernel.ptr, sms, 512, SMEM, comm, params, pdl)
                join.record(comm)
                compute.wait_event(join)
            else:
                launch(kernel.kernel.ptr, sms, 512, SMEM, compute, params, pdl)

    compute.begin_capture()
    body()
    graph = compute.end_capture()
    pairs = np.arange(1, n)  # measured gaps: kernel i-1's end -> kernel i's start, for these i
    if alternate:
        pairs = pairs[pairs % 2 == 1]
    times, gaps, waits = [], [], []
    with compute:  # the stamps' resets in stream order with the replays
        for r in range(reps + 3):
            replay(graph, compute, stamps, r >= 3, n, pairs, times, gaps, waits)
    return np.median(times), np.median(gaps), np.median(waits)


def replay(graph, compute, stamps, record: bool, n: int, pairs, times, gaps, waits) -> None:
    stamps.fill(np.iinfo(np.uint64).max)
    stamps[:, 2] = 0
    start = compute.record()
    graph.launch(compute)
    end = compute.record()
    end.synchronize()
    if not record:
        return
    times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / n)
    s = stamps.get().astype(np.int64)
    gaps.append(np.median(s[pairs, 0] - s[pairs - 1, 2]) / 1e3)   # next grid's first start - this grid's last end
    waits.append(np.median(s[pairs, 1] - s[pairs - 1, 2]) / 1e3)  # next grid past its wait - this grid's last end


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--busy-us", type=float, default=5.0)
    p.add_argument("--reps", type=int, default=50)
    a = p.parse_args()
    dev = cupy.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    kernel = cupy.RawKernel(SOURCE, "spin")
    kernel.max_dynamic_shared_size_bytes = SMEM
    print(f"{sms} blocks x 512 threads, {SMEM // 1024} KB dynamic shared memory, {a.n} kernels per graph, "
          f"busy {a.busy_us} us each, {a.reps} replays; us per kernel (median) / gap last end -> next first "
          f"start / last end -> next past its wait")
    for name in ("plain", "pdl", "pdl_no_trigger", "pdl_after_plain", "events", "pdl_events"):
        try:
            t, g, w = run_variant(kernel, name, a.n, int(a.busy_us * 1000), a.reps, sms)
            print(f"  {name:15s} {t:7.2f} us per kernel  gap {g:6.2f} us  wait released {w:6.2f} us", flush=True)
        except Exception as e:  # report and go on: one variant's failure (e.g. capture of PDL) must not hide the rest
            print(f"  {name:15s} FAILED: {type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
    main()
