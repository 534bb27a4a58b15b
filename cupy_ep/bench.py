"""``python -m cupy_ep.bench``: the dispatch/combine benchmark, :mod:`cupy_ep.tools.bench` (options:
:mod:`cupy_ep.tools.cli`).

Run as the main job, the arguments come first (``--help`` and bad values end here, before MPI), then MPI starts
while a thread imports numpy, CuPy and the backend (cupy_ep/mpi_start.py), instead of after them with the GIL
held; the benchmark's start-up times read what that took. Under ``torchrun --nproc-per-node N -m cupy_ep.bench``
torch.distributed starts instead (gloo; ``mpi4py.MPI`` is never imported).
"""
if __name__ == "__main__":
    from cupy_ep.tools.cli import parse_args

    _args = parse_args()
    from cupy_ep.mpi_start import start_world

    start_world()  # MPI, or torch.distributed under torchrun
    from cupy_ep.tools.bench import main

    main(args=_args)
else:
    from .tools.bench import main  # noqa: F401
