"""Host-side argument checks shared by both backends.

Every check runs before any kernel is launched and raises ``TypeError`` (wrong kind or dtype) or
``ValueError`` (wrong shape, value or size) with the argument's name first in the message, so a bad call
leaves the buffer usable.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from . import interop
from .config import MAX_HIDDEN_BYTES, MAX_LOCAL_EXPERTS, MAX_TOPK


def _fail(name: str, what: str, exc=ValueError):
    raise exc(f"{name}: {what}")


ROW_ALIGN = 16  # bytes: the kernels move token rows in 16-byte pieces (int4 loads and stores, TMA bulk copies)


def check_array(x, name: str, dtypes: tuple, ndim: int | None = None, device: int | None = None,
                contiguous: bool = True, aligned: bool = False):
    """Kind, dtype, rank, contiguity and device of one array argument; returns its logical dtype name.
    ``aligned``: a GPU array of token rows must start at a multiple of ROW_ALIGN bytes (a view at an odd element
    offset would otherwise fail inside a kernel with a misaligned address, which poisons the CUDA context)."""
    if x is None:
        _fail(name, "must not be None", TypeError)
    try:
        kind = interop.kind_of(x)
    except TypeError as e:
        _fail(name, str(e), TypeError)
    dt = interop.dtype_name(x)
    if dt not in dtypes:
        _fail(name, f"dtype must be one of {', '.join(dtypes)}, got {dt}", TypeError)
    if ndim is not None and x.ndim != ndim:
        _fail(name, f"must be {ndim}-D, got shape {tuple(x.shape)}")
    if contiguous and not interop.is_contiguous(x):
        _fail(name, "must be contiguous (row-major)")
    if device is not None and not kind.on_gpu:
        _fail(name, "is a host array, but this buffer runs on the GPU: pass a CuPy array or a CUDA torch tensor",
              TypeError)
    if device is not None and kind.on_gpu and interop.device_of(x) != device:
        _fail(name, f"is on GPU {interop.device_of(x)}, but this buffer uses GPU {device}")
    offset = interop.data_ptr(x) % ROW_ALIGN if aligned and device is not None else 0
    if offset:
        _fail(name, f"must start at a multiple of {ROW_ALIGN} bytes (the kernels move rows in {ROW_ALIGN}-byte "
                    f"pieces); this one starts {offset} bytes past one (a view at an odd element offset?)")
    return dt


def check_num_experts(num_experts, num_ranks: int) -> int:
    if not isinstance(num_experts, int) or isinstance(num_experts, bool):
        _fail("num_experts", f"must be an int, got {type(num_experts).__name__}", TypeError)
    if num_experts <= 0 or num_experts % num_ranks:
        _fail("num_experts", f"must be a positive multiple of the rank count {num_ranks}, got {num_experts}")
    if num_experts // num_ranks > MAX_LOCAL_EXPERTS:
        _fail("num_experts", f"{num_experts // num_ranks} experts per rank exceed the limit {MAX_LOCAL_EXPERTS}")
    return num_experts


def check_topk_idx(topk_idx, num_experts: int | None, device=None, check_values: bool = True,
                   name: str = "topk_idx"):
    """``topk_idx [T, K]`` int32/int64 with 1 <= K <= 32 and values in [-1, num_experts)."""
    check_array(topk_idx, name, ("int64", "int32"), ndim=2, device=device)
    num_tokens, num_topk = topk_idx.shape
    if not 1 <= num_topk <= MAX_TOPK:
        _fail(name, f"top-k (shape[1]) must be in [1, {MAX_TOPK}], got {num_topk}")
    if check_values and num_experts is not None and num_tokens > 0:
        # one copy to the host (one sync) rather than a min and a max reduction on the device, each read back:
        # two kernels and two syncs per call (the top-k of a call is small: 8 KB at 128 tokens x top-8)
        host = interop.to_host(topk_idx)
        lo, hi = int(host.min()), int(host.max())
        if lo < -1 or hi >= num_experts:
            _fail(name, f"values must lie in [-1, {num_experts}), found min {lo} and max {hi}")
    return num_tokens, num_topk


@dataclasses.dataclass
class XInfo:
    """What dispatch needs to know of ``x``."""
    x: object                # the data array [T, H]
    scales: object | None    # [T, S] float32 (FP8 only)
    dtype: str               # 'bfloat16' or 'float8_e4m3fn' (uint8 is taken as raw e4m3)
    num_tokens: int
    hidden: int
    hidden_bytes: int
    num_scales: int


def check_x(x, device=None, name: str = "x") -> XInfo:
    """BF16 ``[T, H]`` or the FP8 pair ``(x_e4m3 [T, H], scales [T, ceil(H/128)] float32, any strides)``."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            _fail(name, f"an FP8 input must be the pair (x_e4m3, scales), got {len(x)} items")
        data, scales = x
        check_array(data, f"{name}[0]", ("float8_e4m3fn", "uint8"), ndim=2, device=device, aligned=True)
        if scales is None:
            _fail(f"{name}[1]", "FP8 dispatch needs the per-128-channel scales", TypeError)
        check_array(scales, f"{name}[1]", ("float32",), ndim=2, device=device, contiguous=False)
        num_tokens, hidden = data.shape
        num_scales = -(-hidden // 128)
        if tuple(scales.shape) != (num_tokens, num_scales):
            _fail(f"{name}[1]", f"scales must have shape {(num_tokens, num_scales)}, got {tuple(scales.shape)}")
        hidden_bytes = hidden
        info = XInfo(data, scales, "float8_e4m3fn", num_tokens, hidden, hidden_bytes, num_scales)
    else:
        check_array(x, name, ("bfloat16",), ndim=2, device=device, aligned=True)
        num_tokens, hidden = x.shape
        info = XInfo(x, None, "bfloat16", num_tokens, hidden, hidden * 2, 0)
    if info.hidden_bytes % 16:
        _fail(name, f"a row must be a multiple of 16 bytes, got hidden={info.hidden} ({info.hidden_bytes} bytes)")
    if info.hidden_bytes <= 0 or info.hidden_bytes > MAX_HIDDEN_BYTES:
        _fail(name, f"row bytes must be in [16, {MAX_HIDDEN_BYTES}], got {info.hidden_bytes}")
    return info


def check_topk_weights(topk_weights, num_tokens: int, num_topk: int, device=None,
                       name: str = "topk_weights"):
    check_array(topk_weights, name, ("float32",), ndim=2, device=device)
    if tuple(topk_weights.shape) != (num_tokens, num_topk):
        _fail(name, f"must have shape {(num_tokens, num_topk)}, got {tuple(topk_weights.shape)}")


def check_dispatch_layout_args(num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                               topk_weights, num_worst_tokens, num_ranks: int, num_tokens: int, device,
                               check_values: bool, what: str = "a non-cached dispatch", extra_required=()):
    """The layout and top-k arguments of a non-cached GPU dispatch (intranode and internode alike).

    ``extra_required``: more ``(name, value)`` pairs that must not be None (checked after
    ``num_tokens_per_rank``, in that order). Returns ``(num_experts, num_topk, idx_name)``; without top-k
    ``num_topk`` is 0 and ``idx_name`` "int64"."""
    required = (("num_tokens_per_rank", num_tokens_per_rank), *extra_required,
                ("is_token_in_rank", is_token_in_rank), ("num_tokens_per_expert", num_tokens_per_expert))
    for name, value in required:
        if value is None:
            raise ValueError(f"{name}: required for {what} (from get_dispatch_layout)")
    R, T = num_ranks, num_tokens
    check_array(num_tokens_per_rank, "num_tokens_per_rank", ("int32",), ndim=1, device=device)
    if tuple(num_tokens_per_rank.shape) != (R,):
        raise ValueError(f"num_tokens_per_rank: expected shape ({R},), got {tuple(num_tokens_per_rank.shape)}")
    check_array(is_token_in_rank, "is_token_in_rank", ("bool",), ndim=2, device=device)
    if tuple(is_token_in_rank.shape) != (T, R):
        raise ValueError(f"is_token_in_rank: expected shape {(T, R)}, got {tuple(is_token_in_rank.shape)}")
    check_array(num_tokens_per_expert, "num_tokens_per_expert", ("int32",), ndim=1, device=device)
    num_experts = int(num_tokens_per_expert.shape[0])
    check_num_experts(num_experts, R)
    if (topk_idx is None) != (topk_weights is None):
        raise ValueError("topk_idx/topk_weights: give both or neither")
    num_topk, idx_name = 0, "int64"
    if topk_idx is not None:
        t2, num_topk = check_topk_idx(topk_idx, num_experts, device, check_values)
        if t2 != T:
            raise ValueError(f"topk_idx: has {t2} rows but x has {T}")
        check_topk_weights(topk_weights, T, num_topk, device)
        idx_name = interop.dtype_name(topk_idx)
    if num_worst_tokens and topk_idx is None:
        raise ValueError("num_worst_tokens: needs topk_idx and topk_weights")
    return num_experts, num_topk, idx_name


def check_combine_x(x, device) -> tuple[int, int]:
    """``x`` of a GPU combine: bf16 ``[N, H]`` with 16-byte rows; returns ``(N, H)``."""
    check_array(x, "x", ("bfloat16",), ndim=2, device=device, aligned=True)
    num_recv, hidden = x.shape
    if (hidden * 2) % 16:
        raise ValueError(f"x: a row must be a multiple of 16 bytes, got hidden={hidden}")
    return int(num_recv), int(hidden)


def check_combine_topk_weights(topk_weights, num_recv: int, device) -> int | None:
    """``topk_weights`` of a GPU combine: None or float32 ``[N, K<=32]``; returns K (None without)."""
    if topk_weights is None:
        return None
    check_array(topk_weights, "topk_weights", ("float32",), ndim=2, device=device)
    if topk_weights.shape[0] != num_recv or not 1 <= topk_weights.shape[1] <= MAX_TOPK:
        raise ValueError(f"topk_weights: expected shape ({num_recv}, K<=32), got {tuple(topk_weights.shape)}")
    return int(topk_weights.shape[1])


def check_expert_alignment(expert_alignment) -> int:
    if not isinstance(expert_alignment, int) or isinstance(expert_alignment, bool) or expert_alignment < 1:
        _fail("expert_alignment", f"must be a positive int, got {expert_alignment!r}")
    return expert_alignment


def check_num_worst_tokens(num_worst_tokens, num_ranks: int, num_tokens: int) -> int:
    if not isinstance(num_worst_tokens, int) or isinstance(num_worst_tokens, bool) or num_worst_tokens < 0:
        _fail("num_worst_tokens", f"must be a non-negative int, got {num_worst_tokens!r}")
    return num_worst_tokens


def check_bias(bias, num_tokens: int, hidden: int, device=None):
    """None, one ``[T, H]`` bf16 array, or a pair (either may be None); returns a 2-list."""
    if bias is None:
        return [None, None]
    items = list(bias) if isinstance(bias, (tuple, list)) else [bias]
    if len(items) > 2:
        _fail("bias", f"at most two biases, got {len(items)}")
    items += [None] * (2 - len(items))
    for i, b in enumerate(items):
        if b is None:
            continue
        check_array(b, f"bias[{i}]", ("bfloat16",), ndim=2, device=device, aligned=True)
        if tuple(b.shape) != (num_tokens, hidden):
            _fail(f"bias[{i}]", f"must have shape {(num_tokens, hidden)}, got {tuple(b.shape)}")
    return items


def check_stream_args(previous_event, async_finish: bool, allocate_on_comm_stream: bool):
    if allocate_on_comm_stream and (previous_event is None or not async_finish):
        _fail("allocate_on_comm_stream", "needs previous_event and async_finish=True")


# ---- low-latency mode (shared by host_backend.HostBuffer and cuda_low_latency.LowLatencyState) ----------
def check_flag(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: must be a bool, got {type(value).__name__}")
    return bool(value)


def check_positive_int(value, name: str) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)) or value <= 0:
        raise ValueError(f"{name}: must be a positive int, got {value!r}")
    return int(value)


