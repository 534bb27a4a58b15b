"""Session 23: the benchmark's warm start with MPI started as ``python -m cupy_ep.bench`` now starts it
(``cupy_ep.start_mpi``: MPI_Init through ctypes, the imports and CuPy's runtime start in a thread meanwhile) or,
with ``--plain``, the usual way (``from mpi4py import MPI`` first, holding the GIL; then the imports and the GPU
probe). Then what the benchmark does up to its first dispatch (``bench.start``, ``Bench.__init__``: the size hints,
the Buffer, the first layout + dispatch); prints every rank's ``startup`` record and exits.

    mpirun -n 2 python3 benchmarks/experiments/s23/startup_probe.py [--plain]
"""
import sys  # noqa: I001  (the order is the point: MPI's start first, as at the top of cupy_ep/bench.py)
import time

PLAIN = "--plain" in sys.argv
if PLAIN:
    _t0 = time.perf_counter()
    from mpi4py import MPI
    MPI.COMM_WORLD.Barrier()
    PLAIN_MPI_S = time.perf_counter() - _t0
else:
    from cupy_ep.mpi_start import start_mpi
    start_mpi()

from cupy_ep import bench  # noqa: E402


def main():
    comm, args = bench.start([])
    if PLAIN:  # start_mpi found MPI up ("already") and ran the imports + probe in this thread
        args.mpi_init_s = PLAIN_MPI_S
        args.process_age_at_mpi_start_s = max(0.0, args.process_age_at_mpi_start_s - PLAIN_MPI_S)
    b = bench.Bench(args, comm)
    for r, s in enumerate(comm.allgather(b.startup)):
        if comm.Get_rank() == 0:
            print(f"rank {r} ({'plain' if PLAIN else s['mpi_start']}): "
                  + ", ".join(f"{k[:-2]} {v:.3f}" for k, v in s.items() if isinstance(v, float)), flush=True)
    b.buf.destroy()


if __name__ == "__main__":
    main()
