"""Dead or late peers: a rank that skips a call makes the others raise CommTimeoutError in bounded time,
and the buffer then refuses further use. (Marked runs_last: it runs after the other GPU tests.)

Every rank reaches ``destroy()`` whatever happens, so a failure here never leaves a peer waiting."""
import time
import traceback

import numpy as np
import pytest

import cupy_ep
from cupy_ep import Buffer, CommTimeoutError
from tests.gpu.conftest import nvl_bytes_for
from tests.helpers import all_ok, make_inputs, refused_after_failure

pytestmark = pytest.mark.runs_last(
    reason="a rank skips or changes a call on purpose: the timed-out buffers refuse further use")

TIMEOUT_S = 3.0
SKIPPER = 1


def _log(comm, *what):
    print(f"[rank {comm.Get_rank()}]", *what, flush=True)


def _setup(comm, timeout_s: float = TIMEOUT_S):
    import cupy
    rank, R = comm.Get_rank(), comm.Get_size()
    buf = Buffer(comm, num_nvl_bytes=nvl_bytes_for(R, 8192, 24), backend="cuda", timeout_s=timeout_s)
    rng = np.random.default_rng(rank)
    inp = make_inputs(rng, 200, 4096, 4, 8 * R, R)
    with cupy.cuda.Device(buf.device_id):
        x = cupy.asarray(inp.x.view(np.uint16)).view(cupy_ep.interop.BF16)
        idx, w = cupy.asarray(inp.topk_idx), cupy.asarray(inp.topk_weights)
        layout = buf.get_dispatch_layout(idx, 8 * R)
    return buf, x, idx, w, layout


def _combine_synced(buf, recv_x, handle, zero_copy=False):
    """combine, then wait for the device and raise what its kernels recorded."""
    import cupy
    buf.combine(recv_x, handle, zero_copy=zero_copy)
    with cupy.cuda.Device(buf.device_id):
        cupy.cuda.runtime.deviceSynchronize()
    buf.check_health()


def _dispatch(buf, x, idx, w, layout):
    return buf.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                        num_tokens_per_expert=layout[2], topk_idx=idx, topk_weights=w)


@pytest.mark.mpi(min_size=2)
def test_a_buffer_can_be_recreated(comm):
    """destroy() then a new Buffer in the same process works (no stale IPC mapping or module state)."""
    import cupy
    ok = True
    for it in range(2):
        _log(comm, "recreate iteration", it)
        buf, x, idx, w, layout = _setup(comm, timeout_s=60)
        try:
            recv_x, _, _, _, handle, _ = _dispatch(buf, x, idx, w, layout)
            buf.combine(recv_x, handle)
            with cupy.cuda.Device(buf.device_id):
                cupy.cuda.runtime.deviceSynchronize()
            _log(comm, "iteration", it, "dispatch + combine ok")
        except Exception:
            ok = False
            traceback.print_exc()
        finally:
            buf.destroy()
    assert all_ok(comm, ok)

def _expect_timeout(rank, what, fn, kernels, roles=None):
    """Run fn; True iff it raised CommTimeoutError in bounded time naming one of ``kernels`` (and of ``roles``)."""
    start = time.monotonic()
    try:
        fn()
    except CommTimeoutError as e:
        elapsed = time.monotonic() - start
        print(f"rank {rank}: {what}: CommTimeoutError after {elapsed:.1f} s: {e.record}", flush=True)
        return (elapsed < TIMEOUT_S + 10 and e.record.get("kernel") in kernels and e.record.get("rank") == rank
                and (roles is None or e.record.get("role") in roles))
    except Exception:
        print(f"rank {rank}: {what}: unexpected exception", flush=True)
        traceback.print_exc()
        return False
    print(f"rank {rank}: {what}: no exception", flush=True)
    return False


@pytest.mark.mpi(min_size=2)
def test_rank_skipping_dispatch_times_out(comm):
    rank = comm.Get_rank()
    buf, x, idx, w, layout = _setup(comm)
    ok = True
    try:
        if rank != SKIPPER:
            ok = _expect_timeout(rank, "dispatch", lambda: _dispatch(buf, x, idx, w, layout), ("notify_dispatch",))
            ok = refused_after_failure(rank, lambda: _dispatch(buf, x, idx, w, layout)) and ok
    finally:
        buf.destroy()
    assert all_ok(comm, ok)


