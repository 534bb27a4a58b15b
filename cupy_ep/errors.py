"""Exception classes of cupy_ep.

Every error the library raises on purpose is one of these (or a plain ``ValueError``/``TypeError`` for bad
arguments, which always names the argument)."""


class CupyEpError(RuntimeError):
    """Base class of cupy_ep's own runtime errors."""


class CompileError(CupyEpError):
    """NVRTC could not compile a kernel; ``log`` holds the compiler's log."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(f"{message}\n--- NVRTC log ---\n{log}" if log else message)
        self.log = log


class CommError(CupyEpError):
    """A collective call failed on the device; ``record`` is a dict saying where (rank, kernel, role, channel,
    peer and the numbers seen). After this error the buffer is unusable and must be destroyed."""

    def __init__(self, message: str, record: dict | None = None):
        super().__init__(message if record is None else f"{message}: {record}")
        self.record = record or {}


class CommTimeoutError(CommError):
    """A device-side wait (or the host wait on a device counter) ran past the configured timeout.

    ``record``: what the waiting thread saw: rank, kernel, role, channel, peer, head, tail, expected. After
    this error the buffer is unusable (its ring state is unknown) and must be destroyed."""


class CallMismatchError(CommError):
    """The ranks disagreed about a collective call (another ``num_sms``/config, hidden size or top-k, or a
    cached dispatch on one rank and a normal one on another; on the host backend: another call altogether, such as a
    rank a call ahead of the others). Every rank raises it; no data moved.

    ``record``: ``peer`` (a rank that disagrees), ``word`` (what differs), ``mine`` and ``theirs``. The host backend
    numbers each Buffer's calls and adds ``in_step``: True when the ranks disagreed only about which call this one is
    (the same number of calls made), and the Buffer then stays usable; False when they are out of step (a rank missed
    a call), and the Buffer is unusable."""


class BufferUnusableError(CupyEpError):
    """The buffer was destroyed, or a previous call timed out and left it in an unknown state."""


class BackendUnavailableError(CupyEpError):
    """The requested backend cannot run here (for example ``backend="cuda"`` on a machine without a GPU)."""
