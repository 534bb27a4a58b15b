"""What a GPU low-latency call hands its kernel, without a GPU: LowLatencyState.dispatch / combine run on CuPy arrays
over made-up device addresses, with fake streams, a fake allocator and a fake kernel that records its launches.

The kernels' arguments are pinned here one by one (low_latency.cu's parameter lists), so the host-side shortcuts
(remembered checks, per-shape argument caches, outputs carved from shared allocations) cannot change them; and the
outputs must be fresh, aligned, disjoint arrays of the documented shapes, allocated on the caller's stream."""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cupy_ep.cuda import low_latency as cll  # noqa: E402
from cupy_ep import interop  # noqa: E402
from cupy_ep.event import RecvHooks  # noqa: E402
from cupy_ep.ll_handle import LowLatencyHandle  # noqa: E402

R, M, H, E, T, K = 2, 16, 512, 8, 12, 3
RANK = 1  # not 0: another zero (the buffer index, say) in the rank argument's place must not pass for it
L, ROWS = E // R, R * M
BASE = 1 << 44


def gpu_array(shape, dtype, address=1 << 40):
    memory = cupy.cuda.UnownedMemory(address, 1 << 30, None, 0)
    return cupy.ndarray(shape, dtype=dtype, memptr=cupy.cuda.MemoryPointer(memory, 0))


class FakeStream:
    """A stream; ``current`` is CuPy's current-stream stack (entering a stream makes it current)."""
    ptr = 77

    def __init__(self, current):
        self.current = current

    def __enter__(self):
        self.current.append(self)
        return self

    def __exit__(self, *exc):
        assert self.current.pop() is self
        return False

    def is_capturing(self):
        return False


class FakeDevice:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class FakeBuf:
    device_id, num_ranks, rank = 0, R, RANK

    def __init__(self, current):
        self.ctx = gpu_array((64,), np.uint8, 1 << 41)
        self.device = FakeDevice()
        self.comm_stream = FakeStream(current)
        self.comm_stream.ptr = 1

    def check_usable(self):
        pass

    def begin(self, kind, previous_event):
        return self.compute

    def finish(self, compute, async_finish, keep, kind):
        from cupy_ep.event import EventOverlap
        return EventOverlap(None)


@pytest.fixture
def ll(monkeypatch):
    """``(state, launches, allocations, current)``: a LowLatencyState over fakes, called from CuPy code whose
    current stream is ``current[-1]`` (``state.buf.compute``, the caller's stream)."""
    current, launches, allocations = [], [], []
    buf = FakeBuf(current)
    buf.compute = FakeStream(current)
    current.append(buf.compute)
    monkeypatch.setattr(cll.interop, "current_stream", lambda kind, device_id=None: current[-1])
    next_address = [1 << 45]

    def alloc(nbytes):  # a bump allocator; records the stream it allocates on (CuPy's current one)
        address, next_address[0] = next_address[0], next_address[0] + (1 << 32)
        allocations.append((address, nbytes, current[-1]))
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(address, max(nbytes, 1), None, 0), 0)

    monkeypatch.setattr(cupy.cuda, "alloc", alloc)
    monkeypatch.setattr(cupy, "empty", lambda shape, dtype=float: cupy.ndarray(
        shape, dtype, alloc(int(np.prod(shape)) * np.dtype(dtype).itemsize)))
    state = cll.LowLatencyState.__new__(cll.LowLatencyState)
    state.buf = state.rt = buf  # the backend and its runtime in one fake
    state.num_bytes, state.base, state.num_blocks = 1 << 34, BASE, 132
    state.hooks, state.signal_shape, state.index, state.stamps = RecvHooks(), (M, H, E), 0, None
    state.direct, state.last_stream, state.force_put = True, None, False
    state.nvlink_peers, state.no_peers = gpu_array((R,), np.uint64, 1 << 42), gpu_array((R,), np.uint64, 1 << 43)
    state.workspace = gpu_array((cll._WORKSPACE_INTS,), np.int32, 1 << 39)

    class Kernel:
        def __init__(self, name):
            self.name = name

        def __call__(self, grid, block, args, shared_mem=0, stream=None):
            launches.append(dict(name=self.name, grid=grid, block=block, args=args, shared_mem=shared_mem,
                                 stream=stream))
    state.kernel = Kernel
    return state, launches, allocations, current


