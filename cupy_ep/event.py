"""``EventOverlap``: an event recorded on the communication stream, plus the arrays it keeps alive (the signature
and semantics of DeepEP's ``deep_ep.EventOverlap``).

Returned by every communication call. With ``async_finish=True`` it carries an event, and the caller decides when
its stream waits for the communication (``current_stream_wait()`` or ``with event: ...``). A synchronous call has
already made the caller's stream wait: its ``EventOverlap`` carries ``event=None``, and waiting on it is an error,
as in DeepEP.

"The caller's stream" is the current stream of the caller's framework, on the buffer's device: for a call with
torch CUDA tensors ``torch.cuda.current_stream()``, for CuPy arrays CuPy's current stream. A call without arrays
(:meth:`cupy_ep.Buffer.capture`, :meth:`cupy_ep.Buffer.get_comm_stream`) serves the framework that
:func:`cupy_ep.interop.caller_kind` names.
"""
from __future__ import annotations

from typing import Callable


class HostEvent:
    """The event of the host backend: its calls finish on the host before they return, so it is always complete
    (``query()`` is True, ``synchronize()`` returns at once, and no stream has anything to wait for)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def __repr__(self) -> str:
        return "HostEvent(complete)"


HOST_EVENT = HostEvent()

_NO_EVENT = ("EventOverlap: this event holds no CUDA event: the call ran without async_finish=True (it already "
             "made the caller's stream wait) or the event was released")


class EventOverlap:
    """An event and the arrays it keeps alive (DeepEP's ``EventOverlap``).

    Attributes:
        event: the event recorded after the communication (a ``cupy.cuda.Event``; :class:`HostEvent` on the host
            backend), or None for a synchronous call.
        extra_tensors: arrays the communication reads or writes, kept alive while this object lives (DeepEP's
            stand-in for ``record_stream``, which CUDA graphs do not allow).
    """

    def __init__(self, event=None, extra_tensors: tuple | None = None, *,
                 current_stream: Callable | None = None, on_wait: Callable | None = None):
        """
        Args:
            event: the event, or None (a synchronous call).
            extra_tensors: a tuple of arrays to keep alive, or None.
            current_stream: (keyword-only) a function returning the caller's current stream as a CuPy stream
                object. The calls pass their arrays' framework's; default: that of
                :func:`cupy_ep.interop.caller_kind`.
            on_wait: (keyword-only) run after each wait (the CUDA backend checks its health there).
        """
        self.event = event
        self.extra_tensors = extra_tensors
        self.hook_after_wait: Callable | None = None
        self._current_stream = current_stream
        self._on_wait = on_wait
        self._release_handle_by_call = False

    def _caller_stream(self):
        if self._current_stream is not None:
            return self._current_stream()
        from . import interop  # an event made by hand: no call told its framework
        return interop.current_stream(interop.caller_kind())

    def current_stream_wait(self, release_handle: bool = False, *, stream=None) -> None:
        """Make the caller's current stream wait for the event (the stream of the framework the call's arrays
        came from), then run the hook of :meth:`register_hook_after_wait` once.

        Args:
            release_handle: drop the event afterwards (``event`` becomes None; a later wait is an error).
            stream: (keyword-only) the stream that waits instead, a CuPy stream or a ``torch.cuda.Stream``.

        Raises:
            AssertionError: the event is None (as DeepEP asserts).
        """
        if self.event is None:
            raise AssertionError(_NO_EVENT)
        if not isinstance(self.event, HostEvent):
            (self._caller_stream() if stream is None else _as_cupy_stream(stream)).wait_event(self.event)
        self._after_wait()
        if release_handle:
            self.event = None

    def synchronize(self) -> None:
        """Block the host until the event has completed, then run the hook of :meth:`register_hook_after_wait`
        once (beyond DeepEP). AssertionError when the event is None."""
        if self.event is None:
            raise AssertionError(_NO_EVENT)
        self.event.synchronize()
        self._after_wait()

    def _after_wait(self) -> None:
        if self._on_wait is not None:
            self._on_wait()
        hook, self.hook_after_wait = self.hook_after_wait, None
        if hook is not None:
            hook()

    def register_hook_after_wait(self, hook_after_wait: Callable) -> None:
        """Run ``hook_after_wait()`` once, right after the next :meth:`current_stream_wait` (for work that must
        follow the wait on the caller's stream). One hook at a time: AssertionError when one is registered."""
        if not callable(hook_after_wait):
            raise TypeError(f"hook_after_wait: must be callable, got {type(hook_after_wait).__name__}")
        if self.hook_after_wait is not None:
            raise AssertionError("EventOverlap.register_hook_after_wait: a hook is already registered on this event")
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        """``with event(release_handle=True): ...`` releases the event when the block ends; returns ``self``."""
        self._release_handle_by_call = release_handle
        return self

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        """The caller's stream waits for the event when the block ends (nothing when the event is None)."""
        try:
            if self.event is not None:
                self.current_stream_wait(release_handle=self._release_handle_by_call)
        finally:
            self._release_handle_by_call = False
        return False


def host_event(async_finish: bool) -> EventOverlap:
    """The host backend's ``EventOverlap`` of a call: a complete :class:`HostEvent` with ``async_finish``, None
    without (as a synchronous call's)."""
    return EventOverlap(HOST_EVENT if async_finish else None)


def capture() -> EventOverlap:
    """An event recorded on the caller's current stream (:func:`cupy_ep.interop.caller_kind` names the framework),
    on that framework's current device; its :meth:`EventOverlap.current_stream_wait` makes the same framework's
    current stream wait."""
    import functools

    import cupy

    from . import interop
    kind = interop.caller_kind()
    device_id = interop.current_device(kind)
    stream = interop.current_stream(kind, device_id)
    with cupy.cuda.Device(device_id):  # an event is recorded on a stream of its own device
        event = stream.record()
    return EventOverlap(event, current_stream=functools.partial(interop.current_stream, kind, device_id))


def _as_cupy_stream(stream):
    """A CuPy stream as it is, a ``torch.cuda.Stream`` as a CuPy stream over the same handle."""
    if hasattr(stream, "wait_event") and hasattr(stream, "ptr"):
        return stream
    if hasattr(stream, "cuda_stream"):
        from . import interop
        return interop.cupy_stream(int(stream.cuda_stream), int(stream.device.index))
    raise TypeError(f"stream: must be a CuPy stream or a torch.cuda.Stream, got {type(stream).__name__}")


class RecvHooks:
    """The rule for low-latency receive hooks (``return_recv_hook=True``), the same on both backends: each hook
    runs once, and before the buffer's next low-latency call or ``clean_low_latency_buffer``.

    Why: the GPU kernels consume each signal as they read it, and the two buffers alternate, so the call after
    next writes into the buffer a pending hook would still read, and its peers may get there as soon as this
    rank's next call has signalled them (a hook run that late would read the newer call's data or wait for a
    signal already consumed). A second run of one hook would wait for consumed signals."""

    def __init__(self):
        self.pending: str | None = None  # the call whose hook has not run yet
        self._token = None                # identifies that hook

    def check_next_call(self, what: str) -> None:
        """Raise before ``what`` (a low-latency call) if a hook is still pending."""
        if self.pending is not None:
            raise RuntimeError(f"return_recv_hook: the receive hook of the previous {self.pending} has not run; "
                               f"call it before {what} (each hook must run before the buffer's next "
                               "low-latency call)")

    def make(self, run, what: str):
        """A hook that calls ``run()`` once; ``what`` names the call in the errors. It becomes the pending one."""
        token = object()
        ran = False

        def hook():
            nonlocal ran
            if ran:
                raise RuntimeError(f"return_recv_hook: the receive hook of this {what} already ran (each hook "
                                   "runs once)")
            run()
            ran = True
            if self._token is token:
                self.pending, self._token = None, None

        self.pending, self._token = what, token
        return hook
