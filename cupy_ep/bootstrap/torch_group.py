""":class:`TorchComm`: the :class:`~cupy_ep.bootstrap.comm.Comm` interface over a ``torch.distributed`` group.

Everything goes through the key-value store of torch.distributed's default group (the ``TCPStore`` torchrun or
``init_process_group`` set up), never through the group's own backend: no collective of an NCCL group runs on a
GPU stream, gloo's blocking collectives are avoided, and every wait polls against a deadline (a peer that never
comes raises :class:`~cupy_ep.errors.CommTimeoutError`, it does not hang). Hence NCCL and gloo groups alike.

Keys live under a name that every member computes alike: the group's global ranks and how many adapters this
process made for them (adapters, like communicators, are made collectively), then ``/d<n>`` or ``/s<n>.<color>``
for ``Dup`` / ``Idup`` and ``Split`` (``n``: the collective's number on the parent).

* Collective number ``n``: rank ``r`` sets ``<name>/c<n>/<r>`` and reads the others' (``Ibarrier``: tests that
  they exist). It deletes its own key of collective ``n - 2`` then: every peer has read it, since every peer
  contributed to collective ``n - 1``, which it enters only after it left ``n - 2``.
* Messages: one ordered stream per (sender, receiver) pair, keys ``<name>/m<src>.<dst>/<seq>``, the tag inside.
  A receiver pulls a pair's messages in order into its inbox (and deletes their keys); ``Iprobe`` / ``Irecv``
  look there for the tag asked for, so messages of one tag keep their order and tags do not block each other.
  Sends complete at once (the store holds the message).
* A value over 4 MiB is stored as chunks ``<key>#<i>`` set before ``<key>``, which then holds their count: a
  reader that sees the key finds every chunk.

Requires torch; never imports ``mpi4py.MPI`` (that would start MPI inside a torchrun job).
"""
from __future__ import annotations

import collections
import hashlib
import pickle
import socket
import struct
import time

import numpy as np

from ..config import default_timeout_s
from ..errors import CommTimeoutError

_POLL_S = 50e-6
_RAW, _OBJ = 0, 1
_HEAD = struct.Struct("<iB")   # tag, kind
_CHUNK = 4 << 20               # bytes per store value (the TCPStore refuses payloads over 8 MiB)
_WHOLE, _SPLIT = b"w", b"s"    # a stored value's first byte: the value itself, or the count of its chunks
_made: collections.Counter = collections.Counter()  # adapters made in this process, per tuple of global ranks
ANY_SOURCE = -1
ANY_TAG = -1


def _as_bytes(buf) -> memoryview:
    """A byte view of a numpy buffer or an mpi4py ``[buf, "B"]`` spec."""
    if isinstance(buf, (list, tuple)):
        buf = buf[0]
    return memoryview(np.ascontiguousarray(buf)).cast("B") if not isinstance(buf, (bytes, bytearray)) \
        else memoryview(buf)


def _into(buf, data: bytes) -> None:
    """Copy a message's bytes into a numpy buffer (or ``[buf, "B"]`` spec) of at least their size."""
    if isinstance(buf, (list, tuple)):
        buf = buf[0]
    view = np.asarray(buf).reshape(-1).view(np.uint8)
    if len(data) > view.size:
        raise ValueError(f"buf: a message of {len(data)} bytes does not fit {view.size} bytes")
    view[:len(data)] = np.frombuffer(data, dtype=np.uint8)


class _Done:
    """A request complete when made (a send: the store holds the message)."""

    def Test(self) -> bool:
        return True

    def Wait(self) -> None:
        pass

    def Cancel(self) -> None:
        pass

    def Free(self) -> None:
        pass


