"""``event.RecvHooks`` (the low-latency receive-hook rule) and ``event.EventOverlap`` (DeepEP's semantics) on their own
(no MPI, no GPU)."""
from __future__ import annotations

import pytest

from cupy_ep.event import EventOverlap, RecvHooks


def test_a_pending_hook_blocks_the_next_call_until_it_runs():
    hooks, runs = RecvHooks(), []
    hooks.check_next_call("low_latency_dispatch")          # nothing pending yet
    hook = hooks.make(lambda: runs.append("recv"), "low_latency_dispatch")
    with pytest.raises(RuntimeError, match=r"^return_recv_hook: .*previous low_latency_dispatch.*before "
                                           r"low_latency_combine"):
        hooks.check_next_call("low_latency_combine")
    assert runs == []                                      # checking runs nothing
    hook()
    assert runs == ["recv"]
    hooks.check_next_call("low_latency_combine")           # no longer pending


def test_a_hook_runs_once():
    hooks, runs = RecvHooks(), []
    hook = hooks.make(lambda: runs.append(1), "low_latency_combine")
    hook()
    with pytest.raises(RuntimeError, match=r"^return_recv_hook: .*already ran"):
        hook()
    assert runs == [1]


def test_a_failed_run_leaves_the_hook_pending():
    hooks = RecvHooks()

    def fail():
        raise ValueError("device gone")

    hook = hooks.make(fail, "low_latency_dispatch")
    with pytest.raises(ValueError):
        hook()
    with pytest.raises(RuntimeError, match="has not run"):
        hooks.check_next_call("low_latency_dispatch")


def test_an_old_hook_does_not_clear_a_newer_one():
    hooks = RecvHooks()
    first = hooks.make(lambda: None, "low_latency_dispatch")
    first()
    hooks.make(lambda: None, "low_latency_combine")      # the newer call's hook is pending
    with pytest.raises(RuntimeError, match="already ran"):
        first()
    with pytest.raises(RuntimeError, match="previous low_latency_combine has not run"):
        hooks.check_next_call("low_latency_dispatch")


# ---- EventOverlap: DeepEP's semantics -----------------------------------------------------------------
class FakeStream:
    def __init__(self, name, log):
        self.name, self.log, self.ptr = name, log, 7

    def wait_event(self, event):
        self.log.append(("wait", self.name, event))


def _event(log, name="caller", on_wait=None):
    stream = FakeStream(name, log)
    return EventOverlap("ev", ("kept",), current_stream=lambda: stream, on_wait=on_wait)


def test_current_stream_wait_makes_the_callers_framework_stream_wait():
    log = []
    event = _event(log, on_wait=lambda: log.append("health"))
    event.current_stream_wait()
    assert log == [("wait", "caller", "ev"), "health"]
    assert event.event == "ev" and event.extra_tensors == ("kept",)   # kept: it may be waited on again
    event.current_stream_wait(release_handle=True)
    assert event.event is None
    with pytest.raises(AssertionError, match="holds no CUDA event"):
        event.current_stream_wait()


def test_a_synchronous_calls_event_cannot_be_waited_on_but_a_with_block_is_fine():
    event = EventOverlap()                       # what a call without async_finish returns
    with pytest.raises(AssertionError, match="without async_finish=True"):
        event.current_stream_wait()
    with pytest.raises(AssertionError):
        event.synchronize()
    with event:                                  # as DeepEP: the block waits only when there is an event
        pass
    assert event.event is None


def test_the_hook_runs_once_after_the_wait():
    log = []
    event = _event(log)
    event.register_hook_after_wait(lambda: log.append("hook"))
    with pytest.raises(AssertionError, match="already registered"):
        event.register_hook_after_wait(lambda: None)
    with pytest.raises(TypeError, match="^hook_after_wait: must be callable"):
        EventOverlap("ev").register_hook_after_wait("not a function")
    event.current_stream_wait()
    event.current_stream_wait()
    assert log == [("wait", "caller", "ev"), "hook", ("wait", "caller", "ev")]
    event.register_hook_after_wait(lambda: log.append("hook 2"))   # registrable again once it ran
    with event:
        log.append("inside")
    assert log[-3:] == ["inside", ("wait", "caller", "ev"), "hook 2"]


def test_with_event_release_handle_drops_the_event_at_the_end():
    log = []
    event = _event(log)
    with event(release_handle=True) as same:
        assert same is event and event.event == "ev"
    assert event.event is None and log == [("wait", "caller", "ev")]
    event = _event(log)
    with event:                                  # the flag applies to one block only
        pass
    assert event.event == "ev"


def test_a_with_block_waits_even_when_it_raises():
    log = []
    event = _event(log)
    with pytest.raises(KeyError):
        with event:
            raise KeyError("compute failed")
    assert log == [("wait", "caller", "ev")]


def test_an_explicit_stream_waits_instead_of_the_current_one():
    log = []
    event = _event(log)
    other = FakeStream("other", log)
    event.current_stream_wait(stream=other)
    assert log == [("wait", "other", "ev")]
    with pytest.raises(TypeError, match="^stream: must be a CuPy stream or a torch.cuda.Stream"):
        event.current_stream_wait(stream=3)


def test_the_host_event_is_complete_and_waits_on_no_stream():
    from cupy_ep.event import HOST_EVENT, HostEvent, host_event
    log = []
    event = EventOverlap(HOST_EVENT, current_stream=lambda: pytest.fail("a host event touched a stream"))
    event.register_hook_after_wait(lambda: log.append("hook"))
    event.current_stream_wait()
    event.synchronize()
    assert log == ["hook"] and isinstance(event.event, HostEvent) and event.event.query()
    assert host_event(True).event is HOST_EVENT and host_event(False).event is None
