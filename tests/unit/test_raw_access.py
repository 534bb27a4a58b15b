"""DeepEP's raw-access methods on the host backend and their argument checks (no GPU): ``get_local_buffer_tensor``,
``get_comm_stream``, ``is_sm90_compiled``. tests/gpu/common/test_bootstrap.py checks the CUDA backend's view against
what the peers see through CUDA IPC."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import cupy_ep
from cupy_ep import validate
from cupy_ep import Buffer


@pytest.fixture
def buf():
    b = Buffer(MPI.COMM_SELF, num_nvl_bytes=4096, num_rdma_bytes=1024, low_latency_mode=True, backend="host")
    yield b
    b.destroy()


def test_views_alias_one_persistent_buffer(buf):
    """Two views of the same bytes see each other's writes, and the bytes outlive the views."""
    whole = buf.get_local_buffer_tensor(np.uint8)
    assert whole.shape == (4096,) and whole.dtype == np.uint8 and not whole.any()
    ints = buf.get_local_buffer_tensor(np.int32, 4, offset=8)
    ints[:] = [1, -2, 3, 70000]
    assert np.array_equal(whole[8:24].view(np.int32), [1, -2, 3, 70000])
    del ints, whole
    again = buf.get_local_buffer_tensor(np.dtype(np.int32), (2, 2), offset=8)
    assert again.shape == (2, 2) and again.tolist() == [[1, -2], [3, 70000]]


def test_rdma_buffer_is_another_region(buf):
    rdma = buf.get_local_buffer_tensor(np.float32, use_rdma_buffer=True)
    assert rdma.shape == (256,)
    rdma[:] = 1.5
    assert not buf.get_local_buffer_tensor(np.uint8).any()      # the NVLink buffer did not change


def test_low_precision_dtypes(buf):
    bf16 = buf.get_local_buffer_tensor(ml_dtypes.bfloat16, 8)
    bf16[:] = np.arange(8, dtype=np.float32).astype(ml_dtypes.bfloat16)
    assert bf16.dtype == np.dtype(ml_dtypes.bfloat16)
    assert np.array_equal(buf.get_local_buffer_tensor(np.uint16, 8), np.arange(8, dtype=np.float32)
                          .astype(ml_dtypes.bfloat16).view(np.uint16))
    assert buf.get_local_buffer_tensor(ml_dtypes.float8_e4m3fn, 3, offset=1).dtype.itemsize == 1


def test_torch_dtype_gives_a_tensor_over_the_same_bytes(buf):
    torch = pytest.importorskip("torch")
    t = buf.get_local_buffer_tensor(torch.int32, (3,), offset=16)
    assert isinstance(t, torch.Tensor) and t.dtype == torch.int32 and tuple(t.shape) == (3,)
    t[:] = torch.tensor([5, 6, 7], dtype=torch.int32)
    assert buf.get_local_buffer_tensor(np.int32, 3, offset=16).tolist() == [5, 6, 7]


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(dtype=np.int32, offset=2), ValueError, "^offset: must be a non-negative multiple of the dtype's 4"),
    (dict(dtype=np.int32, offset=-4), ValueError, "^offset:"),
    (dict(dtype=np.uint8, size=4097), ValueError, "^size: .* need 4097 bytes, the buffer has num_nvl_bytes=4096"),
    (dict(dtype=np.float64, size=(2, 300)), ValueError, "^size:"),
    (dict(dtype=np.uint8, size=-1), ValueError, "^size: dimensions must be non-negative"),
    (dict(dtype=np.uint8, size="big"), TypeError, "^size: must be an int or a shape"),
    (dict(dtype="not-a-dtype"), TypeError, "^dtype:"),
    (dict(dtype=object), TypeError, "^dtype: must be a fixed-size numeric dtype"),
    (dict(dtype=np.uint8, size=8, offset=4096), ValueError, "^size:"),
])
def test_bad_arguments_name_themselves(buf, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        buf.get_local_buffer_tensor(**kwargs)


def test_a_buffer_without_rdma_bytes_has_no_rdma_view():
    b = Buffer(MPI.COMM_SELF, num_nvl_bytes=64, backend="host")
    with pytest.raises(ValueError, match=r"^use_rdma_buffer: this Buffer has no such buffer \(num_rdma_bytes=0\)"):
        b.get_local_buffer_tensor(np.uint8, use_rdma_buffer=True)
    b.destroy()
    with pytest.raises(cupy_ep.BufferUnusableError):
        b.get_local_buffer_tensor(np.uint8)


def test_comm_stream_and_sm90_without_a_gpu(buf, monkeypatch):
    assert buf.get_comm_stream() is None            # the host backend runs every call synchronously
    monkeypatch.setattr(cupy_ep.buffer, "gpu_available", lambda: False)
    assert cupy_ep.Buffer.is_sm90_compiled() is False


def test_check_buffer_view_shapes():
    assert validate.check_buffer_view(100, 4, None, 8, "num_nvl_bytes") == (23,)   # whole elements only
    assert validate.check_buffer_view(100, 2, (5, 2), 0, "num_nvl_bytes") == (5, 2)
    assert validate.check_buffer_view(100, 1, 0, 100, "num_nvl_bytes") == (0,)
    assert validate.check_buffer_view(100, 1, np.int64(3), np.int64(97), "num_nvl_bytes") == (3,)
