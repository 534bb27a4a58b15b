"""The communicator interface every part of cupy_ep talks through, and the few helpers that hide what differs.

:class:`Comm` is the subset of mpi4py's communicator API the library uses: an ``mpi4py.MPI.Comm`` satisfies it as
is, and :class:`~cupy_ep.bootstrap.torch_group.TorchComm` implements it over a ``torch.distributed`` process
group. What mpi4py spells with its own objects (reduction ops, ``COMM_TYPE_SHARED``, ``ANY_SOURCE`` with a
``Status``) goes through :func:`allreduce`, :func:`split_shared` and :func:`drain`, which pick the spelling of the
communicator they are given. Buffers (``Isend``/``Irecv``/``Recv``) are numpy arrays or mpi4py's ``[array, "B"]``
specs; both implementations take both.

Which world a ``Buffer(None)`` joins (:func:`as_comm`): the default ``torch.distributed`` group when
torch.distributed is initialized and MPI is not what the job asked for (mpi4py's MPI not started, no
``CUPY_EP_BOOTSTRAP=mpi``); else ``MPI.COMM_WORLD``. ``CUPY_EP_BOOTSTRAP=torch`` / ``mpi`` forces the choice.
Importing this module imports neither torch nor mpi4py.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Protocol, runtime_checkable

#: Reduction names :func:`allreduce` takes.
REDUCE_OPS = ("sum", "min", "max", "land", "lor")


@runtime_checkable
class Request(Protocol):
    """A non-blocking operation's handle (mpi4py's ``Request``)."""

    def Test(self) -> bool: ...
    def Wait(self) -> None: ...
    def Cancel(self) -> None: ...
    def Free(self) -> None: ...


@runtime_checkable
class Comm(Protocol):
    """What cupy_ep calls on a communicator (mpi4py's names and meanings; ranks are ranks of this communicator).

    Collectives (every rank calls them, in the same order): ``allgather(obj) -> list`` (by rank),
    ``bcast(obj, root) -> obj``, ``allreduce(value, op)`` (op: the implementation's own; use :func:`allreduce`),
    ``Barrier()``, ``Ibarrier() -> Request``, ``Split(color, key) -> Comm``, ``Split_type(type, key) -> Comm``
    (use :func:`split_shared`), ``Dup() -> Comm``, ``Free()``.
    Point to point (messages between two ranks on one tag arrive in order): ``isend(obj, dest, tag)``,
    ``recv(source, tag) -> obj`` (pickled objects), ``Isend(buf, dest, tag)``, ``Irecv(buf, source, tag)``,
    ``Recv(buf, source, tag)`` (bytes into a numpy buffer of the right size), ``Iprobe(source, tag) -> bool``.
    """

    def Get_rank(self) -> int: ...
    def Get_size(self) -> int: ...
    def allgather(self, obj: Any) -> list: ...
    def bcast(self, obj: Any, root: int = 0) -> Any: ...
    def allreduce(self, value: Any, op: Any = ...) -> Any: ...
    def Barrier(self) -> None: ...
    def Ibarrier(self) -> Request: ...
    def Split(self, color: int = 0, key: int = 0) -> "Comm": ...
    def Split_type(self, split_type: Any, key: int = 0) -> "Comm": ...
    def Dup(self) -> "Comm": ...
    def Free(self) -> None: ...
    def isend(self, obj: Any, dest: int, tag: int = 0) -> Request: ...
    def recv(self, buf: Any = None, source: int = ..., tag: int = ...) -> Any: ...
    def Isend(self, buf: Any, dest: int, tag: int = 0) -> Request: ...
    def Irecv(self, buf: Any, source: int = ..., tag: int = ...) -> Request: ...
    def Recv(self, buf: Any, source: int = ..., tag: int = ...) -> None: ...
    def Iprobe(self, source: int = ..., tag: int = ...) -> bool: ...


def is_mpi4py(comm) -> bool:
    """Whether ``comm`` is an mpi4py communicator (then mpi4py's MPI module is loaded already)."""
    return type(comm).__module__.startswith("mpi4py")


def allreduce(comm, value, op: str = "sum"):
    """Collective: ``value`` reduced over the ranks of ``comm`` by ``op`` (one of :data:`REDUCE_OPS`)."""
    if op not in REDUCE_OPS:
        raise ValueError(f"op: must be one of {REDUCE_OPS}, got {op!r}")
    if is_mpi4py(comm):
        from mpi4py import MPI
        return comm.allreduce(value, op=getattr(MPI, op.upper()))
    return comm.allreduce(value, op=op)


def split_shared(comm):
    """Collective: the sub-communicator of the ranks of ``comm`` on this machine (``Split_type(COMM_TYPE_SHARED)``,
    ranks ordered as in ``comm``); ``Free()`` it after use."""
    if is_mpi4py(comm):
        from mpi4py import MPI
        return comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    return comm.Split_type("shared", key=comm.Get_rank())


def drain(comm, tag: int | None = None) -> int:
    """Receive and drop every message already sent to this rank on ``comm`` (on ``tag``; None: any tag), so that
    none is left when ``comm`` is freed. Returns how many. Call it after a barrier that every sender passed."""
    if not is_mpi4py(comm):
        return comm.drain(tag)
    import numpy as np
    from mpi4py import MPI
    status, count = MPI.Status(), 0
    any_tag = MPI.ANY_TAG if tag is None else tag
    while comm.Iprobe(source=MPI.ANY_SOURCE, tag=any_tag, status=status):
        sink = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
        comm.Recv([sink, "B"], source=status.Get_source(), tag=status.Get_tag())
        count += 1
    return count


def torch_group_ready() -> bool:
    """torch.distributed is imported and initialized (looked up without importing torch)."""
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def mpi_started() -> bool:
    """mpi4py's MPI module is loaded and MPI is initialized (looked up without importing it)."""
    mpi = sys.modules.get("mpi4py.MPI")
    return bool(mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized())


def default_world() -> str:
    """``"torch"`` or ``"mpi"``: the world ``as_comm(None)`` joins (the module docstring's rule)."""
    forced = os.environ.get("CUPY_EP_BOOTSTRAP", "").strip().lower()
    if forced in ("torch", "mpi"):
        return forced
    if forced:
        raise ValueError(f"CUPY_EP_BOOTSTRAP: must be 'torch' or 'mpi', got {forced!r}")
    return "torch" if torch_group_ready() and not mpi_started() else "mpi"


def is_torch_group(obj) -> bool:
    """Whether ``obj`` is a ``torch.distributed`` process group (looked up without importing torch)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and isinstance(obj, dist.ProcessGroup)


def as_comm(group_or_comm=None, *, timeout_s: float | None = None):
    """The :class:`Comm` behind a user's ``group_or_comm``: an mpi4py communicator (or anything with its API) as
    is, a ``torch.distributed.ProcessGroup`` (NCCL or gloo) as a :class:`~cupy_ep.bootstrap.torch_group.TorchComm`,
    None as the module docstring says. ``timeout_s`` bounds the torch adapter's collectives (default: its own)."""
    if group_or_comm is None:
        if default_world() == "torch":
            from .torch_group import TorchComm
            return TorchComm(None, timeout_s=timeout_s)
        from mpi4py import MPI
        return MPI.COMM_WORLD
    if is_torch_group(group_or_comm):
        from .torch_group import TorchComm
        return TorchComm(group_or_comm, timeout_s=timeout_s)
    return group_or_comm


def launched_by_torchrun() -> bool:
    """This process was started by torchrun (torch.distributed.run / torchelastic), judged by its environment."""
    env = os.environ
    return bool(env.get("TORCHELASTIC_RUN_ID") or env.get("TORCHELASTIC_RESTART_COUNT") is not None
                or ("RANK" in env and "WORLD_SIZE" in env and "LOCAL_RANK" in env and "MASTER_ADDR" in env
                    and not any(k in env for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"))))


def world(backend: str | None = None, *, timeout_s: float | None = None):
    """The job's communicator, for scripts that run under mpirun and torchrun alike: under torchrun (or with
    torch.distributed initialized, see :func:`default_world`) torch.distributed's default group as a
    :class:`~cupy_ep.bootstrap.torch_group.TorchComm` (initializing it first, with ``backend``: default gloo),
    else ``MPI.COMM_WORLD``.
    """
    forced = os.environ.get("CUPY_EP_BOOTSTRAP", "").strip().lower()
    if forced != "mpi" and (launched_by_torchrun() or forced == "torch") and not mpi_started():
        import torch.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group(backend or "gloo")
        from .torch_group import TorchComm
        return TorchComm(None, timeout_s=timeout_s)
    return as_comm(None, timeout_s=timeout_s)
