"""The GPU internode path: ``InternodeState`` owns the node-local NVLink buffer, the RDMA buffer (NVSHMEM
symmetric heap, or CUDA IPC for testing) and the launches of ``cuda_src/internode.cu``. ``CudaBackend`` creates one
when the job spans more than one node and routes ``dispatch`` / ``combine`` here.

Decisions (DeepEP V1's internode path is the model):

* topology: node = ``rank // G`` and GPU index = ``rank % G`` with G = ``num_ranks_per_node`` (default: the MPI
  shared-memory split). The NVLink domain is the G ranks of a node (one CUDA-IPC buffer each), the RDMA domain
  the N ranks with the same GPU index (NVSHMEM PE = node index);
* transport (``internode_transport=`` or env ``CUPY_EP_INTERNODE_TRANSPORT``): ``"nvshmem"`` (default, the path
  for clusters) or ``"ipc"``: the same kernels with the RDMA puts done as CUDA-IPC stores, so that
  2 nodes x 2 ranks can be tested on one box with 2 GPUs (ranks of one "RDMA domain" may then share a GPU);
* RDMA peers this GPU reaches by loads/stores (always with ``"ipc"``; with NVSHMEM where ``nvshmem_ptr`` != 0, i.e.
  the same box over NVLink) get the ring data stored straight into their receive slots by the many data warps, and
  the one put-issuing warp per channel only signals the tail; the others get puts (a real NIC). The choice is per
  producer and peer, and both land in the same slot, so ranks may differ. ``CUPY_EP_INTERNODE_FORCE_PUT=1`` (or
  ``state.force_put = True``, read at every launch) sends everything through puts, so that path stays testable on
  one box (the low-latency path's ``CUPY_EP_LL_FORCE_PUT`` is the model);
* the handle is DeepEP's internode 10-tuple ``(is_token_in_rank, rdma_channel_prefix_matrix,
  gbl_channel_prefix_matrix, recv_rdma_channel_prefix_matrix, recv_rdma_rank_prefix_sum,
  recv_gbl_channel_prefix_matrix, recv_gbl_rank_prefix_sum, recv_src_meta, send_rdma_head, send_nvl_head)``
  with ``recv_src_meta [num_recv, 8] uint8`` (int32 source node, int32 bit mask of destination GPUs) and
  ``send_nvl_head [num_rdma_recv, G]``; combine does not modify it;
* combine is deterministic with a fixed order: per node a bf16-rounded fp32 sum over its GPUs in ascending
  order, then at the owner an fp32 sum of bias0, bias1 and the node partials in ascending node order, rounded
  once more (see :func:`cupy_ep.internode_reference.combine`);
* ``num_worst_tokens`` works: outputs get that many rows, ``send_nvl_head`` too; the notify kernel stops the
  buffer (``CommTimeoutError`` with role ``capacity``) if a rank would receive more.

STATUS: the put path passed the GPU tests on both transports (2 nodes x 1 GPU, 2 x 2 ranks; H200 box). The direct
stores (now the default on one box) and force_put came after that run: compile- and CPU-checked only.
"""
from __future__ import annotations

import os
import time

import numpy as np

from .. import bootstrap, handles, ids, interop, jit, validate
from .. import config as _config
from ..errors import CommTimeoutError
from . import kernels_internode as kin
# the instantiation names and block rule live with the launchers; readable from here too (the CPU tests do)
from .kernels_internode import TRANSPORT_TYPES as _TRANSPORT_TYPES  # noqa: F401
from .kernels_internode import kernel_name, threads

_OP_CACHED_DISPATCH, _OP_COMBINE = ids.OP["kOpInternodeCachedDispatch"], ids.OP["kOpInternodeCombine"]
_FORCE_PUT_ENV = "CUPY_EP_INTERNODE_FORCE_PUT"
TRANSPORTS = ("nvshmem", "ipc")

HANDLE_FIELDS = ("is_token_in_rank", "rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix",
                 "recv_rdma_channel_prefix_matrix", "recv_rdma_rank_prefix_sum", "recv_gbl_channel_prefix_matrix",
                 "recv_gbl_rank_prefix_sum", "recv_src_meta", "send_rdma_head", "send_nvl_head")
_HANDLE_DTYPES = ("bool", "int32", "int32", "int32", "int32", "int32", "int32", "uint8", "int32", "int32")


