"""The handles dispatch calls return: DeepEP's tuples, carrying where they come from.

Each handle is a ``tuple`` subclass, so code written for DeepEP indexes and unpacks it as before. The extra
attributes let a later call check it was given the right handle:

* ``buffer_id``: the id of the Buffer that made it, the same on every rank of that Buffer (rank 0's, shared at
  construction: :func:`new_buffer_id`). A handle of another Buffer is refused (:func:`check_origin`).
* ``epoch``: the number of the dispatch call that made it on that Buffer. The host backend compares the epochs of
  every rank's handle before a combine or cached dispatch moves any data: handles of different dispatches would
  pair rows of one routing with counts of another.
* ``routing`` (low-latency only): a digest of the ``topk_idx`` the dispatch was given (None when the values were
  not read: ``check_values=False``); the combine refuses a ``topk_idx`` with another digest (:func:`check_routing`).

A plain tuple made from a handle's items has none of them and is accepted as DeepEP accepts it (its origin is not
checked); a low-latency combine given one computes the ``topk_slots`` again from its ``topk_idx``
(:func:`cupy_ep.validate.low_latency_slots_of`; refused with ``enable_shrink``, where they depend on the mask).
"""
from __future__ import annotations

import hashlib
import os

import numpy as np

from . import interop


class _Handle(tuple):
    """A tuple of DeepEP's fields plus ``buffer_id`` and ``epoch`` (None when unknown)."""

    def __new__(cls, fields, buffer_id=None, epoch=None):
        self = super().__new__(cls, fields)
        self.buffer_id = buffer_id
        self.epoch = epoch
        return self

    def _extra(self) -> str:
        return f"buffer_id={self.buffer_id!r}, epoch={self.epoch!r}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({tuple.__repr__(self)}, {self._extra()})"


class DispatchHandle(_Handle):
    """What an intranode ``dispatch`` returns as ``handle``: DeepEP's 6-tuple ``(rank_prefix_matrix [R, R],
    channel_prefix_matrix [R, C], recv_channel_prefix_matrix [R, C], recv_src_idx [N], is_token_in_rank [T, R]
    bool, send_head [T, R])``, all int32 but the bool, with ``buffer_id`` and ``epoch``."""


class InternodeHandle(_Handle):
    """What an internode ``dispatch`` returns as ``handle``: DeepEP's internode 10-tuple (see
    :mod:`cupy_ep.cuda.internode`), with ``buffer_id`` and ``epoch``."""


class LowLatencyHandle(_Handle):
    """What ``low_latency_dispatch`` returns as ``handle``: DeepEP's ``(src_info [L, R*M] int32, layout_range
    [L, R] int64, M, H, E)``, indexed and unpacked as that 5-tuple, with attributes:

    ``topk_slots``: ``[T, K] int32``, the slot the dispatch gave each of this rank's top-k entries (its place
    among the rows its expert received from this rank; -1: no expert, or past the M slots). The combine finds the
    expert rows of each token by these slots instead of counting them again from ``topk_idx``; give it the
    dispatch's ``topk_idx``. A plain tuple made from the items has no slots: the combine then computes them again
    from ``topk_idx`` (a sort on its device per call; not in shrink mode), so passing the handle back as it is
    stays the fast path.

    ``buffer_id``, ``epoch``, ``routing``: see :mod:`cupy_ep.handles`.
    """

    def __new__(cls, fields, topk_slots=None, buffer_id=None, epoch=None, routing=None):
        self = super().__new__(cls, fields, buffer_id, epoch)
        self.topk_slots = topk_slots
        self.routing = routing
        return self

    def _extra(self) -> str:
        return f"topk_slots={self.topk_slots!r}, {super()._extra()}, routing={self.routing!r}"


def new_buffer_id(comm) -> int:
    """Collective: one random 63-bit id for a new Buffer, rank 0's, the same on every rank of ``comm``."""
    mine = int.from_bytes(os.urandom(8), "little") >> 1
    return int(comm.bcast(mine, root=0))


def check_origin(handle, buffer_id, name: str = "handle") -> None:
    """ValueError unless ``handle`` was made by the Buffer of ``buffer_id`` (or carries no id: a plain tuple)."""
    theirs = getattr(handle, "buffer_id", None)
    if theirs is not None and buffer_id is not None and theirs != buffer_id:
        raise ValueError(f"{name}: was made by another Buffer (buffer id {theirs:#x}, this Buffer is "
                         f"{buffer_id:#x}); pass the handle this Buffer's dispatch returned")


def routing_digest(topk_idx, host=None) -> str:
    """A digest of ``topk_idx``'s values (any integer dtype, any kind: a GPU array is copied to the host, unless
    the caller passes that copy as ``host``)."""
    host = np.ascontiguousarray(interop.to_host(topk_idx) if host is None else host).astype(np.int64, copy=False)
    return hashlib.blake2b(host.tobytes() + repr(host.shape).encode(), digest_size=12).hexdigest()


def check_routing(handle, topk_idx, host=None) -> None:
    """ValueError when ``handle`` (a low-latency handle with a ``routing`` digest) was made from another
    ``topk_idx`` than the one given (this reads ``topk_idx`` on the host)."""
    want = getattr(handle, "routing", None)
    if want is not None and routing_digest(topk_idx, host) != want:
        raise ValueError("topk_idx: differs from the topk_idx of the dispatch that made the handle (a combine must "
                         "get its dispatch's routing, or its rows go to the wrong tokens)")
