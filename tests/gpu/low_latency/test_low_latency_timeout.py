"""A dead peer in low-latency mode: rank SKIPPER skips a low_latency_dispatch, the others get CommTimeoutError
in bounded time naming the low-latency dispatch's receiver, and the buffer then refuses further use.
(Marked runs_last: it runs after the other GPU tests; its own process state: one NVSHMEM init. Every rank reaches
destroy().)"""
import time
import traceback

import numpy as np
import pytest

import cupy_ep
from cupy_ep import CommTimeoutError, config as cfgmod
from tests.helpers import all_ok, make_inputs, random_bf16, refused_after_failure

pytestmark = pytest.mark.runs_last(
    reason="a rank skips a low-latency call on purpose: the timed-out buffer refuses further use")

TIMEOUT_S = 3.0
SKIPPER = 1


@pytest.mark.mpi(min_size=2)
def test_ranks_sharing_a_gpu_are_refused(comm):
    """With several ranks per GPU and no MPS, Buffer(low_latency_mode=True) on the NVSHMEM transport raises a
    ValueError naming low_latency_mode and pointing at the IPC transport on every rank (nobody hangs)."""
    from tests.gpu.low_latency.test_low_latency import mps_clients, ranks_share_a_gpu
    if not ranks_share_a_gpu(comm):
        pytest.skip("one rank per GPU here: low_latency_mode is allowed")
    if mps_clients(comm):
        pytest.skip("the ranks are CUDA MPS clients: NVSHMEM allows several per GPU (the low-latency tests run)")
    with pytest.raises(ValueError, match="^low_latency_mode: the NVSHMEM transport needs one GPU per rank.*"
                                         "low_latency_transport='ipc'"):
        cupy_ep.Buffer(comm, num_rdma_bytes=1 << 20, low_latency_mode=True, backend="cuda",
                       low_latency_transport="nvshmem")
    comm.Barrier()


def _small_ll_buffer(comm):
    """``(rank, R, M, H, E, buf)``: a small low-latency Buffer with the short timeout, on the transport of
    CUPY_EP_LL_TRANSPORT (skips where ranks share a GPU on NVSHMEM, which refuses that)."""
    from tests.gpu.low_latency.test_low_latency import skip_unless_usable
    skip_unless_usable(comm)
    rank, R = comm.Get_rank(), comm.Get_size()
    M, H, E = 32, 1024, 8 * R
    buf = cupy_ep.Buffer(comm, num_rdma_bytes=cfgmod.low_latency_rdma_size_hint(M, H, R, E),
                         low_latency_mode=True, backend="cuda", timeout_s=TIMEOUT_S)
    return rank, R, M, H, E, buf


@pytest.mark.mpi(min_size=2)
def test_rank_skipping_low_latency_dispatch_times_out(comm):
    import cupy
    rank, R, M, H, E, buf = _small_ll_buffer(comm)
    ok = True
    try:
        rng = np.random.default_rng(rank)
        inp = make_inputs(rng, M, 16, 4, E, R)
        x = cupy.asarray(random_bf16(rng, (M, H)).view(np.uint16)).view(cupy_ep.interop.BF16)
        idx = cupy.asarray(inp.topk_idx)
        # Every rank makes the first call of this shape (it also cleans the signal regions, a host-side
        # collective); then SKIPPER skips the next one.
        buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
        cupy.cuda.runtime.deviceSynchronize()
        buf.check_health()
        if rank != SKIPPER:
            start = time.monotonic()
            try:
                buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
                cupy.cuda.runtime.deviceSynchronize()
                buf.check_health()
                ok = False
                print(f"rank {rank}: no exception", flush=True)
            except CommTimeoutError as e:
                elapsed = time.monotonic() - start
                print(f"rank {rank}: CommTimeoutError after {elapsed:.1f} s: {e.record}", flush=True)
                ok = (elapsed < TIMEOUT_S + 10 and e.record.get("kernel") == "low_latency_dispatch"
                      and e.record.get("role") == "receiver" and e.record.get("peer") == SKIPPER)
            except Exception:
                ok = False
                traceback.print_exc()
            ok = refused_after_failure(rank, lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)) and ok
    finally:
        buf.destroy()
    assert all_ok(comm, ok)


@pytest.mark.mpi(min_size=2)
def test_graph_with_an_odd_number_of_low_latency_calls_is_refused(comm):
    """A CUDA graph holding one low_latency_dispatch replays it on the same buffer every time (the index is
    fixed at capture): the second replay's send phase finds the previous send on that buffer and stops the
    buffer with a CommError on every rank (instead of receivers reading stale signals and old data).
    Last in the file: the buffer ends stopped, and no low-latency Buffer follows it in this process."""
    import cupy
    rank, R, M, H, E, buf = _small_ll_buffer(comm)
    ok, kept = False, None
    try:
        with cupy.cuda.Device(buf.device_id):
            rng = np.random.default_rng(rank)
            inp = make_inputs(rng, M, 16, 4, E, R)
            x = cupy.asarray(random_bf16(rng, (M, H)).view(np.uint16)).view(cupy_ep.interop.BF16)
            idx = cupy.asarray(inp.topk_idx)
            w = cupy.asarray(inp.topk_weights)
            out = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)          # buffer 0
            y = cupy.zeros((E // R, R * M, H), dtype=cupy.uint16).view(cupy_ep.interop.BF16)
            buf.low_latency_combine(y, idx, w, out[2])                            # buffer 1
            cupy.cuda.runtime.deviceSynchronize()
            buf.check_health()
            stream = cupy.cuda.Stream(non_blocking=True)
            comm.Barrier()
            with stream:
                stream.begin_capture()
                kept = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)     # buffer 0, baked in
                graph = stream.end_capture()
            graph.launch(stream)   # after the combine on buffer 1: fine
            stream.synchronize()
            buf.check_health()
            graph.launch(stream)   # buffer 0 twice in a row: refused on the device
            stream.synchronize()
            del kept               # the replays wrote into the capture's outputs: held until here
            try:
                buf.check_health()
                print(f"rank {rank}: no exception", flush=True)
            except cupy_ep.CommError as e:
                print(f"rank {rank}: {type(e).__name__}: {e}", flush=True)
                ok = (not isinstance(e, CommTimeoutError) and "twice in a row" in str(e)
                      and e.record.get("role") == "buffer_reuse")
            ok = refused_after_failure(rank, lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)) and ok
    except Exception:
        traceback.print_exc()
        ok = False
    finally:
        buf.destroy()
    assert all_ok(comm, ok)