# ---- pure logic (CPU-tested) ---------------------------------------------------------------------------
def resolve_transport(transport: str | None) -> str:
    """``transport`` or env ``CUPY_EP_INTERNODE_TRANSPORT`` or ``"nvshmem"``; checked."""
    value = transport if transport is not None else os.environ.get("CUPY_EP_INTERNODE_TRANSPORT") or "nvshmem"
    if value not in TRANSPORTS:
        raise ValueError(f"internode_transport: must be one of {TRANSPORTS}, got {value!r}")
    return value


def resolve_force_put() -> bool:
    """Env ``CUPY_EP_INTERNODE_FORCE_PUT``: anything but unset, empty or ``"0"`` forces puts to every RDMA peer."""
    return os.environ.get(_FORCE_PUT_ENV, "0") not in ("", "0")


def rdma_peer_table(put_bases, direct_bases) -> np.ndarray:
    """The kernels' RDMA peer table (``RdmaArgs::peer_bases`` in cuda_src/transport/rdma.cuh): uint64
    ``[2, MAX_RDMA_RANKS]`` flattened; row 0: where puts and adds to PE (node) n go (IPC: n's buffer as mapped here;
    NVSHMEM: unused), row 1: n's buffer as reachable by loads/stores from this GPU, 0 where only puts reach it.
    ``None`` leaves a row 0."""
    table = np.zeros((2, _config.MAX_RDMA_RANKS), dtype=np.uint64)
    for row, bases in enumerate((put_bases, direct_bases)):
        if bases is not None:
            bases = np.asarray(bases, dtype=np.uint64)
            if bases.ndim != 1 or len(bases) > _config.MAX_RDMA_RANKS:
                raise ValueError(f"rdma_peer_table: at most {_config.MAX_RDMA_RANKS} bases per row, got shape "
                                 f"{bases.shape}")
            table[row, :len(bases)] = bases
    return table.reshape(-1)


def check_topology(num_ranks: int, num_ranks_per_node: int) -> tuple[int, int]:
    """``(N, G)`` of an internode job; ValueError naming what is out of range."""
    if num_ranks % num_ranks_per_node:
        raise ValueError(f"num_ranks_per_node: must divide the world size {num_ranks}, got {num_ranks_per_node}")
    num_nodes = num_ranks // num_ranks_per_node
    if not 2 <= num_nodes <= _config.MAX_RDMA_RANKS:
        raise ValueError(f"comm: the internode kernels support 2..{_config.MAX_RDMA_RANKS} nodes, got {num_nodes}")
    if not 1 <= num_ranks_per_node <= _config.MAX_NVL_RANKS:
        raise ValueError(f"num_ranks_per_node: the internode kernels support 1..{_config.MAX_NVL_RANKS} GPUs per "
                         f"node, got {num_ranks_per_node}")
    return num_nodes, num_ranks_per_node


def check_config(cfg: _config.Config, num_nodes: int, kind: str) -> None:
    """The ring-size relations the internode kernels rely on (besides what ``Config`` checks itself)."""
    if kind == "combine":
        sub = cfg.num_max_nvl_chunked_recv_tokens // num_nodes
        if sub < cfg.num_max_nvl_chunked_send_tokens:
            raise ValueError(f"config: internode combine splits each NVLink ring into {num_nodes} sub-rings (one per "
                             f"node): num_max_nvl_chunked_recv_tokens // {num_nodes} = {sub} must be >= "
                             f"num_max_nvl_chunked_send_tokens = {cfg.num_max_nvl_chunked_send_tokens}")


def check_buffer_sizes(lay: dict, what: str, num_nvl_bytes: int, num_rdma_bytes: int) -> None:
    """ValueError naming the buffer that is too small for a call's carve (``config.internode_layout``)."""
    nvl = lay[f"nvl_{what}_end"] - _config.SIGNAL_BYTES
    rdma = lay[f"rdma_{what}_end"]
    if nvl > num_nvl_bytes:
        raise ValueError(f"num_nvl_bytes: this internode {what} needs at least {nvl} bytes of NVLink buffer, "
                         f"the buffer has {num_nvl_bytes} (use cupy_ep.config.internode_buffer_bytes)")
    if rdma > num_rdma_bytes:
        raise ValueError(f"num_rdma_bytes: this internode {what} needs at least {rdma} bytes of RDMA buffer, "
                         f"the buffer has {num_rdma_bytes} (use cupy_ep.config.internode_buffer_bytes)")


