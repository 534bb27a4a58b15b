"""cupy_ep.bootstrap: the torch.distributed adapter (TorchComm) gives mpi4py's results, method by method, and a
Buffer made over a gloo process group matches the reference, on the host backend.

Under mpiexec (``--only-mpi``) the adapter runs over a gloo group started from MPI and is compared with
``MPI.COMM_WORLD`` call for call; under torchrun (``--with-torchrun``) the ``comm`` fixture is the adapter itself
and the same calls are checked against their closed forms, and MPI must never have been imported. The
single-process tests check which world ``Buffer(None)`` picks.
"""
from __future__ import annotations

import socket
import sys
import time

import numpy as np
import pytest

from cupy_ep import bootstrap
from cupy_ep.errors import CommTimeoutError
from tests.helpers import HOST_NVL_BYTES, HOST_RDMA_BYTES, all_ok

TIMEOUT_S = 2.0
SLACK_S = 3.0


def _exercise(comm) -> dict:
    """Every Comm method cupy_ep calls, with results that depend on rank and size only."""
    rank, size = comm.Get_rank(), comm.Get_size()
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    out = {"rank": rank, "size": size}
    out["allgather"] = comm.allgather(("r", rank, [rank] * rank))
    out["bcast"] = comm.bcast({"from": rank} if rank == size - 1 else None, root=size - 1)
    for op in bootstrap.REDUCE_OPS:
        out[f"allreduce.{op}"] = bootstrap.allreduce(comm, rank + 1 if op in ("sum", "min", "max") else rank > 0, op)
    out["allreduce.array"] = bootstrap.allreduce(comm, np.arange(3) * rank, "sum").tolist()
    comm.Barrier()
    request = comm.Ibarrier()
    deadline = time.monotonic() + 30
    while not request.Test() and time.monotonic() < deadline:
        time.sleep(1e-4)
    out["ibarrier"] = request.Test()
    half = comm.Split(rank % 2, -rank)   # keys reversed: rank order inside is reversed too
    out["split"] = (half.Get_rank(), half.Get_size(), half.allgather(rank))
    half.Free()
    local = bootstrap.split_shared(comm)
    out["split_shared"] = (local.Get_rank(), local.Get_size())
    local.Free()
    dup = comm.Dup()
    # objects around the ring, on two tags received in the other order (tags do not block each other)
    sends = [dup.isend(("a", rank), dest=nxt, tag=7), dup.isend(("b", rank), dest=nxt, tag=8)]
    out["recv"] = (dup.recv(source=prv, tag=8), dup.recv(source=prv, tag=7))
    # bytes around the ring, into numpy buffers (mpi4py's [buf, "B"] specs)
    payload = np.arange(5, dtype=np.int32) + 10 * rank
    inbox = np.zeros(5, dtype=np.int32)
    sends.append(dup.Isend([payload.view(np.uint8), "B"], dest=nxt, tag=3))
    receive = dup.Irecv([inbox.view(np.uint8), "B"], source=prv, tag=3)
    deadline = time.monotonic() + 30
    while not receive.Test() and time.monotonic() < deadline:
        time.sleep(1e-4)
    out["irecv"] = inbox.tolist()
    token = np.full(1, rank, dtype=np.int32)
    sends.append(dup.Isend(token, dest=nxt, tag=4))
    deadline = time.monotonic() + 30
    while not dup.Iprobe(source=prv, tag=4) and time.monotonic() < deadline:
        time.sleep(1e-4)
    out["iprobe.other_tag"] = dup.Iprobe(source=prv, tag=5)
    got = np.zeros(1, dtype=np.int32)
    dup.Recv(got, source=prv, tag=4)
    out["Recv"] = int(got[0])
    never = dup.Irecv(np.zeros(1, dtype=np.int32), source=prv, tag=6)  # nobody sends it
    out["cancelled.test"] = never.Test()
    never.Cancel()
    never.Wait()
    # left for drain: two messages nobody receives
    sends += [dup.isend(rank, dest=nxt, tag=9), dup.Isend(token, dest=nxt, tag=9)]
    for request in sends:
        request.Wait()
    dup.Barrier()
    out["drain"] = bootstrap.drain(dup, 9)
    out["drain.after"] = dup.Iprobe(source=prv, tag=9)
    dup.Free()
    return out


