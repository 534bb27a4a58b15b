"""``Buffer``: the public entry point (DeepEP V1 API).

``Buffer(...)`` holds one backend (``buf.impl``): the CUDA path (:class:`cupy_ep.cuda.backend.CudaBackend`: CUDA IPC
buffers, a high-priority communication stream, kernels from ``cuda_src/``) when a GPU is present, the numpy + MPI
:class:`cupy_ep.host.backend.HostBackend` when not. ``backend="cuda"|"host"`` forces the choice and ``buf.backend``
says which one runs. Every public call is a method here; it runs on the backend with the backend's device current.
"""
from __future__ import annotations

import os

from . import backend_base as _backend_base
from . import config as _config
from . import event as _event
from .errors import BackendUnavailableError


def gpu_available() -> bool:
    """True when CuPy can see at least one CUDA device."""
    try:
        import cupy
        return cupy.cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver, no libcuda, no cupy: all mean "no GPU"
        return False


def _choose_backend(backend: str | None) -> str:
    backend = backend or os.environ.get("CUPY_EP_BACKEND") or None
    if backend not in (None, "cuda", "host"):
        raise ValueError(f"backend: must be 'cuda', 'host' or None, got {backend!r}")
    if backend == "cuda" and not gpu_available():
        raise BackendUnavailableError("backend='cuda' was asked for, but CuPy sees no GPU here")
    if backend is None:
        backend = "cuda" if gpu_available() else "host"
    return backend


default_timeout_s = _backend_base.default_timeout_s


