"""Which stream a low-latency call launches on (cuda_low_latency.LowLatencyState.run), without a GPU: calls with
both phases and no async_finish go on the caller's stream; async calls and a hook's phases go on the comm stream
bracketed by the caller's stream. Whichever stream it is, a kernel waits for the previous low-latency kernel when
that one was launched on another stream (and not across a capture's boundary)."""
from __future__ import annotations

import pytest

from cupy_ep.cuda import low_latency as cll
from cupy_ep.event import EventOverlap

BOTH = cll._SEND | cll._RECV


class FakeStream:
    def __init__(self, name, log, ptr, capturing=False):
        self.name, self.log, self.ptr, self.capturing = name, log, ptr, capturing

    def record(self):
        self.log.append(("record", self.name))
        return f"event@{self.name}"

    def wait_event(self, event):
        self.log.append(("wait", self.name, event))

    def is_capturing(self):
        return self.capturing

    def synchronize(self):
        self.log.append(("sync", self.name))


class FakeBuffer:
    device_id = 0

    def __init__(self, log):
        self.log = log
        self.compute = None
        self.comm_stream = FakeStream("comm", log, ptr=1)

    def begin(self, kind, previous_event):  # as Runtime.begin: comm waits for the caller
        self.log.append(("begin", self.compute.name))
        return self.compute

    def finish(self, compute, async_finish, keep, kind):
        self.log.append(("finish", async_finish))
        return EventOverlap("async-event" if async_finish else None)


@pytest.fixture
def ll(monkeypatch):
    log: list = []
    buf = FakeBuffer(log)
    streams = {"a": FakeStream("a", log, ptr=10), "b": FakeStream("b", log, ptr=11)}
    buf.compute = streams["a"]
    monkeypatch.setattr(cll.interop, "current_stream", lambda kind, device_id=None: buf.compute)
    obj = cll.LowLatencyState.__new__(cll.LowLatencyState)
    obj.buf = obj.rt = buf  # the backend and its runtime in one fake
    obj.direct, obj.last_stream = True, None
    obj.num_blocks = 132

    def kernel(name):
        return lambda grid, block, args, shared_mem=0, stream=None: log.append(("launch", name, stream.name))
    obj.kernel = kernel

    def use(name):  # the caller's current stream from now on
        buf.compute = streams[name]
    return obj, log, use, streams


def call(obj, phases=BOTH, async_finish=False, name="k"):
    return obj.run(None, name, lambda p: (p,), phases, async_finish, keep=())


def test_both_phases_without_async_go_on_the_callers_stream(ll):
    obj, log, _, _ = ll
    event = call(obj)
    call(obj)
    assert log == [("launch", "k", "a"), ("launch", "k", "a")]  # one stream: no events at all
    assert event.event is None


def test_a_call_on_another_stream_waits_for_the_previous_kernel(ll):
    obj, log, use, _ = ll
    call(obj)
    use("b")
    call(obj)
    assert log == [("launch", "k", "a"), ("record", "a"), ("wait", "b", "event@a"), ("launch", "k", "b")]


def test_an_async_call_stays_on_comm_and_the_next_direct_call_waits_for_it(ll):
    obj, log, _, _ = ll
    event = call(obj, async_finish=True)
    assert log == [("begin", "a"), ("launch", "k", "comm"), ("finish", True)]
    assert event.event == "async-event"
    log.clear()
    call(obj)
    assert log == [("record", "comm"), ("wait", "a", "event@comm"), ("launch", "k", "a")]
    log.clear()
    call(obj)  # the last kernel is on this stream: no wait
    assert log == [("launch", "k", "a")]


@pytest.mark.parametrize("phases", [cll._SEND, cll._RECV], ids=["send", "recv"])
def test_a_hooks_phases_stay_on_comm(ll, phases):
    obj, log, _, _ = ll
    call(obj, phases=phases)
    assert log == [("begin", "a"), ("launch", "k", "comm"), ("finish", False)]


def test_a_comm_call_after_a_direct_one_on_the_same_stream_adds_no_event(ll):
    obj, log, _, _ = ll
    call(obj)
    call(obj, phases=cll._SEND)  # comm already waits for the caller's stream (begin)
    assert log == [("launch", "k", "a"), ("begin", "a"), ("launch", "k", "comm"), ("finish", False)]


def test_a_comm_call_after_a_direct_one_on_another_stream_waits_for_it(ll):
    obj, log, use, _ = ll
    call(obj)
    use("b")
    call(obj, phases=cll._SEND)
    assert log == [("launch", "k", "a"), ("begin", "b"), ("record", "a"), ("wait", "comm", "event@a"),
                   ("launch", "k", "comm"), ("finish", False)]


def test_no_wait_across_a_captures_boundary(ll):
    obj, log, use, streams = ll
    call(obj)                       # eager, on a
    streams["b"].capturing = True
    use("b")
    call(obj)                       # captured on b: a graph cannot wait for a's eager work
    call(obj)
    streams["b"].capturing = False
    use("a")
    call(obj)                       # eager again: b holds no real kernel
    streams["a"].capturing = streams["b"].capturing = True
    use("b")
    call(obj)                       # both in the capture: joined
    assert log == [("launch", "k", "a"), ("launch", "k", "b"), ("launch", "k", "b"),
                   ("record", "b"), ("wait", "a", "event@b"), ("launch", "k", "a"),
                   ("record", "a"), ("wait", "b", "event@a"), ("launch", "k", "b")]


def test_the_legacy_stream_is_not_queried_during_a_capture(ll):
    obj, log, use, streams = ll
    legacy = FakeStream("null", log, ptr=0)
    legacy.is_capturing = lambda: pytest.fail("queried the legacy stream during a capture")
    obj.last_stream = legacy        # eager warm-up calls on the legacy default stream
    streams["b"].capturing = True
    use("b")
    call(obj)
    assert log == [("launch", "k", "b")]


def test_with_the_comm_stream_switch_every_call_goes_on_comm(ll):
    obj, log, _, _ = ll
    obj.direct = False
    call(obj)
    call(obj)
    assert log == [("begin", "a"), ("launch", "k", "comm"), ("finish", False)] * 2


def test_the_switch_is_read_from_the_environment(monkeypatch):
    for value, direct in (("1", False), ("0", True), ("", True)):
        monkeypatch.setenv("CUPY_EP_LL_COMM_STREAM", value)
        assert cll.direct_launch_enabled() is direct
    monkeypatch.delenv("CUPY_EP_LL_COMM_STREAM")
    assert cll.direct_launch_enabled() is True


def test_launch_uses_each_kernels_block_size(ll):
    obj, _, _, streams = ll
    calls = []
    obj.kernel = lambda name: (lambda grid, block, args, shared_mem=0, stream=None:
                               calls.append((name, grid, block, stream.name)))
    obj.launch("ep::dispatch<true, long long>", (), streams["a"])
    obj.launch("ep::combine<int>", (), streams["b"], shared_mem=64)
    assert calls == [("ep::dispatch<true, long long>", (132,), (cll._THREADS,), "a"),
                     ("ep::combine<int>", (132,), (cll._COMBINE_THREADS,), "b")]
    assert obj.last_stream is streams["b"]
