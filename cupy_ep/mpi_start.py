"""Start MPI while numpy, CuPy and cupy_ep's backend import, instead of before them.

``from mpi4py import MPI`` runs ``MPI_Init_thread`` inside the module's import, holding the GIL: on the GPU
machine that is 0.24-0.41 s during which no other Python thread moves, and numpy + CuPy + cupy_ep's modules
(~0.3 s) and CuPy's runtime start (~0.15 s) then run after it (measured on an H200 machine). ctypes releases
the GIL around a foreign call, so :func:`start_mpi` imports mpi4py with ``rc.initialize = False``, calls
``MPI_Init_thread`` from the very ``libmpi`` that mpi4py loaded through ctypes, and lets a thread do the imports
and the GPU probe meanwhile. mpi4py works on an MPI that someone else initialised; what its own start would
have done besides (the error handler ``rc.errors`` asks for, ``MPI_Finalize`` at exit) is done here.

    from cupy_ep import start_mpi
    MPI = start_mpi().MPI          # instead of: from mpi4py import MPI
    comm = MPI.COMM_WORLD

Under torchrun, :func:`start_world` starts torch.distributed instead (the same preload beside its rendezvous) and
never imports ``mpi4py.MPI``; elsewhere it is :func:`start_mpi`. Both leave the job's communicator in
:attr:`Started.comm`.

Call it before anything imports ``mpi4py.MPI``. Where MPI is already up (mpi4py imported the usual way), it
only runs the imports, in this thread. Where ``libmpi`` cannot be found in the process, it falls back to
``MPI.Init_thread()`` (correct, just not overlapped) and says so in :attr:`Started.how`.
"""
from __future__ import annotations

import atexit
import ctypes
import dataclasses
import sys
import threading
import time
from collections.abc import Callable

_THREAD_LEVELS = {"single": "THREAD_SINGLE", "funneled": "THREAD_FUNNELED", "serialized": "THREAD_SERIALIZED",
                  "multiple": "THREAD_MULTIPLE"}
_ERRHANDLERS = {"exception": "ERRORS_RETURN", "abort": "ERRORS_ABORT", "fatal": "ERRORS_ARE_FATAL"}


@dataclasses.dataclass
class Started:
    """What :func:`start_mpi` did, with its times in seconds (this process's view).

    ``how``: ``"overlapped"`` (MPI_Init_thread through ctypes while the preload thread ran), ``"mpi4py"`` (the
    fallback: ``MPI.Init_thread()`` then the preload), ``"already"`` (MPI was up before the call), or under
    torchrun (:func:`start_world`) ``"torchrun"`` (``init_process_group`` while the preload ran) or
    ``"torchrun-already"`` (torch.distributed was initialized before the call); ``MPI`` is then None.
    ``comm``: the job's communicator (``MPI.COMM_WORLD``, or a :class:`cupy_ep.bootstrap.TorchComm` of
    torch.distributed's default group).
    ``mpi_init_s``: MPI_Init_thread plus a barrier over COMM_WORLD after the preload (the ranks' start-up skew
    is MPI's too).
    ``preload_s``: the preload's own duration; ``preload_wait_s``: how long this thread waited for it after MPI.
    ``gpu``: what the preload's GPU probe returned (None without a probe).
    ``t_begin`` / ``t_end``: ``time.perf_counter()`` when the call began and returned.
    """
    MPI: object
    how: str
    mpi_init_s: float
    preload_s: float
    preload_wait_s: float
    gpu: bool | None
    t_begin: float = 0.0
    t_end: float = 0.0
    comm: object = None


_started: Started | None = None


def default_preload() -> bool:
    """numpy, cupy_ep's backend modules (which import CuPy lazily) and CuPy's runtime start: True when a GPU is
    visible (:func:`cupy_ep.gpu_available`)."""
    import numpy  # noqa: F401

    from . import buffer  # noqa: F401  (and through it config, reference, the CUDA backend modules)
    return buffer.gpu_available()


def libmpi_path() -> str | None:
    """The path of the ``libmpi`` shared object mapped into this process (mpi4py's), or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                path = fields[5] if len(fields) >= 6 else ""
                if path.rsplit("/", 1)[-1].startswith("libmpi.so"):  # Open MPI .so.40, MPICH .so.12
                    return path
    except OSError:
        pass
    return None


def _run_preload(preload: Callable[[], bool | None], out: dict) -> None:
    t0 = time.perf_counter()
    try:
        out["gpu"] = preload()
    except BaseException as e:  # re-raised in the calling thread, which owns the error
        out["error"] = e
    out["s"] = time.perf_counter() - t0


def _start_preload(preload, out: dict) -> threading.Thread | None:
    """``preload`` running in a daemon thread (None without one); :func:`_join_preload` waits for it."""
    if preload is None:
        return None
    thread = threading.Thread(target=_run_preload, args=(preload, out), name="cupy_ep-preload", daemon=True)
    thread.start()
    return thread


def _join_preload(thread: threading.Thread | None, out: dict) -> None:
    """Wait for the preload thread; ``out["wait"]``: how long this thread waited for it."""
    if thread is not None:
        t1 = time.perf_counter()
        thread.join()
        out["wait"] = time.perf_counter() - t1


def _mpi_init_ctypes(MPI, level: int) -> bool:
    """MPI_Init_thread through ctypes (the GIL released meanwhile); False when libmpi is not found."""
    path = libmpi_path()
    if path is None:
        return False
    lib = ctypes.CDLL(path)
    provided = ctypes.c_int(-1)
    rc = lib.MPI_Init_thread(None, None, ctypes.c_int(level), ctypes.byref(provided))
    if rc != 0:
        raise RuntimeError(f"start_mpi: MPI_Init_thread returned {rc} (through ctypes, {path})")
    return True


def _as_mpi4py_would(MPI, rc) -> None:
    """The parts of mpi4py's own start that an external MPI_Init skips: ``rc.errors`` on COMM_SELF/COMM_WORLD."""
    name = _ERRHANDLERS.get(str(rc.errors))
    if name is not None and hasattr(MPI, name):
        for comm in (MPI.COMM_SELF, MPI.COMM_WORLD):
            comm.Set_errhandler(getattr(MPI, name))


