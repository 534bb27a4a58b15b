"""S24: the low-latency buffer's peer table per rank (NVSHMEM: nvshmem_ptr of every PE; IPC: the opened handles)
and its grid. Run under mpirun."""
from mpi4py import MPI

import cupy_ep
from cupy_ep import config as cfgmod

comm = MPI.COMM_WORLD
rank, R = comm.Get_rank(), comm.Get_size()
M, H, E = 32, 1024, 8 * R
buf = cupy_ep.Buffer(comm, num_rdma_bytes=cfgmod.low_latency_rdma_size_hint(M, H, R, E), low_latency_mode=True,
                     backend="cuda", timeout_s=10.0)
ll = buf._ll
peers = [f"{p:#x}" if p else "0 (puts)" for p in ll.nvlink_peers.get().tolist()]
lines = comm.gather(f"rank {rank}: transport {ll.transport} blocks {ll.num_blocks} ({buf.sm_share.describe()}); "
                    f"peer table {peers}")
if rank == 0:
    print("\n".join(lines), flush=True)
buf.destroy()