class Buffer:
    """Expert-parallel communication buffer of one rank (DeepEP V1 compatible).

    Args:
        comm: the expert-parallel group: an mpi4py communicator, a ``torch.distributed.ProcessGroup`` (NCCL or
            gloo; the ranks then talk through torch.distributed's store, :mod:`cupy_ep.bootstrap.torch_group`),
            or None: torch.distributed's default group when it is initialized and MPI is not started (nor
            ``CUPY_EP_BOOTSTRAP=mpi`` set), else ``MPI.COMM_WORLD`` (:func:`cupy_ep.bootstrap.as_comm`).
        num_nvl_bytes: bytes of the NVLink (CUDA IPC) buffer; size it with
            ``Config.get_nvl_buffer_size_hint`` or :meth:`get_nvl_buffer_size_hint`.
        num_rdma_bytes: bytes of the NVSHMEM symmetric buffer; 0 for the intranode normal mode, and at
            least :meth:`get_low_latency_rdma_size_hint` with ``low_latency_mode=True``.
        low_latency_mode: also set up the low-latency (decode) path: NVSHMEM is initialised over ``comm``
            and ``low_latency_dispatch``/``low_latency_combine`` become available (the normal-mode calls
            keep working when ``num_nvl_bytes`` is given too). Two buffers alternate per low-latency call;
            a CUDA graph fixes the buffer at capture, so a graph must hold an even number of low-latency
            calls (dispatch + combine pairs, as in DeepEP): an odd number is refused on the device at the
            second replay with a ``CommError``.
        num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, explicitly_destroy: accepted for
            DeepEP compatibility.
        enable_shrink: with ``low_latency_mode``, DeepEP's shrink mode: a rank that times out in a low-latency call
            is masked and left out of the later ones (``low_latency_update_mask_buffer`` / ``_query_`` /
            ``_clean_mask_buffer``).
        backend: ``"cuda"``, ``"host"`` or None (auto: cuda when a GPU is visible).
        device: GPU ordinal; default the rank on this machine modulo the visible GPUs.
        timeout_s: timeout in seconds of every wait for another rank (device waits; host waits on the host
            backend), default ``CUPY_EP_TIMEOUT_S`` or 100.
        num_ranks_per_node: GPUs per NVLink domain (default: the MPI shared-memory split). When the ranks span
            more than one such domain, the internode path runs (cupy_ep/cuda/internode.py).
        internode_transport: ``"nvshmem"`` (default; env ``CUPY_EP_INTERNODE_TRANSPORT``) or ``"ipc"`` (the RDMA
            domain through CUDA-IPC stores: for testing several "nodes" on one box). CUDA backend only.
        low_latency_transport: ``"nvshmem"`` (default; env ``CUPY_EP_LL_TRANSPORT``) or ``"ipc"``: the
            low-latency buffer as a CUDA-IPC allocation opened by every rank of the node instead of NVSHMEM
            symmetric memory. The same kernels (every peer by NVLink stores), no NVSHMEM wheel or start-up, and
            ranks may share a GPU; one node only (as the low-latency path is either way). CUDA backend only.
        check_values: check ``topk_idx`` values on the host (costs a device sync; off for benchmarks). With
            False, a low-latency call whose arguments look like the last ones that passed (types, dtypes, shapes,
            contiguity, device, scalar values) also skips re-checking them (host time per call).
    """

    #: SMs used by dispatch/combine unless a Config says otherwise (even; Config explains how they are used).
    num_sms: int = 20

    def __init__(self, comm=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, *,
                 backend: str | None = None, device: int | None = None, timeout_s: float | None = None,
                 num_ranks_per_node: int | None = None, check_values: bool = True,
                 internode_transport: str | None = None, low_latency_transport: str | None = None):
        if _choose_backend(backend) == "host":
            from .host.backend import HostBackend as backend_class
        else:
            from .cuda.backend import CudaBackend as backend_class
        #: the backend (``cupy_ep.cuda.backend.CudaBackend`` or ``cupy_ep.host.backend.HostBackend``) every call
        #: goes to; tests and tools reach its internals through it
        self.impl = backend_class(comm, num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank,
                                  allow_nvlink_for_low_latency_mode, allow_mnnvl, explicitly_destroy, enable_shrink,
                                  backend=backend, device=device, timeout_s=timeout_s,
                                  num_ranks_per_node=num_ranks_per_node, check_values=check_values,
                                  internode_transport=internode_transport,
                                  low_latency_transport=low_latency_transport)

    def __getattr__(self, name: str):
        # The backend's public attributes (rank, num_ranks, comm, comm_stream, device_id, topology, buffer_id, ...);
        # only reached for names the Buffer itself lacks, so the calls' lookups never come here.
        impl = self.__dict__.get("impl")
        if impl is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(impl, name)

    @property
    def backend(self) -> str:
        """``"cuda"`` or ``"host"``: the backend this Buffer runs on."""
        return self.impl.backend

    @property
    def check_values(self) -> bool:
        """Whether calls check ``topk_idx`` values on the host (the constructor's ``check_values``); settable."""
        return self.impl.check_values

    @check_values.setter
    def check_values(self, value: bool) -> None:
        """Turn the host-side ``topk_idx`` checks on or off for the calls that follow (False in decode loops and
        CUDA graphs: the checks copy ``topk_idx`` to the host)."""
        self.impl.check_values = value

    # ---- class-level knobs (DeepEP API) -------------------------------------------------------------
    @classmethod
    def set_num_sms(cls, new_num_sms: int) -> None:
        """Set the SMs dispatch/combine use by default (even, >= 2)."""
        if not isinstance(new_num_sms, int) or new_num_sms < 2 or new_num_sms % 2:
            raise ValueError(f"new_num_sms: must be an even int >= 2, got {new_num_sms!r}")
        Buffer.num_sms = new_num_sms
        _config.set_default_num_sms(new_num_sms)

    @staticmethod
    def get_dispatch_config(num_ranks: int, *, hidden_bytes: int | None = None) -> _config.Config:
        """The default dispatch ``Config`` for ``num_ranks`` ranks at ``Buffer.num_sms`` SMs (DeepEP's
        ``get_dispatch_config``): a tuned entry for this machine and shape where one exists
        (``cupy_ep.tune``), else the built-in table. ``hidden_bytes`` (keyword-only, cupy_ep's extension): the
        bytes of one ``x`` row (2 H for BF16), which the tuned entries are keyed by; None: any."""
        return _config.get_dispatch_config(num_ranks, Buffer.num_sms, hidden_bytes)

    @staticmethod
    def get_combine_config(num_ranks: int, *, hidden_bytes: int | None = None) -> _config.Config:
        """The default combine ``Config``; as :meth:`get_dispatch_config`."""
        return _config.get_combine_config(num_ranks, Buffer.num_sms, hidden_bytes)

    @staticmethod
    def get_nvl_buffer_size_hint(hidden_bytes: int, num_ranks: int) -> int:
        """``num_nvl_bytes`` that the default dispatch and combine configs need for this hidden size."""
        return max(
            Buffer.get_dispatch_config(num_ranks, hidden_bytes=hidden_bytes).get_nvl_buffer_size_hint(
                hidden_bytes, num_ranks),
            Buffer.get_combine_config(num_ranks, hidden_bytes=hidden_bytes).get_nvl_buffer_size_hint(
                hidden_bytes, num_ranks))

    @staticmethod
    def get_zero_copy_nvl_size_hint(num_max_tokens_per_rank: int, hidden_bytes: int, num_ranks: int,
                                    num_topk: int = 8) -> int:
        """``num_nvl_bytes`` for zero-copy dispatch and combine (``zero_copy=True``) of up to
        ``num_max_tokens_per_rank`` tokens on every rank: a dispatch may receive all ranks' tokens, a combine
        receives each of the owner's tokens once per rank. ``hidden_bytes`` as in
        :meth:`get_nvl_buffer_size_hint` (BF16 rows; FP8 rows with their scales are smaller). At least the
        ring hint of the default configs."""
        t, r = num_max_tokens_per_rank, num_ranks
        scales = -(-(hidden_bytes // 2) // 128)
        zero_copy = max(_config.direct_dispatch_bytes(256, r * t, hidden_bytes, num_topk, 0),
                        _config.direct_dispatch_bytes(256, r * t, hidden_bytes // 2, num_topk, scales),
                        _config.direct_combine_bytes(r, t, hidden_bytes, num_topk))
        return max(_config.align_up(_config.NOTIFY_BYTES + zero_copy),
                   Buffer.get_nvl_buffer_size_hint(hidden_bytes, num_ranks))

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """``num_rdma_bytes`` the low-latency kernels need (DeepEP's hint, sized for BF16 rows; the host backend
        itself needs none): :func:`cupy_ep.config.low_latency_rdma_size_hint`. Callable before any Buffer exists.

        Args:
            num_max_dispatch_tokens_per_rank: M, the most tokens any rank dispatches in one call (the same on
                every rank).
            hidden: H, the hidden size.
            num_ranks: the ranks of the expert-parallel group.
            num_experts: E, all experts.

        Returns:
            int, bytes."""
        return _config.low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                                  num_experts)

    @staticmethod
    def capture() -> _event.EventOverlap:
        """An ``EventOverlap`` recorded on the caller's current stream (DeepEP's ``Buffer.capture()``, for
        ``previous_event=``): torch's ``torch.cuda.current_stream()`` for torch users, CuPy's current stream for
        CuPy users (:func:`cupy_ep.interop.caller_kind` says how it tells them apart); its
        ``current_stream_wait()`` makes that framework's current stream wait. Without a GPU, or with
        ``CUPY_EP_BACKEND=host``: a complete :class:`~cupy_ep.event.HostEvent` (the host backend's calls are
        synchronous)."""
        if _choose_backend(None) == "host":
            return _event.EventOverlap(_event.HOST_EVENT)
        return _event.capture()

    @staticmethod
    def is_sm90_compiled() -> bool:
        """DeepEP compatibility: whether the kernels use the SM90 features (TMA bulk copies, mbarriers). cupy_ep
        compiles them at run time for the GPU it runs on, so this is True when the current GPU has compute
        capability 9.0 or newer, False without a GPU (the host backend)."""
        if not gpu_available():
            return False
        import cupy
        return int(cupy.cuda.Device().compute_capability) >= 90

    # ---- the calls (each runs on the backend, with its device current) --------------------------------
    def get_dispatch_layout(self, topk_idx, num_experts: int, previous_event=None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        """Routing counts of this rank's tokens.

        Args:
            topk_idx: ``[T, K]`` int64 or int32, -1 = no expert.
            num_experts: E, a multiple of the rank count.
            previous_event: an ``EventOverlap`` the communication stream waits for first; None: the caller's
                current stream.
            async_finish: return at once with an event to wait on; the caller's stream does not wait.
            allocate_on_comm_stream: allocate the outputs on the communication stream (with
                ``previous_event``, as DeepEP's).

        Returns:
            ``(num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank [N] int32 (internode; None inside one
            node), num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool, EventOverlap)``, arrays of
            ``topk_idx``'s kind."""
        impl = self.impl
        with impl.scope:
            result = impl.get_dispatch_layout(topk_idx, num_experts, previous_event, async_finish,
                                              allocate_on_comm_stream)
            impl.note_arrays(topk_idx)
            return result

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config=None, previous_event=None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False, *, zero_copy: bool = False):
        """Send every token to the ranks that own its experts.

        Args:
            x: BF16 ``[T, H]``, or the FP8 pair ``(x_e4m3 [T, H] float8_e4m3fn/uint8, scales [T, ceil(H/128)]
                float32, any strides)``.
            handle: a previous dispatch's handle for a cached dispatch (no CPU sync; topk must be None).
            num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert: from ``get_dispatch_layout``
                (``[R]`` int32, ``[T, R]`` bool, ``[E]`` int32).
            num_tokens_per_rdma_rank: ``[N]`` int32 from ``get_dispatch_layout`` across nodes; None inside one.
            topk_idx, topk_weights: ``[T, K]`` int64/int32 and float32, both or neither.
            expert_alignment: per-expert receive counts are rounded up to this.
            num_worst_tokens: > 0 = no CPU sync: outputs have this many rows (CUDA-graph capturable). Across nodes
                it also bounds the rows this rank receives over RDMA, those only forwarded to its node peers
                included; a smaller bound stops the buffer with a capacity error (T * R always suffices).
            config: ``Config``; default ``get_dispatch_config(R)``.
            previous_event, async_finish, allocate_on_comm_stream: as in :meth:`get_dispatch_layout`.
            zero_copy: (keyword-only) the senders store every row straight into its final row in the receiver's
                NVLink buffer, and ``recv_x`` is a view of that buffer (no ring, no receiver copy: the fast path). The
                view is valid until the next dispatch or combine on this buffer; copy it to keep it. It holds
                ``config.direct_dispatch_capacity(num_nvl_bytes, ...)`` rows; more stops the buffer on every rank
                (a CommError, at once where the count is known on the host: a dispatch that syncs; otherwise at
                the next call). ``config.num_sms`` blocks (``config.zero_copy_local_blocks(R)`` of them copy the
                rank's own rows); a cached call runs no notify kernel (an entry handshake inside the kernel). The
                handle is the same as without it (combine and cached dispatch take either).

        Returns:
            ``(recv_x | (recv_x, recv_x_scales), recv_topk_idx, recv_topk_weights,
            num_recv_tokens_per_expert_list, handle, EventOverlap)``; rows ordered by (source rank, source
            token). Cached mode returns ``(recv_x[, scales], None, None, None, None, EventOverlap)``.
            Across nodes (cupy_ep/cuda/internode.py) ``num_tokens_per_rdma_rank`` is required and the handle is
            DeepEP's internode 10-tuple."""
        impl = self.impl
        with impl.scope:
            result = impl.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                   num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                                   config, previous_event, async_finish, allocate_on_comm_stream, zero_copy)
            impl.note_arrays(x)
            return result

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False, *, zero_copy: bool = False):
        """Send expert outputs back to the tokens' owners and sum them there.

        Args:
            x: BF16 ``[N, H]``, one row per row of the dispatch output that made ``handle``.
            handle: the dispatch handle (not modified).
            topk_weights: ``[N, K]`` float32 or None; summed per token like x.
            bias: None, a ``[T, H]`` bf16 array, or a pair; added first.
            config: ``Config``; default ``get_combine_config(R)``.
            previous_event, async_finish, allocate_on_comm_stream: as in :meth:`get_dispatch_layout`.
            zero_copy: (keyword-only) the expert ranks store the rows straight into the owners' NVLink buffers
                and the owners reduce them as they land (no ring: the fast path). The buffer must hold the owner's
                tokens from every rank: ``config.direct_combine_capacity(num_nvl_bytes, R, 2 * H, K)`` rows per
                rank, at least T (``config.direct_combine_bytes`` sizes it). ``config.num_sms`` blocks:
                ``config.zero_copy_combine_senders(R)`` store, the rest reduce. Same result, bit for bit.

        Returns:
            ``(combined_x [T, H] bf16, combined_topk_weights [T, K] float32 or None, EventOverlap)``: an fp32
            sum (0 + bias0 + bias1 + contributions in ascending rank order) rounded once to bf16."""
        impl = self.impl
        with impl.scope:
            result = impl.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                                  allocate_on_comm_stream, zero_copy)
            impl.note_arrays(x)
            return result

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Collective: zero both low-latency signal areas between two NVSHMEM barriers (needed after the
        shapes change; synchronous). With ``enable_shrink``: collective over the ranks unmasked here only (a rank
        that does not come within the timeout is masked), and it restarts the buffers' alternation and epochs, so
        that a rank unmasked again takes part in the next call.

        Args:
            num_max_dispatch_tokens_per_rank: M of the calls that follow (as in :meth:`low_latency_dispatch`).
            hidden: H of the calls that follow.
            num_experts: E of the calls that follow."""
        impl = self.impl
        with impl.scope:
            return impl.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False):
        """Send every (token, top-k slot) to its expert's rank, into fixed per-expert slots (collective; on the GPU
        no host sync, CUDA-graph capturable).

        Args:
            x: bf16 ``[T, H]`` contiguous, ``H % 128 == 0`` (``H % 512 == 0`` with ``use_fp8``, as DeepEP),
                ``T <= num_max_dispatch_tokens_per_rank``.
            topk_idx: ``[T, K]`` int32/int64, ``K <= 32`` (``reference.LOW_LATENCY_MAX_TOPK``; DeepEP's
                kernels take fewer), -1 = no expert.
            num_max_dispatch_tokens_per_rank: M, the same on every rank; ``R * M % 4 == 0`` (DeepEP: TMA).
            num_experts: E, a multiple of R; rank r owns experts ``[r*L, (r+1)*L)``, L = E/R.
            cumulative_local_expert_recv_stats: ``[L] int32`` or None; ``+= recv_count`` in place.
            dispatch_wait_recv_cost_stats: ``[R] int64`` or None; ``+=`` in place, per source rank, the SM clock
                cycles (clock64, DeepEP's unit) the receive phase waited for that rank's count of each local
                expert, on the GPU. The host backend has no device waits: checked, left unchanged.
            use_fp8, round_scale, use_ue8m0: the FP8 cast of :func:`reference.per_token_cast_to_fp8`
                (``use_ue8m0`` needs ``round_scale``; both are ignored without ``use_fp8``).
            async_finish: return an event to wait on instead of ordering the caller's stream after the call (the
                host backend's calls are synchronous: checked only); not together with ``return_recv_hook``.
            return_recv_hook: return a callable ``hook``; DeepEP's outputs are final only after ``hook()``. On the
                GPU this call launches the send phase and the hook the receive phase; the host backend does all
                the work in this call and its hook does nothing. Call it once and before the next low-latency
                call (RuntimeError otherwise).

        Returns:
            ``(recv_x | (recv_x, recv_x_scales), recv_count, handle, EventOverlap, hook)``: ``recv_x``
            ``[L, R*M, H]`` bf16 (or float8_e4m3fn with ``use_fp8``); ``recv_x_scales`` ``[L, R*M, H/128]``
            float32 or (UE8M0) ``[L, R*M, H/512]`` int32, column-major in the last two dims (a transposed
            view of a ``[L, S, R*M]`` array, as DeepEP); ``recv_count [L] int32``; ``handle``: a
            :class:`~cupy_ep.handles.LowLatencyHandle`, DeepEP's ``(src_info [L, R*M] int32, layout_range
            [L, R] int64, M, H, E)`` with ``.topk_slots [T, K] int32``; ``hook`` None unless
            ``return_recv_hook``. Rows of local expert e: by source rank, then token, then k (see
            :func:`reference.low_latency_dispatch`); rows past ``recv_count[e]`` are undefined (zero on
            the host backend)."""
        impl = self.impl
        with impl.scope:
            result = impl.low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                               cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                                               use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook)
            impl.note_arrays(x)
            return result

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False, return_recv_hook: bool = False,
                            out=None, combine_wait_recv_cost_stats=None, *, bf16_partials: bool = False):
        """Send the expert outputs back to the token owners and reduce them *with* the weights (collective).

        Args:
            x: bf16 ``[L, R*M, H]`` contiguous, laid out as this rank's dispatch output. Ignored with
                ``zero_copy`` (may be None then; checked when given).
            topk_idx, topk_weights: ``[T, K]`` int32/int64 and float32: the routing this rank gave to the
                dispatch that made ``handle`` (``T <= M``), and the weights.
            handle: the dispatch's :class:`~cupy_ep.handles.LowLatencyHandle` (``(src_info, layout_range, M,
                H, E)`` and ``.topk_slots``; not modified). ``topk_idx`` must have its ``topk_slots``' shape. A
                plain 5-tuple of its items works too: the slots are then computed again from ``topk_idx`` (a sort
                on its device; refused with ``enable_shrink``).
            use_logfmt: this rank's tokens' partial sums cross as LogFMT-10 (:mod:`cupy_ep.logfmt`: 10 bits per
                value and 8 bytes per 128, under half the 24-bit bytes; a relative error of at most
                ``2^(step/2) - 1`` per partial value, 2.2 % at worst). Each rank chooses for its own tokens; not
                together with ``zero_copy`` (as in DeepEP) or ``bf16_partials``.
            zero_copy: take the expert outputs from :meth:`get_next_low_latency_combine_buffer` instead of x.
            async_finish, return_recv_hook: as in :meth:`low_latency_dispatch`.
            out: optional bf16 ``[T, H]`` written in place and returned.
            combine_wait_recv_cost_stats: ``[R] int64`` or None; ``+=`` in place, per source rank, the SM clock
                cycles the receive phase waited for that rank's partial sums of this rank's tokens, on the GPU
                (this rank's own partials need no wait in a one-launch combine: its entry grows only in hook
                mode). The host backend: checked, left unchanged.
            bf16_partials: (keyword-only) round each expert rank's partial sum of this rank's tokens to bf16
                instead of 24 bits (on the GPU a third fewer bytes cross NVLink, at the price of a second bf16
                rounding). Each rank
                chooses for its own tokens; the ranks need not agree.

        Returns:
            ``(combined_x [T, H] bf16, EventOverlap, hook)``: per token, fp32 ``sum_k w[t, k] * y`` (-1
            skipped): per expert rank over k ascending, rounded to 24 bits (or bf16), then over the ranks
            ascending, rounded to bf16 once (:func:`reference.low_latency_combine`)."""
        impl = self.impl
        with impl.scope:
            result = impl.low_latency_combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                              return_recv_hook, out, combine_wait_recv_cost_stats, bf16_partials)
            impl.note_arrays(topk_idx)
            return result

    def get_next_low_latency_combine_buffer(self, handle):
        """The bf16 ``[L, R*M, H]`` array a ``zero_copy`` combine with this handle's shape reads (local).

        Owned by the buffer (on the GPU a view of the send region of the buffer the next call uses, as DeepEP's;
        the host backend keeps one array, re-made, zeroed, when the shape changes). Fill it, then call
        :meth:`low_latency_combine` with ``zero_copy=True``."""
        impl = self.impl
        with impl.scope:
            return impl.get_next_low_latency_combine_buffer(handle)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (``mask=True``) or unmask a rank in this rank's view, from the next low-latency call on (on the
        current stream, after the previous low-latency call; a CUDA-graph replay on another stream must be ordered
        after it by the caller; not collective). A masked rank is neither sent to nor waited for: its
        experts' top-k entries count as not selected, it contributes no tokens, its combine partials are absent.
        A low-latency wait that times out masks its peer by itself. Unmasking a rank that missed calls or was
        masked while alive needs :meth:`clean_low_latency_buffer` on every rank taking part before the next call.

        Args:
            rank_to_mask: int in ``[0, num_ranks)``.
            mask: bool; True masks, False unmasks."""
        impl = self.impl
        with impl.scope:
            return impl.low_latency_update_mask_buffer(rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status) -> None:
        """Fill ``mask_status`` with this rank's mask (1 = masked, 0 = not), on the caller's current stream after
        the previous low-latency calls (not collective).

        Args:
            mask_status: ``[num_ranks]`` int32, contiguous, a CuPy array or CUDA torch tensor on this buffer's GPU."""
        impl = self.impl
        with impl.scope:
            return impl.low_latency_query_mask_buffer(mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank in this rank's view (as :meth:`low_latency_update_mask_buffer` with ``mask=False``
        for each; not collective)."""
        impl = self.impl
        with impl.scope:
            return impl.low_latency_clean_mask_buffer()

    def barrier(self) -> None:
        """Device-side barrier of all ranks on the communication stream (tests and benchmarks)."""
        impl = self.impl
        with impl.scope:
            return impl.barrier()

    def check_health(self) -> None:
        """Raise ``CommTimeoutError`` if a device wait of this buffer timed out, or ``CallMismatchError`` if the
        ranks disagreed about a call (the buffer is then unusable)."""
        return self.impl.check_health()

    def get_comm_stream(self):
        """The stream the communication kernels run on (``async_finish`` calls, hooks), in the caller's framework:
        a ``torch.cuda.ExternalStream`` when this buffer's most recent call with arrays took torch tensors (or,
        before any, when it was made over a ``torch.distributed`` group), the ``cupy.cuda.Stream`` when it took
        CuPy arrays; before any call otherwise as :meth:`capture` chooses. ``buf.comm_stream`` is always the CuPy
        one. None on the host backend, which runs every call synchronously on the host."""
        return self.impl.get_comm_stream()

    def get_local_buffer_tensor(self, dtype, size=None, offset: int = 0, use_rdma_buffer: bool = False):
        """A view of this rank's own communication buffer, as DeepEP's: the ``num_nvl_bytes`` NVLink buffer, or
        with ``use_rdma_buffer`` the ``num_rdma_bytes`` one (low-latency or internode). For tests and custom
        kernels: the next call may overwrite it, and writing it while a call runs corrupts that call.

        Args:
            dtype: numpy / CuPy dtype, or a torch dtype (then a torch tensor comes back).
            size: element count or shape; default: every whole element from ``offset`` to the buffer's end.
            offset: bytes from the start of the buffer (a multiple of the dtype's size).

        Returns:
            ``[size]`` (or ``size``-shaped) array of ``dtype`` on the buffer's GPU (CUDA backend), or over host memory
            that lives as long as the Buffer (host backend, which has no device buffer; zeroed at first use)."""
        return self.impl.get_local_buffer_tensor(dtype, size, offset, use_rdma_buffer)

    def destroy(self) -> None:
        """Release everything (collective: every rank must call it)."""
        return self.impl.destroy()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.destroy()
        return False
