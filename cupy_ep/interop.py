"""Arrays in and out: CuPy arrays, torch tensors (through DLPack, zero-copy) and numpy arrays (host backend).

Inside cupy_ep every payload is handled as *raw bytes of a known logical dtype*: bf16 travels as uint16,
fp8 e4m3 as uint8. ``unwrap`` turns a user array into ``(raw array, Kind)`` and ``wrap`` gives an output
back as the user's kind with the logical dtype restored. bf16/fp8 on the host use ml_dtypes.
"""
from __future__ import annotations

import dataclasses
import sys

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)

# logical dtype name -> (numpy dtype of the raw view, element size)
_RAW = {
    "bfloat16": np.dtype(np.uint16),
    "float8_e4m3fn": np.dtype(np.uint8),
    "uint8": np.dtype(np.uint8),
    "float32": np.dtype(np.float32),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "bool": np.dtype(np.bool_),
}


@dataclasses.dataclass(frozen=True)
class Kind:
    """Where an array came from: ``"cupy"``, ``"torch"`` or ``"numpy"``, and for torch whether it is on the GPU."""
    lib: str
    on_gpu: bool


_CUPY_KIND = Kind("cupy", True)
_NUMPY_KIND = Kind("numpy", False)


_LIB_BY_TYPE: dict = {}     # type -> "torch" | "cupy" | "numpy" | None  (hot path: no string work per call)
_NAME_BY_DTYPE: dict = {}   # numpy/CuPy dtype -> logical name


def _lib(x) -> str | None:
    t = type(x)
    lib = _LIB_BY_TYPE.get(t, False)
    if lib is False:
        module = t.__module__
        if module.startswith("torch") and hasattr(x, "data_ptr"):
            lib = "torch"
        elif module.startswith("cupy") and hasattr(x, "data"):
            lib = "cupy"
        elif isinstance(x, np.ndarray):
            lib = "numpy"
        else:
            lib = None
        _LIB_BY_TYPE[t] = lib
    return lib


def library_of(x) -> str | None:
    """``"torch"``, ``"cupy"`` or ``"numpy"`` for an array of that library, None for anything else."""
    return _lib(x)


def kind_of(x) -> Kind:
    lib = _lib(x)
    if lib == "torch":
        return Kind("torch", bool(x.is_cuda))
    if lib == "cupy":
        return _CUPY_KIND
    if lib == "numpy":
        return _NUMPY_KIND
    raise TypeError(f"expected a CuPy array, torch tensor or numpy array, got {type(x).__name__}")


def dtype_name(x) -> str:
    """The logical dtype of ``x`` as a string: 'bfloat16', 'float8_e4m3fn', 'float32', 'int64', ..."""
    dt = x.dtype
    name = _NAME_BY_DTYPE.get(dt)
    if name is None:
        if _lib(x) == "torch":
            name = str(dt).replace("torch.", "")
        else:
            dt = np.dtype(dt)
            name = ("bfloat16" if dt == BF16 else "float8_e4m3fn" if dt == FP8
                    else "bool" if dt == np.bool_ else dt.name)
        _NAME_BY_DTYPE[x.dtype] = name
    return name


def is_contiguous(x) -> bool:
    if _lib(x) == "torch":
        return bool(x.is_contiguous())
    return bool(x.flags.c_contiguous)


def data_ptr(x) -> int:
    """Address of the first element of a CuPy array, torch tensor or numpy array."""
    lib = _lib(x)
    if lib == "cupy":
        return x.data.ptr
    if lib == "torch":
        return x.data_ptr()
    return x.ctypes.data


def to_host(x) -> np.ndarray:
    """A numpy copy of ``x``'s values (its raw dtype), one device-to-host copy for a GPU array (which waits for
    the stream's work before it), ``x`` itself for a numpy array."""
    raw = unwrap(x)
    return np.asarray(raw.get() if hasattr(raw, "get") else raw)


def device_of(x) -> int | None:
    """CUDA device ordinal of a GPU array, None for host arrays."""
    lib = _lib(x)
    if lib == "cupy":
        return x.data.device_id
    if lib == "torch":
        return x.device.index if x.is_cuda else None
    return None


