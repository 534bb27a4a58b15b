"""``python -m cupy_ep.soak``: randomly shaped dispatch/combine rounds checked against the reference,
:mod:`cupy_ep.tools.soak` (``--mode low-latency``: :mod:`cupy_ep.tools.soak_ll`). Under mpirun, or
``torchrun --nproc-per-node N -m cupy_ep.soak`` (torch.distributed's default group, gloo; ``mpi4py.MPI`` is never
imported)."""
import sys

from .tools.soak import main

if __name__ == "__main__":
    sys.exit(main())
