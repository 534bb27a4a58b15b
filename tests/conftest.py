"""Fixtures shared by every test; reusable helpers live in tests/helpers.py (GPU tests import them too)."""
from __future__ import annotations

import os

import pytest

from tests.helpers import HOST_NVL_BYTES, all_ok, gather_all, make_inputs  # noqa: F401  (re-exported for tests)


_NEED_WITH_MPI = "need --with-mpi option to run"  # pytest-mpi's skip reason for an MPI-marked test


def pytest_addoption(parser):
    parser.addoption(
        "--with-torchrun", action="store_true", default=False,
        help="run under torchrun (python -m torch.distributed.run): every test runs, as with --with-mpi, and the "
             "comm fixture is torch.distributed's default group (gloo, initialized here) through "
             "cupy_ep.bootstrap.TorchComm; mpi4py's MPI is never imported. Pair with -m mpi for the MPI tests only.")


def _torchrun(config) -> bool:
    return bool(config.getoption("--with-torchrun"))


def move_runs_last_to_end(items) -> None:
    """Reorders ``items`` in place: the tests marked ``runs_last`` after every other one, each part in its
    collection order. Such a test leaves process state that later tests cannot use (a timed-out kernel's
    buffer, a poisoned NVSHMEM or CUDA context), so the order is by marker, never by file name. Every rank of an
    MPI run computes the same order from the same collection."""
    last = []
    for item in items:
        mark = item.get_closest_marker("runs_last")
        if mark is None:
            continue
        if not (mark.kwargs.get("reason") or mark.args):
            raise pytest.UsageError(f"{item.nodeid}: runs_last needs a reason (what state the test leaves behind)")
        last.append(item)
    if last:
        marked = {id(item) for item in last}
        items[:] = [item for item in items if id(item) not in marked] + last


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Moves the ``runs_last`` tests to the end (:func:`move_runs_last_to_end`); under --with-torchrun the
    MPI-marked tests run: drop pytest-mpi's skip (it only knows --with-mpi)."""
    move_runs_last_to_end(items)
    if not _torchrun(config):
        return
    if config.getoption("--with-mpi", default=False) or config.getoption("--only-mpi", default=False):
        raise pytest.UsageError("--with-torchrun: pass it instead of --with-mpi / --only-mpi, not with them")
    for item in items:
        item.own_markers[:] = [m for m in item.own_markers
                               if not (m.name == "skip" and m.kwargs.get("reason") == _NEED_WITH_MPI)]


def pytest_runtest_setup(item):
    """Under --with-torchrun: pytest-mpi's ``min_size`` against the torchrun world size."""
    if not _torchrun(item.config):
        return
    size = int(os.environ.get("WORLD_SIZE", "1"))
    for mark in item.iter_markers(name="mpi"):
        min_size = mark.kwargs.get("min_size")
        if min_size is not None and size < min_size:
            pytest.skip(f"Test requires {min_size} ranks, only {size} torchrun ranks")


@pytest.fixture(scope="session")
def comm(request):
    """The job's communicator: ``MPI.COMM_WORLD`` (the test is skipped where mpi4py cannot start), or with
    --with-torchrun torch.distributed's default group (gloo) as a :class:`cupy_ep.bootstrap.TorchComm`."""
    if _torchrun(request.config):
        import torch.distributed as dist

        from cupy_ep.bootstrap.torch_group import TorchComm
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        return TorchComm(None)
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError) as e:
        pytest.skip(f"mpi4py is not usable here: {e}")
    return MPI.COMM_WORLD


@pytest.fixture
def host_buffer(comm):
    """A fresh host-backend Buffer on the ``comm`` fixture, destroyed after the test."""
    from cupy_ep import Buffer
    buf = Buffer(comm, HOST_NVL_BYTES, backend="host")
    yield buf
    buf.destroy()