def array_signature(x):
    """Everything :func:`cupy_ep.validate.check_array` reads of ``x``, as a tuple that compares equal only for
    arrays it would treat alike: the type (its library; for torch ``device`` says whether it is on the GPU), the
    dtype, the shape, whether it is C-contiguous, the device and the address modulo 16 (``aligned``). None for
    None; for anything that is not a CuPy array or torch tensor a fresh object, equal to nothing (those never pass
    the GPU checks anyway).

    Why: a low-latency call remembers the signature of the last arguments that passed its checks and skips them
    when the next call's signature is the same (host time per call, :mod:`cupy_ep.cuda.low_latency`), so this must
    cost far less than the checks: attributes only, no string work."""
    if x is None:
        return None
    lib = _lib(x)
    if lib == "cupy":
        memory = x.data
        return type(x), x.dtype, x.shape, x.flags.c_contiguous, memory.device_id, memory.ptr % 16
    if lib == "torch":
        return type(x), x.dtype, x.shape, x.is_contiguous(), x.device, x.data_ptr() % 16
    return object()


def raw_dtype(name: str) -> np.dtype:
    try:
        return _RAW[name]
    except KeyError:
        raise TypeError(f"unsupported dtype {name}") from None


def unwrap(x, logical: str | None = None):
    """``x`` as a raw CuPy array (GPU) or numpy array (host), zero-copy, viewed as the raw dtype (None stays
    None: optional arguments pass straight through)."""
    if x is None:
        return None
    name = logical or dtype_name(x)
    raw = raw_dtype(name)
    if _lib(x) == "torch":
        import torch
        view_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[raw.itemsize]
        t = x if x.dtype == torch.bool else x.view(view_dtype)
        if t.is_cuda:
            import cupy
            return cupy.from_dlpack(t).view(raw)
        return t.numpy().view(raw)
    return x if x.dtype == raw else x.view(raw)


def wrap(raw, kind: Kind, name: str):
    """Give a raw output back as the user's kind with its logical dtype."""
    if raw is None:
        return None
    if kind.lib == "torch":
        import torch
        t = torch.from_dlpack(raw) if kind.on_gpu else torch.from_numpy(np.ascontiguousarray(raw))
        target = getattr(torch, name if name != "bool" else "bool")
        return t if t.dtype == target else t.view(target)
    if kind.lib == "numpy":
        return raw.view(BF16 if name == "bfloat16" else FP8 if name == "float8_e4m3fn" else raw.dtype)
    # CuPy: restore bf16 where CuPy knows it (it does when ml_dtypes is installed); fp8 stays uint8.
    if name == "bfloat16":
        try:
            return raw.view(BF16)
        except (TypeError, ValueError):
            return raw
    return raw


def alloc_dispatch_outputs(num_recv: int, info, raw_x, raw_scales, raw_idx, num_topk: int, with_x: bool = True):
    """``(recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights)`` of a GPU dispatch, raw CuPy arrays on the
    current stream (``info``: ``validate.check_x``'s result; scales / top-k None when the call has none;
    recv_x None unless ``with_x``: a zero-copy dispatch's rows stay in the buffer)."""
    import cupy
    recv_x = cupy.empty((num_recv, info.hidden), dtype=raw_x.dtype) if with_x else None
    recv_scales = cupy.empty((num_recv, info.num_scales), dtype=cupy.float32) if raw_scales is not None else None
    recv_idx = recv_w = None
    if raw_idx is not None:
        recv_idx = cupy.empty((num_recv, num_topk), dtype=raw_idx.dtype)
        recv_w = cupy.empty((num_recv, num_topk), dtype=cupy.float32)
    return recv_x, recv_scales, recv_idx, recv_w


