"""The intranode path (one NVLink domain: CUDA-IPC ring buffers, ``cuda_src/intranode.cu``): ``IntranodePath``
runs a dispatch and a combine whose common arguments the backend checked, each as a straight line: plan (the
handle's or the layout's arrays, the channel split, the zero-copy capacity), allocate (the outputs, on the caller's
stream or the comm stream), launch (the notify kernel, then the data kernel, through :mod:`.kernels`), wrap (the
caller's array kind, the handle, the event).
"""
from __future__ import annotations

import numpy as np

from .. import config as _config
from .. import handles, interop, validate
from . import kernels

HANDLE_FIELDS = ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx",
                 "is_token_in_rank", "send_head")
_HANDLE_DTYPES = ("int32", "int32", "int32", "int32", "bool", "int32")


class IntranodePath:
    """The intranode calls of one ``CudaBackend``.

    Args:
        buf: the backend (rank, num_ranks, device_id, num_nvl_bytes, buffer_id, health, the dispatch epoch).
        runtime: its :class:`~.runtime.Runtime` (comm stream, DeviceCtx, begin/finish, the host-mapped counters).
        nvl: the NVLink buffer (``bootstrap.IpcBuffer``: ``ptr``, ``ptr_table``).
    """

    def __init__(self, buf, runtime, nvl):
        self.buf, self.rt, self.nvl = buf, runtime, nvl

    def unpack_handle(self, handle, num_tokens: int, num_channels: int | None):
        """The handle's raw arrays after checking dtypes, device and shapes; ``num_channels``: the channels
        of the dispatch config (a cached dispatch must cut the tokens as the handle's did), or None (a
        combine has its own)."""
        buf = self.buf
        if not isinstance(handle, (tuple, list)) or len(handle) != 6:
            raise ValueError("handle: must be the 6-tuple returned by an intranode dispatch")
        handles.check_origin(handle, getattr(buf, "buffer_id", None))
        raws = []
        for name, dt, a in zip(HANDLE_FIELDS, _HANDLE_DTYPES, handle):
            validate.check_array(a, f"handle.{name}", (dt,), device=buf.device_id)
            raws.append(interop.unwrap(a))
        rpm, cpm, rcpm, src_idx, in_rank, send_head = raws
        R = buf.num_ranks
        channels = num_channels if num_channels is not None else (cpm.shape[1] if cpm.ndim == 2 else -1)
        expected = {"rank_prefix_matrix": (R, R), "channel_prefix_matrix": (R, channels),
                    "recv_channel_prefix_matrix": (R, channels), "is_token_in_rank": (num_tokens, R),
                    "send_head": (num_tokens, R)}
        for name, a in zip(HANDLE_FIELDS, raws):
            if name in expected and tuple(a.shape) != expected[name]:
                sms = "" if num_channels is None else f", a dispatch config with {num_channels} channels"
                raise ValueError(f"handle.{name}: expected shape {expected[name]} (this buffer, {num_tokens} tokens"
                                 f"{sms}), got {tuple(a.shape)}; was the handle made by another buffer, other "
                                 "inputs or another num_sms?")
        if src_idx.ndim != 1:
            raise ValueError(f"handle.recv_src_idx: must be 1-D, got shape {tuple(src_idx.shape)}")
        return rpm, cpm, rcpm, src_idx, in_rank, send_head

    def direct_recv_x(self, rows: int, hidden: int, dtype, num_channels: int):
        """The zero-copy dispatch's recv_x: ``[rows, hidden]`` of ``dtype``, a view of this rank's buffer at
        DirectDispatchLayout's x (cuda_src/common/layout.cuh); it keeps the backend alive, not the memory's
        contents."""
        import cupy
        if rows == 0:
            return cupy.empty((0, hidden), dtype=dtype)
        offset = _config.SIGNAL_BYTES + _config.direct_dispatch_x_offset(num_channels)
        nbytes = rows * hidden * cupy.dtype(dtype).itemsize
        mem = cupy.cuda.UnownedMemory(self.nvl.ptr + offset, nbytes, self.buf, self.buf.device_id)
        return cupy.ndarray((rows, hidden), dtype=dtype, memptr=cupy.cuda.MemoryPointer(mem, 0))

    # ---- dispatch -----------------------------------------------------------------------------------
    def dispatch(self, info, cfg, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                 topk_weights, expert_alignment, num_worst_tokens, previous_event, async_finish,
                 allocate_on_comm_stream, zero_copy, check_values: bool):
        """:meth:`cupy_ep.Buffer.dispatch` inside one NVLink domain; ``info``: ``validate.check_x``'s result,
        ``cfg`` the resolved config (the backend checked both, and the stream arguments)."""
        import cupy
        buf, rt, nvl = self.buf, self.rt, self.nvl
        # plan
        R, T, rank = buf.num_ranks, info.num_tokens, buf.rank
        C, num_own_blocks = cfg.intranode_dispatch_split(R)
        cached = handle is not None
        num_topk, idx_name, num_experts = 0, "int64", 0
        if cached:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("topk_idx/topk_weights: must be None in a cached dispatch (handle given)")
            rpm, cpm, rcpm, src_idx, in_rank, send_head = self.unpack_handle(handle, T, C)
        else:
            num_experts, num_topk, idx_name = validate.check_dispatch_layout_args(
                num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                num_worst_tokens, R, T, buf.device_id, check_values)
        S = info.num_scales
        hidden_int4 = info.hidden_bytes // 16
        # rows of a zero-copy output; 0: the ring dispatch
        capacity = validate.check_intranode_dispatch_fits(
            cfg, R, buf.num_nvl_bytes, info.hidden_bytes, num_topk, S, zero_copy, num_worst_tokens,
            int(src_idx.shape[0]) if cached else None)
        kind = interop.kind_of(info.x)
        raw_x = interop.unwrap(info.x, "bfloat16" if info.dtype == "bfloat16" else "float8_e4m3fn")
        raw_scales = interop.unwrap(info.scales)
        slots, ctx = np.int32(cfg.num_max_nvl_chunked_recv_tokens), rt.ctx
        compute = rt.begin(kind, previous_event)
        alloc_stream = buf.comm_stream if allocate_on_comm_stream else compute
        per_expert_list = None
        # the notify kernel (the receive counts: the one host sync of a dispatch without num_worst_tokens)
        if cached:
            num_recv = int(src_idx.shape[0])
            if not zero_copy:  # a zero-copy dispatch_direct meets the ranks itself (its entry handshake)
                kernels.cached_notify_dispatch(rt, kernels.CachedNotifyDispatch(
                    nvl.ptr_table, np.int32(rank), np.int32(C), slots, np.int32(hidden_int4),
                    np.int32(max(num_topk, 1)), np.int32(S), ctx), R)
            raw_idx = raw_w = None
        else:
            in_rank = interop.unwrap(is_token_in_rank)
            raw_idx = interop.unwrap(topk_idx)
            raw_w = interop.unwrap(topk_weights)
            with alloc_stream:
                rpm = cupy.empty((R, R), dtype=cupy.int32)
                cpm = cupy.empty((R, C), dtype=cupy.int32)
            sync = num_worst_tokens == 0
            if sync:
                rt.recv_counter[0] = -1
            kernels.notify_dispatch(rt, kernels.NotifyDispatch(
                interop.unwrap(num_tokens_per_rank), interop.unwrap(num_tokens_per_expert), np.int32(num_experts),
                in_rank, np.int32(T), np.int32(C), np.int32(expert_alignment), rpm, cpm,
                np.uint64(rt.host.ptr) if sync else None, np.uint64(rt.host.ptr + 4) if sync else None,
                nvl.ptr_table, np.int32(rank), slots, np.int32(hidden_int4), np.int32(max(num_topk, 1)),
                np.int32(S), np.int32(capacity), ctx), R)
            if sync:
                num_recv = rt.wait_recv_counter()
                if zero_copy:
                    buf.check_health()  # notify_dispatch stopped every rank if a receiver's rows do not fit
                per_expert_list = [int(v) for v in rt.expert_counters[: num_experts // R]]
            else:
                num_recv = num_worst_tokens
            with alloc_stream:
                src_idx = cupy.empty(num_recv, dtype=cupy.int32)
                rcpm = cupy.empty((R, C), dtype=cupy.int32)
                send_head = cupy.empty((T, R), dtype=cupy.int32)
        # allocate
        with alloc_stream:
            recv_x, recv_scales, recv_idx, recv_w = interop.alloc_dispatch_outputs(
                num_recv, info, raw_x, raw_scales, raw_idx, num_topk, with_x=not zero_copy)
        # launch
        ctype = kernels.idx_ctype(idx_name)
        stride_t, stride_h = interop.scale_strides(raw_scales)
        out_src_idx, out_rcpm, out_send_head = (None, None, None) if cached else (src_idx, rcpm, send_head)
        if zero_copy:
            recv_x = self.direct_recv_x(min(num_recv, capacity), info.hidden, raw_x.dtype, C)
            kernels.dispatch_direct(rt, kernels.DispatchDirect(
                recv_scales, out_src_idx, recv_idx, recv_w, out_rcpm, out_send_head, raw_x, raw_scales, raw_idx,
                raw_w, in_rank, cpm, rpm, np.int32(T), np.int32(num_recv), np.int32(hidden_int4), np.int32(num_topk),
                np.int32(num_experts), np.int32(S), np.int64(stride_t), np.int64(stride_h), nvl.ptr_table,
                np.int32(rank), np.int32(C), np.int32(capacity), np.int32(cfg.zero_copy_local_blocks(R)),
                np.int32(cached), ctx), R, ctype, cfg.num_sms)
        else:
            kernels.dispatch(rt, kernels.Dispatch(
                recv_x, recv_scales, out_src_idx, recv_idx, recv_w, out_rcpm, out_send_head, raw_x, raw_scales,
                raw_idx, raw_w, in_rank, cpm, rpm, np.int32(T), np.int32(num_worst_tokens), np.int32(hidden_int4),
                np.int32(num_topk), np.int32(num_experts), np.int32(S), np.int64(stride_t), np.int64(stride_h),
                nvl.ptr_table, np.int32(rank), np.int32(C), np.int32(cfg.num_max_nvl_chunked_send_tokens), slots,
                ctx), R, ctype, C, num_own_blocks)
        keep = (raw_x, raw_scales, raw_idx, raw_w, recv_x, recv_scales, recv_idx, recv_w, rpm, cpm, rcpm,
                src_idx, send_head, in_rank)
        event = rt.finish(compute, async_finish, keep, kind)
        # wrap
        out_x = interop.wrap_recv_x(recv_x, recv_scales, kind, info)
        if cached:
            return out_x, None, None, None, None, event
        out_handle = handles.DispatchHandle((
            interop.wrap(rpm, kind, "int32"), interop.wrap(cpm, kind, "int32"), interop.wrap(rcpm, kind, "int32"),
            interop.wrap(src_idx, kind, "int32"), is_token_in_rank, interop.wrap(send_head, kind, "int32")),
            buf.buffer_id, buf.next_dispatch_epoch())
        return (out_x, interop.wrap(recv_idx, kind, idx_name), interop.wrap(recv_w, kind, "float32"),
                per_expert_list if per_expert_list is not None else [], out_handle, event)

    # ---- combine ------------------------------------------------------------------------------------
    def combine(self, x, num_recv: int, hidden: int, handle, topk_weights, bias, cfg, previous_event, async_finish,
                allocate_on_comm_stream, zero_copy: bool):
        """:meth:`cupy_ep.Buffer.combine` inside one NVLink domain; ``x`` ``[num_recv, hidden]`` and ``cfg`` checked
        by the backend (and the stream arguments)."""
        import cupy
        buf, rt, nvl = self.buf, self.rt, self.nvl
        # plan (the backend checked that handle is a 6-tuple)
        num_tokens = int(handle[4].shape[0]) if hasattr(handle[4], "shape") else 0
        R, C, rank = buf.num_ranks, cfg.num_channels, buf.rank
        rpm, _, _, src_idx, in_rank, send_head = self.unpack_handle(handle, num_tokens, None)
        if int(src_idx.shape[0]) != num_recv:
            raise ValueError(f"x: has {num_recv} rows but the handle's dispatch received {src_idx.shape[0]}")
        num_topk = validate.check_combine_topk_weights(topk_weights, num_recv, buf.device_id) or 1
        biases = validate.check_bias(bias, num_tokens, hidden, buf.device_id)
        hidden_int4 = hidden * 2 // 16
        # rows per source rank of a zero-copy combine; 0: the ring combine
        capacity = validate.check_intranode_combine_fits(cfg, R, buf.num_nvl_bytes, hidden, num_topk, num_tokens,
                                                         zero_copy)
        kind = interop.kind_of(x)
        raw_x = interop.unwrap(x)
        raw_w = interop.unwrap(topk_weights)
        raw_b = [interop.unwrap(b) for b in biases]
        compute = rt.begin(kind, previous_event)
        # allocate
        with (buf.comm_stream if allocate_on_comm_stream else compute):
            out = cupy.empty((num_tokens, hidden), dtype=cupy.uint16)
            out_w = cupy.empty((num_tokens, num_topk), dtype=cupy.float32) if raw_w is not None else None
        # launch
        ctx = rt.ctx
        if zero_copy:  # combine_direct meets the ranks itself (its entry handshake): no notify kernel
            kernels.combine_direct(rt, kernels.CombineDirect(
                out, out_w, raw_x, raw_w, raw_b[0], raw_b[1], rpm, send_head, np.int32(num_tokens),
                np.int32(hidden_int4), np.int32(num_topk), nvl.ptr_table, np.int32(rank), np.int32(capacity),
                np.int32(_config.DIRECT_COMBINE_ROWS_PER_FLAG), np.int32(cfg.zero_copy_combine_senders(R)), ctx),
                R, cfg.num_sms)
        else:
            slots = np.int32(cfg.num_max_nvl_chunked_recv_tokens)
            kernels.cached_notify_combine(rt, kernels.CachedNotifyCombine(
                nvl.ptr_table, np.int32(rank), np.int32(C), slots, np.int32(hidden_int4), np.int32(num_topk),
                np.int32(num_tokens), ctx), R)
            kernels.combine(rt, kernels.Combine(
                out, out_w, raw_x, raw_w, raw_b[0], raw_b[1], rpm, src_idx, send_head, np.int32(num_tokens),
                np.int32(hidden_int4), np.int32(num_topk), nvl.ptr_table, np.int32(rank),
                np.int32(cfg.num_max_nvl_chunked_send_tokens), slots, ctx), R, C)
        event = rt.finish(compute, async_finish, (raw_x, raw_w, *raw_b, out, out_w, rpm, src_idx, send_head), kind)
        # wrap
        return interop.wrap(out, kind, "bfloat16"), interop.wrap(out_w, kind, "float32"), event

    def barrier(self) -> None:
        """Device-side barrier of the domain's ranks on the comm stream."""
        kernels.barrier(self.rt, kernels.Barrier(self.nvl.ptr_table, np.int32(self.buf.rank), self.rt.ctx),
                        self.buf.num_ranks)
