"""cupy_ep.start_mpi: MPI_Init runs without the GIL while the preload thread imports, and MPI then behaves as
mpi4py's own start leaves it (errors raise, finalised at exit). Each case runs in a fresh interpreter (a singleton
MPI process; MPI starts once per process); the file skips itself under a launcher (mpirun), whose variables would
make the child try to join the parent's job. Also: ``import cupy_ep`` stays light (numpy loads on first use),
which the overlap relies on."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("mpi4py")

# set by mpirun / mpiexec for each rank (Open MPI, PMI-1/2 launchers such as MPICH's Hydra, PMIx)
_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")
pytestmark = pytest.mark.skipif(any(v in os.environ for v in _LAUNCHER_VARS),
                                reason="starts singleton MPI processes: runs in the single-process step only")


def run_child(code: str) -> dict[str, str]:
    """Run ``code`` in a fresh interpreter; returns its ``key=value`` output lines (the run must exit 0)."""
    env = dict(os.environ)  # as is: e.g. Open MPI's singleton start as root needs OMPI_ALLOW_RUN_AS_ROOT*
    env["CUPY_EP_PREINIT"] = "0"  # no CUDA start in these children: they test MPI's start only
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env=env, cwd=root)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)


# registered first, so it runs last at exit: after start_mpi's own exit hook
_AT_EXIT = """
import atexit
def _last():
    from mpi4py import MPI
    print(f"finalized_at_exit={MPI.Is_finalized()}", flush=True)
atexit.register(_last)
"""


def test_mpi_init_runs_while_the_preload_thread_runs_python():
    out = run_child(_AT_EXIT + """
    import time
    from cupy_ep import mpi_start
    state = {"in_init": False, "ticks": 0, "done": False}
    real_init = mpi_start._mpi_init_ctypes
    def traced_init(MPI, level):
        state["in_init"] = True
        try:
            return real_init(MPI, level)
        finally:
            state["in_init"] = False
            state["done"] = True
    mpi_start._mpi_init_ctypes = traced_init
    def preload():
        while not state["done"]:  # Python bytecode: it only runs while the main thread does not hold the GIL
            if state["in_init"]:
                state["ticks"] += 1
            time.sleep(0)
        return "loaded"
    s = mpi_start.start_mpi(preload)
    print(f"how={s.how}")
    print(f"ticks={state['ticks']}")
    print(f"gpu={s.gpu}")
    print(f"again_same={mpi_start.start_mpi() is s}")
    print(f"initialized={s.MPI.Is_initialized()}")
    print(f"size={s.MPI.COMM_WORLD.Get_size()}")
    print(f"times_ok={s.mpi_init_s > 0 and s.preload_s > 0 and s.t_end >= s.t_begin}")
    """.replace("\n    ", "\n"))
    assert out["how"] == "overlapped"
    assert int(out["ticks"]) > 0, "the preload thread never ran while MPI_Init_thread did: the GIL was held"
    assert out["gpu"] == "loaded"  # the preload's return value
    assert out["again_same"] == "True"  # idempotent
    assert out["initialized"] == "True" and out["size"] == "1" and out["times_ok"] == "True"
    assert out["finalized_at_exit"] == "True"


def test_mpi_errors_raise_as_after_mpi4pys_own_start():
    out = run_child("""
    from cupy_ep.mpi_start import start_mpi
    MPI = start_mpi(preload=None).MPI
    print(f"errhandler_return={MPI.COMM_WORLD.Get_errhandler() == MPI.ERRORS_RETURN}")
    try:
        MPI.COMM_WORLD.Send(b"x", dest=5)  # no rank 5 in a singleton
        print("raised=False")
    except MPI.Exception as e:
        print(f"raised={e.Get_error_class() == MPI.ERR_RANK}")
    """)
    assert out == {"errhandler_return": "True", "raised": "True"}


def test_a_preload_error_reaches_the_caller_and_mpi_still_finalizes():
    out = run_child(_AT_EXIT + """
    from cupy_ep.mpi_start import start_mpi
    def preload():
        raise ValueError("boom in preload")
    try:
        start_mpi(preload)
    except ValueError as e:
        print(f"error={e}")
    """.replace("\n    ", "\n"))
    assert out["error"] == "boom in preload"
    assert out["finalized_at_exit"] == "True"


def test_without_libmpi_in_the_maps_mpi4py_starts_mpi():
    out = run_child(_AT_EXIT + """
    from cupy_ep import mpi_start
    mpi_start.libmpi_path = lambda: None
    s = mpi_start.start_mpi(lambda: 3)
    print(f"how={s.how}")
    print(f"gpu={s.gpu}")
    print(f"initialized={s.MPI.Is_initialized()}")
    """.replace("\n    ", "\n"))
    assert out["how"] == "mpi4py" and out["gpu"] == "3" and out["initialized"] == "True"
    assert out["finalized_at_exit"] == "True"


def test_mpi_already_up_runs_the_preload_here():
    out = run_child("""
    import threading
    from mpi4py import MPI  # the usual start: MPI_Init inside the import
    from cupy_ep.mpi_start import start_mpi
    s = start_mpi(lambda: threading.current_thread() is threading.main_thread())
    print(f"how={s.how}")
    print(f"in_main_thread={s.gpu}")
    print(f"mpi_init_s={s.mpi_init_s}")
    """)
    assert out == {"how": "already", "in_main_thread": "True", "mpi_init_s": "0.0"}


def test_libmpi_path_finds_mpi4pys_library():
    out = run_child("""
    import mpi4py
    mpi4py.rc.initialize = False
    from mpi4py import MPI
    from cupy_ep.mpi_start import libmpi_path
    print(f"path={libmpi_path()}")
    """)
    assert os.path.basename(out["path"]).startswith("libmpi.so")


def test_import_cupy_ep_leaves_numpy_for_later():
    out = run_child("""
    import sys
    import cupy_ep
    print(f"numpy_loaded={'numpy' in sys.modules}")
    print(f"buffer_loaded={'cupy_ep.buffer' in sys.modules}")
    print(f"buffer_name={cupy_ep.Buffer.__name__}")
    print(f"numpy_after={'numpy' in sys.modules}")
    print(f"reference={cupy_ep.reference.__name__}")
    print(f"in_dir={'Buffer' in dir(cupy_ep) and 'start_mpi' in dir(cupy_ep)}")
    try:
        cupy_ep.no_such_name
    except AttributeError as e:
        print(f"missing={e}")
    """)
    assert out["numpy_loaded"] == "False" and out["buffer_loaded"] == "False"
    assert out["buffer_name"] == "Buffer" and out["numpy_after"] == "True"
    assert out["reference"] == "cupy_ep.reference" and out["in_dir"] == "True"
    assert "no_such_name" in out["missing"]
