"""``CudaBackend``: the GPU path of ``Buffer`` (intranode: CUDA-IPC ring buffers in one NVLink domain).

A call goes: argument checks (validate.py) -> the communication stream waits for the caller's stream (or
``previous_event``) -> ``Runtime.launch`` (runtime.py) of one kernel from ``cuda_src/`` (jit.py) -> outputs
wrapped as the caller's array kind, and either the caller's stream waits for the communication stream
or an ``EventOverlap`` is returned (``async_finish=True``).
"""
from __future__ import annotations

import numpy as np

from .. import bootstrap, handles, interop, validate
from .. import config as _config
from ..backend_base import BackendBase
from . import internode as cuda_internode
from . import kernels
from . import low_latency as cuda_low_latency
from .intranode import IntranodePath
from .runtime import Runtime, capturing



class CudaBackend(BackendBase):
    """GPU backend of :class:`cupy_ep.Buffer`; see its docstring for the arguments. ``enable_shrink=True`` (with
    ``low_latency_mode``) turns on DeepEP's shrink mode: a low-latency wait that times out masks its peer instead
    of stopping the buffer, and masked ranks are left out of every later low-latency call
    (:meth:`low_latency_update_mask_buffer`, :meth:`low_latency_query_mask_buffer`,
    :meth:`low_latency_clean_mask_buffer`)."""

    backend = "cuda"

    def __init__(self, comm=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode=False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False, *,
                 backend=None, device=None, timeout_s=None, num_ranks_per_node=None, check_values=True,
                 internode_transport=None, low_latency_transport=None):
        super().__init__(comm, num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank,
                         allow_nvlink_for_low_latency_mode, allow_mnnvl, explicitly_destroy, enable_shrink,
                         backend=backend, device=device, timeout_s=timeout_s,
                         num_ranks_per_node=num_ranks_per_node, check_values=check_values)
        import cupy
        self.topology = bootstrap.topology(self.comm, num_ranks_per_node)
        internode = self.topology.num_nodes > 1
        if internode:  # checked on every rank alike, before anything collective
            transport = cuda_internode.resolve_transport(internode_transport)
            cuda_internode.check_topology(self.num_ranks, self.topology.num_ranks_per_node)
            if low_latency_mode:
                raise NotImplementedError("low_latency_mode: not implemented together with the internode path "
                                          "(one NVSHMEM world would have to serve both); use one Buffer per mode")
        else:
            validate.check_intranode_ranks(self.num_ranks)
            if num_rdma_bytes and not low_latency_mode:
                raise ValueError("num_rdma_bytes: must be 0 inside one NVLink domain (unless low_latency_mode)")
        self.device_id = bootstrap.choose_device(self.topology.machine_rank, device)
        self._device = cupy.cuda.Device(self.device_id)
        # every public call runs with this GPU current (Buffer enters it): every CuPy call inside, validation
        # included, must run there whatever device the caller has current (a reduction launched on another
        # device over this device's memory is an illegal access)
        self.scope = self._device
        ll_transport = None  # the env var matters in low-latency mode only; a bad argument is refused always
        if low_latency_mode or low_latency_transport is not None:
            ll_transport = cuda_low_latency.resolve_transport(low_latency_transport)
        if low_latency_mode:  # the arguments first, then what this machine allows (the message names each)
            cuda_low_latency.check_num_rdma_bytes(num_rdma_bytes)
            cuda_low_latency.resolve_force_put(ll_transport)
        self.enable_shrink = validate.check_flag(enable_shrink, "enable_shrink")
        # Collective (every rank, before any check that raises): what each rank's kernels may hold at once.
        self.sm_share = bootstrap.gpu_sm_share(self.comm, self.device_id, self.topology.local_size)
        self.buffer_id = handles.new_buffer_id(self.comm)  # collective; handles carry it (handles.check_origin)
        self._dispatch_epoch = 0  # normal-mode dispatches made so far (next_dispatch_epoch)
        self.num_device_sms = self.sm_share.device_sms
        ranks_per_gpu = self.sm_share.ranks_per_gpu
        if low_latency_mode and ranks_per_gpu > 1 and ll_transport == "nvshmem" and not self.sm_share.mps:
            # Checked on every rank alike (sm_share agrees on mps everywhere): no rank is left waiting.
            raise ValueError(
                f"low_latency_mode: the NVSHMEM transport needs one GPU per rank, but {self.topology.local_size} "
                f"ranks share {_gpu_count()} GPU(s) on this node and are not CUDA MPS clients (NVSHMEM supports "
                "several processes per GPU only through CUDA MPS). Run one rank per GPU, start the MPS control "
                "daemon (nvidia-cuda-mps-control -d) before the ranks, or pass low_latency_transport='ipc' (or set "
                "CUPY_EP_LL_TRANSPORT=ipc): the same kernels over a CUDA-IPC buffer, which ranks sharing a GPU may "
                "use (without MPS each wait for a peer then costs a time slice of the shared GPU)")
        with self._device:
            # internode: the NVLink buffer spans one node only; InternodeState makes it
            self._nvl = None if internode else bootstrap.IpcBuffer(self.comm, num_nvl_bytes + _config.SIGNAL_BYTES)
            self._workspace = cupy.zeros(_config.WORKSPACE_BYTES // 4, dtype=cupy.int32)
            # the device plumbing every path launches with (handed to them: low_latency.py, internode.py)
            self.runtime = Runtime(self.device_id, self.rank, self.num_ranks, self.timeout_s,
                                   bool(low_latency_mode and self.enable_shrink))
            self.comm_stream = self.runtime.comm_stream
            self._ctx = self.runtime.ctx
            self._torch_comm_stream = None  # get_comm_stream's torch view of comm_stream, made at first use
            # the intranode path (cupy_ep/cuda/intranode.py) over the NVLink buffer of the domain
            self._intranode = IntranodePath(self, self.runtime, self._nvl) if self._nvl is not None else None
            # low-latency mode: NVSHMEM world + symmetric buffer (cupy_ep/cuda/low_latency.py)
            self._ll = (cuda_low_latency.LowLatencyState(self, num_rdma_bytes, self.topology.num_nodes == 1,
                                                         ll_transport)
                        if low_latency_mode else None)
            # internode path (cupy_ep/cuda/internode.py): NVLink buffer of the node + RDMA buffer
            self._internode = (cuda_internode.InternodeState(self, num_nvl_bytes, num_rdma_bytes, transport)
                               if internode else None)
            self._device.synchronize()
        # Make this buffer's GPU current, as DeepEP users do with torch.cuda.set_device(local_rank): arrays
        # the caller creates next land on the right GPU (a wrong one is refused with a clear error anyway).
        self._device.use()
        self.comm.Barrier()

    # ---- lifetime and health --------------------------------------------------------------------------
    def destroy(self) -> None:
        """Collective: wait for the device, close the IPC mappings, free everything."""
        if self._destroyed:
            return
        try:
            with self._device:
                try:
                    self._device.synchronize()
                except Exception:
                    pass  # a sticky device error: the collective steps below still run on every rank
                try:
                    if self._ll is not None:
                        self._ll.destroy()  # agrees over MPI before any NVSHMEM collective
                    if self._internode is not None:
                        self._internode.destroy()
                finally:
                    if self._nvl is not None:
                        self._nvl.close()   # ends with an MPI barrier that every rank reaches
                    self.runtime.free()
        finally:
            self._workspace = self._ctx = None
            super().destroy()               # never run the collectives twice

    def __del__(self):
        pass  # release is explicit (destroy / context manager): a collective must not run in a finalizer

    @property
    def _unusable_reason(self) -> str | None:  # the runtime's: the paths' waits set it there
        return self.runtime.unusable_reason

    @_unusable_reason.setter
    def _unusable_reason(self, reason: str | None) -> None:
        self.runtime.unusable_reason = reason

    def check_health(self) -> None:
        """See :meth:`cupy_ep.Buffer.check_health`."""
        self.runtime.check_health()

    def check_usable(self) -> None:
        super().check_usable()
        self.runtime.check_health()

    def get_comm_stream(self):
        if (self.framework or interop.caller_kind().lib) == "torch":
            import torch
            if self._torch_comm_stream is None:
                self._torch_comm_stream = torch.cuda.ExternalStream(
                    self.comm_stream.ptr, device=torch.device("cuda", self.device_id))
            return self._torch_comm_stream
        return self.comm_stream

    def _buffer_bytes(self, offset: int, nbytes: int, rdma: bool):
        import cupy
        if rdma:  # the low-latency buffer, or the internode RDMA buffer (Buffer checked num_rdma_bytes > 0)
            base = self._ll.base if self._ll is not None else self._internode.rdma_base
        else:     # the NVLink buffer after its signal header (num_nvl_bytes of it are the caller's to size)
            nvl = self._nvl if self._nvl is not None else self._internode.nvl
            base = nvl.ptr + _config.SIGNAL_BYTES
        mem = cupy.cuda.UnownedMemory(base + offset, nbytes, self, self.device_id)
        return cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))

    def _check_sms(self, cfg: _config.Config, arg: str = "config") -> None:
        limit = self.sm_share.normal_mode_sms
        if cfg.num_sms > limit:
            raise ValueError(f"{arg}: num_sms={cfg.num_sms} exceeds the {limit} SMs a rank may use on GPU "
                             f"{self.device_id} ({self.sm_share.describe()}; every block must be resident)")

    # ---- layout -------------------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx, num_experts: int, previous_event=None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        """See :meth:`cupy_ep.Buffer.get_dispatch_layout`."""
        import cupy
        self.check_usable()
        validate.check_num_experts(num_experts, self.num_ranks)
        num_tokens, num_topk = validate.check_topk_idx(topk_idx, num_experts, self.device_id,
                                                        self.check_values and not capturing())
        validate.check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        kind = interop.kind_of(topk_idx)
        idx_name = interop.dtype_name(topk_idx)
        with self._device:
            raw_idx = interop.unwrap(topk_idx)
            compute = self.runtime.begin(kind, previous_event)
            with (self.comm_stream if allocate_on_comm_stream else compute):
                per_rank = cupy.empty(self.num_ranks, dtype=cupy.int32)
                per_expert = cupy.empty(num_experts, dtype=cupy.int32)
                in_rank = cupy.empty((num_tokens, self.num_ranks), dtype=cupy.bool_)
                per_rdma = (cupy.empty(self.topology.num_nodes, dtype=cupy.int32) if self._internode is not None
                            else None)
            columns = num_experts + self.num_ranks + (self.topology.num_nodes if per_rdma is not None else 0)
            kernels.get_dispatch_layout(self.runtime, kernels.GetDispatchLayout(
                raw_idx, np.int32(num_tokens), np.int32(num_topk), np.int32(num_experts), np.int32(self.num_ranks),
                np.int32(self.topology.num_ranks_per_node), per_rank, per_rdma, per_expert, in_rank, self._workspace),
                kernels.idx_ctype(idx_name), num_tokens, num_topk, columns, self.num_device_sms)
            event = self.runtime.finish(compute, async_finish, (raw_idx, per_rank, per_rdma, per_expert, in_rank),
                                        kind)
        return (interop.wrap(per_rank, kind, "int32"), interop.wrap(per_rdma, kind, "int32"),
                interop.wrap(per_expert, kind, "int32"), interop.wrap(in_rank, kind, "bool"), event)

    # ---- dispatch -----------------------------------------------------------------------------------
    def _check_outside_buffer(self, a, name: str) -> None:
        """Refuse an input that lives in this buffer's NVLink memory (a zero-copy dispatch's recv_x): the call
        would overwrite it while reading it."""
        raw = interop.unwrap(a)
        ptr = int(getattr(getattr(raw, "data", None), "ptr", 0) or 0)
        if self._nvl is not None and self._nvl.ptr <= ptr < self._nvl.ptr + self._nvl.nbytes:
            raise ValueError(f"{name}: is a view of this buffer (a zero-copy dispatch's recv_x), which this call "
                             "overwrites; copy it first (or compute the expert outputs into a new array)")

    def next_dispatch_epoch(self) -> int:
        """Count one more normal-mode dispatch (intranode or internode) and return its number: the ``epoch`` of the
        handle it returns (:mod:`cupy_ep.handles`)."""
        self._dispatch_epoch = getattr(self, "_dispatch_epoch", 0) + 1
        return self._dispatch_epoch

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config=None, previous_event=None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False, zero_copy: bool = False):
        """See :meth:`cupy_ep.Buffer.dispatch`."""
        self.check_usable()
        info = validate.check_x(x, self.device_id)
        cfg = self._resolve_config(config, "dispatch", max(info.hidden_bytes, 2 * info.hidden))
        self._check_sms(cfg)
        validate.check_expert_alignment(expert_alignment)
        validate.check_num_worst_tokens(num_worst_tokens, self.num_ranks, info.num_tokens)
        validate.check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        zero_copy = validate.check_flag(zero_copy, "zero_copy")
        self._check_outside_buffer(info.x, "x")
        if self._internode is not None:
            if zero_copy:
                raise NotImplementedError("zero_copy: only inside one NVLink domain (intranode) for now")
            return self._internode.dispatch(
                info, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens, cfg,
                previous_event, async_finish, allocate_on_comm_stream, self.check_values and not capturing())
        return self._intranode.dispatch(
            info, cfg, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
            expert_alignment, num_worst_tokens, previous_event, async_finish, allocate_on_comm_stream, zero_copy,
            self.check_values and not capturing())

    # ---- combine ------------------------------------------------------------------------------------
    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False, zero_copy: bool = False):
        """See :meth:`cupy_ep.Buffer.combine`."""
        self.check_usable()
        if self._internode is not None:
            if zero_copy:
                raise NotImplementedError("zero_copy: only inside one NVLink domain (intranode) for now")

            def config_getter(num_channels):
                cfg = self._resolve_config(config, "combine",
                                           2 * int(x.shape[1]) if getattr(x, "ndim", 0) == 2 else None, num_channels)
                self._check_sms(cfg)
                return cfg
            return self._internode.combine(x, handle, topk_weights, bias, config_getter, previous_event,
                                           async_finish, allocate_on_comm_stream)
        num_recv, hidden = validate.check_combine_x(x, self.device_id)
        self._check_outside_buffer(x, "x")
        zero_copy = validate.check_flag(zero_copy, "zero_copy")
        if not isinstance(handle, (tuple, list)) or len(handle) != 6:
            raise ValueError("handle: must be the 6-tuple returned by an intranode dispatch")
        # a combine cuts the tokens into its own channels: send_head does not depend on the dispatch's
        cfg = self._resolve_config(config, "combine", hidden * 2)
        self._check_sms(cfg)
        validate.check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        return self._intranode.combine(x, num_recv, hidden, handle, topk_weights, bias, cfg, previous_event,
                                       async_finish, allocate_on_comm_stream, zero_copy)

    # ---- low-latency mode (the logic lives in cuda_low_latency.LowLatencyState) ----------------------
    def _low_latency(self):
        self.check_usable()
        if self._ll is None:
            raise ValueError("low_latency_mode: the low-latency calls need a Buffer created with "
                             "low_latency_mode=True")
        return self._ll

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """See :meth:`cupy_ep.Buffer.clean_low_latency_buffer`."""
        self._low_latency().clean(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        self.check_health()

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False):
        """Send every (token, top-k slot) to its expert's rank, into fixed per-expert slots (collective, no
        host sync, CUDA-graph capturable). Arguments, shapes and results as ``HostBackend.low_latency_dispatch``:

        Returns:
            ``(recv_x | (recv_x, recv_x_scales), recv_count, handle, EventOverlap, hook)``: ``recv_x``
            ``[L, R*M, H]`` bf16 or float8_e4m3fn (CuPy: uint8); scales ``[L, R*M, H/128]`` float32 or
            ``[L, R*M, H/512]`` int32 (UE8M0), column-major in the last two dims; ``recv_count [L] int32``;
            ``handle``: a :class:`~cupy_ep.handles.LowLatencyHandle`, DeepEP's ``(src_info [L, R*M] int32,
            layout_range [L, R] int64, M, H, E)`` with ``.topk_slots [T, K] int32`` (each top-k entry's slot, which
            the combine finds its rows by; -1: not sent); ``hook`` launches the
            receive phase when ``return_recv_hook`` (outputs are final only after it). Rows of a local expert:
            by source rank, then token, then k (deterministic); rows past ``recv_count`` are undefined.
        """
        check = self.check_values and not capturing()
        return self._low_latency().dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
            dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook, check)

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False, return_recv_hook: bool = False,
                            out=None, combine_wait_recv_cost_stats=None, bf16_partials: bool = False):
        """Send expert outputs ``x [L, R*M, H]`` bf16 back to the token owners and reduce them with the
        weights: ``(combined_x [T, H] bf16, EventOverlap, hook)``, per token the fp32 sum of ``w[t, k] * row``:
        per expert rank over k ascending, rounded to 24 bits (``bf16_partials=True``: to bf16, a third fewer bytes
        across NVLink, one more rounding; ``use_logfmt=True``: LogFMT-10, :mod:`cupy_ep.logfmt`, 44 % of the
        24-bit bytes, at most 2.2 % relative error per partial value; this rank's choice, for its own tokens), then
        over the ranks ascending, rounded once to bf16 (:func:`cupy_ep.reference.low_latency_combine`). ``zero_copy``:
        the rows are in
        :meth:`get_next_low_latency_combine_buffer`; ``out``: written in place and returned. ``topk_idx`` must be
        the routing of the dispatch that made ``handle`` (its shape is checked: the kernel finds each entry's row
        by ``handle.topk_slots``)."""
        check = self.check_values and not capturing()
        return self._low_latency().combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                           return_recv_hook, out, combine_wait_recv_cost_stats, bf16_partials, check)

    def get_next_low_latency_combine_buffer(self, handle):
        """bf16 ``[L, R*M, H]`` view of the symmetric send buffer the next low-latency call uses (write the
        expert outputs there, then ``low_latency_combine(..., zero_copy=True)``)."""
        ll = self._low_latency()
        return ll.next_combine_buffer(handle, interop.kind_of(handle[0]) if isinstance(handle, (tuple, list))
                                      and handle else interop.Kind("cupy", True))

    # ---- shrink mode (low-latency fault tolerance, as DeepEP's; cuda_low_latency.LowLatencyState) --------
    def _shrink(self):
        self.check_usable()
        validate.check_shrink_enabled(self._ll is not None and self.enable_shrink)
        return self._ll

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """See :meth:`cupy_ep.Buffer.low_latency_update_mask_buffer`."""
        ll = self._shrink()
        rank = validate.check_rank_to_mask(rank_to_mask, self.num_ranks)
        ll.update_mask(rank, validate.check_flag(mask, "mask"))

    def low_latency_query_mask_buffer(self, mask_status) -> None:
        """See :meth:`cupy_ep.Buffer.low_latency_query_mask_buffer`."""
        ll = self._shrink()
        validate.check_mask_status(mask_status, self.num_ranks, self.device_id)
        ll.query_mask(mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        """See :meth:`cupy_ep.Buffer.low_latency_clean_mask_buffer`."""
        self._shrink().clean_mask()

    # ---- what the tools read (benchmarks: cupy_ep/tools) ---------------------------------------------
    @property
    def nvl_peer_table(self):
        """CuPy uint64 ``[D]`` on this buffer's GPU: the NVLink buffer of each of the D ranks of this rank's NVLink
        domain (all ranks inside one domain, this node's across nodes), in domain-rank order, as mapped here over
        CUDA IPC: the ``buffer_ptrs`` the kernels take. Each buffer starts with ``config.SIGNAL_BYTES`` of signals;
        tools may write past them only between calls."""
        return (self._nvl if self._nvl is not None else self._internode.nvl).ptr_table

    @property
    def low_latency_transport(self) -> str | None:
        """The low-latency buffer's transport, ``"nvshmem"`` or ``"ipc"``; None without ``low_latency_mode``."""
        return self._ll.transport if self._ll is not None else None

    @property
    def internode_transport(self) -> str | None:
        """The internode path's RDMA transport, ``"nvshmem"`` or ``"ipc"``; None inside one NVLink domain."""
        return self._internode.transport if self._internode is not None else None

    def low_latency_state(self) -> cuda_low_latency.LowLatencyState:
        """The low-latency path's state, for profiling (its ``enable_stamps`` and ``stamps_of``: the kernels' phase
        stamps); checks the buffer is usable. ValueError naming ``low_latency_mode`` without it."""
        return self._low_latency()

    def internode_put_ceiling_launcher(self, bytes_per_peer: int, num_blocks: int):
        """A function of no arguments that launches the RDMA put-bandwidth kernel once on the current stream: every
        GPU puts ``bytes_per_peer`` bytes (rounded up to 16) to each other node's GPU of its index, through this
        buffer's transport, from ``num_blocks`` blocks (the internode benchmark's ceiling). It uses the RDMA
        buffer's channel area as scratch: run it between calls only. ValueError when the job spans one node (no RDMA
        domain), or naming ``bytes_per_peer`` when the region does not fit the RDMA buffer."""
        self.check_usable()
        if self._internode is None:
            raise ValueError("internode_put_ceiling_launcher: needs a buffer whose job spans more than one node")
        with self._device:
            return self._internode.put_ceiling_launcher(bytes_per_peer, num_blocks)

    # ---- tests / tools ------------------------------------------------------------------------------
    def barrier(self) -> None:
        """See :meth:`cupy_ep.Buffer.barrier`."""
        self.check_usable()
        with self._device:
            if self._internode is not None:
                self._internode.barrier()
            else:
                self._intranode.barrier()
            self.comm_stream.synchronize()
        self.check_health()


def _gpu_count() -> int:
    import cupy
    return cupy.cuda.runtime.getDeviceCount()
