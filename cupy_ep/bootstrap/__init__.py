"""How the ranks of a Buffer find each other: the communicator interface (:mod:`.comm`, with an mpi4py and a
``torch.distributed`` implementation, :mod:`.torch_group`) and what is built over it (:mod:`.topology`: ranks per
node, GPU choice, SM shares, the CUDA-IPC buffer every rank of a node shares).

Importing this package imports neither torch nor mpi4py.
"""
from .comm import (REDUCE_OPS, Comm, Request, allreduce, as_comm, default_world, drain, is_mpi4py,  # noqa: F401
                   is_torch_group, launched_by_torchrun, mpi_started, split_shared, torch_group_ready, world)
from .torch_group import TorchComm  # noqa: F401  (imports torch only when one is made)
from .topology import (HostMapped, IpcBuffer, SmShare, Topology, check_peer_access, choose_device,  # noqa: F401
                       gpu_of_each_rank, gpu_sm_share, query_mps, sm_share, topology, whole_gpu_sms)
