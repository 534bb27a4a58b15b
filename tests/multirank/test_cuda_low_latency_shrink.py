"""Shrink mode (``Buffer(enable_shrink=True)``) of the GPU low-latency path, without a GPU: CudaBackend's mask methods
check their arguments (naming them) before anything runs; the kernels get the mask as an argument of every launch;
clean meets the unmasked ranks only (a timed point-to-point barrier, MPI tests below) and restarts the buffers; the
DeviceCtx mirror in cuda/runtime.py matches cuda_src/common/wait.cuh, whose timed wait compiles in both policies
(NVRTC, sm_90). The kernels' behaviour is tests/gpu/low_latency/test_low_latency_shrink.py's."""
from __future__ import annotations

import time
import types

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cupy_ep.cuda import low_latency as cll  # noqa: E402
from cupy_ep.cuda.backend import CudaBackend  # noqa: E402
from cupy_ep.cuda.runtime import CTX_DTYPE  # noqa: E402
from cupy_ep.errors import BufferUnusableError  # noqa: E402
from cupy_ep.event import RecvHooks  # noqa: E402
from tests.unit.test_cuda_low_latency_calls import (  # noqa: E402,F401  (ll: a fixture)
    R, FakeDevice, combine, dispatch, gpu_array, ll)

NUM_RANKS = 4


class _RecordingState:
    """Stands in for LowLatencyState: records what the mask methods hand it."""

    def __init__(self):
        self.calls = []

    def update_mask(self, rank, masked):
        self.calls.append(("update", rank, masked))

    def query_mask(self, mask_status):
        self.calls.append(("query", mask_status))

    def clean_mask(self):
        self.calls.append(("clean",))


def _buffer(enable_shrink=True, low_latency=True):
    buf = CudaBackend.__new__(CudaBackend)
    buf.runtime = types.SimpleNamespace(unusable_reason=None, check_health=lambda: None)  # no record to read
    buf._destroyed = False
    buf._device, buf.num_ranks, buf.device_id, buf.rank = FakeDevice(), NUM_RANKS, 0, 1
    buf.enable_shrink = enable_shrink
    buf._ll = _RecordingState() if low_latency else None
    return buf


