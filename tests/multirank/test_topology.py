"""bootstrap.topology: the node-local rank (NVLink-domain index) and the machine rank (which picks the GPU) stay
apart when num_ranks_per_node simulates several nodes on one machine."""
import math

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


# ---- SMs per rank (bootstrap.SmShare): time slices without MPS, the MPS share with it ------------------------

def test_without_mps_a_rank_may_hold_the_whole_gpu_and_normal_mode_divides_it():
    share = bootstrap.SmShare(device_sms=132, provisioned_sms=132, gpu_sms=132, ranks_per_gpu=2, mps=False)
    assert share.per_rank == 132          # time slices: one process at a time, the low-latency grid is unchanged
    assert share.normal_mode_sms == 66    # what normal mode allowed before MPS was recognised
    assert "MPS" not in share.describe()


def test_under_mps_without_a_percentage_the_ranks_split_the_gpu():
    # MPS at 100 % for each of two clients reports 132 SMs to each; both grids must be resident together
    full = bootstrap.SmShare(device_sms=132, provisioned_sms=132, gpu_sms=132, ranks_per_gpu=2, mps=True)
    assert full.per_rank == full.normal_mode_sms == 66


def test_under_mps_the_clients_of_a_gpu_divide_one_clients_provisioned_sms():
    # CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 reports 66 SMs (the attribute and the execution affinity alike). MPS does
    # not keep two clients on different SMs, so both grids must fit on the 66 SMs either of them may be given: a
    # grid of 64 per rank (the GPU's half) left blocks of one rank waiting for SMs the other rank's blocks held.
    gpu = bootstrap.whole_gpu_sms(66, 50.0)
    assert gpu == 128                     # (66 - 2) x 2: never more than the GPU has
    half = bootstrap.SmShare(device_sms=66, provisioned_sms=66, gpu_sms=gpu, ranks_per_gpu=2, mps=True)
    assert half.per_rank == half.normal_mode_sms == 33
    assert "66 SMs provisioned" in half.describe() and "33 for its kernels" in half.describe()


@pytest.mark.parametrize("sms,pct,clients", [(132, 25.0, 4), (132, 33.0, 3), (132, 50.0, 2), (132, 12.5, 8),
                                             (114, 25.0, 4), (78, 50.0, 2), (132, 100.0, 2), (132, 100.0, 8),
                                             (132, 60.0, 2), (132, 30.0, 3)])
def test_every_client_of_a_gpu_fits_on_one_clients_provisioned_sms(sms, pct, clients):
    # MPS rounds a share up to whole TPCs (2 SMs) and may place every client on the same SMs: the blocks of all
    # clients of a GPU must fit on the SMs one client is provisioned with (one block per SM).
    wanted = math.ceil(sms * pct / 100)
    provisioned = min(sms, wanted + wanted % 2)
    share = bootstrap.SmShare(provisioned, provisioned, bootstrap.whole_gpu_sms(provisioned, pct), clients, True)
    assert share.per_rank * clients <= provisioned
    assert share.per_rank >= provisioned // clients      # and gives away nothing beyond the rounding


def test_without_a_percentage_the_estimate_is_what_is_provisioned():
    assert bootstrap.whole_gpu_sms(132, None) == bootstrap.whole_gpu_sms(132, 100.0) == 132
    assert bootstrap.whole_gpu_sms(40, 0.0) == 40   # a daemon default unseen here: smaller, never larger


@pytest.mark.mpi(min_size=2)
def test_mps_counts_only_when_every_rank_is_a_client(comm):
    r = comm.Get_rank()
    everywhere = bootstrap.sm_share(comm, 132, 2, mps=True, provisioned_sms=132, gpu_sms=132)
    assert everywhere.mps and everywhere.per_rank == 66
    mixed = bootstrap.sm_share(comm, 132, 2, mps=(r != 0), provisioned_sms=66, gpu_sms=130)
    # every rank takes the same decision: no MPS, the whole GPU (and its own SM count, not the provisioned one)
    assert not mixed.mps and mixed.per_rank == 132 and mixed.provisioned_sms == mixed.gpu_sms == 132
