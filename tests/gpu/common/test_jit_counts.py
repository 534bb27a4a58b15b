"""Kernel instantiations per shape on the GPU: the intranode kernels are templates of the rank count and the
top-k index type, so a sweep of hidden sizes, once one hidden size has run, compiles and loads no kernel
(``cupy_ep.jit.counters``), and every hidden size's round trip still equals the reference bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from cupy_ep import jit
from cupy_ep.tools.harness import to_device
from tests.helpers import all_ok, random_bf16, reference_combine, reference_dispatch, same_bytes, to_numpy

# ten hidden sizes, multiples of 16 values (rows of 16-byte units), from one int4 per lane to DeepSeek-V3's
HIDDENS = (256, 512, 1024, 2048, 2112, 3584, 4096, 5120, 6144, 7168)


def _round_trip(comm, buf, hidden: int) -> bool:
    """Layout, dispatch, cached dispatch and combine of a small batch at ``hidden``; True where all of them equal
    the reference on every rank."""
    import cupy
    R, rank = comm.Get_size(), comm.Get_rank()
    rng = np.random.default_rng(31 * rank + hidden)
    T, K, E = 96, 8, 8 * R
    x = random_bf16(rng, (T, hidden))
    idx = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int64)
    w = rng.random((T, K), dtype=np.float32)
    with cupy.cuda.Device(buf.device_id):
        dx, didx, dw = to_device(x), to_device(idx), to_device(w)
        layout = buf.get_dispatch_layout(didx, E)
        recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            dx, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
            topk_idx=didx, topk_weights=dw)
        cached = buf.dispatch(dx, handle=handle)[0]
        combined, _, _ = buf.combine(recv_x, handle)
        ref = reference_dispatch(comm, x, idx, w, E)
        want, _ = reference_combine(comm, to_numpy(recv_x), ref.is_token_in_rank)
        ok = (same_bytes(recv_x, ref.recv_x) and same_bytes(cached, ref.recv_x)
              and same_bytes(recv_idx, ref.recv_topk_idx) and counts == ref.num_recv_tokens_per_expert_list
              and same_bytes(combined, want))
    return all_ok(comm, ok)


@pytest.mark.mpi(min_size=2)
def test_a_hidden_size_sweep_loads_no_new_kernel(comm, gpu_buffer):
    assert _round_trip(comm, gpu_buffer, HIDDENS[0])  # loads (or compiles) what any hidden size needs
    before = jit.counters()
    for hidden in HIDDENS:
        assert _round_trip(comm, gpu_buffer, hidden), hidden
    after = jit.counters()
    loaded = {k: after[k] - before[k] for k in ("compiled", "disk_cache_hits")}
    assert all_ok(comm, loaded == {"compiled": 0, "disk_cache_hits": 0}), loaded
