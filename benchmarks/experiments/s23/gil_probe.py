"""Session 23: what a thread can do while Open MPI's MPI_Init_thread runs (called through ctypes, GIL released).
Thread A ticks in pure Python (sleep 1 ms) the whole time; thread B, 20 ms after MPI_Init began, dlopens a library
not loaded yet (ctypes.CDLL of libbz2 / libexpat / libz, whichever exists). Prints, per rank: MPI_Init's span, how
many of A's ticks fell inside it and the largest gap between ticks, B's dlopen start / end relative to MPI_Init."""
import ctypes  # noqa: I001
import ctypes.util
import threading
import time

import mpi4py

mpi4py.rc.initialize = False
from mpi4py import MPI  # noqa: E402

from cupy_ep.mpi_start import libmpi_path  # noqa: E402

ticks, dl = [], {}
stop = False


def tick():
    while not stop:
        ticks.append(time.perf_counter())
        time.sleep(0.001)


def load(t_begin):
    while time.perf_counter() < t_begin + 0.02:
        time.sleep(0.001)
    for name in ("bz2", "expat", "lzma", "z"):
        path = ctypes.util.find_library(name)
        if path:
            dl["lib"] = path
            dl["a"] = time.perf_counter()
            ctypes.CDLL(path)
            dl["b"] = time.perf_counter()
            return


lib = ctypes.CDLL(libmpi_path())
A = threading.Thread(target=tick, daemon=True)
A.start()
time.sleep(0.01)
t0 = time.perf_counter()
B = threading.Thread(target=load, args=(t0,), daemon=True)
B.start()
prov = ctypes.c_int(0)
rc = lib.MPI_Init_thread(None, None, ctypes.c_int(MPI.THREAD_MULTIPLE), ctypes.byref(prov))
t1 = time.perf_counter()
stop = True
A.join()
B.join()
inside = [t for t in ticks if t0 <= t <= t1]
gaps = [b - a for a, b in zip(inside, inside[1:])] or [t1 - t0]
line = (f"init {t1 - t0:.3f}s rc={rc}; ticks inside {len(inside)}, largest gap {max(gaps):.3f}s; "
        f"dlopen {dl.get('lib')} {dl.get('a', t0) - t0:+.3f} -> {dl.get('b', t0) - t0:+.3f}")
for r, text in enumerate(MPI.COMM_WORLD.allgather(line)):
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"rank {r}: {text}", flush=True)
MPI.Finalize()