def check_vector(a, name: str, dtype: str, length: int, device=None) -> None:
    check_array(a, name, (dtype,), ndim=1, device=device)
    if tuple(a.shape) != (length,):
        raise ValueError(f"{name}: must have shape ({length},), got {tuple(a.shape)}")


def check_low_latency_topk(topk_idx, num_experts: int, check_values: bool, device=None) -> None:
    """``topk_idx [T, K]`` int32/int64 with ``K <= 11`` (DeepEP's low-latency ``kNumMaxTopK``)."""
    from .reference import LOW_LATENCY_MAX_TOPK
    check_topk_idx(topk_idx, num_experts, device=device, check_values=check_values)
    if topk_idx.shape[1] > LOW_LATENCY_MAX_TOPK:
        raise ValueError(f"topk_idx: the low-latency kernels take at most {LOW_LATENCY_MAX_TOPK} "
                         f"top-k slots, got {topk_idx.shape[1]}")


def last_two_transposed(a, kind: interop.Kind):
    """A view of ``a`` (3-D, numpy, CuPy or torch) with its last two dimensions swapped."""
    return a.transpose(1, 2) if kind.lib == "torch" else a.transpose(0, 2, 1)


def check_low_latency_handle(handle, num_ranks: int, check_values: bool, device=None) -> tuple:
    """``(src_info raw, layout_range raw, M, H, E)`` of a low-latency dispatch handle, after checking its types
    and shapes (and, with ``check_values``, that every ``(begin << 32) | count`` range fits its expert's rows;
    that reads ``layout_range`` on the host)."""
    if not isinstance(handle, (tuple, list)) or len(handle) != 5:
        got = type(handle).__name__ + (f" of {len(handle)}" if isinstance(handle, (tuple, list)) else "")
        raise ValueError("handle: must be the 5-tuple (src_info, layout_range, num_max_dispatch_tokens_per_rank, "
                         f"hidden, num_experts) low_latency_dispatch returned, got {got}")
    src_info, layout_range, max_tokens, hidden, num_experts = handle
    for value, name in ((max_tokens, "num_max_dispatch_tokens_per_rank"), (hidden, "hidden"),
                        (num_experts, "num_experts")):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"handle: its {name} must be a positive int, got {value!r}")
    max_tokens, hidden, num_experts = int(max_tokens), int(hidden), int(num_experts)
    if hidden % 128 or num_experts % num_ranks:
        raise ValueError(f"handle: hidden={hidden} must be a multiple of 128 and num_experts={num_experts} "
                         f"a multiple of the rank count {num_ranks}")
    num_local, rows = num_experts // num_ranks, num_ranks * max_tokens
    check_array(src_info, "handle.src_info", ("int32",), ndim=2, device=device)
    check_array(layout_range, "handle.layout_range", ("int64",), ndim=2, device=device)
    for a, name, shape in ((src_info, "src_info", (num_local, rows)), (layout_range, "layout_range", (num_local, num_ranks))):
        if tuple(a.shape) != shape:
            raise ValueError(f"handle.{name}: must have shape {shape}, got {tuple(a.shape)}")
    raw_range = interop.unwrap(layout_range)
    if check_values:
        packed = interop.to_host(raw_range)
        begin, count = packed >> 32, packed & 0xFFFFFFFF
        if np.any(begin < 0) or np.any(begin + count > rows):
            raise ValueError(f"handle.layout_range: a (begin << 32) | count entry runs outside [0, {rows}) rows")
    return interop.unwrap(src_info), raw_range, max_tokens, hidden, num_experts


