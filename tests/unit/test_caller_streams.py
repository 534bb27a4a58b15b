"""Which stream a call's events use, without a GPU (fakes for the streams and for torch): the framework a call
without arrays serves (``interop.caller_kind``), the CUDA runtime's ``begin`` / ``finish`` (an async event makes
the current stream of the call's framework wait, not CuPy's), ``Buffer.capture()`` and ``get_comm_stream()``."""
from __future__ import annotations

import sys
import types

import pytest

import cupy_ep
from cupy_ep import interop
from cupy_ep.cuda.backend import CudaBackend
from cupy_ep.cuda.runtime import Runtime
from cupy_ep.event import HOST_EVENT, EventOverlap, HostEvent

TORCH = interop.Kind("torch", True)
CUPY = interop.Kind("cupy", True)


class FakeStream:
    def __init__(self, name, log, ptr):
        self.name, self.log, self.ptr = name, log, ptr

    def record(self, event=None):
        self.log.append(("record", self.name))
        return f"event@{self.name}"

    def wait_event(self, event):
        self.log.append(("wait", self.name, event))


class FakeEvent:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def record(self, stream):
        self.log.append(("record", self.name, stream.name))


def _fake_torch(initialized: bool):
    cuda = types.SimpleNamespace(is_initialized=lambda: initialized)
    return types.SimpleNamespace(cuda=cuda)


@pytest.fixture
def streams(monkeypatch):
    """Per framework a current stream: CuPy's (default: the legacy null stream, ptr 0) and torch's."""
    log: list = []
    state = types.SimpleNamespace(log=log, cupy=FakeStream("cupy-default", log, 0), torch=FakeStream("torch", log, 9))
    monkeypatch.setattr(interop, "_cupy_current_stream", lambda: state.cupy)
    monkeypatch.setattr(interop, "current_stream",
                        lambda kind, device_id=None: state.torch if kind.lib == "torch" else state.cupy)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    return state


@pytest.mark.parametrize("cupy_ptr, torch_state, want", [
    (0, None, "cupy"),             # no torch in the process
    (0, False, "cupy"),            # torch imported, never touched the GPU
    (0, True, "torch"),            # a torch user on CuPy's default stream
    (2, True, "torch"),            # ... also with CuPy's per-thread default stream
    (1, True, "torch"),            # ... and cudaStreamLegacy
    (0x7f00, True, "cupy"),        # the caller entered a CuPy stream: that one is meant
    (0x7f00, None, "cupy"),
])
def test_caller_kind(streams, monkeypatch, cupy_ptr, torch_state, want):
    streams.cupy.ptr = cupy_ptr
    if torch_state is not None:
        monkeypatch.setitem(sys.modules, "torch", _fake_torch(torch_state))
    assert interop.caller_kind().lib == want


def _runtime(log):
    rt = Runtime.__new__(Runtime)
    rt.comm_stream = FakeStream("comm", log, 3)
    rt._fork_event, rt._join_event = FakeEvent("fork", log), FakeEvent("join", log)
    rt.device_id = 0
    rt.check_health = lambda: log.append("health")
    return rt


def _cuda_buffer(log):
    buf = CudaBackend.__new__(CudaBackend)
    buf.comm_stream = FakeStream("comm", log, 3)
    buf.device_id = 0
    return buf


@pytest.mark.parametrize("kind, caller", [(TORCH, "torch"), (CUPY, "cupy-default")])
def test_an_async_event_waits_on_the_calls_framework_stream(streams, kind, caller):
    log = streams.log
    buf = _runtime(log)
    compute = buf.begin(kind, None)
    assert compute.name == caller
    event = buf.finish(compute, True, ("keep",), kind)
    assert log == [("record", "fork", caller), ("wait", "comm", buf._fork_event),
                   ("record", "comm")]
    log.clear()
    event.current_stream_wait()
    assert log == [("wait", caller, "event@comm"), "health"]  # the caller's stream, whatever CuPy's current is


def test_a_synchronous_call_joins_the_callers_stream_and_returns_no_event(streams):
    log = streams.log
    buf = _runtime(log)
    compute = buf.begin(TORCH, None)
    log.clear()
    event = buf.finish(compute, False, (), TORCH)
    assert log == [("record", "join", "comm"), ("wait", "torch", buf._join_event)]
    assert event.event is None


@pytest.mark.parametrize("previous", [EventOverlap(), EventOverlap(HOST_EVENT)], ids=["no-event", "host-event"])
def test_a_previous_event_without_a_cuda_event_follows_the_callers_stream(streams, previous):
    """As DeepEP, which hands ``previous_event.event`` (None) on: the comm stream then waits for the caller."""
    log = streams.log
    buf = _runtime(log)
    buf.begin(TORCH, previous)
    assert log == [("record", "fork", "torch"), ("wait", "comm", buf._fork_event)]