def span(a):
    return a.data.ptr, a.data.ptr + a.nbytes


def assert_int32(value, want):
    assert type(value) is np.int32 and value == want, (value, want)


def assert_common(state, args, index):
    """The arguments every low-latency kernel takes after its own: base, peers, buffer index, M, H, E, rank,
    num_ranks, workspace, shrink_mask (None without shrink mode)."""
    base, peers, idx, m, h, e, rank, num_ranks, workspace, shrink_mask = args
    assert type(base) is np.uint64 and base == BASE
    assert peers is (state.no_peers if state.force_put else state.nvlink_peers)
    assert_int32(idx, index)
    assert_int32(m, M), assert_int32(h, H), assert_int32(e, E)
    assert_int32(rank, RANK), assert_int32(num_ranks, R)
    assert workspace is state.workspace
    assert shrink_mask is state.shrink_mask


def dispatch(state, use_fp8=True, round_scale=False, use_ue8m0=False, return_recv_hook=False, stats=None,
             idx_dtype=np.int64, wait_stats=None):
    x = gpu_array((T, H), interop.BF16, 1 << 38)
    topk_idx = gpu_array((T, K), idx_dtype, 1 << 37)
    out = state.dispatch(x, topk_idx, M, E, stats, wait_stats, use_fp8, round_scale, use_ue8m0, False,
                         return_recv_hook, False)
    return x, topk_idx, out


@pytest.mark.parametrize("use_fp8, round_scale, use_ue8m0", [(True, False, False), (True, True, True),
                                                             (False, False, False)],
                         ids=["fp8", "fp8-ue8m0", "bf16"])
@pytest.mark.parametrize("idx_dtype", [np.int64, np.int32])
def test_dispatch_kernel_arguments(ll, use_fp8, round_scale, use_ue8m0, idx_dtype):
    state, launches, allocations, current = ll
    stats, wait_stats = gpu_array((L,), np.int32, 1 << 36), gpu_array((R,), np.int64, 1 << 31)
    for call in range(3):
        x, topk_idx, (out_x, count, handle, event, hook) = dispatch(state, use_fp8, round_scale, use_ue8m0,
                                                                      stats=stats, idx_dtype=idx_dtype,
                                                                      wait_stats=wait_stats)
        launch = launches[-1]
        ctype = "long long" if idx_dtype == np.int64 else "int"
        assert launch["name"] == f"ep::dispatch<{'true' if use_fp8 else 'false'}, {ctype}>"
        assert launch["grid"] == (132,) and launch["block"] == (cll._THREADS,) and launch["shared_mem"] == 0
        assert launch["stream"] is state.buf.compute
        args = launch["args"]
        assert len(args) == 27
        recv_x, scales, count_raw, src_info, layout_range, raw_stats, raw_wait, raw_x, raw_idx, slots = args[:10]
        assert recv_x.shape == (L, ROWS, H) and recv_x.dtype == (np.uint8 if use_fp8 else np.uint16)
        if use_fp8:
            columns = H // 512 if use_ue8m0 else H // 128
            assert scales.shape == (L, columns, ROWS) and scales.dtype == (np.int32 if use_ue8m0 else np.float32)
        else:
            assert scales is None
        assert count_raw.shape == (L,) and count_raw.dtype == np.int32
        assert src_info.shape == (L, ROWS) and src_info.dtype == np.int32
        assert layout_range.shape == (L, R) and layout_range.dtype == np.int64
        assert slots.shape == (T, K) and slots.dtype == np.int32
        assert raw_stats is stats and raw_wait is wait_stats and raw_idx is topk_idx
        assert raw_x.data.ptr == x.data.ptr and raw_x.dtype == np.uint16 and raw_x.shape == (T, H)
        for value, want in zip(args[10:14], (T, K, round_scale, use_ue8m0)):
            assert_int32(value, want)
        assert_common(state, args[14:24], call % 2)
        assert_int32(args[24], cll._SEND | cll._RECV)
        assert args[25] is None and args[26] is state.rt.ctx

        outputs = [a for a in (recv_x, scales, count_raw, src_info, layout_range, slots) if a is not None]
        assert all(a.flags.c_contiguous and a.data.ptr % 256 == 0 for a in outputs)
        spans = sorted(span(a) for a in outputs)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), "outputs overlap"
        # what the caller gets: the same memory, with the logical dtypes; scales column-major in the last two dims
        data = out_x[0] if use_fp8 else out_x
        assert data.data.ptr == recv_x.data.ptr and data.shape == recv_x.shape
        if use_fp8:
            assert out_x[1].data.ptr == scales.data.ptr and out_x[1].shape == (L, ROWS, columns)
            assert out_x[1].strides == (scales.strides[0], scales.strides[2], scales.strides[1])
        assert count is count_raw
        assert isinstance(handle, LowLatencyHandle) and tuple(handle[2:]) == (M, H, E)
        assert handle[0] is src_info and handle[1] is layout_range and handle.topk_slots is slots
        assert event.event is None and hook is None
    # every output allocated on the caller's stream, left current; fresh memory on every call
    assert allocations and all(stream is state.buf.compute for _, _, stream in allocations)
    assert current == [state.buf.compute]
    assert len({a for a, _, _ in allocations}) == len(allocations)