@pytest.mark.mpi(min_size=2)
def test_rank_skipping_combine_times_out(comm):
    rank = comm.Get_rank()
    buf, x, idx, w, layout = _setup(comm)
    ok = True
    try:
        recv_x, _, _, _, handle, _ = _dispatch(buf, x, idx, w, layout)
        if rank != SKIPPER:
            ok = _expect_timeout(rank, "combine", lambda: _combine_synced(buf, recv_x, handle),
                                 ("cached_notify_combine", "combine"))
    finally:
        buf.destroy()
    assert all_ok(comm, ok)



@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("what", ["num_sms", "hidden"])
def test_rank_with_another_call_is_refused(comm, what):
    """One rank dispatches with another num_sms (or hidden size) than the others: the notify kernel's call
    check stops every rank at once with CallMismatchError naming what differs (no timeout, no data moved),
    and the buffer then refuses further use."""
    import cupy
    from cupy_ep import CallMismatchError, Config
    rank = comm.Get_rank()
    buf, x, idx, w, layout = _setup(comm)
    odd = rank == SKIPPER
    cfg = Config(8 if odd and what == "num_sms" else 24, 6, 256)
    if odd and what == "hidden":
        with cupy.cuda.Device(buf.device_id):
            x = cupy.ascontiguousarray(x[:, :2048])
    word = "num_channels" if what == "num_sms" else "hidden_int4"
    ok = True
    start = time.monotonic()
    try:
        buf.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
                     topk_idx=idx, topk_weights=w, config=cfg)
        ok = False
        print(f"rank {rank}: no exception", flush=True)
    except CallMismatchError as e:
        elapsed = time.monotonic() - start
        print(f"rank {rank}: CallMismatchError after {elapsed:.2f} s: {e}", flush=True)
        ok = elapsed < TIMEOUT_S and e.record.get("word", "").startswith(word) and e.record.get("rank") == rank
    except Exception:
        ok = False
        traceback.print_exc()
    try:
        if ok:
            ok = refused_after_failure(rank, lambda: _dispatch(buf, x, idx, w, layout), "the mismatch")
    finally:
        buf.destroy()
    assert all_ok(comm, ok)


@pytest.mark.mpi(min_size=2)
def test_ring_combine_against_zero_copy_combine_times_out(comm):
    """The zero-copy kernels meet the ranks by a handshake inside the kernel (no notify kernel): a rank that makes
    a ring combine while the others make a zero-copy combine never enters theirs. Every rank raises
    CommTimeoutError in bounded time: combine_direct's entry wait, or the ring notify's barrier."""
    rank = comm.Get_rank()
    buf, x, idx, w, layout = _setup(comm)
    ok = True
    try:
        recv_x, _, _, _, handle, _ = _dispatch(buf, x, idx, w, layout)
        if rank != SKIPPER:
            ok = _expect_timeout(rank, "zero-copy combine", lambda: _combine_synced(buf, recv_x, handle, True),
                                 ("combine_direct",), ("entry",))
        else:
            ok = _expect_timeout(rank, "ring combine", lambda: _combine_synced(buf, recv_x, handle),
                                 ("cached_notify_combine",))
        ok = refused_after_failure(rank, lambda: _dispatch(buf, x, idx, w, layout)) and ok
    finally:
        buf.destroy()
    assert all_ok(comm, ok)


@pytest.mark.mpi(min_size=2)
def test_zero_copy_cached_dispatch_with_another_hidden_is_refused(comm):
    """One rank makes its cached zero-copy dispatch with another hidden size: the entry handshake compares the
    call words, so every rank raises CallMismatchError naming hidden_int4 before a row is stored."""
    import cupy
    from cupy_ep import CallMismatchError
    rank = comm.Get_rank()
    buf, x, idx, w, layout = _setup(comm)
    ok = True
    try:
        handle = _dispatch(buf, x, idx, w, layout)[4]
        with cupy.cuda.Device(buf.device_id):
            if rank == SKIPPER:
                x = cupy.ascontiguousarray(x[:, :2048])
            start = time.monotonic()
            try:
                buf.dispatch(x, handle=handle, zero_copy=True)
                cupy.cuda.runtime.deviceSynchronize()
                buf.check_health()
                ok = False
                print(f"rank {rank}: no exception", flush=True)
            except CallMismatchError as e:
                elapsed = time.monotonic() - start
                print(f"rank {rank}: CallMismatchError after {elapsed:.2f} s: {e}", flush=True)
                ok = (elapsed < TIMEOUT_S and e.record.get("word") == "hidden_int4"
                      and e.record.get("kernel") == "dispatch_direct" and e.record.get("rank") == rank)
        ok = ok and refused_after_failure(rank, lambda: _dispatch(buf, x, idx, w, layout), "the mismatch")
    finally:
        buf.destroy()
    assert all_ok(comm, ok)
