"""Bootstrap over a communicator (:mod:`cupy_ep.bootstrap.comm`): ranks, node-local ranks, GPU choice, and the
CUDA-IPC buffer every rank shares.

Handles travel as bytes over the communicator (the pip MPIs are not CUDA-aware, so no device buffer ever goes to
MPI).
IPC buffers are plain ``cudaMalloc`` allocations: a handle of a pooled sub-allocation would point at the
pool's base allocation.
"""
from __future__ import annotations

import ctypes
import dataclasses
import os

import numpy as np

from .comm import allreduce, split_shared


@dataclasses.dataclass
class Topology:
    rank: int
    num_ranks: int
    local_rank: int             # rank inside its (possibly simulated) node: the NVLink-domain index
    local_size: int             # ranks on this machine (the MPI shared-memory split)
    num_ranks_per_node: int
    machine_rank: int = -1      # rank on this machine (the split's rank): picks the GPU

    def __post_init__(self):
        if self.machine_rank < 0:
            self.machine_rank = self.local_rank

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.num_ranks_per_node


def topology(comm, num_ranks_per_node: int | None = None) -> Topology:
    """Rank, world size and node-local rank/size (``Split_type(COMM_TYPE_SHARED)``), overridable."""
    local = split_shared(comm)
    local_rank, local_size = local.Get_rank(), local.Get_size()
    machine_rank = local_rank
    local.Free()
    rank, size = comm.Get_rank(), comm.Get_size()
    if num_ranks_per_node is None:
        num_ranks_per_node = local_size
    elif num_ranks_per_node <= 0 or size % num_ranks_per_node:
        raise ValueError(f"num_ranks_per_node: must divide the world size {size}, got {num_ranks_per_node}")
    else:
        local_rank = rank % num_ranks_per_node
    # With num_ranks_per_node overridden (several simulated nodes on one machine) the node-local rank no longer
    # tells which GPU this process owns: 2 ranks as 2 nodes x 1 GPU both have local rank 0 but must use GPUs 0
    # and 1 (before this, both ran on GPU 0 and every wait cost a time slice of the shared GPU: ~4 ms).
    return Topology(rank, size, local_rank, local_size, num_ranks_per_node, machine_rank)


def choose_device(local_rank: int, device: int | None = None) -> int:
    """``device`` if given (or ``CUPY_EP_DEVICE``), else local rank modulo the visible GPUs."""
    import cupy
    count = cupy.cuda.runtime.getDeviceCount()
    if device is None and os.environ.get("CUPY_EP_DEVICE"):
        device = int(os.environ["CUPY_EP_DEVICE"])
    if device is None:
        return local_rank % count
    if not 0 <= device < count:
        raise ValueError(f"device: must be in [0, {count}), got {device}")
    return device


def gpu_of_each_rank(comm, rt) -> list[tuple[str, str]]:
    """Collective: every rank's GPU as ``(host name, PCI bus id)``, by rank (``rt``: ``cupy.cuda.runtime``)."""
    import socket
    return comm.allgather((socket.gethostname(), rt.deviceGetPCIBusId(rt.getDevice())))


def check_peer_access(comm, rt) -> None:
    """Collective: raise :class:`BackendUnavailableError` on every rank of ``comm`` (before any IPC handle is
    opened, so no rank is left waiting) when one rank's GPU cannot reach another rank's memory by load/store
    (``cudaDeviceCanAccessPeer`` = 0: no NVLink and no PCIe peer-to-peer between them). Ranks sharing a GPU
    always can; a peer GPU this process cannot see (``CUDA_VISIBLE_DEVICES``) is left to ``cudaIpcOpenMemHandle``.
    ``rt`` is ``cupy.cuda.runtime`` (a stand-in in the CPU tests)."""
    from ..errors import BackendUnavailableError
    me = rt.getDevice()
    gpus = gpu_of_each_rank(comm, rt)  # an IPC buffer's ranks share a host: the bus ids tell the GPUs apart
    bus = gpus[comm.Get_rank()][1]
    problems = []
    for r, (_, other) in enumerate(gpus):
        if other == bus:
            continue
        try:
            peer = rt.deviceGetByPCIBusId(other)
        except Exception:  # not visible here: nothing to ask the driver
            continue
        if not rt.deviceCanAccessPeer(me, peer):
            problems.append(f"rank {comm.Get_rank()} (GPU {bus}) cannot access rank {r}'s GPU {other}")
    problems = [p for ps in comm.allgather(problems) for p in ps]
    if problems:
        raise BackendUnavailableError(
            "CUDA IPC buffers need peer access (NVLink or PCIe P2P) between the GPUs of one NVLink domain, and "
            f"cudaDeviceCanAccessPeer says no: {'; '.join(problems[:8])}"
            + (f" (+{len(problems) - 8} more)" if len(problems) > 8 else ""))


