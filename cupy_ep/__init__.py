"""cupy_ep: expert-parallel (MoE) dispatch and combine for Python.

DeepEP's V1 design (channels, SM pairs, ring buffers in CUDA-IPC memory) with kernels compiled at run
time by NVRTC through CuPy, ranks started by mpirun and bootstrapped with mpi4py. Without a GPU the same
API runs on numpy + MPI (the host backend).

    from cupy_ep import Buffer, Config
    buf = Buffer(comm, num_nvl_bytes=Buffer.get_nvl_buffer_size_hint(7168 * 2, comm.size))
    layout = buf.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_topk_idx, recv_topk_weights, counts, handle, event = buf.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=layout[0],
        is_token_in_rank=layout[3], num_tokens_per_expert=layout[2])
    combined_x, combined_weights, event = buf.combine(expert_out, handle, topk_weights=recv_topk_weights)
"""
# First, before numpy/CuPy are imported: the CUDA context is created in a background thread meanwhile
# (cupy_ep/preinit.py; CUPY_EP_PREINIT=0 turns it off).
from . import preinit as _preinit

_preinit.start()

# The rest loads on first use (PEP 562), so that ``import cupy_ep`` stays light: numpy and the backend modules
# can then import in a thread while MPI starts (cupy_ep/mpi_start.py: ``start_mpi``).
import importlib as _importlib  # noqa: E402

from .errors import (BackendUnavailableError, BufferUnusableError, CallMismatchError, CommError,  # noqa: E402
                     CommTimeoutError, CompileError, CupyEpError)

_LAZY = {"Buffer": "buffer", "gpu_available": "buffer", "Config": "config", "EventOverlap": "event",
         "start_mpi": "mpi_start", "start_world": "mpi_start"}

__all__ = ["Buffer", "Config", "EventOverlap", "CupyEpError", "CompileError", "CommError", "CommTimeoutError",
           "CallMismatchError", "BufferUnusableError", "BackendUnavailableError", "gpu_available", "start_mpi",
           "start_world"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(_importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # the next lookup is a plain module attribute
        return value
    try:  # a submodule not imported yet (``cupy_ep.reference`` after a bare ``import cupy_ep``)
        return _importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
