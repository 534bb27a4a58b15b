"""DeepEP's public names over cupy_ep, so that DeepEP-style code switches with one import line::

    import cupy_ep.deep_ep as deep_ep       # in place of: import deep_ep
    from cupy_ep.deep_ep import Buffer, Config, EventOverlap, topk_idx_t

``Buffer`` takes DeepEP's constructor (``group`` first, ``comm=`` for an mpi4py communicator) and is a
:class:`cupy_ep.Buffer` (on the CUDA or the host backend, chosen as there); ``Config``, ``EventOverlap`` and the
static helpers (``get_low_latency_rdma_size_hint``, ``get_dispatch_config``, ``get_combine_config``,
``set_num_sms``, ``capture``, ``is_sm90_compiled``) are cupy_ep's. The group is a ``torch.distributed`` process
group (NCCL or gloo, as DeepEP's), an mpi4py communicator, or None (:func:`cupy_ep.bootstrap.as_comm`: the default
torch group when torch.distributed is initialized and MPI is not started, else ``MPI.COMM_WORLD``). Every
remaining difference from DeepEP is listed in docs/deepep_compatibility.md. Needs torch (``topk_idx_t`` is a torch
dtype, as DeepEP's).
"""
from __future__ import annotations

import torch

from . import buffer as _buffer
from .bootstrap import is_torch_group
from .config import Config
from .event import EventOverlap

__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t"]

#: The dtype of ``topk_idx`` (DeepEP's ``deep_ep.topk_idx_t``); int32 ids are accepted too.
topk_idx_t = torch.int64


def _communicator(group, comm):
    """What DeepEP's ``group`` / ``comm`` arguments name: a process group, a communicator, or None (the default
    world, chosen by :class:`cupy_ep.Buffer`)."""
    if group is not None and comm is not None:
        raise ValueError("group, comm: pass one communicator, not both")
    comm = group if group is not None else comm
    if comm is not None and not is_torch_group(comm) and not (
            hasattr(comm, "Get_rank") and hasattr(comm, "Get_size") and hasattr(comm, "allgather")):
        raise TypeError(f"group: must be a torch.distributed.ProcessGroup, an mpi4py communicator or None, got "
                        f"{type(comm).__name__}")
    return comm


class Buffer(_buffer.Buffer):
    """DeepEP's ``deep_ep.Buffer``: a :class:`cupy_ep.Buffer` made from DeepEP's constructor arguments.

    Args:
        group: the expert-parallel group: a ``torch.distributed.ProcessGroup`` (NCCL or gloo), an mpi4py
            communicator, or None (``comm``, else the default world: :func:`cupy_ep.bootstrap.as_comm`).
        num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank, allow_nvlink_for_low_latency_mode,
            allow_mnnvl, explicitly_destroy, enable_shrink: as :class:`cupy_ep.Buffer`.
        comm: an mpi4py communicator, used when ``group`` is None (as DeepEP's).
        **extensions: cupy_ep's keyword-only arguments (``backend=``, ``device=``, ``timeout_s=``, ...).

    Attributes (DeepEP's): ``rank``, ``group_size``, ``group`` (the group as given; ``comm``: the communicator the
    buffer talks through), ``num_nvl_bytes``,
    ``num_rdma_bytes``, ``low_latency_mode``, ``explicitly_destroy``; ``num_sms`` on the class.
    """

    def __init__(self, group=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm=None, **extensions):
        comm = _communicator(group, comm)
        super().__init__(comm, num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank,
                         allow_nvlink_for_low_latency_mode, allow_mnnvl, explicitly_destroy, enable_shrink,
                         **extensions)
        self.group, self.group_size = comm if comm is not None else self.comm, self.num_ranks