def test_dispatch_outputs_share_two_allocations(ll):
    """recv_x with its scales, and the count with the handle's arrays (kept apart: a handle kept for longer must
    not keep recv_x's memory alive)."""
    state, launches, allocations, _ = ll
    dispatch(state)
    recv_x, scales, count, src_info, layout_range, _, _, _, _, slots = launches[-1]["args"][:10]

    def allocation(a):
        return next(address for address, nbytes, _ in allocations if address <= a.data.ptr < address + nbytes)
    assert len(allocations) == 2
    assert allocation(recv_x) == allocation(scales) != allocation(count)
    assert {allocation(a) for a in (count, src_info, layout_range, slots)} == {allocation(count)}


def test_carve_gives_aligned_disjoint_arrays_of_one_allocation(ll):
    _, _, allocations, _ = ll
    specs = (((3, 5), np.dtype(np.uint8)), ((0, 4), np.dtype(np.int32)), ((7,), np.dtype(np.int64)),
             ((2, 3, 4), np.dtype(np.float32)))
    arrays = cll.carve(specs)
    (address, nbytes, _), = allocations
    assert [(a.shape, a.dtype) for a in arrays] == [(s, d) for s, d in specs]
    assert [a.data.ptr - address for a in arrays] == [0, 256, 256, 512]
    assert nbytes == 768 and all(a.flags.c_contiguous and a.base is None for a in arrays)


def test_dispatch_hook_launches_the_receive_phase_with_the_same_arguments(ll):
    state, launches, _, _ = ll
    _, _, (_, _, _, _, hook) = dispatch(state, return_recv_hook=True)
    hook()
    send, recv = launches
    assert send["stream"] is recv["stream"] is state.buf.comm_stream
    assert_int32(send["args"][24], cll._SEND), assert_int32(recv["args"][24], cll._RECV)
    for i, (a, b) in enumerate(zip(send["args"], recv["args"])):
        if i != 24:
            assert a is b or (isinstance(a, np.generic) and type(a) is type(b) and a == b), i


def combine(state, handle, out=None, zero_copy=False, bf16_partials=False, return_recv_hook=False,
            wait_stats=None, use_logfmt=False):
    x = None if zero_copy else gpu_array((L, ROWS, H), interop.BF16, 1 << 35)
    topk_idx = gpu_array((T, K), np.int64, 1 << 34)
    weights = gpu_array((T, K), np.float32, 1 << 33)
    result = state.combine(x, topk_idx, weights, handle, use_logfmt, zero_copy, False, return_recv_hook, out,
                           wait_stats, bf16_partials, False)
    return x, topk_idx, weights, result


@pytest.mark.parametrize("with_out, zero_copy, wire", [(False, False, cll.WIRE_24), (True, False, cll.WIRE_BF16),
                                                       (False, True, cll.WIRE_24), (False, False, cll.WIRE_LOGFMT)],
                         ids=["plain", "out-bf16-partials", "zero-copy", "logfmt"])
