"""``python -m cupy_ep.tune``: sweep dispatch/combine configs on this machine and write the fastest,
:mod:`cupy_ep.tools.tune`. Under mpirun, or ``torchrun --nproc-per-node N -m cupy_ep.tune``."""
from .tools.tune import main

if __name__ == "__main__":
    main()
