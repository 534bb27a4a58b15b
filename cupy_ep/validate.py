"""Host-side argument checks shared by both backends.

Every check runs before any kernel is launched and raises ``TypeError`` (wrong kind or dtype) or
``ValueError`` (wrong shape, value or size) with the argument's name first in the message, so a bad call
leaves the buffer usable.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from . import config as _config
from . import ids, interop
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
    if isinstance(x, (list, tuple)):
        _fail(name, f"must be an array (numpy, CuPy or torch), got a Python {type(x).__name__} of {len(x)} "
                    f"{_item_kind(x)}; convert it first (e.g. numpy.asarray)", TypeError)
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
        check_topk_values(interop.to_host(topk_idx), num_experts, name)
    return num_tokens, num_topk


def check_topk_values(host, num_experts: int, name: str = "topk_idx") -> None:
    """The values of ``host`` (a top-k index array on the host) lie in ``[-1, num_experts)``."""
    if host.size:
        lo, hi = int(host.min()), int(host.max())
        if lo < -1 or hi >= num_experts:
            _fail(name, f"values must lie in [-1, {num_experts}), found min {lo} and max {hi}")


def _is_array(a) -> bool:
    try:
        interop.kind_of(a)
        return True
    except TypeError:
        return False


def is_array_pair(x) -> bool:
    """True when ``x`` looks like an FP8 pair: a 2-sequence whose first item is an array (the scales may be
    missing or wrong: check_x names them then) or any sequence of arrays (a pair of the wrong length)."""
    return bool(x) and all(_is_array(a) or a is None for a in x) and _is_array(x[0])


def _item_kind(x) -> str:
    kinds = sorted({type(a).__name__ for a in x})
    return "items" if not kinds else f"{'/'.join(kinds)} items"


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
    if isinstance(x, (tuple, list)) and not is_array_pair(x):
        # nested Python lists of numbers are data, not an FP8 pair: name what was passed
        _fail(name, f"must be an array (numpy, CuPy or torch) or the FP8 pair (x_e4m3, scales), got a Python "
                    f"{type(x).__name__} of {len(x)} {_item_kind(x)}; convert it first (e.g. numpy.asarray(..., "
                    "dtype=ml_dtypes.bfloat16))", TypeError)
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
    if (topk_idx is None) != (topk_weights is None):
        raise ValueError("topk_idx/topk_weights: give both or neither")
    if topk_idx is not None and getattr(topk_idx, "ndim", None) == 2 and topk_idx.shape[0] != T:
        # before the layout arrays: they were made from topk_idx, so a row count unlike x's is topk_idx's
        raise ValueError(f"topk_idx: has {topk_idx.shape[0]} rows but x has {T} (one top-k row per token)")
    check_array(num_tokens_per_rank, "num_tokens_per_rank", ("int32",), ndim=1, device=device)
    if tuple(num_tokens_per_rank.shape) != (R,):
        raise ValueError(f"num_tokens_per_rank: expected shape ({R},), got {tuple(num_tokens_per_rank.shape)}")
    check_array(is_token_in_rank, "is_token_in_rank", ("bool",), ndim=2, device=device)
    if tuple(is_token_in_rank.shape) != (T, R):
        raise ValueError(f"is_token_in_rank: expected shape {(T, R)}, got {tuple(is_token_in_rank.shape)}")
    check_array(num_tokens_per_expert, "num_tokens_per_expert", ("int32",), ndim=1, device=device)
    num_experts = int(num_tokens_per_expert.shape[0])
    try:
        check_num_experts(num_experts, R)
    except ValueError as e:
        raise ValueError(f"num_tokens_per_expert: its length {num_experts} is not a valid expert count ({e})") from None
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
    """``previous_event`` None or an :class:`~cupy_ep.event.EventOverlap`; the two flags bools; and
    ``allocate_on_comm_stream`` only with both of the others (as DeepEP)."""
    from .event import EventOverlap
    if previous_event is not None and not isinstance(previous_event, EventOverlap):
        _fail("previous_event", f"must be None or the EventOverlap a cupy_ep call returned "
                                f"(buffer.capture() makes one), got {type(previous_event).__name__}", TypeError)
    check_flag(async_finish, "async_finish")
    check_flag(allocate_on_comm_stream, "allocate_on_comm_stream")
    if allocate_on_comm_stream and (previous_event is None or not async_finish):
        _fail("allocate_on_comm_stream", "needs previous_event and async_finish=True")


# ---- low-latency mode (shared by host.backend.HostBackend and cuda.low_latency.LowLatencyState) ----------
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


def check_low_latency_topk(topk_idx, num_experts: int, check_values: bool, device=None):
    """``topk_idx [T, K]`` int32/int64 with ``K <= LOW_LATENCY_MAX_TOPK`` (32; DeepEP's kernels take 11). Returns
    the host copy of ``topk_idx`` that the value checks read (``check_values``; else None): the call's routing
    digest (:func:`cupy_ep.handles.routing_digest`) reads the same copy, as each copy from a GPU is a sync."""
    from .reference import LOW_LATENCY_MAX_TOPK
    check_topk_idx(topk_idx, num_experts, device=device, check_values=False)
    if topk_idx.shape[1] > LOW_LATENCY_MAX_TOPK:
        raise ValueError(f"topk_idx: the low-latency kernels take at most {LOW_LATENCY_MAX_TOPK} "
                         f"top-k slots, got {topk_idx.shape[1]}")
    if not check_values:
        return None
    host = interop.to_host(topk_idx)
    check_topk_values(host, num_experts)
    return host


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
    for a, name, shape in ((src_info, "src_info", (num_local, rows)),
                           (layout_range, "layout_range", (num_local, num_ranks))):
        if tuple(a.shape) != shape:
            raise ValueError(f"handle.{name}: must have shape {shape}, got {tuple(a.shape)}")
    raw_range = interop.unwrap(layout_range)
    if check_values:
        packed = interop.to_host(raw_range)
        begin, count = packed >> 32, packed & 0xFFFFFFFF
        if np.any(begin < 0) or np.any(begin + count > rows):
            raise ValueError(f"handle.layout_range: a (begin << 32) | count entry runs outside [0, {rows}) rows")
    return interop.unwrap(src_info), raw_range, max_tokens, hidden, num_experts


def check_low_latency_slots(handle, topk_idx, max_tokens: int, num_experts: int, check_values: bool, device=None,
                            shrink: bool = False):
    """The raw ``topk_slots`` ``[T, K] int32`` a low-latency combine finds its rows by (the dispatch's slot of each
    top-k entry of this rank: :class:`cupy_ep.handles.LowLatencyHandle`), after checking that ``topk_idx``
    (already checked) has the dispatch's shape, and, with ``check_values``, that every slot is -1 or below
    ``max_tokens`` (that reads them on the host).

    A handle rebuilt as a plain 5-tuple (DeepEP's callers may do that) carries no slots: they are computed again
    from ``topk_idx`` (:func:`low_latency_slots_of`, on its device), which is what the dispatch gave them when the
    combine gets the dispatch's routing. Not in shrink mode (``shrink``): there the slots also depend on the mask
    the dispatch saw."""
    slots = getattr(handle, "topk_slots", None)
    if slots is None:
        if shrink:
            raise ValueError(f"handle: a plain {type(handle).__name__} carries no topk_slots, and with "
                             "enable_shrink=True they depend on the mask the dispatch saw: pass the LowLatencyHandle "
                             "low_latency_dispatch returned")
        return low_latency_slots_of(interop.unwrap(topk_idx), max_tokens, num_experts)
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


def low_latency_slots_of(raw_topk_idx, max_tokens: int, num_experts: int):
    """The slots low-latency dispatch gives the top-k entries ``raw_topk_idx`` ``[T, K]`` (a numpy or CuPy array;
    the result ``[T, K] int32`` on the same device): entry (t, k)'s place among the entries before it, row-major,
    that select the same expert; -1 for no expert in ``[0, E)`` or a place of M or more. The same rule as
    :func:`cupy_ep.reference.low_latency_slots`, in array operations (a sort), so that it runs where the routing
    is, without a host copy."""
    xp = np if isinstance(raw_topk_idx, np.ndarray) else __import__("cupy")
    flat = raw_topk_idx.reshape(-1).astype(xp.int64)
    n = flat.size
    valid = (flat >= 0) & (flat < num_experts)
    # one key per entry: its expert (E for none) first, its position second, so the order is the same with any
    # sort (no reliance on a stable sort)
    key = xp.where(valid, flat, num_experts) * max(n, 1) + xp.arange(n, dtype=xp.int64)
    order = xp.argsort(key)
    expert = key[order] // max(n, 1)
    place = xp.arange(n, dtype=xp.int64) - xp.searchsorted(expert, expert, side="left")
    slots = xp.empty(n, dtype=xp.int32)
    slots[order] = xp.where((expert < num_experts) & (place < max_tokens), place, -1).astype(xp.int32)
    return slots.reshape(raw_topk_idx.shape)


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


# ---- what the buffer and the kernels can hold (the host backend refuses the same calls as the GPU) ---------------
def intranode_warps(num_ranks: int) -> int:
    """Warps of an intranode dispatch/combine block (Groups<kNumRanks>::kWarps in cuda_src/intranode/groups.cuh;
    tests/unit/test_mirrors.py compares at compile time)."""
    return (ids.INTRANODE_WARPS // num_ranks) * num_ranks


def intranode_remote_warps(num_ranks: int) -> int:
    """Sender warps per remote peer (RemoteGroups<kNumRanks>::kWarpsPerPeer, cuda_src/intranode/groups.cuh)."""
    per_rank, remote = ids.INTRANODE_WARPS // num_ranks, max(num_ranks - 1, 1)
    return max(intranode_warps(num_ranks) // remote, per_rank)


def intranode_dispatch_batch(num_ranks: int) -> int:
    """Ring slots a dispatch sender claims at once (RemoteGroups<kNumRanks>::kBatchTokens)."""
    return -(-intranode_remote_warps(num_ranks) * 4 // 32) * 32


COMBINE_TOKENS_PER_WARP = ids.COMBINE_TOKENS_PER_WARP  # kCombineTokensPerWarp in cuda_src/intranode/combine.cuh


def check_nvl_bytes(needed: int, num_nvl_bytes: int, what: str) -> None:
    if needed > num_nvl_bytes:
        raise ValueError(f"num_nvl_bytes: this {what} needs at least {needed} bytes of NVLink buffer, the "
                         f"buffer has {num_nvl_bytes} (use Buffer.get_nvl_buffer_size_hint)")


def check_intranode_dispatch_fits(cfg, num_ranks: int, num_nvl_bytes: int, hidden_bytes: int, num_topk: int,
                                  num_scales: int, zero_copy: bool, num_worst_tokens: int,
                                  cached_rows: int | None = None) -> int:
    """An intranode dispatch of ``cfg`` with these rows fits the buffer and the kernels' limits (``num_topk``: 0
    without top-k; ``cached_rows``: the rows a cached dispatch's handle received). Returns the zero-copy capacity in
    rows (0: the ring dispatch)."""
    channels, _ = cfg.intranode_dispatch_split(num_ranks)
    if zero_copy:
        capacity = _config.direct_dispatch_capacity(num_nvl_bytes, channels, hidden_bytes, max(num_topk, 1),
                                                    num_scales)
        if capacity < max(1, num_worst_tokens):
            raise ValueError(f"num_nvl_bytes: a zero-copy dispatch of {hidden_bytes}-byte rows fits {capacity} rows "
                             f"in this buffer ({num_nvl_bytes} bytes), it needs {max(1, num_worst_tokens)} "
                             "(Buffer.get_zero_copy_nvl_size_hint sizes it)")
        if cached_rows is not None and cached_rows > capacity:
            raise ValueError(f"handle: its dispatch received {cached_rows} rows, more than the {capacity} a "
                             f"zero-copy dispatch fits in num_nvl_bytes={num_nvl_bytes}")
        return capacity
    batch = intranode_dispatch_batch(num_ranks)
    if cfg.num_max_nvl_chunked_recv_tokens < batch:
        raise ValueError(f"config: dispatch at {num_ranks} ranks needs num_max_nvl_chunked_recv_tokens >= {batch} "
                         f"(the slots a sender claims at once), got {cfg.num_max_nvl_chunked_recv_tokens}")
    check_nvl_bytes(_config.NOTIFY_BYTES + _config.dispatch_channel_bytes(
        channels, num_ranks, cfg.num_max_nvl_chunked_recv_tokens, hidden_bytes, max(num_topk, 1), num_scales),
        num_nvl_bytes, "dispatch")
    return 0


def check_intranode_combine_fits(cfg, num_ranks: int, num_nvl_bytes: int, hidden: int, num_topk: int,
                                 num_tokens: int, zero_copy: bool) -> int:
    """An intranode combine of ``cfg`` (bf16 rows of ``hidden``; ``num_topk``: the weights' K, 1 without) fits the
    buffer and the kernels' limits. Returns the zero-copy capacity in rows per rank (0: the ring combine)."""
    if zero_copy:
        capacity = _config.direct_combine_capacity(num_nvl_bytes, num_ranks, hidden * 2, num_topk)
        if capacity < max(1, num_tokens):
            raise ValueError(f"num_nvl_bytes: a zero-copy combine of {hidden * 2}-byte rows fits {capacity} rows per "
                             f"rank in this buffer ({num_nvl_bytes} bytes), this rank's {num_tokens} tokens need as "
                             "many (Buffer.get_zero_copy_nvl_size_hint sizes it)")
        return capacity
    batch = intranode_warps(num_ranks) * COMBINE_TOKENS_PER_WARP
    if cfg.num_max_nvl_chunked_recv_tokens - cfg.num_max_nvl_chunked_send_tokens < batch:
        raise ValueError(f"config: combine needs num_max_nvl_chunked_recv_tokens - num_max_nvl_chunked_send_tokens "
                         f">= {batch} (the receiver's batch), got {cfg.num_max_nvl_chunked_recv_tokens} - "
                         f"{cfg.num_max_nvl_chunked_send_tokens}")
    check_nvl_bytes(_config.NOTIFY_BYTES + _config.combine_channel_bytes(
        cfg.num_channels, num_ranks, cfg.num_max_nvl_chunked_recv_tokens, hidden * 2, num_topk),
        num_nvl_bytes, "combine")
    return 0


def check_intranode_ranks(num_ranks: int) -> None:
    if not 1 <= num_ranks <= _config.MAX_NVL_RANKS:
        raise ValueError(f"comm: intranode supports 1..{_config.MAX_NVL_RANKS} ranks, got {num_ranks}")


def check_num_rdma_bytes(num_rdma_bytes: int) -> None:
    """low_latency_mode needs a symmetric buffer (an argument error: checked before what the machine allows)."""
    if num_rdma_bytes <= 0:
        raise ValueError("num_rdma_bytes: low_latency_mode needs a symmetric buffer; size it with "
                         "Buffer.get_low_latency_rdma_size_hint(...)")


def check_low_latency_rdma_bytes(num_rdma_bytes: int, max_tokens: int, hidden: int, num_ranks: int,
                                 num_experts: int) -> dict:
    """The (M, H, E) low-latency layout (:func:`cupy_ep.config.low_latency_layout`), after checking that it fits
    ``num_rdma_bytes``."""
    lay = _config.low_latency_layout(max_tokens, hidden, num_ranks, num_experts)
    if lay["total_bytes"] > num_rdma_bytes:
        raise ValueError(f"num_rdma_bytes: {num_rdma_bytes} bytes are too few for num_max_dispatch_tokens_per_rank="
                         f"{max_tokens}, hidden={hidden}, num_experts={num_experts} (needs {lay['total_bytes']}; use "
                         "Buffer.get_low_latency_rdma_size_hint)")
    return lay


def check_low_latency_experts(num_experts, num_ranks: int) -> int:
    check_num_experts(num_experts, num_ranks)
    if num_experts > _config.LL_MAX_EXPERTS:
        raise ValueError(f"num_experts: the low-latency kernels support up to {_config.LL_MAX_EXPERTS} experts, "
                         f"got {num_experts}")
    return num_experts


def check_low_latency_shape(max_tokens, hidden, num_experts, num_ranks: int) -> tuple[int, int, int]:
    """``(M, H, E)`` of clean_low_latency_buffer (and of every low-latency call)."""
    max_tokens = check_low_latency_max_tokens(max_tokens, num_ranks)
    hidden = check_positive_int(hidden, "hidden")
    if hidden % 128:
        raise ValueError(f"hidden: must be a multiple of 128 in low-latency mode, got {hidden}")
    return max_tokens, hidden, check_low_latency_experts(num_experts, num_ranks)


def check_low_latency_max_tokens(max_tokens, num_ranks: int) -> int:
    max_tokens = check_positive_int(max_tokens, "num_max_dispatch_tokens_per_rank")
    if max_tokens > _config.LL_MAX_TOKENS:
        raise ValueError(f"num_max_dispatch_tokens_per_rank: the low-latency kernels support up to "
                         f"{_config.LL_MAX_TOKENS}, got {max_tokens}")
    if (num_ranks * max_tokens) % 4:
        raise ValueError(f"num_max_dispatch_tokens_per_rank: num_ranks * num_max_dispatch_tokens_per_rank "
                         f"must be a multiple of 4 (DeepEP's TMA requirement), got {num_ranks} * {max_tokens}")
    return max_tokens


def check_low_latency_dispatch_args(x, topk_idx, max_tokens, num_experts, stats, wait_stats, use_fp8, round_scale,
                                    use_ue8m0, async_finish, return_recv_hook, num_ranks: int, check_values: bool,
                                    device=None):
    """Every argument of a low-latency dispatch, in the order both backends report them. Returns
    ``(M, T, H, (use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook), routing)``, ``routing`` the
    digest of ``topk_idx`` for the handle (:func:`cupy_ep.handles.routing_digest`; None without ``check_values``)."""
    from . import handles
    flags = tuple(check_flag(v, n) for v, n in (
        (use_fp8, "use_fp8"), (round_scale, "round_scale"), (use_ue8m0, "use_ue8m0"),
        (async_finish, "async_finish"), (return_recv_hook, "return_recv_hook")))
    max_tokens = check_low_latency_max_tokens(max_tokens, num_ranks)
    check_low_latency_experts(num_experts, num_ranks)
    check_array(x, "x", ("bfloat16",), ndim=2, device=device, aligned=True)
    num_tokens, hidden = x.shape
    if hidden <= 0 or hidden % 128:
        raise ValueError(f"x: hidden (shape[1]) must be a positive multiple of 128 in low-latency mode, got {hidden}")
    if flags[0] and hidden % 512:
        raise ValueError(f"x: FP8 low-latency dispatch needs hidden % 512 == 0 (as DeepEP), got {hidden}")
    if num_tokens > max_tokens:
        raise ValueError(f"x: has {num_tokens} tokens, more than num_max_dispatch_tokens_per_rank={max_tokens}")
    if flags[2] and not flags[1]:
        raise ValueError("use_ue8m0: UE8M0 scales need round_scale=True")
    if getattr(topk_idx, "ndim", None) == 2 and topk_idx.shape[0] != num_tokens:
        raise ValueError(f"topk_idx: must have {num_tokens} rows (as x), got {topk_idx.shape[0]}")
    host_idx = check_low_latency_topk(topk_idx, num_experts, check_values, device=device)
    if stats is not None:
        check_vector(stats, "cumulative_local_expert_recv_stats", "int32", num_experts // num_ranks, device)
    if wait_stats is not None:
        check_vector(wait_stats, "dispatch_wait_recv_cost_stats", "int64", num_ranks, device)
    if flags[3] and flags[4]:
        raise ValueError("return_recv_hook: cannot be used together with async_finish=True (as in DeepEP)")
    routing = handles.routing_digest(topk_idx, host=host_idx) if check_values else None
    return max_tokens, num_tokens, hidden, flags, routing


def check_low_latency_combine_args(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                   return_recv_hook, out, wait_stats, bf16_partials, num_ranks: int,
                                   check_values: bool, device=None, buffer_id=None, shrink: bool = False):
    """Every argument of a low-latency combine but the zero-copy buffer (the backends keep it differently);
    ``shrink``: the Buffer's ``enable_shrink`` (see :func:`check_low_latency_slots`).
    Returns ``(src_info, layout_range, topk_slots (raw), M, H, E, T, K, (use_logfmt, zero_copy, async_finish,
    return_recv_hook, bf16_partials))``."""
    from . import handles
    flags = tuple(check_flag(v, n) for v, n in (
        (use_logfmt, "use_logfmt"), (zero_copy, "zero_copy"), (async_finish, "async_finish"),
        (return_recv_hook, "return_recv_hook"), (bf16_partials, "bf16_partials")))
    use_logfmt, zero_copy, async_finish, return_recv_hook, bf16_partials = flags
    src_info, layout_range, max_tokens, hidden, num_experts = check_low_latency_handle(
        handle, num_ranks, check_values, device)
    handles.check_origin(handle, buffer_id)
    shape = (num_experts // num_ranks, num_ranks * max_tokens, hidden)
    if use_logfmt and zero_copy:
        raise ValueError("use_logfmt: cannot be used together with zero_copy=True (as in DeepEP)")
    if use_logfmt and bf16_partials:
        raise ValueError("use_logfmt: cannot be used together with bf16_partials=True (one wire format)")
    if x is not None or not zero_copy:
        check_array(x, "x", ("bfloat16",), ndim=3, device=device, aligned=True)
        if tuple(x.shape) != shape:
            raise ValueError(f"x: must have shape {shape} ([L, R*M, H] from the handle), got {tuple(x.shape)}")
    host_idx = check_low_latency_topk(topk_idx, num_experts, check_values, device=device)
    num_tokens, num_topk = topk_idx.shape
    if num_tokens > max_tokens:
        raise ValueError(f"topk_idx: has {num_tokens} rows, more than num_max_dispatch_tokens_per_rank="
                         f"{max_tokens} (from the handle)")
    slots = check_low_latency_slots(handle, topk_idx, max_tokens, num_experts, check_values, device=device,
                                    shrink=shrink)
    if check_values:
        handles.check_routing(handle, topk_idx, host=host_idx)
    check_topk_weights(topk_weights, num_tokens, num_topk, device=device)
    if out is not None:
        check_array(out, "out", ("bfloat16",), ndim=2, device=device, aligned=True)
        if tuple(out.shape) != (num_tokens, hidden):
            raise ValueError(f"out: must have shape {(num_tokens, hidden)}, got {tuple(out.shape)}")
    if wait_stats is not None:
        check_vector(wait_stats, "combine_wait_recv_cost_stats", "int64", num_ranks, device)
    if async_finish and return_recv_hook:
        raise ValueError("return_recv_hook: cannot be used together with async_finish=True (as in DeepEP)")
    return src_info, layout_range, slots, max_tokens, hidden, num_experts, num_tokens, num_topk, flags


# ---- shrink mode's mask methods (both backends) ------------------------------------------------------------
def check_shrink_enabled(enabled: bool) -> None:
    if not enabled:
        raise ValueError("enable_shrink: the mask buffer exists only in a Buffer created with "
                         "low_latency_mode=True and enable_shrink=True")


def check_rank_to_mask(rank_to_mask, num_ranks: int) -> int:
    if not isinstance(rank_to_mask, (int, np.integer)) or isinstance(rank_to_mask, (bool, np.bool_)):
        raise TypeError(f"rank_to_mask: must be an int, got {type(rank_to_mask).__name__}")
    if not 0 <= rank_to_mask < num_ranks:
        raise ValueError(f"rank_to_mask: must be in [0, {num_ranks}), got {rank_to_mask}")
    return int(rank_to_mask)


def check_mask_status(mask_status, num_ranks: int, device=None) -> None:
    check_vector(mask_status, "mask_status", "int32", num_ranks, device)


def check_low_latency_ranks(num_ranks: int) -> None:
    if num_ranks > _config.LL_MAX_RANKS:
        raise ValueError(f"comm: the low-latency kernels support up to {_config.LL_MAX_RANKS} ranks, got {num_ranks}")


def check_comm(comm) -> None:
    """``comm`` must be a communicator (:class:`cupy_ep.bootstrap.Comm`: mpi4py's, the torch adapter, or anything
    with their Get_rank / Get_size / allgather / Barrier)."""
    missing = [m for m in ("Get_rank", "Get_size", "allgather", "Barrier") if not callable(getattr(comm, m, None))]
    if missing:
        raise TypeError(f"comm: must be an mpi4py communicator (e.g. MPI.COMM_WORLD) or a torch.distributed "
                        f"ProcessGroup, got {type(comm).__name__} "
                        f"(no {', '.join(missing)})")