def test_combine_kernel_arguments(ll, with_out, zero_copy, wire):
    """The kernel's `wire` argument: the owner's format for its own tokens (0 24 bits, 1 bf16_partials, 2
    use_logfmt), as cuda_src/low_latency.cu's Wire."""
    bf16_partials, use_logfmt = wire == cll.WIRE_BF16, wire == cll.WIRE_LOGFMT
    state, launches, allocations, _ = ll
    _, _, (_, _, handle, _, _) = dispatch(state)
    wait_stats = gpu_array((R,), np.int64, 1 << 31) if with_out else None
    for call in range(3):
        out = gpu_array((T, H), interop.BF16, 1 << 32) if with_out else None
        x, topk_idx, weights, (combined, event, hook) = combine(state, handle, out, zero_copy, bf16_partials,
                                                                wait_stats=wait_stats, use_logfmt=use_logfmt)
        launch = launches[-1]
        assert launch["name"] == "ep::combine<long long>"
        assert launch["grid"] == (132,) and launch["block"] == (cll._COMBINE_THREADS,)
        assert launch["shared_mem"] == cll.combine_stage_bytes(K) and launch["stream"] is state.buf.compute
        args = launch["args"]
        assert len(args) == 24
        raw_out, raw_x, layout_range, raw_idx, slots, raw_w, raw_wait = args[:7]
        if with_out:
            assert combined is out and raw_out.data.ptr == out.data.ptr
        else:
            assert raw_out.shape == (T, H) and raw_out.dtype == np.uint16 and raw_out.data.ptr % 256 == 0
            assert combined.data.ptr == raw_out.data.ptr and combined.dtype == interop.BF16
        if zero_copy:
            assert raw_x is None
        else:
            assert raw_x.data.ptr == x.data.ptr and raw_x.dtype == np.uint16
        assert layout_range is handle[1] and slots is handle.topk_slots
        assert raw_idx is topk_idx and raw_w is weights and raw_wait is wait_stats
        for value, want in zip(args[7:11], (T, K, zero_copy, wire)):
            assert_int32(value, want)
        assert_common(state, args[11:21], (call + 1) % 2)  # the dispatch used buffer 0
        assert_int32(args[21], cll._SEND | cll._RECV)
        assert args[22] is None and args[23] is state.rt.ctx
        assert event.event is None and hook is None
    assert all(stream is state.buf.compute for _, _, stream in allocations)
    assert len(allocations) == 2 + (0 if with_out else 3)  # the dispatch's two, a combined_x per combine


def test_outputs_of_torch_callers_are_allocated_inside_their_stream():
    """interop.current_stream gives torch callers their torch stream, not CuPy's current one: enter it. A CuPy
    caller's stream is CuPy's current stream already."""
    stream = FakeStream([])
    assert cll.allocating_on(stream, interop.Kind("torch", True)) is stream
    with cll.allocating_on(stream, interop.Kind("cupy", True)):
        assert stream.current == []


def test_force_put_switches_the_peer_table_of_a_cached_shape(ll):
    state, launches, _, _ = ll
    dispatch(state)
    state.force_put = True
    dispatch(state)
    assert launches[0]["args"][15] is state.nvlink_peers and launches[1]["args"][15] is state.no_peers


def test_layout_is_computed_once_per_shape_and_its_size_checked_every_time(ll, monkeypatch):
    state, _, _, _ = ll
    computed = []
    real = cll._config.low_latency_layout
    monkeypatch.setattr(cll._config, "low_latency_layout", lambda *a: computed.append(a) or real(*a))
    first = state.layout(M, H, E)
    assert state.layout(M, H, E) is first and len(computed) == 1
    assert state.layout(2 * M, H, E) == real(2 * M, H, R, E) and len(computed) == 2
    assert state.layout(M, H, E) == first and len(computed) == 3
    state.num_bytes = first["total_bytes"] - 1
    state._last_layout = None
    for _ in range(2):
        with pytest.raises(ValueError, match=r"^num_rdma_bytes: .* bytes are too few"):
            state.layout(M, H, E)


def test_a_new_shape_cleans_the_buffer_first(ll, monkeypatch):
    state, launches, _, _ = ll
    cleaned = []
    monkeypatch.setattr(state, "clean", lambda *shape: cleaned.append(shape) or setattr(state, "signal_shape", shape))
    dispatch(state)
    x = gpu_array((T, H), interop.BF16)
    state.dispatch(x, gpu_array((T, K), np.int64), 2 * M, E, None, None, True, False, False, False, False, False)
    assert cleaned == [(2 * M, H, E)]
    assert_int32(launches[-1]["args"][17], 2 * M)