def _vector(dtype=np.int32, n=NUM_RANKS, device=0, strides=None):
    memory = cupy.cuda.UnownedMemory(1 << 40, 1 << 20, None, device)
    shape = (n,) if strides is None else (n // 2,)
    return cupy.ndarray(shape, dtype=dtype, memptr=cupy.cuda.MemoryPointer(memory, 0), strides=strides)


def test_update_mask_checks_rank_to_mask_and_mask_first():
    buf = _buffer()
    for bad in (-1, NUM_RANKS, 99):
        with pytest.raises(ValueError, match=rf"^rank_to_mask: must be in \[0, {NUM_RANKS}\), got {bad}$"):
            buf.low_latency_update_mask_buffer(bad, True)
    for bad in (True, 1.0, "1", None):
        with pytest.raises(TypeError, match="^rank_to_mask: must be an int"):
            buf.low_latency_update_mask_buffer(bad, True)
    for bad in (1, None, "yes"):
        with pytest.raises(TypeError, match="^mask: must be a bool"):
            buf.low_latency_update_mask_buffer(2, bad)
    assert buf._ll.calls == []
    buf.low_latency_update_mask_buffer(np.int64(3), True)
    buf.low_latency_update_mask_buffer(0)  # DeepEP's default: unmask
    buf.low_latency_update_mask_buffer(2, np.bool_(True))
    assert buf._ll.calls == [("update", 3, True), ("update", 0, False), ("update", 2, True)]
    assert all(type(c[1]) is int and type(c[2]) is bool for c in buf._ll.calls)


def test_query_mask_checks_mask_status_first():
    buf = _buffer()
    cases = [(_vector(np.int64), TypeError, "^mask_status: dtype must be one of int32, got int64"),
             (_vector(n=NUM_RANKS + 1), ValueError, rf"^mask_status: must have shape \({NUM_RANKS},\)"),
             (_vector(n=2 * NUM_RANKS, strides=(8,)), ValueError, "^mask_status: must be contiguous"),
             (_vector(device=1), ValueError, "^mask_status: is on GPU 1, but this buffer uses GPU 0"),
             (np.zeros(NUM_RANKS, dtype=np.int32), TypeError, "^mask_status: is a host array"),
             (None, TypeError, "^mask_status: must not be None")]
    for status, error, message in cases:
        with pytest.raises(error, match=message):
            buf.low_latency_query_mask_buffer(status)
    assert buf._ll.calls == []
    good = _vector()
    buf.low_latency_query_mask_buffer(good)
    assert buf._ll.calls == [("query", good)]


def test_clean_mask_hands_over():
    buf = _buffer()
    buf.low_latency_clean_mask_buffer()
    assert buf._ll.calls == [("clean",)]


@pytest.mark.parametrize("enable_shrink, low_latency", [(False, True), (True, False)],
                         ids=["without-enable_shrink", "normal-mode"])
def test_mask_methods_need_a_shrink_buffer_before_anything_else(enable_shrink, low_latency):
    """Without a mask (no enable_shrink, or no low_latency_mode) every mask method raises ValueError naming
    enable_shrink, also before looking at its (here bad) arguments."""
    buf = _buffer(enable_shrink, low_latency)
    for call in (lambda: buf.low_latency_update_mask_buffer(0, True),
                 lambda: buf.low_latency_update_mask_buffer(-5, "bad"),
                 lambda: buf.low_latency_query_mask_buffer(_vector()),
                 lambda: buf.low_latency_query_mask_buffer(None),
                 buf.low_latency_clean_mask_buffer):
        with pytest.raises(ValueError, match="^enable_shrink: the mask buffer exists only in a Buffer created with "
                                             "low_latency_mode=True and enable_shrink=True"):
            call()
    assert buf._ll is None or buf._ll.calls == []


def test_mask_methods_of_a_destroyed_buffer_refuse():
    buf = _buffer()
    buf._destroyed = True
    with pytest.raises(BufferUnusableError):
        buf.low_latency_update_mask_buffer(0, True)
    buf._destroyed, buf._unusable_reason = False, "a device wait timed out"
    with pytest.raises(BufferUnusableError):
        buf.low_latency_clean_mask_buffer()
    assert buf._ll.calls == []


@pytest.mark.parametrize("shrink", [False, True], ids=["off", "on"])
def test_every_launch_gets_the_mask(ll, shrink):  # noqa: F811  (ll: the imported fixture)
    """The mask (None without shrink mode) is the last of the common arguments of both kernels, in one launch and in
    a hook's two (dispatch: argument 23, combine: 20; test_cuda_low_latency_calls pins the others)."""
    state, launches, _, _ = ll
    state.shrink_mask = gpu_array((R,), np.int32, 1 << 30) if shrink else None
    _, _, (_, _, handle, _, _) = dispatch(state)
    combine(state, handle)
    _, _, (_, _, handle, _, hook) = dispatch(state, return_recv_hook=True)
    hook()
    *_, (_, _, hook) = combine(state, handle, return_recv_hook=True)
    hook()
    assert [launch["name"].split("<")[0] for launch in launches] == ["ep::dispatch", "ep::combine"] + \
        ["ep::dispatch"] * 2 + ["ep::combine"] * 2
    for launch in launches:
        position = 23 if launch["name"].startswith("ep::dispatch") else 20
        assert launch["args"][position] is state.shrink_mask


# ---- clean ----------------------------------------------------------------------------------------------
class _Pointer:
    """A device pointer whose memsets are recorded as (offset, value, bytes, stream)."""

    def __init__(self, log, offset=0):
        self.log, self.offset = log, offset

    def __add__(self, n):
        return _Pointer(self.log, self.offset + n)

    def memset_async(self, value, nbytes, stream):
        self.log.append(("memset", self.offset, value, nbytes, stream))


class _Stream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def synchronize(self):
        self.log.append(("sync", self.name))


def _clean_state(log, shrink: bool):
    M, H, E = 16, 512, 8
    state = cll.LowLatencyState.__new__(cll.LowLatencyState)
    requests = []
    comm = types.SimpleNamespace(Ibarrier=lambda: requests.append("ibarrier") or types.SimpleNamespace(
        Test=lambda: True))
    state.buf = types.SimpleNamespace(num_ranks=2, rank=0, timeout_s=1.0, comm=comm,
                                      comm_stream=_Stream(log, "comm"))
    state.num_bytes, state.hooks, state.index, state.signal_shape = 1 << 30, RecvHooks(), 1, None
    state.memory, state.last_stream = _Pointer(log), _Stream(log, "last")
    state.workspace = types.SimpleNamespace(data=_Pointer(log, "workspace"), nbytes=4 * cll._WORKSPACE_INTS)
    if shrink:
        state.shrink_mask = object()
        state.shrink_barrier = lambda: log.append(("shrink barrier",))
    return state, requests, (M, H, E)


@pytest.mark.parametrize("shrink", [False, True], ids=["off", "on"])
def test_clean_meets_the_unmasked_ranks_and_restarts_the_buffers_in_shrink_mode(shrink):
    """clean: drain, barrier, zero both signal and both recv regions, barrier. Shrink mode: the barriers are the
    mask-aware ones (shrink_barrier, not the MPI Ibarrier over every rank), and the workspace is zeroed too and the
    next call uses buffer 0 (ranks unmasked after missing calls start where the others do). Without it the
    workspace and the buffer index are left alone."""
    log = []
    state, requests, (M, H, E) = _clean_state(log, shrink)
    state.clean(M, H, E)
    lay = cll._config.low_latency_layout(M, H, 2, E)
    zero = [("memset", 0, 0, 2 * lay["signal_bytes"], state.buf.comm_stream),
            ("memset", lay["recv_offset_0"], 0, 2 * lay["recv_bytes"], state.buf.comm_stream)]
    if shrink:
        zero.append(("memset", "workspace", 0, 4 * cll._WORKSPACE_INTS, state.buf.comm_stream))
    barrier = [("shrink barrier",)] if shrink else []
    assert log == [("sync", "last"), ("sync", "comm")] + barrier + zero + [("sync", "comm")] + barrier
    assert requests == ([] if shrink else ["ibarrier", "ibarrier"])
    assert state.index == (0 if shrink else 1) and state.signal_shape == (M, H, E)
    assert state.last_stream is state.buf.comm_stream


# ---- the mask's stream order ------------------------------------------------------------------------------
class _OrderStream:
    def __init__(self, log, name, ptr):
        self.log, self.name, self.ptr = log, name, ptr

    def __enter__(self):
        self.log.append(("enter", self.name))
        return self

    def __exit__(self, *exc):
        self.log.append(("exit", self.name))
        return False

    def is_capturing(self):
        return False

    def record(self):
        return f"event@{self.name}"

    def wait_event(self, event):
        self.log.append(("wait", self.name, event))


class _Mask:
    """A [R] int32 'device' mask over numpy whose writes are logged."""

    def __init__(self, log, n):
        self.log, self.values = log, np.zeros(n, dtype=np.int32)

    def __getitem__(self, index):
        log, values = self.log, self.values

        class View:
            def fill(self, v):
                log.append(("fill", index.start, v))
                values[index] = v
        return View()

    def fill(self, v):
        self.log.append(("fill all", v))
        self.values[:] = v

    def get(self):
        return self.values.copy()


def test_mask_updates_run_in_order_with_the_kernels(monkeypatch):
    """update_mask / clean_mask write the mask on the caller's current stream (a CuPy stream it entered, here) after
    the previous low-latency kernel (which ran on another stream here: the current stream waits for it), and the
    next kernel follows them (last_stream)."""
    log = []
    current = _OrderStream(log, "current", 5)
    monkeypatch.setattr(cll.interop, "_cupy_current_stream", lambda: current)
    state = cll.LowLatencyState.__new__(cll.LowLatencyState)
    state.buf = types.SimpleNamespace(device_id=0)
    state.shrink_mask = _Mask(log, NUM_RANKS)
    state.last_stream = _OrderStream(log, "kernel", 6)
    state.update_mask(2, True)
    assert log == [("wait", "current", "event@kernel"), ("enter", "current"), ("fill", 2, 1), ("exit", "current")]
    assert state.last_stream is current and state.shrink_mask.values.tolist() == [0, 0, 1, 0]
    log.clear()
    state.update_mask(2, False)
    state.update_mask(1, True)
    state.clean_mask()
    assert [e for e in log if e[0] != "enter" and e[0] != "exit"] == [("fill", 2, 0), ("fill", 1, 1), ("fill all", 0)]
    assert state.shrink_mask.values.tolist() == [0] * NUM_RANKS


# ---- the shrink barrier (MPI) ----------------------------------------------------------------------------
def _barrier_state(comm, masked, timeout_s):
    log = []
    state = cll.LowLatencyState.__new__(cll.LowLatencyState)
    stream = _OrderStream(log, "comm", 1)
    stream.synchronize = lambda: log.append(("sync", "comm"))
    state.buf = types.SimpleNamespace(rank=comm.Get_rank(), num_ranks=comm.Get_size(), timeout_s=timeout_s,
                                      comm_stream=stream)
    state.shrink_mask = _Mask(log, comm.Get_size())
    state.shrink_mask.values[sorted(masked)] = 1
    state._shrink_comm = comm.Dup()
    return state, log


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("last_masked", [False, True], ids=["absent-rank-unmasked", "absent-rank-masked"])
def test_shrink_barrier_goes_on_without_an_absent_rank(comm, last_masked):
    """The last rank does not come. Where it is masked already the others pass at once; where it is not, they pass
    after the timeout with it masked, without an error. (Then every rank frees the barrier's communicator, the
    absent one too, taking the tokens nobody received.)"""
    rank, last = comm.Get_rank(), comm.Get_size() - 1
    timeout_s = 5.0 if last_masked else 0.5
    state, log = _barrier_state(comm, {last} if last_masked else set(), timeout_s)
    ok = True
    if rank != last:
        start = time.monotonic()
        state.shrink_barrier()
        elapsed = time.monotonic() - start
        if last_masked:
            ok = elapsed < timeout_s / 2 and not any(e[0] == "fill" for e in log)
        else:
            ok = timeout_s <= elapsed < timeout_s + 2 and ("fill", last, 1) in log and ("sync", "comm") in log
        ok = ok and state.shrink_mask.values.tolist() == [0] * last + [1]
        if not ok:
            print(f"rank {rank}: {elapsed:.3f} s, {log}", flush=True)
    state.free_shrink_comm()
    from tests.helpers import all_ok
    assert all_ok(comm, ok)


@pytest.mark.mpi(min_size=2)
def test_shrink_barrier_of_every_rank_masks_nobody(comm):
    """Every rank comes: two barriers in a row pass quickly and mask nobody; so does one where every rank masked the
    same rank, which stays out of it."""
    rank, last = comm.Get_rank(), comm.Get_size() - 1
    state, log = _barrier_state(comm, set(), 5.0)
    start = time.monotonic()
    state.shrink_barrier()
    state.shrink_barrier()
    state.shrink_mask.values[last] = 1
    if rank != last:
        state.shrink_barrier()
    elapsed = time.monotonic() - start
    state.free_shrink_comm()
    from tests.helpers import all_ok
    ok = elapsed < 2.5 and not any(e[0] == "fill" for e in log)
    assert all_ok(comm, ok), f"rank {rank}: {elapsed:.3f} s, {log}"


# ---- compile-only: the DeviceCtx mirror and the timed wait's two policies ------------------------------------
_PROBE = r"""
#include "common/wait.cuh"
%s
namespace probe {
__global__ void wait_failing(const ep::DeviceCtx* ctx, const int* flag, int* out) {
    out[0] = ep::wait_until(ctx, ep::WaitSite{ep::kKernelLowLatencyDispatch, ep::kRoleReceiver, 0, out[1]},
                            [&] { return ep::ld_acquire_sys(flag) != 0; },
                            [&](long long& head, long long&, long long&) { head = ep::ld_volatile(flag); });
}
__global__ void wait_masking(const ep::DeviceCtx* ctx, const int* flag, int* out) {
    out[0] = ep::wait_until<true>(ctx, ep::WaitSite{ep::kKernelLowLatencyDispatch, ep::kRoleReceiver, 0, out[1]},
                                  [&] { return ep::ld_acquire_sys(flag) != 0; },
                                  [&](long long& head, long long&, long long&) { head = ep::ld_volatile(flag); });
}
}  // namespace probe
"""


def test_device_ctx_mirror_and_both_wait_policies_compile(tmp_path, monkeypatch):
    """runtime.CTX_DTYPE (what the host writes) has DeviceCtx's field offsets and size (static_asserts in a
    probe compiled with NVRTC for sm_90); wait_until compiles as the failing wait and as the masking one
    (kMaskPeer), both without spills."""
    from cupy_ep import jit
    asserts = [f'static_assert(__builtin_offsetof(ep::DeviceCtx, {name}) == {CTX_DTYPE.fields[name][1]}, '
               f'"DeviceCtx::{name} is not where runtime.CTX_DTYPE puts it");' for name in CTX_DTYPE.names]
    asserts.append(f'static_assert(sizeof(ep::DeviceCtx) == {CTX_DTYPE.itemsize}, "DeviceCtx size");')
    (tmp_path / "probe.cu").write_text(_PROBE % "\n".join(asserts))
    real = jit.source_dir()
    monkeypatch.setattr(jit, "source_dir", lambda: tmp_path)
    names = ["probe::wait_failing", "probe::wait_masking"]
    result = jit.compile_only("probe.cu", names, arch="sm_90", extra_options=(f"-I{real}",))
    resources = result.resources()
    for name in names:
        assert resources[result.mapping[name]].get("spill_stores", 0) == 0, resources
    assert "shrink_mask" in CTX_DTYPE.names
