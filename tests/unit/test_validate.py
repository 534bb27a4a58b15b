"""validate.py on its own (no MPI, no GPU): the GPU path's argument checks name the argument."""
import ml_dtypes
import numpy as np
import pytest

from cupy_ep import validate


def test_host_array_refused_where_a_gpu_array_is_needed():
    x = np.zeros((4, 8), dtype=ml_dtypes.bfloat16)
    assert validate.check_array(x, "x", ("bfloat16",), ndim=2) == "bfloat16"   # host backend: fine
    with pytest.raises(TypeError, match=r"^x: is a host array"):
        validate.check_array(x, "x", ("bfloat16",), ndim=2, device=0)         # CUDA backend: refused


@pytest.mark.parametrize("bad, pattern", [
    (np.zeros((4, 8), np.float32), r"^x: dtype"),
    (np.zeros((4, 8, 2), ml_dtypes.bfloat16), r"^x: must be 2-D"),
    (np.zeros((8, 8), ml_dtypes.bfloat16)[:, ::2], r"^x: must be contiguous"),
    ([1, 2, 3], r"^x: must be an array \(numpy, CuPy or torch\), got a Python list of 3 int items"),
    ("abc", r"^x: expected a CuPy array"),
])
def test_check_array_names_the_argument(bad, pattern):
    with pytest.raises((TypeError, ValueError), match=pattern):
        validate.check_array(bad, "x", ("bfloat16",), ndim=2)


def test_check_x_fp8_and_topk():
    data = np.zeros((3, 256), np.uint8)
    info = validate.check_x((data, np.ones((3, 2), np.float32)))
    assert (info.dtype, info.num_scales, info.hidden_bytes) == ("float8_e4m3fn", 2, 256)
    with pytest.raises(ValueError, match=r"^x\[1\]: scales must have shape"):
        validate.check_x((data, np.ones((3, 3), np.float32)))
    with pytest.raises(ValueError, match=r"^topk_idx: values must lie in \[-1, 8\)"):
        validate.check_topk_idx(np.array([[0, 8]], np.int64), 8)
    with pytest.raises(ValueError, match=r"^topk_idx: top-k"):
        validate.check_topk_idx(np.zeros((2, 33), np.int64), 64)


def test_low_latency_dispatch_checks_read_topk_idx_once(monkeypatch):
    """With check_values the value checks and the routing digest read one host copy of topk_idx (each copy from a
    GPU is a sync); without, no copy and no digest."""
    from cupy_ep import handles, interop
    copies = []
    real = interop.to_host

    def counting(a):
        copies.append(a.shape)
        return real(a)
    monkeypatch.setattr(interop, "to_host", counting)
    x = np.zeros((4, 512), ml_dtypes.bfloat16)
    idx = np.array([[0, 5], [7, -1], [2, 3], [1, 6]], np.int64)
    args = (x, idx, 8, 8, None, None, True, False, False, False, False, 2)
    *_, routing = validate.check_low_latency_dispatch_args(*args, True)
    assert copies == [(4, 2)]
    assert routing == handles.routing_digest(idx.astype(np.int32)) and routing != handles.routing_digest(idx[::-1])
    copies.clear()
    assert validate.check_low_latency_dispatch_args(*args, False)[-1] is None and copies == []
    with pytest.raises(ValueError, match=r"^topk_idx: values must lie in \[-1, 8\)"):
        validate.check_low_latency_dispatch_args(x, np.full((4, 2), 8, np.int64), *args[2:], True)
