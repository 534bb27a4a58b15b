"""Start the CUDA driver in the background when ``cupy_ep`` is imported.

A warm start (kernel cache present) is mostly fixed costs: the interpreter, ``import numpy`` and ``import cupy``,
``MPI_Init`` and the CUDA context (~0.26 s on an H200).
Only the last one does not need the GIL: ``cuInit`` and ``cuDevicePrimaryCtxRetain`` are plain driver calls, so
a thread started first thing in ``cupy_ep/__init__.py`` creates this rank's context while the main thread imports
numpy, CuPy and mpi4py and starts MPI. CuPy (the runtime API) later finds the primary context ready.

Which GPU: the one :func:`cupy_ep.bootstrap.choose_device` will pick for a ``Buffer`` over ``MPI.COMM_WORLD``:
``CUPY_EP_DEVICE`` if set, else the launcher's node-local rank (Open MPI, MPICH/Hydra, Slurm, MVAPICH,
torchrun) modulo the visible GPUs. Without a local rank (a plain ``python``), only ``cuInit`` runs (no context on
any GPU). A ``Buffer`` over a sub-communicator may pick another GPU; the preinit context then just sits unused on
the guessed one (about 0.5 GB). ``CUPY_EP_PREINIT=0`` turns all of this off; nothing changes without a driver.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import threading

_LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "SLURM_LOCALID",
                    "MV2_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK")  # torchrun's last: an mpirun inside it inherits it
_JOIN_TIMEOUT_S = 30.0

_thread: threading.Thread | None = None
# what the thread did, for tests and diagnostics: "off", "no driver", "cuInit failed", "driver only",
# "no such device", "context <ordinal>", or the error it hit
status = "not started"


def local_rank() -> int | None:
    """This process's node-local rank as the MPI launcher exported it, or None."""
    for name in _LOCAL_RANK_VARS:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def wanted_device() -> tuple[int | None, bool]:
    """``(ordinal, modulo)``: ``CUPY_EP_DEVICE`` as is (modulo False), else the local rank to take modulo the
    device count (modulo True); ``(None, False)`` when neither is known."""
    explicit = os.environ.get("CUPY_EP_DEVICE", "")
    if explicit:
        return (int(explicit), False) if explicit.isdigit() else (None, False)
    rank = local_rank()
    return (rank, True) if rank is not None else (None, False)


def _run(device: int | None, modulo: bool) -> None:
    global status
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        status = "no driver"
        return
    try:
        if cuda.cuInit(0) != 0:
            status = "cuInit failed"
            return
        if device is None:
            status = "driver only"
            return
        count = ctypes.c_int(0)
        if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value <= 0:
            status = "no such device"
            return
        ordinal = device % count.value if modulo else device
        handle = ctypes.c_int(0)
        if ordinal >= count.value or cuda.cuDeviceGet(ctypes.byref(handle), ordinal) != 0:
            status = "no such device"
            return
        ctx = ctypes.c_void_p()
        rc = cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), handle)
        status = f"context {ordinal}" if rc == 0 else f"cuDevicePrimaryCtxRetain returned {rc}"
    except Exception as e:  # never let a background thread's failure reach the user: CuPy reports real errors
        status = f"{type(e).__name__}: {e}"


def start() -> None:
    """Start the background thread (once per process); ``CUPY_EP_PREINIT=0`` disables it."""
    global _thread, status
    if _thread is not None:
        return
    if os.environ.get("CUPY_EP_PREINIT", "1") == "0":
        status = "off"
        return
    device, modulo = wanted_device()
    _thread = threading.Thread(target=_run, args=(device, modulo), name="cupy_ep-cuda-preinit", daemon=True)
    _thread.start()
    atexit.register(join)  # no interpreter teardown while the driver is half-way through creating a context


def join(timeout: float = _JOIN_TIMEOUT_S) -> str:
    """Wait for the thread (if any) and return :data:`status`."""
    if _thread is not None:
        _thread.join(timeout)
    return status