def _finalize_at_exit(MPI) -> None:
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()


def start_mpi(preload: Callable[[], bool | None] | None = default_preload) -> Started:
    """Initialise MPI (through mpi4py's library) while ``preload`` runs in a thread; returns :class:`Started`.

    Args:
        preload: a function run in a background thread during ``MPI_Init_thread`` (default: the imports of numpy,
            cupy_ep's backend and CuPy, and the GPU probe); its return value lands in ``Started.gpu``; an
            exception it raises is raised here. None: no preload.

    Idempotent: a second call returns the first call's :class:`Started`.
    """
    global _started
    if _started is not None:
        return _started
    import mpi4py
    if "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.initialize = False  # MPI_Init_thread comes from here, through ctypes, without the GIL
    from mpi4py import MPI

    out: dict = {}
    t0 = time.perf_counter()
    if MPI.Is_initialized():
        how = "already"
        if preload is not None:
            _run_preload(preload, out)
        init_s = 0.0
    else:
        thread = _start_preload(preload, out)
        level = getattr(MPI, _THREAD_LEVELS.get(str(mpi4py.rc.thread_level), "THREAD_MULTIPLE"))
        if _mpi_init_ctypes(MPI, level):
            how = "overlapped" if thread is not None else "ctypes"
            _as_mpi4py_would(MPI, mpi4py.rc)
        else:
            how = "mpi4py"  # libmpi not found in the maps: mpi4py's own call, with the GIL held
            MPI.Init_thread(level)
        # mpi4py 4.1 finalises at exit only an MPI its import started (not after rc.initialize = False, whatever
        # rc.finalize says), so this does; exit hooks registered later (a Buffer's) run before it
        atexit.register(_finalize_at_exit, MPI)
        init_s = time.perf_counter() - t0
        _join_preload(thread, out)
        # The ranks' start-up skew, counted as MPI's; after the join, because a rank that waits here busy-polls a
        # core that its own preload (or a rank's sharing the host) would want.
        t2 = time.perf_counter()
        MPI.COMM_WORLD.Barrier()
        init_s += time.perf_counter() - t2
    if "error" in out:
        raise out["error"]
    _started = Started(MPI=MPI, how=how, mpi_init_s=init_s, preload_s=out.get("s", 0.0),
                       preload_wait_s=out.get("wait", out.get("s", 0.0)), gpu=out.get("gpu"), t_begin=t0,
                       t_end=time.perf_counter(), comm=MPI.COMM_WORLD)
    return _started


def start_world(preload: Callable[[], bool | None] | None = default_preload, torch_backend: str | None = None
                ) -> Started:
    """:func:`start_mpi`, or under torchrun (:func:`cupy_ep.bootstrap.launched_by_torchrun`, or
    ``CUPY_EP_BOOTSTRAP=torch``) ``torch.distributed.init_process_group`` from torchrun's environment while
    ``preload`` runs in a thread; ``Started.comm`` is then a :class:`cupy_ep.bootstrap.TorchComm` of the default
    group. ``torch_backend``: the group's backend (default ``CUPY_EP_TORCH_BACKEND``, else gloo: cupy_ep
    exchanges only host objects, through the group's store, so NCCL is never needed). Idempotent."""
    global _started
    from . import bootstrap
    if _started is not None:
        return _started
    import os
    forced = os.environ.get("CUPY_EP_BOOTSTRAP", "").strip().lower()
    if forced == "mpi" or bootstrap.mpi_started() or not (forced == "torch" or bootstrap.launched_by_torchrun()):
        return start_mpi(preload)
    import torch.distributed as dist

    out: dict = {}
    t0 = time.perf_counter()
    how = "torchrun-already" if dist.is_initialized() else "torchrun"
    thread = _start_preload(preload, out)  # beside the rendezvous (or, already up, just run)
    if how == "torchrun":
        dist.init_process_group(torch_backend or os.environ.get("CUPY_EP_TORCH_BACKEND") or "gloo")
    init_s = time.perf_counter() - t0 if how == "torchrun" else 0.0
    _join_preload(thread, out)
    if "error" in out:
        raise out["error"]
    comm = bootstrap.TorchComm(None)
    t2 = time.perf_counter()
    comm.Barrier()  # the ranks' start-up skew, counted as the launcher's (as start_mpi's barrier)
    init_s += time.perf_counter() - t2
    _started = Started(MPI=None, how=how, mpi_init_s=init_s, preload_s=out.get("s", 0.0),
                       preload_wait_s=out.get("wait", out.get("s", 0.0)), gpu=out.get("gpu"), t_begin=t0,
                       t_end=time.perf_counter(), comm=comm)
    return _started
