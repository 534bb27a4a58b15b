"""The host backend's communication: point-to-point messages over a private duplicate of the Buffer's
communicator, every wait polled against the Buffer's timeout.

Every collective call of a ``HostBackend`` is numbered (``seq``, the same on every rank when the ranks make the same
calls) and starts with :meth:`HostExchange.agree`: each rank sends every peer taking part a header ``(seq, op)``
with its payload (its argument checks' outcome and counts). The headers are compared before any data moves, so

* a rank that never enters the call makes the others raise :class:`~cupy_ep.errors.CommTimeoutError` after the
  timeout (never a hang); with ``on_timeout`` the caller may instead leave the late ranks out (shrink mode);
* a rank making another call (a call ahead, a call missed) makes every rank that sees it raise
  :class:`~cupy_ep.errors.CallMismatchError` naming both calls, instead of pairing one call's rows with another's.

Construction is timed as well: the private duplicate is made with the non-blocking ``Idup`` (polled), and
:meth:`HostExchange.open` exchanges one header ``(0, "construct")`` with every rank, so a rank that never constructs
its Buffer makes the others' constructors raise CommTimeoutError, and a rank that constructs it after the others gave
up raises too instead of waiting alone.

Then :meth:`HostExchange.alltoallv` moves the rows: one message per peer (empty ones too, so that every message
pairs), received into place and polled against the timeout. Headers and data use two tags; MPI keeps the order of
messages between two ranks on one tag, so a header always meets the header of the peer's call of the same number
unless the peer is out of step.
"""
from __future__ import annotations

import atexit
import time

import numpy as np

from ..bootstrap import drain, is_mpi4py, mpi_started
from ..errors import CallMismatchError, CommTimeoutError

_HEADER_TAG = 1
_DATA_TAG = 2
_POLL_S = 20e-6     # sleep between polls once a wait has spun for _SPIN_S
_SPIN_S = 200e-6    # a peer that comes within this is met by polling alone (a sleep lasts ~60 us or more)


# MPI collective requests given up on at a timeout (MPI cannot cancel one): a late rank completes them, and MPI
# releases a request's communicator only once a Test sees it complete, so they are tested at every later
# construction and at exit (before mpi4py's own exit handler, registered earlier, finalizes MPI).
_given_up: list = []


def _test_given_up() -> None:
    if _given_up and mpi_started():
        _given_up[:] = [request for request in _given_up if not request.Test()]


atexit.register(_test_given_up)


class _Pace:
    """Between the polls of one wait: yield the CPU (``sleep(0)``) for the first _SPIN_S, then sleep _POLL_S, so a
    peer already there costs no sleep while a late one leaves the CPU to the other ranks."""

    def __init__(self):
        self.spin_until = time.monotonic() + _SPIN_S

    def __call__(self) -> None:
        time.sleep(0 if time.monotonic() < self.spin_until else _POLL_S)


class PeersTimedOut(Exception):
    """Raised by :meth:`HostExchange.agree` / :meth:`HostExchange.alltoallv` when peers did not answer in time;
    ``peers``: their ranks; ``partial``: what :meth:`HostExchange.agree` received from the others."""

    def __init__(self, peers, partial=None):
        super().__init__(f"ranks {sorted(peers)}")
        self.peers = sorted(peers)
        self.partial = partial or {}