def check_low_latency_slots(handle, topk_idx, max_tokens: int, check_values: bool, device=None):
    """The raw ``topk_slots`` ``[T, K] int32`` a low-latency combine finds its rows by (the dispatch's slot of each
    top-k entry of this rank: :class:`cupy_ep.ll_handle.LowLatencyHandle`), after checking that ``handle``
    carries them, that ``topk_idx`` (already checked) has the dispatch's shape, and, with ``check_values``, that
    every slot is -1 or below ``max_tokens`` (that reads them on the host)."""
    slots = getattr(handle, "topk_slots", None)
    if slots is None:
        raise ValueError("handle: must be the LowLatencyHandle low_latency_dispatch returned (it carries the "
                         f"dispatch's topk_slots), got a plain {type(handle).__name__}")
    check_array(slots, "handle.topk_slots", ("int32",), ndim=2, device=device)
    if tuple(topk_idx.shape) != tuple(slots.shape):
        raise ValueError(f"topk_idx: must have the dispatch's shape {tuple(slots.shape)} (pass the routing of the "
                         f"dispatch that made the handle), got {tuple(topk_idx.shape)}")
    raw = interop.unwrap(slots)
    if check_values and raw.size:
        host = interop.to_host(raw)
        if host.min() < -1 or host.max() >= max_tokens:
            raise ValueError(f"handle.topk_slots: slots must lie in [-1, {max_tokens}), got "
                             f"[{int(host.min())}, {int(host.max())}]")
    return raw


