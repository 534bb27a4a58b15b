"""Token-row arrays on the GPU must start at a 16-byte boundary (validate.check_array(aligned=True)): the kernels move
rows in 16-byte pieces, and a misaligned view would fail inside a kernel with a misaligned address, which poisons
the CUDA context. Checked without a GPU on CuPy arrays over a made-up device address (never dereferenced)."""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cupy_ep import interop, validate  # noqa: E402

T, H = 6, 256


def gpu_array(shape, dtype, offset=0):
    memory = cupy.cuda.UnownedMemory(1 << 40, 1 << 30, None, 0)
    return cupy.ndarray(shape, dtype=dtype, memptr=cupy.cuda.MemoryPointer(memory, offset))


@pytest.mark.parametrize("offset", [2, 4, 8, 14])
def test_misaligned_bf16_x_is_refused_by_name(offset):
    with pytest.raises(ValueError, match=rf"^x: must start at a multiple of 16 bytes .* starts {offset} bytes past"):
        validate.check_x(gpu_array((T, H), interop.BF16, offset), device=0)


@pytest.mark.parametrize("offset", [0, 16, 4096])
def test_aligned_x_passes(offset):
    info = validate.check_x(gpu_array((T, H), interop.BF16, offset), device=0)
    assert (info.num_tokens, info.hidden) == (T, H)


def test_misaligned_fp8_data_is_refused_but_its_scales_need_no_alignment():
    scales = gpu_array((T, H // 128), np.float32, 4)  # any float32 address (the kernels read scales one by one)
    assert validate.check_x((gpu_array((T, H), np.uint8), scales), device=0).num_scales == H // 128
    with pytest.raises(ValueError, match=r"^x\[0\]: must start at a multiple of 16 bytes"):
        validate.check_x((gpu_array((T, H), np.uint8, 1), scales), device=0)


def test_misaligned_combine_x_is_refused():
    with pytest.raises(ValueError, match=r"^x: must start at a multiple of 16 bytes"):
        validate.check_combine_x(gpu_array((T, H), interop.BF16, 6), device=0)


def test_host_arrays_are_not_checked_for_alignment():
    """The host backend's numpy arrays never reach a kernel."""
    flat = np.zeros(T * H + 1, dtype=np.uint16)
    x = flat[1:].view(interop.BF16).reshape(T, H)
    assert interop.data_ptr(x) % 16 != 0
    assert validate.check_x(x).num_tokens == T
