"""bootstrap.topology: the node-local rank (NVLink-domain index) and the machine rank (which picks the GPU) stay
apart when num_ranks_per_node simulates several nodes on one machine."""
import pytest

from cupy_ep import bootstrap


@pytest.mark.mpi(min_size=2)
def test_simulated_nodes_keep_one_gpu_per_process(comm):
    R = comm.Get_size()
    real = bootstrap.topology(comm)
    one_per_node = bootstrap.topology(comm, num_ranks_per_node=1)
    assert one_per_node.local_rank == 0 and one_per_node.num_nodes == R
    # what picks the GPU is unchanged by the override: 2 ranks as 2 nodes x 1 GPU use two GPUs, not GPU 0 twice
    assert one_per_node.machine_rank == real.machine_rank == real.local_rank
    machine_ranks = comm.allgather(one_per_node.machine_rank)
    assert sorted(machine_ranks) == list(range(R))   # mpirun on one machine in the tests


def test_topology_without_override_defaults_machine_rank():
    t = bootstrap.Topology(rank=3, num_ranks=4, local_rank=1, local_size=2, num_ranks_per_node=2)
    assert t.machine_rank == 1