def check_handle(handle, num_ranks: int, num_nodes: int, gpus_per_node: int, num_channels: int | None,
                 device: int | None = None, buffer_id: int | None = None) -> dict:
    """Kinds, dtypes and shapes of an internode handle, and that it is ``buffer_id``'s (when it says); returns
    ``{field: array}`` (arrays unchanged).

    ``num_channels`` None takes it from the handle (combine); otherwise it must match (cached dispatch)."""
    if not isinstance(handle, (tuple, list)) or len(handle) != len(HANDLE_FIELDS):
        raise ValueError(f"handle: must be the {len(HANDLE_FIELDS)}-tuple returned by an internode dispatch "
                         f"({', '.join(HANDLE_FIELDS)})")
    handles.check_origin(handle, buffer_id)
    fields = {}
    for name, dt, a in zip(HANDLE_FIELDS, _HANDLE_DTYPES, handle):
        validate.check_array(a, f"handle.{name}", (dt,), ndim=1 if name.endswith("prefix_sum") else 2, device=device)
        fields[name] = a
    R, N, G = num_ranks, num_nodes, gpus_per_node
    C = num_channels if num_channels is not None else int(fields["rdma_channel_prefix_matrix"].shape[1])
    T = int(fields["is_token_in_rank"].shape[0])
    num_rdma_recv = int(fields["send_nvl_head"].shape[0])
    expected = {"is_token_in_rank": (T, R), "rdma_channel_prefix_matrix": (N, C), "gbl_channel_prefix_matrix": (R, C),
                "recv_rdma_channel_prefix_matrix": (N, C), "recv_rdma_rank_prefix_sum": (N,),
                "recv_gbl_channel_prefix_matrix": (R, C), "recv_gbl_rank_prefix_sum": (R,),
                "send_rdma_head": (T, N), "send_nvl_head": (num_rdma_recv, G)}
    for name, shape in expected.items():
        if tuple(fields[name].shape) != shape:
            raise ValueError(f"handle.{name}: expected shape {shape} ({N} nodes x {G} GPUs, {T} tokens, {C} channels), "
                             f"got {tuple(fields[name].shape)}; was the handle made by another buffer, other inputs or "
                             "another num_sms?")
    if fields["recv_src_meta"].shape[1] != 8:
        raise ValueError("handle.recv_src_meta: expected shape (num_recv, 8), "
                         f"got {tuple(fields['recv_src_meta'].shape)}")
    return fields