def _closed_form(rank: int, size: int) -> dict:
    prv = (rank - 1) % size
    mine = [r for r in range(size) if r % 2 == rank % 2]
    return {"rank": rank, "size": size, "allgather": [("r", r, [r] * r) for r in range(size)],
            "bcast": {"from": size - 1}, "allreduce.sum": size * (size + 1) // 2, "allreduce.min": 1,
            "allreduce.max": size, "allreduce.land": False, "allreduce.lor": True,
            "allreduce.array": [0, size * (size - 1) // 2, size * (size - 1)], "ibarrier": True,
            "split": (sorted(mine, reverse=True).index(rank), len(mine), sorted(mine, reverse=True)),
            "split_shared": (rank, size), "recv": (("b", prv), ("a", prv)),
            "irecv": [10 * prv + i for i in range(5)], "iprobe.other_tag": False, "Recv": prv,
            "cancelled.test": False, "drain": 2, "drain.after": False}


def _compare(got: dict, want: dict) -> list[str]:
    return [f"{k}: {got.get(k)!r} != {v!r}" for k, v in want.items() if got.get(k) != v]


@pytest.fixture(scope="module")
def gloo_group(comm):
    """A gloo ProcessGroup of every rank: a new group under torchrun, else the default group, started here
    from MPI (rank 0's free port, broadcast) and destroyed after the module."""
    dist = pytest.importorskip("torch.distributed")
    if not bootstrap.is_mpi4py(comm):
        yield dist.new_group(backend="gloo")
        return
    if dist.is_initialized():
        pytest.skip("torch.distributed is initialized already in this MPI job")
    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.Get_rank(),
                            world_size=comm.Get_size())
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.mpi(min_size=2)
def test_comm_methods_give_their_closed_forms(comm):
    bad = _compare(_exercise(comm), _closed_form(comm.Get_rank(), comm.Get_size()))
    assert all_ok(comm, not bad), f"rank {comm.Get_rank()} ({type(comm).__name__}): {bad}"


@pytest.mark.mpi(min_size=2)
def test_torch_adapter_matches_mpi4py_method_by_method(comm, gloo_group):
    if not bootstrap.is_mpi4py(comm):
        pytest.skip("needs mpi4py's communicator to compare with (run under mpiexec)")
    from cupy_ep.bootstrap.torch_group import TorchComm
    mpi, torch_side = _exercise(comm), _exercise(TorchComm(gloo_group))
    bad = _compare(torch_side, mpi)
    assert all_ok(comm, not bad), f"rank {comm.Get_rank()}: {bad}"


@pytest.mark.mpi(min_size=2)
def test_large_values_cross_the_store_in_linear_time(comm, gloo_group):
    """A 24 MiB value per rank (six store chunks and a tail) arrives whole, by rank, in well under the 20 s
    bound: the store's batched multi_set / multi_get take time quadratic in their payload (about 40 s for
    32 MiB), one set or get per chunk about a millisecond (the GPU tests' reference exchanges are this big)."""
    from cupy_ep.bootstrap.torch_group import TorchComm
    adapter = TorchComm(gloo_group)
    rank, size = adapter.Get_rank(), adapter.Get_size()
    n = (24 << 20) + 5
    mine = (np.arange(n, dtype=np.int64) * (rank + 3) % 251).astype(np.uint8)
    start = time.monotonic()
    got = adapter.allgather(mine)
    seconds = time.monotonic() - start
    want = [(np.arange(n, dtype=np.int64) * (r + 3) % 251).astype(np.uint8) for r in range(size)]
    equal = [np.array_equal(g, w) for g, w in zip(got, want)]
    ok = len(got) == size and all(equal) and seconds < 20
    assert all_ok(comm, ok), f"rank {rank}: {len(got)} values, equal {equal}, {seconds:.1f} s"


@pytest.mark.mpi(min_size=2)
def test_torchrun_never_imports_mpi(comm):
    if bootstrap.is_mpi4py(comm):
        pytest.skip("checked under torchrun (--with-torchrun)")
    from cupy_ep import Buffer
    buf = Buffer(None, HOST_NVL_BYTES, backend="host")  # None: torch's default group, MPI not started
    try:
        assert type(buf.comm).__name__ == "TorchComm" and buf.num_ranks == comm.Get_size()
    finally:
        buf.destroy()
    assert "mpi4py.MPI" not in sys.modules


@pytest.mark.mpi(min_size=2)
def test_start_world_under_torchrun_gives_the_default_group(comm):
    if bootstrap.is_mpi4py(comm):
        pytest.skip("checked under torchrun (--with-torchrun)")
    from cupy_ep import mpi_start
    started = mpi_start.start_world(lambda: "preloaded")
    assert (started.how, started.MPI, started.gpu) == ("torchrun-already", None, "preloaded")
    assert started.comm.allgather(comm.Get_rank()) == list(range(comm.Get_size()))
    assert mpi_start.start_world() is started and "mpi4py.MPI" not in sys.modules


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["basic", "fp8", "hidden7168", "num-worst-tokens"])
def test_buffer_over_a_gloo_group_matches_the_reference(comm, gloo_group, name):
    from cupy_ep import Buffer
    from tests.multirank.test_host_backend import CASES, _run_case
    buf = Buffer(gloo_group, HOST_NVL_BYTES, backend="host")
    try:
        assert type(buf.comm).__name__ == "TorchComm"
        bad = _run_case(buf.comm, buf, sum(map(ord, name)), **CASES[name])
    finally:
        buf.destroy()
    assert all_ok(comm, not bad), f"rank {comm.Get_rank()}: {bad}"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["bf16", "fp8-ue8m0", "masked-duplicates"])