class _RecvRequest:
    """A posted ``Irecv``: complete when a message of its tag from its source was copied into its buffer."""

    def __init__(self, comm: "TorchComm", buf, source: int, tag: int):
        self.comm, self.buf, self.source, self.tag = comm, buf, source, tag
        self.done = self.cancelled = False

    def Test(self) -> bool:
        if not (self.done or self.cancelled):
            message = self.comm._take(self.source, self.tag)
            if message is not None:
                _into(self.buf, message[1])
                self.done = True
        return self.done or self.cancelled

    def Wait(self) -> None:
        self.comm._poll(self.Test, f"a message from rank {self.source} (tag {self.tag})")

    def Cancel(self) -> None:
        self.cancelled = not self.done

    def Free(self) -> None:
        self.cancelled = not self.done


class _BarrierRequest:
    def __init__(self, comm: "TorchComm", keys: list[str]):
        self.comm, self.keys, self.done = comm, keys, False

    def Test(self) -> bool:
        if not self.done:
            self.done = self.comm._store.check(self.keys)
        return self.done

    def Wait(self) -> None:
        self.comm._poll(self.Test, "a barrier")

    def Cancel(self) -> None:
        pass

    def Free(self) -> None:
        pass


class TorchComm:
    """A ``torch.distributed`` process group (NCCL or gloo; None: the default group) with mpi4py's communicator
    API (:class:`~cupy_ep.bootstrap.comm.Comm`). Collective to create: every member creates it, in the same order
    as its other adapters of the same ranks.

    Args:
        group: a ``torch.distributed.ProcessGroup`` this process is a member of, or None (the default group).
        timeout_s: how long a collective or a blocking receive waits for its peers before it raises
            :class:`~cupy_ep.errors.CommTimeoutError` (default: cupy_ep's default timeout).
    """

    def __init__(self, group=None, *, timeout_s: float | None = None, _child=None):
        self.timeout_s = float(timeout_s) if timeout_s is not None else default_timeout_s()
        if _child is not None:
            self._store, self.name, self._rank, self._size = _child
            self.group = None
        else:
            import torch.distributed as dist
            if not dist.is_initialized():
                raise RuntimeError("group: torch.distributed is not initialized (call init_process_group first)")
            if group is not None and not isinstance(group, dist.ProcessGroup):
                raise TypeError(f"group: must be a torch.distributed.ProcessGroup or None, got "
                                f"{type(group).__name__}")
            self.group = group
            ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
            self._rank = dist.get_rank(group)
            if self._rank < 0:
                raise ValueError("group: this process is not a member of the group")
            self._size = len(ranks)
            _made[ranks] += 1
            digest = hashlib.sha1(repr(ranks).encode()).hexdigest()[:12]
            self.name = f"cupy_ep/{digest}.{_made[ranks]}"
            self._store = dist.distributed_c10d._get_default_store()
        self._coll = 0                      # collectives made on this communicator
        self._own: dict[int, tuple] = {}    # collective number -> this rank's (key, chunks), until deleted
        self._sent = collections.Counter()  # per destination: messages sent
        self._pulled = collections.Counter()  # per source: messages moved into the inbox
        self._inbox: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)
        self._freed = False

    # ---- mpi4py's basics ------------------------------------------------------------------------------
    def Get_rank(self) -> int:
        return self._rank

    def Get_size(self) -> int:
        return self._size

    rank = property(Get_rank)
    size = property(Get_size)

    def __repr__(self) -> str:
        return f"TorchComm(rank={self._rank}, size={self._size}, name={self.name!r})"

    # ---- the store ----------------------------------------------------------------------------------
    def _put(self, key: str, data: bytes) -> int:
        """Store ``data`` under ``key`` (chunked when large); returns the chunk count (0: one value)."""
        if len(data) <= _CHUNK:
            self._store.set(key, _WHOLE + data)
            return 0
        # One set per chunk: the store's multi_set / multi_get take time that grows with the square of their
        # payload (seconds at 16 MiB), one set or get of a chunk about a millisecond.
        view = memoryview(data)
        count = (len(data) + _CHUNK - 1) // _CHUNK
        for i in range(count):
            self._store.set(f"{key}#{i}", view[i * _CHUNK:(i + 1) * _CHUNK].tobytes())
        self._store.set(key, _SPLIT + str(count).encode())
        return count

    def _values(self, keys: list[str]) -> list[tuple[bytes, int]]:
        """``(data, chunk count)`` of every key (each set already)."""
        out = []
        for key in keys:  # one get per value and per chunk (see _put)
            head = self._store.get(key)
            if head[:1] == _WHOLE:
                out.append((head[1:], 0))
            else:
                n = int(head[1:])
                out.append((b"".join(self._store.get(f"{key}#{i}") for i in range(n)), n))
        return out

    def _delete(self, key: str, chunks: int) -> None:
        for i in range(chunks):
            self._store.delete_key(f"{key}#{i}")
        self._store.delete_key(key)

    # ---- collectives --------------------------------------------------------------------------------
    def _poll(self, ready, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            if time.monotonic() > deadline:
                raise CommTimeoutError(f"rank {self._rank}: {what} did not come within {self.timeout_s} s "
                                       f"({self.name})", {"rank": self._rank, "role": "bootstrap", "kernel": what})
            time.sleep(_POLL_S)

    def _contribute(self, value: bytes) -> list[str]:
        """Start collective number n: set this rank's key, delete the one of n - 2; returns every rank's key."""
        n = self._coll
        self._coll += 1
        prefix = f"{self.name}/c{n}/"
        key = prefix + str(self._rank)
        self._own[n] = (key, self._put(key, value))
        old = self._own.pop(n - 2, None)
        if old is not None:
            self._delete(*old)
        return [prefix + str(r) for r in range(self._size)]

    def allgather(self, obj) -> list:
        """Every rank's ``obj``, by rank."""
        keys = self._contribute(pickle.dumps(obj))
        self._poll(lambda: self._store.check(keys), f"allgather #{self._coll - 1}")
        return [pickle.loads(v) for v, _ in self._values(keys)]

    def bcast(self, obj, root: int = 0):
        """Rank ``root``'s ``obj`` on every rank."""
        return self.allgather(obj if self._rank == root else None)[root]

    def allreduce(self, value, op="sum"):
        """``value`` reduced over the ranks, in rank order (``op``: sum, min, max, land, lor; numpy arrays too)."""
        values = self.allgather(value)
        if op == "sum":
            out = values[0]
            for v in values[1:]:
                out = out + v
            return out
        if op in ("min", "max"):
            return (min if op == "min" else max)(values)
        if op in ("land", "lor"):
            return (all if op == "land" else any)(bool(v) for v in values)
        raise ValueError(f"op: must be one of sum, min, max, land, lor, got {op!r}")

    def Ibarrier(self) -> _BarrierRequest:
        return _BarrierRequest(self, self._contribute(b""))

    def Barrier(self) -> None:
        self.Ibarrier().Wait()

    barrier = Barrier

    def Split(self, color: int = 0, key: int = 0) -> "TorchComm":
        """The communicator of the ranks that passed the same ``color``, ordered by ``(key, rank)``."""
        n = self._coll
        chosen = self.allgather((color, key))
        members = sorted((k, r) for r, (c, k) in enumerate(chosen) if c == color)
        rank = [r for _, r in members].index(self._rank)
        return TorchComm(timeout_s=self.timeout_s, _child=(self._store, f"{self.name}/s{n}.{color}", rank,
                                                            len(members)))

    def Split_type(self, split_type="shared", key: int = 0) -> "TorchComm":
        """``"shared"``: the ranks on this machine (by host name), ordered by ``(key, rank)``."""
        if split_type != "shared":
            raise ValueError(f"split_type: only 'shared' is supported, got {split_type!r}")
        hosts = self.allgather(socket.gethostname())
        return self.Split(sorted(set(hosts)).index(hosts[self._rank]), key)

    def Idup(self) -> tuple["TorchComm", _BarrierRequest]:
        """The non-blocking ``Dup`` (as mpi4py's): the duplicate, and a request that completes once every rank
        called it (a barrier); use the duplicate only after that. The caller polls the request, so it can wait for
        less than this communicator's timeout (the host backend's constructor waits for its Buffer's)."""
        n = self._coll
        request = self.Ibarrier()
        return TorchComm(timeout_s=self.timeout_s, _child=(self._store, f"{self.name}/d{n}", self._rank,
                                                            self._size)), request

    def Dup(self) -> "TorchComm":
        dup, request = self.Idup()
        request.Wait()
        return dup

    def Free(self) -> None:
        """Forget this communicator (local; its messages left unreceived stay in the store: :meth:`drain` first)."""
        self._freed = True
        self._inbox.clear()

    def Abort(self, errorcode: int = 1) -> None:
        import os
        os._exit(errorcode)

    # ---- point to point -----------------------------------------------------------------------------
    def _send(self, dest: int, tag: int, kind: int, data) -> _Done:
        if not 0 <= dest < self._size:
            raise ValueError(f"dest: must be a rank in [0, {self._size}), got {dest}")
        seq = self._sent[dest]
        self._sent[dest] += 1
        self._put(f"{self.name}/m{self._rank}.{dest}/{seq}", _HEAD.pack(int(tag), kind) + bytes(data))
        return _Done()

    def _pull(self, source: int) -> None:
        """Move every message ``source`` sent here so far into the inbox, in order."""
        while True:
            key = f"{self.name}/m{source}.{self._rank}/{self._pulled[source]}"
            if not self._store.check([key]):
                return
            (value, chunks), = self._values([key])
            self._delete(key, chunks)
            self._pulled[source] += 1
            tag, kind = _HEAD.unpack_from(value)
            self._inbox[(source, tag)].append((kind, value[_HEAD.size:]))

    def _sources(self, source: int) -> list[int]:
        return [r for r in range(self._size)] if source == ANY_SOURCE else [source]

    def _take(self, source: int, tag: int):
        """The oldest message of ``tag`` from ``source`` (``ANY_*``: any), removed from the inbox; else None."""
        for r in self._sources(source):
            self._pull(r)
            for (s, t), queue in self._inbox.items():
                if s == r and (tag == ANY_TAG or t == tag) and queue:
                    return queue.popleft()
        return None

    def isend(self, obj, dest: int, tag: int = 0) -> _Done:
        return self._send(dest, tag, _OBJ, pickle.dumps(obj))

    def send(self, obj, dest: int, tag: int = 0) -> None:
        self.isend(obj, dest, tag)

    def Isend(self, buf, dest: int, tag: int = 0) -> _Done:
        return self._send(dest, tag, _RAW, _as_bytes(buf))

    def Send(self, buf, dest: int, tag: int = 0) -> None:
        self.Isend(buf, dest, tag)

    def Irecv(self, buf, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> _RecvRequest:
        return _RecvRequest(self, buf, source, tag)

    def Recv(self, buf, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> None:
        self.Irecv(buf, source, tag).Wait()

    def recv(self, buf=None, source: int = ANY_SOURCE, tag: int = ANY_TAG):
        got = []

        def ready():
            message = self._take(source, tag)
            if message is not None:
                got.append(message)
            return bool(got)
        self._poll(ready, f"a message from rank {source} (tag {tag})")
        kind, data = got[0]
        return pickle.loads(data) if kind == _OBJ else data

    def Iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> bool:
        for r in self._sources(source):
            self._pull(r)
            if any(queue for (s, t), queue in self._inbox.items() if s == r and (tag == ANY_TAG or t == tag)):
                return True
        return False

    def drain(self, tag: int | None = None) -> int:
        """Drop every message already sent here (on ``tag``; None: any); returns how many
        (:func:`cupy_ep.bootstrap.drain`)."""
        count = 0
        for r in range(self._size):
            self._pull(r)
        for (_, t), queue in self._inbox.items():
            if tag is None or t == tag:
                count += len(queue)
                queue.clear()
        return count

