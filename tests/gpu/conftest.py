"""GPU tests: run under mpirun with one or more ranks per GPU; skipped with a reason where there is no GPU."""
from __future__ import annotations

import pytest

import cupy_ep
from cupy_ep import Config

_NO_GPU = pytest.mark.skip(reason="no GPU visible: the GPU tests run on the GPU machine (scripts/gpu_check.sh)")


def pytest_collection_modifyitems(config, items):
    if cupy_ep.gpu_available():
        return
    for item in items:
        if "tests/gpu/" in str(item.path).replace("\\", "/"):
            item.add_marker(_NO_GPU)

MAX_HIDDEN_BYTES = 32768          # hidden 16384 bf16, the largest case of the suite
MAX_SMS = 24


def nvl_bytes_for(num_ranks: int, hidden_bytes: int = MAX_HIDDEN_BYTES, num_sms: int = MAX_SMS) -> int:
    return Config(num_sms, 6, 256).get_nvl_buffer_size_hint(hidden_bytes, num_ranks)


@pytest.fixture(scope="module")
def gpu_buffer(comm):
    """One CUDA Buffer per test module, large enough for every case (collective create/destroy)."""
    buf = cupy_ep.Buffer(comm, num_nvl_bytes=nvl_bytes_for(comm.Get_size()), backend="cuda", timeout_s=60)
    yield buf
    buf.destroy()