def scale_strides(raw_scales) -> tuple[int, int]:
    """(token, hidden) strides of the FP8 scales in floats (any layout works), (0, 0) without scales."""
    return (0, 0) if raw_scales is None else tuple(s // 4 for s in raw_scales.strides)


def wrap_recv_x(recv_x, recv_scales, kind: Kind, info):
    """The dispatch's ``recv_x`` (or ``(recv_x, recv_x_scales)`` for FP8) as the kind ``x`` was."""
    x_name = info.dtype if kind.lib != "cupy" or info.dtype == "bfloat16" else dtype_name(info.x)
    out_x = wrap(recv_x, kind, x_name)
    if recv_scales is not None:
        out_x = (out_x, wrap(recv_scales, kind, "float32"))
    return out_x


def current_stream(kind: Kind, device_id: int | None = None):
    """The stream the caller's framework considers current (on ``device_id``; default that framework's current
    device), as a CuPy stream object: torch's current stream for torch CUDA tensors, else CuPy's."""
    if kind.lib == "torch" and kind.on_gpu:
        import torch
        if device_id is None:
            device_id = torch.cuda.current_device()
        stream = torch.cuda.current_stream(device_id)
        return cupy_stream(stream.cuda_stream, device_id)
    return _cupy_current_stream()


class _StreamHandle:
    """A raw ``cudaStream_t`` offered through the CUDA stream protocol (``__cuda_stream__`` returns
    ``(version, handle)``), the form ``cupy.cuda.Stream.from_external`` takes."""
    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


def cupy_stream(handle: int, device_id: int):
    """A CuPy stream object over another framework's stream ``handle`` (a ``cudaStream_t`` as an int; 0 is the
    legacy default stream) on device ``device_id``. The stream is not owned: its framework keeps it alive.

    CuPy 14 deprecates ``cupy.cuda.ExternalStream`` (a ``DeprecationWarning`` at every call) in favour of
    ``Stream.from_external``, which does not record the device; the callers work under the buffer's device, so
    none is needed. ``ExternalStream`` stays the way in where ``from_external`` is missing."""
    import cupy
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is None:
        return cupy.cuda.ExternalStream(int(handle), int(device_id))
    return from_external(_StreamHandle(int(handle)))


def current_device(kind: Kind) -> int:
    """The current CUDA device of the framework ``kind`` names (torch's for torch CUDA tensors, else CuPy's)."""
    if kind.lib == "torch" and kind.on_gpu:
        import torch
        return torch.cuda.current_device()
    import cupy
    return cupy.cuda.runtime.getDevice()


def _cupy_current_stream():
    import cupy
    return cupy.cuda.get_current_stream()


_TORCH_GPU_KIND = Kind("torch", True)
# CuPy's default streams: the legacy null stream (0, or cudaStreamLegacy = 1) and the per-thread one (2).
_DEFAULT_STREAMS = (0, 1, 2)


def caller_kind() -> Kind:
    """The framework a call without arrays serves (``Buffer.capture()``, the mask-buffer calls, and
    ``get_comm_stream()`` on a buffer no call has named a framework for yet): CuPy when the caller entered a CuPy
    stream (CuPy's current stream is not a default stream); else torch when torch is imported and has initialized
    CUDA in this process; else CuPy. Never imports torch.

    Why this order: torch users are told apart by torch having touched the GPU; a CuPy user who also uses torch
    either runs on the default streams, which both frameworks share, or has entered a CuPy stream, which names
    the stream meant."""
    if _cupy_current_stream().ptr not in _DEFAULT_STREAMS:
        return _CUPY_KIND
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return _TORCH_GPU_KIND
    return _CUPY_KIND


def requested_dtype(dtype):
    """A dtype a caller asks for (:meth:`cupy_ep.Buffer.get_local_buffer_tensor`): a torch dtype (returned as it
    is), or anything ``numpy.dtype`` takes (numpy / CuPy dtypes, ml_dtypes' bfloat16 and float8_e4m3fn, names).
    Returns ``(dtype, itemsize)``; TypeError naming ``dtype`` for anything else."""
    if type(dtype).__module__.startswith("torch"):
        return dtype, int(dtype.itemsize)
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype: must be a numpy, CuPy or torch dtype, got {dtype!r}") from None
    if dt.itemsize == 0 or dt.hasobject:
        raise TypeError(f"dtype: must be a fixed-size numeric dtype, got {dt}")
    return dt, dt.itemsize


def view_bytes(raw, dtype, shape: tuple):
    """``raw`` (a 1-D uint8 CuPy or numpy array of ``prod(shape) * itemsize`` bytes) viewed as ``dtype`` with
    ``shape``, zero-copy: a torch tensor for a torch dtype (through DLPack, or ``from_numpy`` on the host), else
    an array of raw's library. CuPy keeps float8 (and bfloat16, where it lacks ml_dtypes support) as unsigned
    integers of the same size, as every cupy_ep output does."""
    if type(dtype).__module__.startswith("torch"):
        import torch
        t = torch.from_numpy(raw) if isinstance(raw, np.ndarray) else torch.from_dlpack(raw)
        return t.view(dtype).reshape(shape)
    if not isinstance(raw, np.ndarray):
        try:
            return raw.view(dtype).reshape(shape)
        except (TypeError, ValueError):  # a dtype CuPy cannot hold (ml_dtypes' float8)
            return raw.view(np.dtype(f"u{dtype.itemsize}")).reshape(shape)
    return raw.view(dtype).reshape(shape)
