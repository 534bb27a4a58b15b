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


class BufferSlot:
    """A test module's Buffer, rebuilt for the next test when a test left it unusable (a device wait that timed
    out, a call the ranks disagreed about): one failure then costs one test, not every later test of the module.

    ``make()`` creates the Buffer (collective). :meth:`get` is collective too: the ranks agree whether any rank's
    buffer is unusable, and then every rank destroys its own and makes a new one together."""

    def __init__(self, comm, make):
        self.comm, self.make = comm, make
        self.buf = make()
        self.rebuilt = 0

    def get(self):
        reason = self.buf.impl._unusable_reason or ("destroyed" if self.buf.impl._destroyed else None)
        reasons = [r for r in self.comm.allgather(reason) if r]
        if reasons:
            if self.comm.Get_rank() == 0:
                print(f"\n[tests] a previous test left the module's Buffer unusable ({reasons[0]}); making a new one")
            try:
                self.buf.destroy()
            except Exception as e:  # the old buffer's teardown failing must not cost the next test too
                print(f"[tests] rank {self.comm.Get_rank()}: destroying the unusable Buffer raised {e!r}")
            self.buf = self.make()
            self.rebuilt += 1
        return self.buf

    def close(self):
        self.buf.destroy()


@pytest.fixture(scope="module")
def _gpu_buffer_slot(comm):
    slot = BufferSlot(comm, lambda: cupy_ep.Buffer(comm, num_nvl_bytes=nvl_bytes_for(comm.Get_size()),
                                                   backend="cuda", timeout_s=60))
    yield slot
    slot.close()


@pytest.fixture
def gpu_buffer(_gpu_buffer_slot):
    """One CUDA Buffer per test module, large enough for every case (collective create/destroy); made anew for a
    test when an earlier one left it unusable (:class:`BufferSlot`)."""
    return _gpu_buffer_slot.get()
