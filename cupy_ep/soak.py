"""``python -m cupy_ep.soak``: randomly shaped dispatch/combine rounds checked against the reference,
:mod:`cupy_ep.tools.soak` (``--mode low-latency``: :mod:`cupy_ep.tools.soak_ll`)."""
import sys

from .tools.soak import main

if __name__ == "__main__":
    sys.exit(main())
