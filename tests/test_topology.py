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


class FakeRuntime:
    """The four ``cupy.cuda.runtime`` calls of ``check_peer_access``: rank r sits on GPU ``gpus[r]`` (bus id
    ``"bus<g>"``); ``no_path`` holds the GPU pairs without peer access; ``hidden`` the GPUs this rank cannot see."""

    def __init__(self, my_gpu, no_path=(), hidden=()):
        self.my_gpu, self.no_path, self.hidden = my_gpu, set(no_path), set(hidden)
        self.asked = []

    def getDevice(self):
        return self.my_gpu

    def deviceGetPCIBusId(self, device):
        return f"bus{device}"

    def deviceGetByPCIBusId(self, bus):
        g = int(bus[3:])
        if g in self.hidden:
            raise RuntimeError("cudaErrorInvalidDevice")
        return g

    def deviceCanAccessPeer(self, a, b):
        self.asked.append((a, b))
        return 0 if (a, b) in self.no_path or (b, a) in self.no_path else 1


@pytest.mark.mpi(min_size=2)
def test_peer_access_everywhere_passes_and_asks_about_every_other_gpu(comm):
    r, R = comm.Get_rank(), comm.Get_size()
    rt = FakeRuntime(my_gpu=r)
    bootstrap.check_peer_access(comm, rt)
    assert sorted(rt.asked) == [(r, g) for g in range(R) if g != r]


@pytest.mark.mpi(min_size=2)
def test_ranks_sharing_a_gpu_need_no_peer_access(comm):
    rt = FakeRuntime(my_gpu=0, no_path={(0, 0)})
    bootstrap.check_peer_access(comm, rt)  # every rank on GPU 0: nothing to ask
    assert rt.asked == []


@pytest.mark.mpi(min_size=2)
def test_a_missing_peer_path_raises_on_every_rank_naming_the_pair(comm):
    from cupy_ep.errors import BackendUnavailableError
    r, R = comm.Get_rank(), comm.Get_size()
    rt = FakeRuntime(my_gpu=r, no_path={(0, R - 1)})  # only GPUs 0 and R-1 lack a path
    with pytest.raises(BackendUnavailableError) as e:
        bootstrap.check_peer_access(comm, rt)  # every rank raises, not only ranks 0 and R-1 (no one left waiting)
    assert f"rank 0 (GPU bus0) cannot access rank {R - 1}'s GPU bus{R - 1}" in str(e.value)
    assert "cudaDeviceCanAccessPeer" in str(e.value)


@pytest.mark.mpi(min_size=2)
def test_a_peer_gpu_hidden_from_this_process_is_not_refused(comm):
    r, R = comm.Get_rank(), comm.Get_size()
    rt = FakeRuntime(my_gpu=r, no_path={(0, 1)}, hidden={g for g in range(R) if g != r})
    bootstrap.check_peer_access(comm, rt)  # CUDA_VISIBLE_DEVICES=<own GPU>: cudaIpcOpenMemHandle decides
    assert rt.asked == []