# ---- the GPU state --------------------------------------------------------------------------------------
class InternodeState:
    """Buffers and launches of the internode path for one ``CudaBackend``.

    Args:
        buf: the owning ``CudaBackend`` (comm, rank, topology, device id, health); its ``runtime`` (the comm
            stream, DeviceCtx, ``begin``/``finish``) is the one the launches use.
        num_nvl_bytes / num_rdma_bytes: sizes of the node-local NVLink buffer and the RDMA buffer
            (:func:`cupy_ep.config.internode_buffer_bytes`).
        transport: ``"nvshmem"`` or ``"ipc"`` (already resolved).
    """

    def __init__(self, buf, num_nvl_bytes: int, num_rdma_bytes: int, transport: str):
        import cupy
        topo = buf.topology
        self.buf = buf
        self.rt = buf.runtime
        self.num_nodes, self.gpus_per_node = check_topology(buf.num_ranks, topo.num_ranks_per_node)
        if num_rdma_bytes <= 0 or num_rdma_bytes % _config.ALIGN:
            raise ValueError(f"num_rdma_bytes: the internode path needs a positive multiple of {_config.ALIGN} bytes "
                             f"(size it with cupy_ep.config.internode_buffer_bytes), got {num_rdma_bytes}")
        if num_nvl_bytes <= 0:
            raise ValueError("num_nvl_bytes: the internode path needs an NVLink buffer (size it with "
                             "cupy_ep.config.internode_buffer_bytes)")
        self.transport = transport
        self.node, self.nvl_rank = buf.rank // self.gpus_per_node, buf.rank % self.gpus_per_node
        # node = rank // G assumes ranks are placed node by node; with the real shared-memory split check it
        # (collectively, so that every rank raises together)
        real_split = topo.local_size == self.gpus_per_node
        misplaced = buf.comm.allreduce(int(real_split and topo.local_rank != self.nvl_rank))
        if misplaced:
            raise ValueError(f"comm: ranks must be placed node by node (ranks [n*G, n*G + G) on node n, G = "
                             f"{self.gpus_per_node}); {misplaced} rank(s) are not (use mpirun's by-node/block mapping)")
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.node_comm = buf.comm.Split(self.node, buf.rank)
        self.rdma_comm = buf.comm.Split(self.nvl_rank, buf.rank)   # rank in it = node index
        self.nvl = bootstrap.IpcBuffer(self.node_comm, num_nvl_bytes + _config.SIGNAL_BYTES)
        self.nv = None
        self.rdma_ipc = None
        if transport == "nvshmem":
            from .low_latency import set_nvshmem_env
            from ..nvshmem import Nvshmem
            set_nvshmem_env(single_node=topo.local_size == buf.num_ranks)
            os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE",
                                  str(max(1 << 30, _config.align_up(num_rdma_bytes, 1 << 21) + (64 << 20))))
            self.nv = Nvshmem(self.rdma_comm, buf.device_id)
            self.rdma_base = self.nv.align(num_rdma_bytes)
            cupy.cuda.runtime.memset(self.rdma_base, 0, num_rdma_bytes)
            put_bases = None                                                  # NvshmemRdma puts by PE index
            direct_bases = [self.nv.peer_ptr(self.rdma_base, n) for n in range(self.num_nodes)]
            cupy.cuda.runtime.deviceSynchronize()
            self.nv.barrier_all()
        else:
            self.rdma_ipc = bootstrap.IpcBuffer(self.rdma_comm, num_rdma_bytes)
            self.rdma_base = self.rdma_ipc.ptr
            put_bases = direct_bases = self.rdma_ipc.ptrs
        # the peer tables (rdma_peer_table): with the load/store addresses, and without them (force_put)
        self.rdma_peers = cupy.asarray(rdma_peer_table(put_bases, direct_bases))
        self.rdma_put_peers = cupy.asarray(rdma_peer_table(put_bases, None))
        self.force_put = resolve_force_put()
        # host-mapped: [0] num_recv, [1] num_rdma_recv, [2..] per local expert
        self.host = bootstrap.HostMapped(4 * (2 + _config.MAX_LOCAL_EXPERTS))
        self.counters = self.host.view(np.int32, 0, 2 + _config.MAX_LOCAL_EXPERTS)
        self._kernels: dict = {}

    # ---- plumbing -----------------------------------------------------------------------------------
    def launch(self, name: str, grid: int, block: int, args) -> None:
        """Launch ``name`` (of this transport's build; NVSHMEM: its module initialised at first use) on the comm
        stream; the launchers of :mod:`.kernels_internode` call it with their grid and block."""
        k = self._kernels.get(name)
        if k is None:
            extra = (jit.NVSHMEM_DEFINE,) if self.transport == "nvshmem" else ()
            k = jit.get_kernel(kin.INTERNODE, name, extra)
            if self.nv is not None:
                self.nv.init_module(k._module.ptr)
            self._kernels[name] = k
        k((grid,), (block,), args, stream=self.buf.comm_stream)

    @property
    def peer_bases(self):
        """The RDMA peer table the kernels get: without load/store addresses with force_put (every peer by puts)."""
        return self.rdma_put_peers if self.force_put else self.rdma_peers

    def endpoints(self) -> tuple:
        """The arguments every communicating kernel of the path takes, in their order: ``nvl_ptrs`` (the node's
        NVLink buffers), ``rdma_base``, ``rdma_peers`` (:attr:`peer_bases`), ``rank``."""
        return (self.nvl.ptr_table, np.uint64(self.rdma_base), self.peer_bases, np.int32(self.buf.rank))

    def wait_counter(self) -> int:
        """Host wait for the notify kernel's receive count (the only CPU sync of a non-cached dispatch)."""
        deadline = time.monotonic() + self.buf.timeout_s + 5.0
        while True:
            value = int(self.counters[0])
            if value >= 0:
                return value
            if self.rt.device_failed():
                self.buf.check_health()
            if time.monotonic() > deadline:
                self.rt.unusable_reason = "host wait for internode_notify_dispatch timed out"
                raise CommTimeoutError(f"rank {self.buf.rank}: host wait for the receive count timed out after "
                                       f"{self.buf.timeout_s} s", {"rank": self.buf.rank,
                                                                   "kernel": "internode_notify_dispatch",
                                                                   "role": "host"})

    def barrier(self) -> None:
        """Both domains meet (a cached notify for combine with 1 channel: barriers + clearing, no ring in use)."""
        kin.cached_notify(self, kin.InternodeCachedNotify(
            np.int32(_OP_COMBINE), np.int32(1), np.int32(2), np.int32(2), np.int32(1), np.int32(0), np.int32(0),
            *self.endpoints(), self.rt.ctx), self.num_nodes, self.gpus_per_node, self.transport)

    # ---- dispatch -----------------------------------------------------------------------------------
    def dispatch(self, info, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                 num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens, cfg,
                 previous_event, async_finish, allocate_on_comm_stream, check_values: bool):
        """See ``CudaBackend.dispatch``; ``info`` is ``validate.check_x``'s result, ``cfg`` the resolved config."""
        import cupy
        buf = self.buf
        # plan
        R, N, G = buf.num_ranks, self.num_nodes, self.gpus_per_node
        C, T = cfg.num_channels, info.num_tokens
        dev = buf.device_id
        check_config(cfg, N, "dispatch")
        cached = handle is not None
        num_topk, idx_name, num_experts = 0, "int64", 0
        if cached:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("topk_idx/topk_weights: must be None in a cached dispatch (handle given)")
            if num_worst_tokens:
                raise ValueError("num_worst_tokens: must be 0 in a cached dispatch (the handle fixes the sizes)")
            h = check_handle(handle, R, N, G, C, dev, getattr(buf, "buffer_id", None))
            if int(h["is_token_in_rank"].shape[0]) != T:
                raise ValueError(f"x: has {T} rows but the handle was made for {h['is_token_in_rank'].shape[0]} tokens")
        else:
            num_experts, num_topk, idx_name = validate.check_dispatch_layout_args(
                num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                num_worst_tokens, R, T, dev, check_values, what="a non-cached internode dispatch",
                extra_required=(("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank),))
            validate.check_array(num_tokens_per_rdma_rank, "num_tokens_per_rdma_rank", ("int32",), ndim=1, device=dev)
            if tuple(num_tokens_per_rdma_rank.shape) != (N,):
                raise ValueError(f"num_tokens_per_rdma_rank: expected shape ({N},), got "
                                 f"{tuple(num_tokens_per_rdma_rank.shape)}")
        S, hidden_int4 = info.num_scales, info.hidden_bytes // 16
        lay = _config.internode_layout(N, G, C, cfg.num_max_rdma_chunked_recv_tokens,
                                       cfg.num_max_nvl_chunked_recv_tokens, info.hidden_bytes, S, num_topk)
        check_buffer_sizes(lay, "dispatch", self.num_nvl_bytes, self.num_rdma_bytes)
        kind = interop.kind_of(info.x)
        raw_x = interop.unwrap(info.x, "bfloat16" if info.dtype == "bfloat16" else "float8_e4m3fn")
        raw_scales = interop.unwrap(info.scales)
        rdma_slots, nvl_slots = cfg.num_max_rdma_chunked_recv_tokens, cfg.num_max_nvl_chunked_recv_tokens
        ends, ctx = self.endpoints(), self.rt.ctx
        compute = self.rt.begin(kind, previous_event)
        alloc_stream = buf.comm_stream if allocate_on_comm_stream else compute
        per_expert_list = None
        # the notify kernel (the receive counts: the one host sync of a dispatch without num_worst_tokens)
        if cached:
            raw = {k: interop.unwrap(v) for k, v in h.items()}
            in_rank = raw["is_token_in_rank"]
            rdma_cpm, gbl_cpm = raw["rdma_channel_prefix_matrix"], raw["gbl_channel_prefix_matrix"]
            rrps, rgps = raw["recv_rdma_rank_prefix_sum"], raw["recv_gbl_rank_prefix_sum"]
            num_recv = int(raw["recv_src_meta"].shape[0])
            kin.cached_notify(self, kin.InternodeCachedNotify(
                np.int32(_OP_CACHED_DISPATCH), np.int32(C), np.int32(rdma_slots), np.int32(nvl_slots),
                np.int32(hidden_int4), np.int32(0), np.int32(S), *ends, ctx), N, G, self.transport)
            raw_idx = raw_w = src_meta = rrcpm = rgcpm = send_rdma_head = send_nvl_head = None
        else:
            in_rank = interop.unwrap(is_token_in_rank)
            raw_idx = interop.unwrap(topk_idx)
            raw_w = interop.unwrap(topk_weights)
            with alloc_stream:
                rdma_cpm = cupy.empty((N, C), dtype=cupy.int32)
                gbl_cpm = cupy.empty((R, C), dtype=cupy.int32)
                rrps = cupy.empty(N, dtype=cupy.int32)
                rgps = cupy.empty(R, dtype=cupy.int32)
            sync = num_worst_tokens == 0
            if sync:
                self.counters[0] = self.counters[1] = -1
            kin.notify_dispatch(self, kin.InternodeNotifyDispatch(
                interop.unwrap(num_tokens_per_rank), interop.unwrap(num_tokens_per_rdma_rank),
                interop.unwrap(num_tokens_per_expert), np.int32(num_experts), in_rank, np.int32(T), np.int32(C),
                np.int32(expert_alignment), rdma_cpm, rrps, gbl_cpm, rgps, np.uint64(self.host.ptr) if sync else None,
                np.int32(-1 if sync else num_worst_tokens), np.int32(-1 if sync else num_worst_tokens), *ends,
                np.int32(rdma_slots), np.int32(nvl_slots), np.int32(hidden_int4), np.int32(num_topk), np.int32(S),
                ctx), N, G, self.transport)
            if sync:
                num_recv = self.wait_counter()
                num_rdma_recv = int(self.counters[1])
                per_expert_list = [int(v) for v in self.counters[2: 2 + num_experts // R]]
            else:
                # num_worst_tokens bounds send_nvl_head's rows too: the tokens that reach this GPU over RDMA, those
                # only forwarded to node peers included, which can exceed what this rank itself receives. A bound
                # sized for recv_x alone then stops the buffer with a `capacity` error (Buffer.dispatch's docstring
                # says so); T * R always suffices.
                num_recv = num_rdma_recv = num_worst_tokens
            with alloc_stream:
                src_meta = cupy.empty((num_recv, 2), dtype=cupy.int32)
                rrcpm = cupy.empty((N, C), dtype=cupy.int32)
                rgcpm = cupy.empty((R, C), dtype=cupy.int32)
                send_rdma_head = cupy.empty((T, N), dtype=cupy.int32)
                send_nvl_head = cupy.empty((num_rdma_recv, G), dtype=cupy.int32)
        # allocate
        with alloc_stream:
            recv_x, recv_scales, recv_idx, recv_w = interop.alloc_dispatch_outputs(
                num_recv, info, raw_x, raw_scales, raw_idx, num_topk)
        # launch
        stride_t, stride_h = interop.scale_strides(raw_scales)
        kin.dispatch(self, kin.InternodeDispatch(
            recv_x, recv_scales, recv_idx, recv_w, src_meta, rrcpm, rgcpm, send_rdma_head, send_nvl_head, raw_x,
            raw_scales, raw_idx, raw_w, in_rank, rdma_cpm, rrps, gbl_cpm, rgps, np.int32(T), np.int32(num_worst_tokens),
            np.int32(hidden_int4), np.int32(num_topk), np.int32(num_experts), np.int32(S), np.int64(stride_t),
            np.int64(stride_h), *ends, np.int32(cfg.num_max_rdma_chunked_send_tokens), np.int32(rdma_slots),
            np.int32(cfg.num_max_nvl_chunked_send_tokens), np.int32(nvl_slots), ctx),
            N, G, self.transport, "long long" if idx_name == "int64" else "int", C)
        keep = (raw_x, raw_scales, raw_idx, raw_w, recv_x, recv_scales, recv_idx, recv_w, in_rank, rdma_cpm, gbl_cpm,
                rrps, rgps, src_meta, rrcpm, rgcpm, send_rdma_head, send_nvl_head)
        event = self.rt.finish(compute, async_finish, keep, kind)
        # wrap
        out_x = interop.wrap_recv_x(recv_x, recv_scales, kind, info)
        if cached:
            return out_x, None, None, None, None, event
        w = lambda a, name="int32": interop.wrap(a, kind, name)  # noqa: E731
        out_handle = handles.InternodeHandle((
            is_token_in_rank, w(rdma_cpm), w(gbl_cpm), w(rrcpm), w(rrps), w(rgcpm), w(rgps),
            w(src_meta.view(cupy.uint8), "uint8"), w(send_rdma_head), w(send_nvl_head)),
            getattr(buf, "buffer_id", None), buf.next_dispatch_epoch())
        return (out_x, interop.wrap(recv_idx, kind, idx_name), interop.wrap(recv_w, kind, "float32"),
                per_expert_list if per_expert_list is not None else [], out_handle, event)

    # ---- combine ------------------------------------------------------------------------------------
    def combine(self, x, handle, topk_weights, bias, config_getter, previous_event, async_finish,
                allocate_on_comm_stream):
        """See ``CudaBackend.combine``. ``config_getter(num_channels)`` resolves the config for the handle's C."""
        import cupy
        buf = self.buf
        # plan
        R, N, G, dev = buf.num_ranks, self.num_nodes, self.gpus_per_node, buf.device_id
        num_recv, hidden = validate.check_combine_x(x, dev)
        h = check_handle(handle, R, N, G, None, dev, getattr(buf, "buffer_id", None))
        C = int(h["rdma_channel_prefix_matrix"].shape[1])
        cfg = config_getter(C)
        if cfg.num_channels != C:
            raise ValueError(f"config: num_sms={cfg.num_sms} but the handle was made with num_sms={2 * C}")
        check_config(cfg, N, "combine")
        if int(h["recv_src_meta"].shape[0]) != num_recv:
            raise ValueError(f"x: has {num_recv} rows but the handle's dispatch received {h['recv_src_meta'].shape[0]}")
        T = int(h["is_token_in_rank"].shape[0])
        num_topk = validate.check_combine_topk_weights(topk_weights, num_recv, dev) or 0
        biases = validate.check_bias(bias, T, hidden, dev)
        validate.check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        hidden_int4 = hidden * 2 // 16
        lay = _config.internode_layout(N, G, C, cfg.num_max_rdma_chunked_recv_tokens,
                                       cfg.num_max_nvl_chunked_recv_tokens, hidden * 2, 0, num_topk)
        check_buffer_sizes(lay, "combine", self.num_nvl_bytes, self.num_rdma_bytes)
        kind = interop.kind_of(x)
        raw = {k: interop.unwrap(v) for k, v in h.items()}
        raw_x = interop.unwrap(x)
        raw_w = interop.unwrap(topk_weights)
        raw_b = [interop.unwrap(b) for b in biases]
        rdma_slots, nvl_slots = cfg.num_max_rdma_chunked_recv_tokens, cfg.num_max_nvl_chunked_recv_tokens
        compute = self.rt.begin(kind, previous_event)
        # allocate
        with (buf.comm_stream if allocate_on_comm_stream else compute):
            out = cupy.empty((T, hidden), dtype=cupy.uint16)
            out_w = cupy.empty((T, num_topk), dtype=cupy.float32) if raw_w is not None else None
        # launch: the cached notify (meet, zero the combine rings' meta, compare the calls), then the combine
        ends, ctx = self.endpoints(), self.rt.ctx
        kin.cached_notify(self, kin.InternodeCachedNotify(
            np.int32(_OP_COMBINE), np.int32(C), np.int32(rdma_slots), np.int32(nvl_slots), np.int32(hidden_int4),
            np.int32(num_topk), np.int32(0), *ends, ctx), N, G, self.transport)
        kin.combine(self, kin.InternodeCombine(
            out, out_w, raw_x, raw_w, raw_b[0], raw_b[1], raw["recv_gbl_channel_prefix_matrix"],
            raw["recv_gbl_rank_prefix_sum"], raw["recv_rdma_channel_prefix_matrix"], raw["recv_rdma_rank_prefix_sum"],
            raw["send_rdma_head"], raw["send_nvl_head"], np.int32(T), np.int32(hidden_int4), np.int32(num_topk), *ends,
            np.int32(cfg.num_max_rdma_chunked_send_tokens), np.int32(rdma_slots),
            np.int32(cfg.num_max_nvl_chunked_send_tokens), np.int32(nvl_slots), ctx), N, G, self.transport, C)
        event = self.rt.finish(compute, async_finish, (raw_x, raw_w, *raw_b, out, out_w, *raw.values()), kind)
        # wrap
        return interop.wrap(out, kind, "bfloat16"), interop.wrap(out_w, kind, "float32"), event

    # ---- tests / tools ------------------------------------------------------------------------------
    def put_ceiling_launcher(self, bytes_per_peer: int, num_blocks: int, threads_per_block: int = 512,
                             chunk_bytes: int = 1 << 16):
        """A function that launches ``internode_put_bandwidth`` once on the current stream: every GPU puts
        ``bytes_per_peer`` to each other PE of its RDMA domain through this buffer's transport (the benchmark's
        ceiling). Uses the channel area of the RDMA buffer as scratch: only between calls."""
        import cupy
        lay = _config.internode_layout(self.num_nodes, self.gpus_per_node, 1, 1, 1, 16, 0, 0)
        offset = _config.align_up(lay["rdma_channel_begin"], 1 << 12)
        bytes_per_peer = _config.align_up(bytes_per_peer, 16)
        if offset + (1 + self.num_nodes) * bytes_per_peer > self.num_rdma_bytes:
            raise ValueError(f"bytes_per_peer: {bytes_per_peer} x {1 + self.num_nodes} does not fit the RDMA buffer "
                             f"({self.num_rdma_bytes} bytes)")
        # load + module init now, outside any timing
        kin.put_bandwidth_warm_up(self, kin.InternodePutBandwidth(
            np.uint64(0), self.peer_bases, np.int32(self.node), np.int32(1), np.int64(0), np.int64(0), np.int64(16)),
            self.transport)
        kernel = self._kernels[kin.put_bandwidth_name(self.transport)]

        def run():
            kin.put_bandwidth(kernel, kin.InternodePutBandwidth(
                np.uint64(self.rdma_base), self.peer_bases, np.int32(self.node), np.int32(self.num_nodes),
                np.int64(offset), np.int64(bytes_per_peer), np.int64(chunk_bytes)), num_blocks, threads_per_block,
                cupy.cuda.get_current_stream())
        return run

    def carve_probe(self, num_channels: int, num_rdma_slots: int, num_nvl_slots: int, hidden_int4: int,
                    num_scales: int, num_topk: int) -> list:
        """The device's own layout sums (``internode_carve_probe``), to compare with ``config.internode_layout``."""
        import cupy
        out = cupy.zeros(8, dtype=cupy.int64)
        kin.carve_probe(kin.InternodeCarveProbe(
            np.int32(self.num_nodes), np.int32(self.gpus_per_node), np.int32(num_channels), np.int32(num_rdma_slots),
            np.int32(num_nvl_slots), np.int32(hidden_int4), np.int32(num_scales), np.int32(num_topk), out))
        return [int(v) for v in out.get()]

    def destroy(self) -> None:
        """Collective: close the NVLink (and IPC "RDMA") buffers; free the symmetric buffer and finalize NVSHMEM
        only when every rank's device is healthy (as LowLatencyState.destroy, which explains why)."""
        import cupy
        reason = None
        try:
            cupy.cuda.runtime.deviceSynchronize()
        except Exception as e:  # noqa: BLE001  (CUDARuntimeError: a sticky device error)
            reason = f"{type(e).__name__}: {e}"
        reasons = self.buf.comm.allgather(reason)
        try:
            self.nvl.close()
            if self.rdma_ipc is not None:
                self.rdma_ipc.close()
            if self.nv is not None:
                nv, self.nv = self.nv, None
                if any(reasons):
                    import warnings
                    warnings.warn(f"rank {self.buf.rank}: NVSHMEM not finalized (a device failed: {reasons}); the "
                                  "symmetric heap is released at process exit", RuntimeWarning, stacklevel=2)
                else:
                    nv.barrier_all()
                    nv.free(self.rdma_base)
                    nv.finalize()
        finally:
            self.host.free()
            for comm in (self.node_comm, self.rdma_comm):
                try:
                    comm.Free()
                except Exception:  # noqa: BLE001
                    pass


__all__ = ["InternodeState", "resolve_transport", "resolve_force_put", "rdma_peer_table", "check_topology",
           "check_config", "check_handle", "check_buffer_sizes", "kernel_name", "threads", "HANDLE_FIELDS",
           "TRANSPORTS"]