def test_low_latency_over_a_gloo_group_matches_the_reference(comm, gloo_group, name):
    from cupy_ep import deep_ep
    from tests.multirank.test_host_low_latency import CASES, _run_case
    buf = deep_ep.Buffer(gloo_group, HOST_NVL_BYTES, HOST_RDMA_BYTES, low_latency_mode=True, backend="host")
    try:
        assert buf.group is gloo_group and buf.group_size == comm.Get_size()
        bad = _run_case(buf.comm, buf, sum(map(ord, name)), **CASES[name])
    finally:
        buf.destroy()
    assert all_ok(comm, not bad), f"rank {comm.Get_rank()}: {bad}"


def _raised(call) -> tuple[Exception | None, float]:
    """What ``call()`` raised (None: it returned) and the seconds it took."""
    start = time.monotonic()
    try:
        call()
    except Exception as e:  # noqa: BLE001  (the caller checks which)
        return e, time.monotonic() - start
    return None, time.monotonic() - start


@pytest.mark.mpi(min_size=2)
def test_a_rank_that_never_dispatches_times_out_the_others_over_a_gloo_group(comm, gloo_group):
    from cupy_ep import Buffer
    from tests.multirank.test_host_faults import _layout_and_topk
    rank, last = comm.Get_rank(), comm.Get_size() - 1
    buf = Buffer(gloo_group, HOST_NVL_BYTES, backend="host", timeout_s=TIMEOUT_S)
    inp, kwargs = _layout_and_topk(buf, rank, comm.Get_size())
    ok = True
    if rank != last:  # the last rank never calls: every other rank gives up on it after the timeout
        error, elapsed = _raised(lambda: buf.dispatch(inp.x, **kwargs))
        ok = (isinstance(error, CommTimeoutError) and TIMEOUT_S <= elapsed < TIMEOUT_S + SLACK_S
              and error.record["peer"] == last)
    comm.Barrier()
    buf.destroy()
    assert all_ok(comm, ok)


# ---- which world Buffer(None) joins (single process) ----------------------------------------------------------
def test_default_world_follows_the_environment_and_what_is_started(monkeypatch):
    monkeypatch.delenv("CUPY_EP_BOOTSTRAP", raising=False)
    monkeypatch.setattr(bootstrap.comm, "torch_group_ready", lambda: True)
    monkeypatch.setattr(bootstrap.comm, "mpi_started", lambda: False)
    assert bootstrap.default_world() == "torch"
    monkeypatch.setattr(bootstrap.comm, "mpi_started", lambda: True)
    assert bootstrap.default_world() == "mpi"        # MPI is what this job started
    monkeypatch.setenv("CUPY_EP_BOOTSTRAP", "torch")
    assert bootstrap.default_world() == "torch"
    monkeypatch.setattr(bootstrap.comm, "torch_group_ready", lambda: False)
    monkeypatch.setenv("CUPY_EP_BOOTSTRAP", "mpi")
    assert bootstrap.default_world() == "mpi"
    monkeypatch.setenv("CUPY_EP_BOOTSTRAP", "nccl")
    with pytest.raises(ValueError, match="^CUPY_EP_BOOTSTRAP: must be 'torch' or 'mpi'"):
        bootstrap.default_world()


@pytest.mark.parametrize("env,expected", [
    ({"TORCHELASTIC_RUN_ID": "x"}, True),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h"}, True),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "PMI_RANK": "0"}, False),
    ({"RANK": "0", "WORLD_SIZE": "2"}, False),
    ({}, False)])
def test_torchrun_is_told_by_its_environment(monkeypatch, env, expected):
    for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                 "MASTER_ADDR", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert bootstrap.launched_by_torchrun() is expected


def test_as_comm_passes_a_communicator_through_and_refuses_nothing_else():
    class Fake:
        pass
    fake = Fake()
    assert bootstrap.as_comm(fake) is fake   # Buffer's check_comm names what is missing
    from cupy_ep import Buffer
    with pytest.raises(TypeError, match="^comm: must be an mpi4py communicator .* or a torch.distributed"):
        Buffer(fake, backend="host")
