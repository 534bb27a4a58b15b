"""``EventOverlap``: an event recorded on the communication stream, plus the arrays it keeps alive.

Returned by every communication call. With ``async_finish=True`` the caller decides when its compute
stream waits for the communication (``current_stream_wait()`` or ``with event: ...``); otherwise the call
already made the compute stream wait and the object only carries ``event=None``.
"""
from __future__ import annotations


class EventOverlap:
    """Wraps a ``cupy.cuda.Event`` (or None on the host backend) and keeps ``extra_tensors`` alive."""

    def __init__(self, event=None, extra_tensors: tuple = (), on_wait=None):
        self.event = event
        self.extra_tensors = tuple(extra_tensors)
        self._on_wait = on_wait

    def current_stream_wait(self, stream=None) -> None:
        """Make ``stream`` (default: CuPy's current stream) wait for the communication."""
        if self.event is not None:
            import cupy
            (stream or cupy.cuda.get_current_stream()).wait_event(self.event)
        if self._on_wait is not None:
            self._on_wait()

    def synchronize(self) -> None:
        """Block the host until the communication has finished."""
        if self.event is not None:
            self.event.synchronize()
        if self._on_wait is not None:
            self._on_wait()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.current_stream_wait()
        return False


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
