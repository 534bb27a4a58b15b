"""Every model shape of cupy_ep.tools.models in every mode on the GPU, bit for bit against the reference.

The experts, top-k and hidden size are the published ones (top-k up to 22, up to 896 experts); the token counts are
small so that the whole module runs in about a minute at 2 ranks once its kernels are in the disk cache:
  * normal mode inside one node: layout, dispatch (ring, zero-copy; bf16 and FP8), cached dispatch, combine (ring
    and zero-copy) -- tests/gpu/intranode/test_intranode.py's run_case;
  * internode over the IPC transport (2 ranks: 2 nodes x 1 GPU; 4 ranks: 2 x 2) -- test_internode.py's
    run_internode_case;
  * low-latency: dispatch (bf16, FP8) and combine, one launch, with the receive hooks, and with the zero-copy
    combine buffer; the top-k above 11 runs the kernels of the larger top-k bounds (config.LL_TOPK_BOUNDS).
Run (GPU machine): mpirun -n 2 python -m pytest --with-mpi -q tests/gpu/common/test_model_shapes.py
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import cupy_ep
from cupy_ep import config as cfgmod, reference
from cupy_ep.tools import models
from tests.gpu.internode import test_internode as inter
from tests.gpu.intranode import test_intranode as intra
from tests.gpu.low_latency import test_low_latency as ll
from tests.helpers import all_ok, gather_all, same_bytes

pytestmark = pytest.mark.mpi(min_size=2)

SHAPES = list(models.MODELS)
TOKENS = 48            # per rank, normal and internode modes
LL_MAX_TOKENS = 12     # num_max_dispatch_tokens_per_rank of the low-latency calls (rank r sends 12 - 3 r)
NUM_SMS = 12
LL_MODES = {"bf16": {}, "fp8": dict(use_fp8=True), "hook": dict(hook=True), "zero-copy": dict(zero_copy=True)}


def _case(model: str, num_ranks: int, dtype: str = "bf16") -> intra.Case:
    shape = models.MODELS[model]
    return intra.Case(f"{model}-{dtype}", TOKENS, shape.hidden, shape.topk, shape.experts // num_ranks, NUM_SMS,
                      dtype=dtype)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("model", SHAPES)
def test_intranode(comm, gpu_buffer, model, dtype):
    """Ring and zero-copy dispatch and combine, cached dispatch, of the model's shape."""
    intra.run_case(comm, gpu_buffer, _case(model, comm.Get_size(), dtype))


@pytest.fixture(scope="module")
def _ipc_internode_slot(comm):
    from tests.gpu.conftest import BufferSlot
    R = comm.Get_size()
    G = inter._topology(R, "ipc")
    if G is None:
        pytest.skip(f"internode over IPC runs at 2 or 4 ranks, not {R}")
    nvl, rdma = inter._buffer_bytes(R, G)

    def make():
        return cupy_ep.Buffer(comm, num_nvl_bytes=nvl, num_rdma_bytes=rdma, backend="cuda",
                              timeout_s=float(os.environ.get("CUPY_EP_TEST_TIMEOUT_S", "20")),
                              num_ranks_per_node=G, internode_transport="ipc")
    slot = BufferSlot(comm, make)
    yield slot
    slot.close()


@pytest.mark.parametrize("model", SHAPES)
def test_internode_over_ipc(comm, _ipc_internode_slot, model):
    """Internode dispatch, cached dispatch and combine (FP8 for the odd models, bf16 for the others)."""
    dtype = "fp8" if SHAPES.index(model) % 2 else "bf16"
    inter.run_internode_case(comm, _ipc_internode_slot.get(), _case(model, comm.Get_size(), dtype))


def _ll_bytes(num_ranks: int) -> int:
    return max(cfgmod.low_latency_rdma_size_hint(LL_MAX_TOKENS, s.hidden, num_ranks, s.experts)
               for s in models.MODELS.values())


@pytest.fixture(scope="module")
def _ll_slot(comm):
    from tests.gpu.conftest import BufferSlot, nvl_bytes_for
    ll.skip_unless_usable(comm)
    R = comm.Get_size()
    slot = BufferSlot(comm, lambda: cupy_ep.Buffer(comm, num_nvl_bytes=nvl_bytes_for(R, 8192, 24),
                                                   num_rdma_bytes=_ll_bytes(R), low_latency_mode=True,
                                                   backend="cuda", timeout_s=ll.TIMEOUT_S))
    yield slot
    slot.close()


@pytest.mark.parametrize("mode", list(LL_MODES))
@pytest.mark.parametrize("model", SHAPES)
def test_low_latency(comm, _ll_slot, model, mode):
    """Low-latency dispatch and combine of the model's shape (top-k up to 22) against the reference."""
    import cupy
    buf = _ll_slot.get()
    shape, opts = models.MODELS[model], dict(LL_MODES[mode])
    hook, zero_copy, use_fp8 = opts.get("hook", False), opts.get("zero_copy", False), opts.get("use_fp8", False)
    rank, R = comm.Get_rank(), comm.Get_size()
    E, L, M, H = shape.experts, shape.experts // R, LL_MAX_TOKENS, shape.hidden
    case = ll.Case(f"{model}-{mode}", M, H, shape.topk, L, use_fp8=use_fp8)
    with cupy.cuda.Device(buf.device_id):
        def prepare():
            x, idx, w, num_experts = ll._inputs(case, comm, 3)
            assert num_experts == E and idx.shape[1] == shape.topk
            rng = np.random.default_rng([3, rank, 99])
            y = ll._small_int_rows(rng, (L, R * M, H))
            weights = (np.float32(2.0) ** rng.integers(-2, 3, size=w.shape)).astype(np.float32)
            return x, idx, y, weights

        x, idx, y, weights = ll._step(buf, comm, "preparing the inputs", prepare)
        gathered = gather_all(comm, (x, idx, y, weights))

        def references(gathered):
            want = reference.low_latency_dispatch([g[0] for g in gathered], [g[1] for g in gathered], M, E, rank,
                                                  use_fp8=use_fp8)
            want_c = reference.low_latency_combine([g[2] for g in gathered], [g[1] for g in gathered],
                                                   [g[3] for g in gathered], M, E, rank)
            return want, want_c

        want, want_c = ll._step(buf, comm, "the reference", references, gathered)
        del gathered

        def dispatch():
            out_x, count, handle, _, h = buf.low_latency_dispatch(ll._dev(x), ll._dev(idx), M, E, use_fp8=use_fp8,
                                                                  return_recv_hook=hook)
            if hook:
                h()
            return out_x, count, handle

        out_x, count, handle = ll._step(buf, comm, "low_latency_dispatch", dispatch)
        errors: list = []
        ll._guarded(comm, errors, "comparing the dispatch", ll._compare_dispatch, errors, (out_x, count, handle),
                    want, case, idx)

        def combine():
            y_arg = ll._dev(y)
            if zero_copy:
                buf.get_next_low_latency_combine_buffer(handle)[...] = y_arg
                y_arg = None
            combined, _, h = buf.low_latency_combine(y_arg, ll._dev(idx), ll._dev(weights), handle,
                                                     zero_copy=zero_copy, return_recv_hook=hook)
            if hook:
                h()
            return combined

        combined = ll._step(buf, comm, "low_latency_combine", combine)

        def check_combine():
            cupy.cuda.runtime.deviceSynchronize()
            if not same_bytes(combined, want_c):
                errors.append("combined_x differs")
            buf.check_health()

        ll._guarded(comm, errors, "comparing the combine", check_combine)
    assert all_ok(comm, not errors), f"rank {rank}: {errors}"