def check_buffer_view(nbytes: int, itemsize: int, size, offset, region: str) -> tuple:
    """The shape of a view of ``itemsize``-byte elements at byte ``offset`` of a buffer of ``nbytes``
    (:meth:`cupy_ep.Buffer.get_local_buffer_tensor`): ``size`` an element count or a shape, None for every whole
    element to the end. ValueError naming the argument when it does not fit (``region``: the buffer's size
    argument, for the message)."""
    if nbytes <= 0:
        raise ValueError(f"use_rdma_buffer: this Buffer has no such buffer ({region}=0)")
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or offset < 0 or offset % itemsize:
        raise ValueError(f"offset: must be a non-negative multiple of the dtype's {itemsize} bytes, got {offset!r}")
    if size is None:
        shape = ((nbytes - offset) // itemsize,)
    else:
        dims = (size,) if isinstance(size, (int, np.integer)) else tuple(size) if isinstance(size, (tuple, list)) \
            else None  # (torch.Size is a tuple)
        if dims is None or not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in dims):
            raise TypeError(f"size: must be an int or a shape (a tuple of ints), got {size!r}")
        shape = tuple(int(d) for d in dims)
        if any(d < 0 for d in shape):
            raise ValueError(f"size: dimensions must be non-negative ints, got {size!r}")
    need = offset + int(np.prod(shape, dtype=np.int64)) * itemsize
    if offset > nbytes or need > nbytes:
        raise ValueError(f"size: {shape} elements of {itemsize} bytes at offset {offset} need {need} bytes, the "
                         f"buffer has {region}={nbytes}")
    return shape