@dataclasses.dataclass(frozen=True)
class SmShare:
    """How many SMs one rank's kernels may fill with resident blocks on its GPU.

    Ranks sharing a GPU without CUDA MPS run in time slices, one process at a time, so a rank's kernel may use the
    whole GPU. Under MPS they run at the same time, so the blocks of all of them must be resident together: a block
    that waits for a peer's block would otherwise wait for an SM that the peer's own waiting blocks hold. MPS caps
    each client at its provisioned SMs (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``) but does not keep the clients apart:
    every client of a GPU may be placed on the same provisioned SMs. So the clients of one GPU divide one client's
    provisioned SMs among them, whatever the percentage: that is the only count known to hold all their blocks
    (at one block per SM, the heaviest shape the kernels use).

    Attributes:
        device_sms: the SMs CUDA reports (``cudaDevAttrMultiProcessorCount``: under MPS already the provisioned
            count).
        provisioned_sms: the SMs this process may use (``cuCtxGetExecAffinity``; ``device_sms`` without MPS).
        gpu_sms: the whole GPU's SMs (``device_sms`` without MPS; under MPS an estimate, see :func:`query_mps`),
            for messages and :attr:`partial`.
        ranks_per_gpu: ranks of this node per GPU (>= 1).
        mps: every rank of the communicator is an MPS client (``cudaDevAttrMpsEnabled``).
    """
    device_sms: int
    provisioned_sms: int
    gpu_sms: int
    ranks_per_gpu: int
    mps: bool

    @property
    def per_rank(self) -> int:
        """SMs one rank's kernel may hold at once: under MPS its part of the provisioned SMs (``per_rank *
        ranks_per_gpu <= provisioned_sms``), else the whole GPU (time slices)."""
        if self.mps:
            return max(1, min(self.provisioned_sms, self.gpu_sms) // self.ranks_per_gpu)
        return self.device_sms

    @property
    def normal_mode_sms(self) -> int:
        """The most SMs a normal-mode call may ask for (``Config.num_sms``): without MPS the GPU's SMs divided among
        the ranks sharing it, under MPS :attr:`per_rank`."""
        return self.per_rank if self.mps else self.device_sms // self.ranks_per_gpu

    @property
    def partial(self) -> bool:
        """Under MPS, a provisioned share smaller than the GPU (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` below 100 in
        this process's environment; a default set in the control daemon is not seen here)."""
        return self.mps and self.provisioned_sms < self.gpu_sms

    def describe(self) -> str:
        if not self.mps:
            return f"{self.device_sms} SMs, {self.ranks_per_gpu} rank(s) per GPU"
        return (f"{self.ranks_per_gpu} rank(s) per GPU as CUDA MPS clients, {self.provisioned_sms} SMs provisioned "
                f"to this rank of about {self.gpu_sms}, {self.per_rank} for its kernels")


_CU_EXEC_AFFINITY_TYPE_SM_COUNT = 0
_CUDA_DEV_ATTR_MPS_ENABLED = 133  # cudaDevAttrMpsEnabled / CU_DEVICE_ATTRIBUTE_MPS_ENABLED
_CUDA_DEV_ATTR_SM_COUNT = 16      # cudaDevAttrMultiProcessorCount


class _ExecAffinityParam(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("sm_count", ctypes.c_uint)]  # CUexecAffinityParam (smCount union arm)


def whole_gpu_sms(provisioned_sms: int, percentage: float | None) -> int:
    """The whole GPU's SMs as an MPS client can estimate them. CUDA reports only the provisioned SMs, rounded up
    to what the hardware can split (66 of 132 at 50 % on an H200; taken here as whole TPCs of 2 SMs). Taking
    ``provisioned - 2`` keeps that rounding from overstating the GPU (8 clients at 12.5 % of 132 SMs get 18 each:
    16 x 8 fits, 17 x 8 would not). Without a
    percentage in this process's environment the provisioning is the whole GPU, or a default the control daemon
    set that this process cannot see: the estimate is then the provisioned count (too small at worst, which costs
    SMs but never residency)."""
    if not percentage or percentage >= 100:
        return provisioned_sms
    return max(provisioned_sms, int(max(0, provisioned_sms - 2) * 100 // percentage))


def query_mps(device_id: int) -> tuple[bool, int, int]:
    """``(mps, provisioned_sms, gpu_sms)`` of this process on GPU ``device_id``: whether its contexts go through a
    CUDA MPS server, how many SMs the MPS provisioning leaves it, and the whole GPU's SMs (:func:`whole_gpu_sms`;
    both are the device's SMs without MPS). Creates the primary context of that GPU if MPS is on."""
    import cupy
    rt = cupy.cuda.runtime
    device_sms = rt.deviceGetAttribute(_CUDA_DEV_ATTR_SM_COUNT, device_id)
    try:
        mps = bool(rt.deviceGetAttribute(_CUDA_DEV_ATTR_MPS_ENABLED, device_id))
    except Exception:  # a driver older than the attribute: no way to tell, and MPS is rare there
        mps = False
    if not mps:
        return False, device_sms, device_sms
    with cupy.cuda.Device(device_id):
        rt.free(0)  # the primary context, current on this thread: what cuCtxGetExecAffinity asks about
        param = _ExecAffinityParam()
        rc = ctypes.CDLL("libcuda.so.1").cuCtxGetExecAffinity(ctypes.byref(param), _CU_EXEC_AFFINITY_TYPE_SM_COUNT)
    provisioned = int(param.sm_count) if rc == 0 and 0 < param.sm_count <= device_sms else device_sms
    try:
        percentage = float(os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") or 0)
    except ValueError:
        percentage = 0.0
    return True, provisioned, whole_gpu_sms(provisioned, percentage)


def sm_share(comm, device_sms: int, ranks_per_gpu: int, mps: bool, provisioned_sms: int,
             gpu_sms: int) -> SmShare:
    """Collective: this rank's :class:`SmShare`. MPS counts only when every rank of ``comm`` is an MPS client, so
    that all ranks take the same decisions from it (a mix raises nowhere here, and is treated as no MPS)."""
    everywhere = bool(allreduce(comm, int(bool(mps)), "min"))
    if not everywhere:
        provisioned_sms = gpu_sms = device_sms
    return SmShare(int(device_sms), int(provisioned_sms), int(gpu_sms), max(1, int(ranks_per_gpu)), everywhere)


def gpu_sm_share(comm, device_id: int, ranks_on_machine: int) -> SmShare:
    """Collective: this rank's :class:`SmShare` on GPU ``device_id``, with ``ranks_on_machine`` ranks spread over
    this machine's visible GPUs (what ``Buffer`` sizes its kernels by)."""
    import cupy
    rt = cupy.cuda.runtime
    ranks_per_gpu = -(-ranks_on_machine // max(1, rt.getDeviceCount()))
    return sm_share(comm, rt.deviceGetAttribute(_CUDA_DEV_ATTR_SM_COUNT, device_id), ranks_per_gpu,
                    *query_mps(device_id))


class IpcBuffer:
    """One zeroed ``cudaMalloc`` of ``nbytes`` per rank, opened by every peer through CUDA IPC.

    Attributes:
        ptrs: list of every rank's base address as seen from this process (own pointer at ``rank``).
        ptr_table: device ``uint64 [R]`` array of the same pointers (the kernels' ``buffer_ptrs``).
    """

    def __init__(self, comm, nbytes: int):
        import cupy
        rt = cupy.cuda.runtime
        self.comm, self.nbytes = comm, nbytes
        self.rank = comm.Get_rank()
        check_peer_access(comm, rt)
        self.ptr = rt.malloc(nbytes)
        rt.memset(self.ptr, 0, nbytes)
        rt.deviceSynchronize()
        handles = comm.allgather(rt.ipcGetMemHandle(self.ptr))
        self.ptrs = [self.ptr if r == self.rank else rt.ipcOpenMemHandle(h) for r, h in enumerate(handles)]
        self.ptr_table = cupy.array(np.array(self.ptrs, dtype=np.uint64))
        comm.Barrier()

    def close(self) -> None:
        """Collective: close the peers' mappings, wait for every rank, then free our allocation."""
        import cupy
        rt = cupy.cuda.runtime
        try:
            rt.deviceSynchronize()
            for r, p in enumerate(self.ptrs):
                if r != self.rank:
                    rt.ipcCloseMemHandle(p)
        finally:
            self.comm.Barrier()  # every rank gets here, even after an error: no peer still maps our memory
            rt.free(self.ptr)
            self.ptrs, self.ptr = [], 0


class HostMapped:
    """Pinned, device-mapped host memory (``cudaHostAlloc(Mapped | Portable)``): the kernels write it,
    the host reads it without a copy. ``view(dtype, offset, count)`` gives a numpy view."""

    def __init__(self, nbytes: int):
        import cupy
        rt = cupy.cuda.runtime
        self.nbytes = nbytes
        self.ptr = rt.hostAlloc(nbytes, rt.hostAllocMapped | rt.hostAllocPortable)
        ctypes.memset(self.ptr, 0, nbytes)

    def view(self, dtype, offset: int, count: int) -> np.ndarray:
        dtype = np.dtype(dtype)
        buf = (ctypes.c_char * (count * dtype.itemsize)).from_address(self.ptr + offset)
        return np.frombuffer(buf, dtype=dtype)

    def free(self) -> None:
        if self.ptr:
            import cupy
            cupy.cuda.runtime.freeHost(self.ptr)
            self.ptr = 0
