"""Session 23: where start_mpi's critical path goes. Stamps (seconds since the process started) of: the preinit
thread's CUDA context done, each step of the preload (numpy, cupy_ep.buffer, cupy, the GPU probe) and MPI_Init's
end; then the first Buffer + layout + dispatch as the benchmark does them. Prints one line per rank.

    mpirun -n 2 python3 benchmarks/experiments/s23/preload_stamps.py
"""
import os  # noqa: I001
import sys
import threading
import time

T0 = time.perf_counter()


def age():
    ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
    return float(open("/proc/uptime").read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")


AGE0 = age()  # process age at T0 (10 ms ticks)
stamps = {}


def stamp(name):
    stamps[name] = AGE0 + time.perf_counter() - T0


from cupy_ep import mpi_start, preinit  # noqa: E402  (starts the preinit thread)

stamp("cupy_ep_imported")


def watch_preinit():
    if preinit._thread is not None:
        preinit._thread.join()
    stamp("context_ready")


threading.Thread(target=watch_preinit, daemon=True).start()


def preload():
    import numpy  # noqa: F401
    stamp("numpy")
    from cupy_ep import buffer
    stamp("cupy_ep_buffer")
    import cupy  # noqa: F401
    stamp("cupy")
    gpu = buffer.gpu_available()
    stamp("gpu_probe")
    return gpu


real_init = mpi_start._mpi_init_ctypes


def traced_init(MPI, level):
    stamp("mpi_init_begin")
    try:
        return real_init(MPI, level)
    finally:
        stamp("mpi_init_end")


mpi_start._mpi_init_ctypes = traced_init
started = mpi_start.start_mpi(preload)
stamp("start_mpi_done")

from cupy_ep import bench  # noqa: E402

comm, args = bench.start([])
b = bench.Bench(args, comm)
stamp("first_dispatch_done")
line = f"{started.how} preinit={preinit.status} " + " ".join(f"{k} {v:.3f}" for k, v in sorted(stamps.items(),
                                                                                                 key=lambda kv: kv[1]))
for r, text in enumerate(comm.allgather(line)):
    if comm.Get_rank() == 0:
        print(f"rank {r}: {text}", flush=True)
b.buf.destroy()
sys.exit(0)
