"""Session 20: the benchmark's warm start without the rest of the benchmark. Does what ``python -m cupy_ep.bench``
does up to its first dispatch (bench.main's MPI start and GPU probe, the default arguments, ``Bench.__init__``:
the size hints, the Buffer, the first layout + dispatch) and prints every rank's ``startup`` record, then exits.
With ``--profile`` it also prints rank 0's cProfile of ``Bench.__init__`` (cumulative, top 45).

    mpirun -n 2 python3 benchmarks/experiments/s20/startup_probe.py [--profile]
"""
import time  # noqa: I001  (the order is the point: cupy_ep first, as runpy imports the package before bench)

import cupy_ep  # noqa: F401
from cupy_ep import bench


def main():
    import sys
    age_at_main = bench.process_age_s()
    t0 = time.perf_counter()
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    comm.Barrier()
    mpi_init_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    gpu = cupy_ep.gpu_available()
    gpu_probe_s = time.perf_counter() - t0
    args = bench.parse_args([], gpu=gpu)
    args.mpi_init_s, args.gpu_probe_s, args.process_age_at_main_s = mpi_init_s, gpu_probe_s, age_at_main
    prof = None
    if "--profile" in sys.argv and comm.Get_rank() == 0:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    b = bench.Bench(args, comm)
    if prof is not None:
        prof.disable()
    for r, s in enumerate(comm.allgather(b.startup)):
        if comm.Get_rank() == 0:
            print(f"rank {r}: " + ", ".join(f"{k[:-2]} {v:.3f}" for k, v in s.items() if v is not None), flush=True)
    if prof is not None:
        import io
        import pstats
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(45)
        print(out.getvalue(), flush=True)
    b.buf.destroy()


if __name__ == "__main__":
    main()
