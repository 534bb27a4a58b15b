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