def test_a_previous_event_is_waited_for_instead_of_the_callers_stream(streams):
    log = streams.log
    buf = _runtime(log)
    buf.begin(TORCH, EventOverlap("captured"))
    assert log == [("wait", "comm", "captured")]
    with pytest.raises(TypeError, match="^previous_event: must be an EventOverlap"):
        buf.begin(TORCH, "captured")


@pytest.mark.parametrize("torch_state, caller", [(True, "torch"), (None, "cupy-default")])
def test_capture_records_on_the_callers_framework_stream(streams, monkeypatch, torch_state, caller):
    import contextlib

    import cupy
    from cupy_ep import event as event_mod
    if torch_state is not None:
        monkeypatch.setitem(sys.modules, "torch", _fake_torch(torch_state))
    monkeypatch.setattr(interop, "current_device", lambda kind: 0)
    monkeypatch.setattr(cupy.cuda, "Device", lambda device_id: contextlib.nullcontext())
    event = event_mod.capture()
    assert streams.log == [("record", caller)] and event.event == f"event@{caller}"
    streams.log.clear()
    event.current_stream_wait()
    assert streams.log == [("wait", caller, f"event@{caller}")]


def test_capture_without_a_gpu_is_a_complete_host_event(monkeypatch):
    monkeypatch.setenv("CUPY_EP_BACKEND", "host")
    event = cupy_ep.Buffer.capture()
    assert isinstance(event.event, HostEvent) and event.event.query()
    event.current_stream_wait()                  # nothing to wait for, and no error
    from cupy_ep.host.backend import HostBackend
    assert HostBackend.capture().event is HOST_EVENT


def test_get_comm_stream_is_cupys_for_cupy_users(streams):
    buf = _cuda_buffer(streams.log)
    buf._torch_comm_stream = None
    assert buf.get_comm_stream() is buf.comm_stream


def _fake_torch_streams(initialized: bool):
    fake = _fake_torch(initialized)
    fake.device = lambda kind, index: (kind, index)
    fake.cuda.ExternalStream = lambda ptr, device: ("torch-stream", ptr, device)
    return fake


@pytest.mark.parametrize("framework, torch_initialized, want", [
    ("cupy", True, "cupy"),     # the last call took CuPy arrays: CuPy's stream, though torch touched the GPU
    ("torch", False, "torch"),  # the last call took torch tensors (or the buffer is over a torch group)
    (None, True, "torch"),      # no call yet: caller_kind (torch has initialized CUDA)
    (None, False, "cupy"),      # no call yet, torch never touched the GPU
])
def test_get_comm_stream_follows_the_buffers_framework(streams, monkeypatch, framework, torch_initialized, want):
    monkeypatch.setitem(sys.modules, "torch", _fake_torch_streams(torch_initialized))
    buf = _cuda_buffer(streams.log)
    buf._torch_comm_stream = None
    buf.framework = framework
    got = buf.get_comm_stream()
    if want == "cupy":
        assert got is buf.comm_stream
    else:
        assert got == ("torch-stream", buf.comm_stream.ptr, ("cuda", 0))
        assert buf.get_comm_stream() is got  # made once


def test_a_call_names_the_buffers_framework():
    import numpy as np
    torch = pytest.importorskip("torch")
    buf = CudaBackend.__new__(CudaBackend)
    assert buf.framework is None
    buf.note_arrays(torch.zeros(2))
    assert buf.framework == "torch"
    buf.note_arrays((np.zeros(2), np.zeros(1)))   # an FP8 pair: its first item names it
    assert buf.framework == "numpy"
    buf.note_arrays(None)                          # a zero-copy combine without x: no change
    buf.note_arrays([1, 2])
    assert buf.framework == "numpy"


def test_the_static_helpers_need_no_buffer():
    from cupy_ep import config
    assert cupy_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256) == \
        config.low_latency_rdma_size_hint(128, 7168, 8, 256)


@pytest.mark.parametrize("torch_capturing", [False, True])
def test_a_torch_graph_capture_counts_as_capturing(monkeypatch, torch_capturing):
    """The host-side value checks (a device sync) are skipped inside ``torch.cuda.graph`` too, whose capture is on
    torch's current stream while CuPy's is idle."""
    import cupy

    from cupy_ep.cuda import runtime
    idle = types.SimpleNamespace(is_capturing=lambda: False)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: idle)
    fake = _fake_torch(True)
    fake.cuda.is_current_stream_capturing = lambda: torch_capturing
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert runtime.capturing() is torch_capturing
    monkeypatch.delitem(sys.modules, "torch")
    assert runtime.capturing() is False


@pytest.mark.parametrize("handle", [0, 0x7F00_1234])
def test_a_foreign_stream_handle_becomes_a_cupy_stream_without_a_deprecation_warning(handle):
    cupy = pytest.importorskip("cupy")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # CuPy 14's ExternalStream warns at every construction
        stream = interop.cupy_stream(handle, 0)
    assert isinstance(stream, cupy.cuda.Stream)
    assert stream.ptr == handle
