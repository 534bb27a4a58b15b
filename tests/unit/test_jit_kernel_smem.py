"""jit.Kernel sets the function's dynamic shared memory limit before a launch that needs one (no GPU: the CUDA
function and the driver call are fakes)."""
from __future__ import annotations

import pytest
from cupy.cuda import driver as cuda_driver  # importable without a GPU (jit.Kernel imports it the same way)

from cupy_ep import jit


class FakeFunction:
    ptr = 1234

    def __init__(self):
        self.launches = []

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        self.launches.append(shared_mem)


@pytest.fixture
def kernel_and_attrs(monkeypatch):
    attrs = []
    monkeypatch.setattr(cuda_driver, "funcSetAttribute", lambda ptr, attr, value: attrs.append((ptr, attr, value)))
    fn = FakeFunction()
    return jit.Kernel(None, fn, "k"), fn, attrs


def test_small_dynamic_shared_memory_is_set_too(kernel_and_attrs):
    # 32 KB is under 48 KB, but a kernel with ~19 KB of static shared memory cannot launch with it unless the
    # attribute says so: it must be set on the first call.
    k, fn, attrs = kernel_and_attrs
    k((1,), (32,), (), shared_mem=32 * 1024)
    assert attrs == [(1234, 8, 32 * 1024)]   # 8: CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    assert fn.launches == [32 * 1024]


def test_the_attribute_grows_only(kernel_and_attrs):
    k, _, attrs = kernel_and_attrs
    for smem in (0, 16 << 10, 128 << 10, 64 << 10, 128 << 10, 180 << 10):
        k((1,), (32,), (), shared_mem=smem)
    assert [a[2] for a in attrs] == [16 << 10, 128 << 10, 180 << 10]
