"""Fixtures shared by every test; reusable helpers live in tests/helpers.py (GPU tests import them too)."""
from __future__ import annotations

import pytest

from tests.helpers import HOST_NVL_BYTES, all_ok, gather_all, make_inputs  # noqa: F401  (re-exported for tests)


@pytest.fixture(scope="session")
def comm():
    """``MPI.COMM_WORLD``; the test is skipped where mpi4py cannot start."""
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError) as e:
        pytest.skip(f"mpi4py is not usable here: {e}")
    return MPI.COMM_WORLD


@pytest.fixture
def host_buffer(comm):
    """A fresh host-backend Buffer on COMM_WORLD, destroyed after the test."""
    from cupy_ep import Buffer
    buf = Buffer(comm, HOST_NVL_BYTES, backend="host")
    yield buf
    buf.destroy()