class HostExchange:
    """Messages of one HostBackend (see the module docstring). Collective to create: duplicates ``comm``, and
    :meth:`open` must follow on every rank; both raise CommTimeoutError when a rank does not come in time."""

    def __init__(self, comm, timeout_s: float):
        self.rank = comm.Get_rank()
        self.num_ranks = comm.Get_size()
        self.timeout_s = timeout_s
        self.seq = 0
        self.op = "construct"    # until open() returns
        self._sends: list = []   # sends not known complete (a peer that never came has not received them)
        self.comm = self._dup(comm)

    # ---- construction ------------------------------------------------------------------------------------
    def _dup(self, comm):
        """``comm`` duplicated, within the timeout. ``Dup`` blocks until every rank calls it (MPI_Comm_dup: a rank
        that never constructs its Buffer would hang the others there; the torch adapter: for its own timeout, not
        the Buffer's), so the non-blocking ``Idup`` is used (mpi4py and the torch adapter have it), its request
        polled. Another communicator without ``Idup`` is duplicated with its ``Dup`` (timed only if it times it)."""
        if not hasattr(comm, "Idup"):
            return comm.Dup()
        _test_given_up()
        dup, request = comm.Idup()
        if not self._wait(request):
            # the request (and the duplicate) are left to the late rank, whose Idup completes them; that rank then
            # times out in open(), since nobody here calls it
            if is_mpi4py(comm):
                _given_up.append(request)
            raise self._construct_timeout(None)
        return dup

    def open(self, payload) -> dict:
        """Collective, once, right after construction: exchange ``payload`` with every rank (as :meth:`agree`, under
        the header ``(0, "construct")``, before any call's). Returns ``{rank: payload}``. A rank that is not here
        within the timeout makes this raise CommTimeoutError; a rank that arrives after the others gave up passes
        the duplication (its Idup completes theirs) and raises here, as nobody answers it."""
        try:
            got = self.agree(payload, range(self.num_ranks))
        except PeersTimedOut as e:
            raise self._construct_timeout(e.peers) from None
        self.op = None
        return got

    def _construct_timeout(self, peers) -> CommTimeoutError:
        record = {"rank": self.rank, "kernel": "construct", "role": "host"}
        who = "a rank" if peers is None else f"rank(s) {peers}"
        if peers:
            record["peer"] = peers[0]
        return CommTimeoutError(f"rank {self.rank}: {who} did not construct the Buffer within {self.timeout_s} s "
                                "(every rank of the communicator must construct it)", record)

    def _wait(self, request) -> bool:
        """Poll ``request`` until it completes (True) or the timeout passes (False; the request is left pending)."""
        deadline = time.monotonic() + self.timeout_s
        pace = _Pace()
        while not request.Test():
            if time.monotonic() > deadline:
                return False
            pace()
        return True

    # ---- one call ----------------------------------------------------------------------------------------
    def begin(self, op: str) -> int:
        """Number the next collective call ``op``; returns its number."""
        self.seq += 1
        self.op = op
        return self.seq

    def agree(self, payload, peers) -> dict:
        """Send ``payload`` with this call's header to every rank of ``peers`` (not this rank) and receive theirs.
        Returns ``{rank: payload}`` (this rank's included). Raises :class:`CallMismatchError` when a peer's header
        is another call's, :class:`PeersTimedOut` when peers did not send within the timeout."""
        peers = [r for r in peers if r != self.rank]
        header = (self.seq, self.op)
        self._keep([self.comm.isend((header, payload), dest=r, tag=_HEADER_TAG) for r in peers])
        got = {self.rank: payload}
        waiting = set(peers)
        deadline = time.monotonic() + self.timeout_s
        pace = _Pace()
        mismatched = []
        while waiting:
            for r in sorted(waiting):
                if self.comm.Iprobe(source=r, tag=_HEADER_TAG):
                    theirs, their_payload = self.comm.recv(source=r, tag=_HEADER_TAG)
                    waiting.discard(r)
                    if tuple(theirs) != header:
                        mismatched.append((r, tuple(theirs)))
                    got[r] = their_payload
            if waiting:
                if time.monotonic() > deadline:
                    break
                pace()
        if mismatched:  # (before a timeout: a peer in another call is the cause to report)
            r, (their_seq, their_op) = mismatched[0]
            in_step = not waiting and all(s == self.seq for _, (s, _) in mismatched)
            record = {"rank": self.rank, "peer": r, "word": "call", "mine": f"{self.op} #{self.seq}",
                      "theirs": f"{their_op} #{their_seq}", "in_step": in_step}
            raise CallMismatchError(
                f"rank {self.rank}: rank {r} is in {their_op} (its call #{their_seq} on this Buffer) while this rank "
                f"is in {self.op} (call #{self.seq}); every rank must make the same calls in the same order", record)
        if waiting:
            raise PeersTimedOut(waiting, got)
        return got

    def alltoallv(self, send: np.ndarray, send_counts, recv_counts, peers) -> np.ndarray:
        """All-to-all of rows among ``peers`` (this rank included; the others' counts must be 0):
        ``send_counts[r]`` consecutive rows of ``send`` go to rank r; the rows from rank r arrive as block r (of
        ``recv_counts[r]`` rows) of the result. Raises :class:`PeersTimedOut` when rows did not come in time."""
        send = np.ascontiguousarray(send)
        row_shape = send.shape[1:]
        row_bytes = send.dtype.itemsize * int(np.prod(row_shape, dtype=np.int64))
        send_counts = [int(c) for c in send_counts]
        recv_counts = [int(c) for c in recv_counts]
        recv = np.empty((sum(recv_counts),) + row_shape, dtype=send.dtype)
        send_bytes = send.reshape(-1).view(np.uint8) if send.size else np.empty(0, np.uint8)
        recv_bytes = recv.reshape(-1).view(np.uint8) if recv.size else np.empty(0, np.uint8)
        send_at = np.concatenate([[0], np.cumsum(send_counts)]) * row_bytes
        recv_at = np.concatenate([[0], np.cumsum(recv_counts)]) * row_bytes
        me = self.rank
        recv_bytes[recv_at[me]:recv_at[me + 1]] = send_bytes[send_at[me]:send_at[me + 1]]
        others = [r for r in peers if r != me]
        receives = {r: self.comm.Irecv([recv_bytes[recv_at[r]:recv_at[r + 1]], "B"], source=r, tag=_DATA_TAG)
                    for r in others}
        sends = [self.comm.Isend([send_bytes[send_at[r]:send_at[r + 1]], "B"], dest=r, tag=_DATA_TAG)
                 for r in others]
        deadline = time.monotonic() + self.timeout_s
        pace = _Pace()
        while receives:
            for r in [r for r, request in receives.items() if request.Test()]:
                del receives[r]
            if receives:
                if time.monotonic() > deadline:
                    for request in receives.values():
                        request.Cancel()
                        request.Wait()
                    self._keep(sends)
                    raise PeersTimedOut(list(receives))
                pace()
        self._keep(sends)
        return recv

    def timeout_error(self, peers, what: str) -> CommTimeoutError:
        """The error of a wait for ``peers`` that ran past the timeout."""
        record = {"rank": self.rank, "kernel": self.op, "role": "host", "peer": peers[0], "call": self.seq}
        return CommTimeoutError(f"rank {self.rank}: rank(s) {peers} did not {what} {self.op} (call #{self.seq}) "
                                f"within {self.timeout_s} s", record)

    def _keep(self, sends) -> None:
        self._sends = [request for request in (*self._sends, *sends) if not request.Test()]

    # ---- lifetime ----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Collective: a barrier (timed), then every message no call took is received and dropped (a header sent
        to a rank that never came, or that was left out), so that a later communicator that reuses this one's
        context finds none; then the duplicate is freed. Raises CommTimeoutError when a rank does not come."""
        comm, self.comm = self.comm, None
        if comm is None:
            return
        request = comm.Ibarrier()
        deadline = time.monotonic() + self.timeout_s
        while not request.Test():
            if time.monotonic() > deadline:
                raise CommTimeoutError(f"rank {self.rank}: peers did not reach destroy within {self.timeout_s} s",
                                       {"rank": self.rank, "kernel": "destroy", "role": "host"})
            time.sleep(_POLL_S)
        drain(comm)
        for request in self._sends:  # received above or by a call: complete, or completing in the background
            if not request.Test():
                request.Free()
        self._sends = []
        comm.Free()
