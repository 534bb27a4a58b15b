"""``HostBackend``: the DeepEP V1 ``Buffer`` API on numpy + MPI, for machines without a GPU.

Every call is synchronous (the returned ``EventOverlap`` carries no event) and computes exactly what
:mod:`cupy_ep.reference` says, moving rows with ``MPI_Alltoallv`` on host memory (bf16 and fp8 travel as
raw bytes). Arguments go through the same :mod:`cupy_ep.validate` checks as the CUDA path, so errors read
the same.

Collective calls first agree on the argument checks with one exchange of headers
(:class:`cupy_ep.host.host_exchange.HostExchange`, over a private duplicate of ``comm``): if any rank's checks fail, or
the ranks disagree on what must match (hidden size, dtypes, top-k, channels, cached mode, the dispatch a handle
came from), every rank raises (a failing rank its own error, the others the same message tagged with that rank),
so a bad argument on one rank never leaves the others waiting in a collective. A rank making another call (a call
ahead) makes the others raise ``CallMismatchError``; a rank that does not come within ``timeout_s`` makes them
raise ``CommTimeoutError`` (the Buffer is then unusable). ``barrier`` is such a call, and the constructor's exchanges
are timed alike (a rank that never constructs its Buffer makes the others' constructors raise
``CommTimeoutError``). In non-cached dispatch the same exchange carries the counts DeepEP's ``notify_dispatch``
exchanges (tokens per rank, per expert, per channel).

The host refuses what the CUDA backend refuses (the checks of :mod:`cupy_ep.validate`, shared): a call whose
rings or zero-copy rows do not fit ``num_nvl_bytes`` (so ``num_nvl_bytes=0`` allows no normal-mode call), a
config below the kernels' limits, a low-latency shape that does not fit ``num_rdma_bytes``, the GPU's rank and
expert limits. ``num_nvl_bytes`` / ``num_rdma_bytes`` are not allocated here (only
``get_local_buffer_tensor`` makes host memory of that size).

Decisions where DeepEP is silent or GPU-specific:

* the handle's ``rank_prefix_matrix`` is the full ``[R, R]`` matrix (every column valid);
* ``num_worst_tokens > 0`` needs ``topk_idx``/``topk_weights`` (as in DeepEP); the padding rows hold
  zeros in ``recv_x``/scales/weights and -1 in ``recv_topk_idx`` and in the handle's ``recv_src_idx``;
  a later cached dispatch or combine with that handle also has ``num_worst_tokens`` rows (the real ones
  first, counted by ``rank_prefix_matrix``); a cached dispatch ignores ``num_worst_tokens`` (as DeepEP:
  the handle fixes the row count);
* ``num_tokens_per_rdma_rank`` is ignored (intranode only); ``previous_event`` and ``allocate_on_comm_stream``
  are only checked; with ``async_finish`` the event is a complete ``HostEvent`` (so ``current_stream_wait`` works);
* with ``check_values`` the layout arguments are checked against each other (and against ``topk_idx``).

Low-latency mode (``low_latency_mode=True``): ``low_latency_dispatch`` /
``low_latency_combine`` compute :func:`reference.low_latency_dispatch` / :func:`reference.low_latency_combine`
bit for bit. Dispatch sends one message per (token, top-k slot) like DeepEP (an 8-byte header with the
source token and expert, the bf16 or e4m3 row, the scales) in one ``MPI_Alltoallv``; combine sends each
expert row back to its token owner, which reduces with the weights. Decisions:

* rows of a local expert are ordered by (source rank, token, k), deterministic (DeepEP's order depends
  on arrival and on atomics; consumers must go through ``src_info`` / ``layout_range`` anyway); rows past
  ``recv_count`` are zero; ``layout_range``'s begin of a source with no rows is the rows of the sources
  before it;
* DeepEP's host asserts are kept: H % 128 (H % 512 with FP8), ``T <= M``, ``R*M % 4 == 0``, K <= 11,
  ``use_ue8m0`` needs ``round_scale``, not ``async_finish`` with ``return_recv_hook``, and the stats
  shapes (``[L] int32``, wait-cost ``[R] int64``, as DeepEP's C++ asserts); so is the GPU backend's
  ``num_rdma_bytes`` >= the (M, H, E) layout; ``topk_idx`` may also be int32;
* ``return_recv_hook=True`` returns a hook that does nothing (the data arrived during the call), under the GPU
  backend's rule (``event.RecvHooks``: it runs once, before the next low-latency call);
  ``async_finish`` and the wait-cost stats are only checked (stats are left unchanged);
* combine checks, before any transfer and identically on every rank, that each token owner's
  ``topk_idx`` selects as many rows of each expert as the owner's ``layout_range`` holds; the row of
  slot (t, k) is then found by order, so a top-k row that names one expert twice uses two rows (DeepEP
  keys its combine slots by (expert, token), so there the later arrival wins);
* ``get_next_low_latency_combine_buffer`` hands out one array owned by the buffer (re-made when the shape
  changes) instead of DeepEP's two alternating RDMA buffers;
* shrink mode (``enable_shrink=True``, low-latency only), as the GPU backend's: this rank's mask (``[R]``, 1 =
  masked) leaves masked ranks out of every low-latency call (their experts' top-k entries count as not selected,
  they send no tokens, nothing is awaited from them), and a rank that does not enter a low-latency call within the
  timeout is masked instead of failing the call. The result is then :func:`reference.mask_ranks` applied to every
  rank's ``topk_idx``, with no tokens from masked ranks. A rank masked after missing calls is out of step with the
  others (its next call would raise ``CallMismatchError``): on the host it does not come back into this Buffer.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import warnings

import numpy as np

from .. import handles, interop, reference, validate
from ..backend_base import BackendBase
from ..config import Config
from ..errors import CallMismatchError
from ..event import HOST_EVENT, EventOverlap, RecvHooks, host_event
from ..handles import DispatchHandle, LowLatencyHandle
from .host_exchange import HostExchange, PeersTimedOut

_HANDLE_FIELDS = (("rank_prefix_matrix", "int32", 2), ("channel_prefix_matrix", "int32", 2),
                  ("recv_channel_prefix_matrix", "int32", 2), ("recv_src_idx", "int32", 1),
                  ("is_token_in_rank", "bool", 2), ("send_head", "int32", 2))


def _warn_host_backend(rank: int) -> None:
    if rank == 0:
        warnings.warn("cupy_ep: no GPU visible, using the host (numpy + MPI) backend", stacklevel=4)
        print("cupy_ep: no GPU visible -> host backend (numpy + MPI alltoallv)", file=sys.stderr)


def _displs(counts) -> list[int]:
    return [int(v) for v in np.cumsum(counts) - counts]


def _pad_rows(a: np.ndarray, rows: int, fill) -> np.ndarray:
    """``a`` with rows appended (filled with ``fill``) up to ``rows`` rows."""
    if a.shape[0] == rows:
        return a
    out = np.full((rows,) + a.shape[1:], fill, dtype=a.dtype)
    out[:a.shape[0]] = a
    return out


@dataclasses.dataclass
class _DispatchArgs:
    """Checked dispatch arguments, as raw numpy arrays (see ``interop.unwrap``)."""
    kind: interop.Kind
    x_name: str                     # logical dtype of the data array (bfloat16, float8_e4m3fn or uint8)
    x: np.ndarray                   # [T, H] raw
    scales: np.ndarray | None       # [T, S] float32, contiguous (FP8 only)
    topk_idx: np.ndarray | None     # [T, K] int32/int64
    topk_name: str | None
    topk_weights: np.ndarray | None  # [T, K] float32
    is_token_in_rank: np.ndarray    # [T, R] bool
    config: Config
    handle: tuple | None = None     # raw handle (cached mode)
    user_is_token_in_rank: object = None


@dataclasses.dataclass
class _LowLatencyArgs:
    """Checked low-latency dispatch/combine arguments (raw numpy arrays)."""
    kind: interop.Kind
    x: np.ndarray | None            # dispatch: [T, H] raw bf16 (uint16)
    topk_idx: np.ndarray            # [T, K] int64
    hidden: int
    max_tokens: int                 # M
    num_experts: int
    num_local: int                  # L = E / R
    use_fp8: bool = False
    round_scale: bool = False
    use_ue8m0: bool = False
    return_recv_hook: bool = False
    stats: np.ndarray | None = None          # dispatch: cumulative_local_expert_recv_stats [L] int32 (in place)
    use_logfmt: bool = False
    bf16_partials: bool = False              # combine: this rank's partials cross as bf16
    y: np.ndarray | None = None              # combine: [L, R*M, H] raw bf16 expert outputs
    weights: np.ndarray | None = None        # combine: [T, K] float32
    layout_range: np.ndarray | None = None   # combine: [L, R] int64
    routing: str | None = None               # dispatch: handles.routing_digest of topk_idx (check_values)


_last_two_transposed = validate.last_two_transposed


def _handle_origin(handle) -> str:
    """What must agree across ranks about a handle: the dispatch call it came from (when it says)."""
    epoch = getattr(handle, "epoch", None)
    return "given" if epoch is None else f"the handle of dispatch call #{epoch}"


def _ready() -> None:
    """The receive phase of the host backend: the data already arrived during the call, nothing to do."""


class HostBackend(BackendBase):
    """numpy + mpi4py implementation of :class:`cupy_ep.Buffer` (see the module docstring).

    Arguments as for :class:`cupy_ep.Buffer`; ``num_nvl_bytes``/``num_rdma_bytes`` bound the calls as on the GPU
    (nothing of that size is allocated), ``timeout_s`` bounds every wait for another rank, ``device`` is checked
    and stored but not used, ``enable_shrink`` turns on shrink mode (the module docstring). Inputs are numpy
    arrays (bf16 as ``ml_dtypes.bfloat16``, fp8 as ``ml_dtypes.float8_e4m3fn`` or ``uint8``) or CPU torch tensors.
    """

    backend = "host"

    def __init__(self, comm=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, *,
                 backend: str | None = None, device: int | None = None, timeout_s: float | None = None,
                 num_ranks_per_node: int | None = None, check_values: bool = True,
                 internode_transport: str | None = None, low_latency_transport: str | None = None):
        if internode_transport not in (None, "nvshmem", "ipc"):  # accepted for the CUDA backend's sake
            raise ValueError(f"internode_transport: must be 'nvshmem', 'ipc' or None, got {internode_transport!r}")
        if low_latency_transport not in (None, "nvshmem", "ipc"):  # likewise
            raise ValueError("low_latency_transport: must be 'nvshmem', 'ipc' or None, got "
                             f"{low_latency_transport!r}")
        super().__init__(comm, num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank,
                         allow_nvlink_for_low_latency_mode, allow_mnnvl, explicitly_destroy, enable_shrink,
                         backend=backend, device=device, timeout_s=timeout_s,
                         num_ranks_per_node=num_ranks_per_node, check_values=check_values)
        self._host_regions: dict = {}  # get_local_buffer_tensor's stand-in buffers, made at first use
        if num_ranks_per_node is not None and (not isinstance(num_ranks_per_node, int)
                                               or num_ranks_per_node <= 0
                                               or self.num_ranks % num_ranks_per_node):
            raise ValueError(f"num_ranks_per_node: must be a positive divisor of the rank count "
                             f"{self.num_ranks}, got {num_ranks_per_node!r}")
        self.num_ranks_per_node = num_ranks_per_node
        # what the CUDA backend refuses at construction (every rank alike, before anything collective)
        if num_ranks_per_node in (None, self.num_ranks):
            validate.check_intranode_ranks(self.num_ranks)
            if num_rdma_bytes and not low_latency_mode:
                raise ValueError("num_rdma_bytes: must be 0 inside one NVLink domain (unless low_latency_mode)")
        if low_latency_mode:
            validate.check_num_rdma_bytes(num_rdma_bytes)
            validate.check_low_latency_ranks(self.num_ranks)
        self.enable_shrink = validate.check_flag(enable_shrink, "enable_shrink")
        # shrink mode: this rank's view of the failed ranks, [R] int32, 1 = masked (low-latency calls only)
        self._shrink_mask = np.zeros(self.num_ranks, dtype=np.int32) if low_latency_mode and enable_shrink else None
        # Collective and timed (a rank that does not construct its Buffer within the timeout makes the others raise
        # CommTimeoutError): the private duplicate, then one exchange that carries rank 0's random id, as
        # handles.new_buffer_id would with a blocking bcast.
        self._exchange = HostExchange(self.comm, self.timeout_s)
        self.buffer_id = int(self._exchange.open(int.from_bytes(os.urandom(8), "little") >> 1)[0])
        self._ll_combine_buffer: np.ndarray | None = None   # raw bf16 [L, R*M, H] (zero-copy combine)
        self._ll_hooks = RecvHooks()  # the GPU backend's rule: a hook runs once, before the next low-latency call
        if backend is None:
            _warn_host_backend(self.rank)

    @staticmethod
    def capture() -> EventOverlap:
        """An ``EventOverlap`` holding a complete :class:`~cupy_ep.event.HostEvent` (every call is synchronous)."""
        return EventOverlap(HOST_EVENT)

    # ---- layout -------------------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx, num_experts: int, previous_event=None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        """Counts of this rank's routing (local, no communication).

        Args:
            topk_idx: ``[T, K]`` int32/int64, -1 = no expert.
            num_experts: E, a multiple of the rank count R.

        Returns:
            ``(num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank [nodes] int32 or None,
            num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool, EventOverlap)``.
        """
        self.check_usable()
        validate.check_num_experts(num_experts, self.num_ranks)
        validate.check_topk_idx(topk_idx, num_experts, check_values=self.check_values)
        validate.check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        kind = interop.kind_of(topk_idx)
        outs = reference.get_dispatch_layout(interop.unwrap(topk_idx), num_experts, self.num_ranks,
                                             self.num_ranks_per_node)
        names = ("int32", "int32", "int32", "bool")
        return tuple(interop.wrap(a, kind, n) for a, n in zip(outs, names)) + (host_event(async_finish),)

    # ---- dispatch -----------------------------------------------------------------------------------
    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Config | None = None,
                 previous_event=None, async_finish: bool = False, allocate_on_comm_stream: bool = False,
                 zero_copy: bool = False):
        """Send every token to the ranks that own its experts (collective).

        Args:
            x: bf16 ``[T, H]``, or the FP8 pair ``(x_e4m3 [T, H], scales [T, ceil(H/128)] float32)``.
            handle: a previous dispatch's handle: cached mode (same routing; ``topk_*`` must be None).
            num_tokens_per_rank ``[R] int32``, is_token_in_rank ``[T, R] bool``,
            num_tokens_per_expert ``[E] int32``: from :meth:`get_dispatch_layout` (non-cached mode).
            topk_idx ``[T, K]`` int32/int64 and topk_weights ``[T, K] float32``: both or neither.
            expert_alignment: the per-expert receive counts are rounded up to it.
            num_worst_tokens: when > 0, outputs have this many rows and the count list is empty.
            zero_copy: on the GPU, recv_x is a view of the buffer (see ``CudaBackend.dispatch``); here the
                values are the same and recv_x is a fresh array either way.

        Returns:
            ``(recv_x [N, H] | (recv_x, recv_x_scales [N, S] float32), recv_topk_idx [N, K] (dtype of
            topk_idx) or None, recv_topk_weights [N, K] float32 or None, num_recv_tokens_per_expert_list
            (list of int), handle, EventOverlap)``; rows ordered by (source rank, source token). Cached
            mode returns ``(recv_x[, scales], None, None, None, None, EventOverlap)``. The handle is
            ``(rank_prefix_matrix [R, R], channel_prefix_matrix [R, C], recv_channel_prefix_matrix [R, C],
            recv_src_idx [N], is_token_in_rank [T, R] bool, send_head [T, R])``, all int32 but the bool.
        """
        self.check_usable()
        args, notes = self._agree("dispatch", lambda: self._check_dispatch(
            x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
            expert_alignment, num_worst_tokens, config, previous_event, async_finish, allocate_on_comm_stream,
            zero_copy))
        me, num_ranks = self.rank, self.num_ranks
        counts_list = []
        if args.handle is not None:
            rank_prefix = args.handle[0]
            num_rows = args.handle[3].shape[0]
        else:
            # What notify_dispatch computes: the prefix matrices and this rank's per-expert counts.
            sent = np.stack([n["sent"] for n in notes])                      # [src, dst]
            for r, n in enumerate(notes):
                if 0 < n["num_worst_tokens"] < sent[:, r].sum():
                    raise ValueError(f"num_worst_tokens: {n['num_worst_tokens']} is less than the "
                                     f"{sent[:, r].sum()} tokens rank {r} receives")
            rank_prefix = reference.rank_prefix_matrix(list(sent))
            num_rows = num_worst_tokens or int(sent[:, me].sum())
            epr = notes[0]["per_expert"].size // num_ranks
            if num_worst_tokens == 0:
                per_expert = sum(n["per_expert"][me * epr:(me + 1) * epr] for n in notes)
                counts_list = [reference.align_up(int(c), expert_alignment) for c in per_expert]

        # Rows for rank r are my tokens with is_token_in_rank[:, r], in token order.
        itr = args.is_token_in_rank
        send_rows = [np.nonzero(itr[:, r])[0] for r in range(num_ranks)]
        order = np.concatenate(send_rows)
        send_counts = [rows.size for rows in send_rows]
        recv_counts = np.diff(rank_prefix[:, me].astype(np.int64), prepend=0)

        def exchange(a, fill):
            return _pad_rows(self._alltoallv_rows(a[order], send_counts, recv_counts), num_rows, fill)

        def wrap(a, name):
            return interop.wrap(a, args.kind, name)

        recv_x = wrap(exchange(args.x, 0), args.x_name)
        if args.scales is not None:
            recv_x = (recv_x, wrap(exchange(args.scales, 0), "float32"))
        if args.handle is not None:
            return recv_x, None, None, None, None, host_event(async_finish)

        recv_topk_idx = recv_topk_weights = None
        if args.topk_idx is not None:
            got_idx, got_w = reference.local_remap_topk(exchange(args.topk_idx, -1),
                                                        exchange(args.topk_weights, 0), me, epr)
            recv_topk_idx, recv_topk_weights = wrap(got_idx, args.topk_name), wrap(got_w, "float32")
        recv_src_idx = exchange(np.arange(itr.shape[0], dtype=np.int32), -1)
        channels = args.config.intranode_dispatch_channels(self.num_ranks)
        new_handle = DispatchHandle((
            wrap(rank_prefix, "int32"),
            wrap(reference.local_channel_prefix_matrix(itr, channels), "int32"),
            wrap(reference.recv_channel_prefix_matrix([n["channel_counts"][me] for n in notes]), "int32"),
            wrap(recv_src_idx, "int32"),
            args.user_is_token_in_rank,
            wrap(reference.local_send_head(itr), "int32"),
        ), self.buffer_id, self._exchange.seq)
        return recv_x, recv_topk_idx, recv_topk_weights, counts_list, new_handle, host_event(async_finish)

    def _check_dispatch(self, x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                        topk_idx, topk_weights, expert_alignment, num_worst_tokens, config, previous_event,
                        async_finish, allocate_on_comm_stream, zero_copy):
        """All of dispatch's argument checks (no communication): returns ``(_DispatchArgs, same, notify)``
        (see :meth:`_agree`); ``notify`` holds this rank's counts for the others (None in cached mode). The
        checks and their order are the CUDA backend's (validate.py)."""
        info = validate.check_x(x)
        num_tokens, num_ranks = info.num_tokens, self.num_ranks
        # FP8 rows are sized as BF16 for the config lookup (DeepEP's hidden_bytes convention), as the GPU path
        config = self._resolve_config(config, "dispatch", max(info.hidden_bytes, 2 * info.hidden))
        validate.check_expert_alignment(expert_alignment)
        validate.check_num_worst_tokens(num_worst_tokens, num_ranks, num_tokens)
        validate.check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        zero_copy = validate.check_flag(zero_copy, "zero_copy")
        channels = config.intranode_dispatch_channels(num_ranks)
        args = _DispatchArgs(
            kind=interop.kind_of(info.x), x_name=interop.dtype_name(info.x), x=interop.unwrap(info.x),
            scales=None if info.scales is None else np.ascontiguousarray(interop.unwrap(info.scales)),
            topk_idx=None, topk_name=None, topk_weights=None, is_token_in_rank=None, config=config)
        scales = "" if info.scales is None else f" + scales [*, {info.num_scales}]"
        same = {"handle": None, "x": f"{args.x_name} [*, {info.hidden}]{scales}",
                "config": f"{channels} channels", "topk_idx": None}

        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("topk_idx, topk_weights: must be None in cached mode (a handle was given)")
            args.handle = self._check_handle(handle, config, num_tokens, channels)
            same["handle"] = _handle_origin(handle)
            validate.check_intranode_dispatch_fits(config, num_ranks, self.num_nvl_bytes, info.hidden_bytes, 1,
                                                   info.num_scales, zero_copy, 0, args.handle[3].shape[0])
            args.is_token_in_rank = args.handle[4]
            return args, same, None

        num_experts, num_topk, _ = validate.check_dispatch_layout_args(
            num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights, num_worst_tokens,
            num_ranks, num_tokens, None, self.check_values)
        validate.check_intranode_dispatch_fits(config, num_ranks, self.num_nvl_bytes, info.hidden_bytes, num_topk,
                                               info.num_scales, zero_copy, num_worst_tokens)
        same["num_tokens_per_expert"] = f"{num_experts} experts"
        if topk_idx is not None:
            args.topk_idx, args.topk_name = interop.unwrap(topk_idx), interop.dtype_name(topk_idx)
            args.topk_weights = interop.unwrap(topk_weights)
            same["topk_idx"] = f"{args.topk_name} [*, {topk_idx.shape[1]}]"
        args.is_token_in_rank = interop.unwrap(is_token_in_rank)
        args.user_is_token_in_rank = is_token_in_rank
        per_rank, per_expert = interop.unwrap(num_tokens_per_rank), interop.unwrap(num_tokens_per_expert)
        sent = args.is_token_in_rank.sum(axis=0)
        if self.check_values:
            if not np.array_equal(per_rank, sent):
                raise ValueError(f"num_tokens_per_rank: {per_rank.tolist()} does not match is_token_in_rank "
                                 f"(column sums {sent.tolist()})")
            if args.topk_idx is not None:
                _, _, want_per_expert, want_itr = reference.get_dispatch_layout(args.topk_idx, num_experts,
                                                                                num_ranks)
                if not np.array_equal(args.is_token_in_rank, want_itr):
                    raise ValueError("is_token_in_rank: does not match topk_idx")
                if not np.array_equal(per_expert, want_per_expert):
                    raise ValueError("num_tokens_per_expert: does not match topk_idx")
        notify = {"sent": sent.astype(np.int64), "per_expert": per_expert.astype(np.int64),
                  "channel_counts": reference.local_channel_counts(args.is_token_in_rank, channels),
                  "num_worst_tokens": num_worst_tokens}
        return args, same, notify

    # ---- combine ------------------------------------------------------------------------------------
    def combine(self, x, handle, topk_weights=None, bias=None, config: Config | None = None,
                previous_event=None, async_finish: bool = False, allocate_on_comm_stream: bool = False,
                zero_copy: bool = False):
        """Send the expert outputs back to the token owners and sum them (collective).

        Args:
            x: bf16 ``[N, H]``, one row per row of the dispatch output (N = the handle's recv_src_idx).
            handle: the handle dispatch returned (not modified).
            topk_weights: ``[N, K] float32`` or None; summed the same way.
            bias: None, a bf16 ``[T, H]`` array, or a pair of them (either may be None).
            zero_copy: on the GPU, rows go straight into the owners' buffers (see ``CudaBackend.combine``); the
                result is the same, bit for bit, and here nothing changes.

        Returns:
            ``(combined_x [T, H] bf16, combined_topk_weights [T, K] float32 or None, EventOverlap)``:
            fp32 ``0 + bias0 + bias1 + contributions in ascending source-rank order``, rounded to bf16 once.
        """
        self.check_usable()
        (kind, x_raw, w_raw, biases, raw_handle), _ = self._agree("combine", lambda: self._check_combine(
            x, handle, topk_weights, bias, config, previous_event, async_finish, allocate_on_comm_stream, zero_copy))
        rank_prefix, itr = raw_handle[0], raw_handle[4]
        num_real = int(rank_prefix[-1, self.rank])
        send_counts = np.diff(rank_prefix[:, self.rank].astype(np.int64), prepend=0)
        recv_counts = itr.sum(axis=0)
        token_rows = [np.nonzero(itr[:, r])[0] for r in range(self.num_ranks)]
        starts = _displs(recv_counts)

        def reduce(values, dtype, acc):
            got = self._alltoallv_rows(values[:num_real], send_counts, recv_counts).view(dtype)
            for r, rows in enumerate(token_rows):  # ascending source rank, as the reference
                acc[rows] += got[starts[r]:starts[r] + rows.size].astype(np.float32)
            return acc

        num_tokens, hidden = itr.shape[0], x_raw.shape[1]
        acc = np.zeros((num_tokens, hidden), dtype=np.float32)
        for b in biases:
            if b is not None:
                acc += b.astype(np.float32)
        combined = reduce(x_raw, interop.BF16, acc).astype(interop.BF16).view(np.uint16)
        combined_w = None
        if w_raw is not None:
            combined_w = reduce(w_raw, np.float32, np.zeros((num_tokens, w_raw.shape[1]), dtype=np.float32))
        return (interop.wrap(combined, kind, "bfloat16"), interop.wrap(combined_w, kind, "float32"),
                host_event(async_finish))

    def _check_combine(self, x, handle, topk_weights, bias, config, previous_event, async_finish,
                       allocate_on_comm_stream, zero_copy):
        """All of combine's argument checks: ``((kind, x raw, weights raw, [bias0, bias1] bf16, raw handle),
        same, None)`` (see :meth:`_agree`)."""
        if isinstance(x, (tuple, list)) and validate.is_array_pair(x):
            raise TypeError("x: combine takes one bf16 [N, H] array, not an FP8 pair")
        num_recv_x, hidden = validate.check_combine_x(x, None)
        zero_copy = validate.check_flag(zero_copy, "zero_copy")
        # a combine cuts the tokens into its own channels (send_head does not depend on the dispatch's)
        config = self._resolve_config(config, "combine", hidden * 2)
        validate.check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        raw_handle = self._check_handle(handle, config, None)
        num_recv, num_tokens = raw_handle[3].shape[0], raw_handle[4].shape[0]
        if num_recv_x != num_recv:
            raise ValueError(f"x: must have {num_recv} rows (one per row of the dispatch output, as the "
                             f"handle's recv_src_idx), got {num_recv_x}")
        num_topk = validate.check_combine_topk_weights(topk_weights, num_recv, None)
        w_raw = None if topk_weights is None else interop.unwrap(topk_weights)
        biases = validate.check_bias(bias, num_tokens, hidden)
        biases = [None if b is None else interop.unwrap(b).view(interop.BF16) for b in biases]
        validate.check_intranode_combine_fits(config, self.num_ranks, self.num_nvl_bytes, hidden, num_topk or 1,
                                              num_tokens, zero_copy)
        same = {"handle": _handle_origin(handle), "x": f"bfloat16 [*, {hidden}]",
                "config": f"{config.num_channels} channels",
                "topk_weights": None if w_raw is None else f"float32 [*, {w_raw.shape[1]}]"}
        return (interop.kind_of(x), interop.unwrap(x), w_raw, biases, raw_handle), same, None

    # ---- low-latency mode ---------------------------------------------------------------------------
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Collective (DeepEP: a barrier, zero both signal areas, a barrier). The host keeps no signals, so
        this only checks the arguments (the same on every rank) with one all-gather."""
        self.check_usable()

        def check():
            self._require_low_latency_mode()
            shape = validate.check_low_latency_shape(num_max_dispatch_tokens_per_rank, hidden, num_experts,
                                                     self.num_ranks)
            validate.check_low_latency_rdma_bytes(self.num_rdma_bytes, *shape[:2], self.num_ranks, shape[2])
            self._ll_hooks.check_next_call("clean_low_latency_buffer")
            same = {"num_max_dispatch_tokens_per_rank": num_max_dispatch_tokens_per_rank, "hidden": hidden,
                    "num_experts": num_experts}
            return None, same, None

        self._agree("clean_low_latency_buffer", check, low_latency=True)

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False):
        """See :meth:`cupy_ep.Buffer.low_latency_dispatch`."""
        self.check_usable()
        args, notes = self._agree("low_latency_dispatch", lambda: self._check_low_latency_dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
            dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook),
            low_latency=True)
        me, num_ranks, num_local = self.rank, self.num_ranks, args.num_local
        routing = args.routing
        args.topk_idx = self._masked_topk(args.topk_idx, args.num_experts)
        rows_per_expert = num_ranks * args.max_tokens

        # Sender: cast each token once, then one message per (t, k) that selects an expert, grouped by
        # destination rank, (t, k) order inside: [int32 token, int32 expert][row bytes][scale bytes].
        if args.use_fp8:
            data, scales = reference.per_token_cast_to_fp8(args.x.view(interop.BF16), args.round_scale,
                                                           args.use_ue8m0)
        else:
            data, scales = args.x, None
        tokens, slots = np.nonzero(args.topk_idx >= 0)
        experts = args.topk_idx[tokens, slots].astype(np.int64)
        order = np.argsort(experts // num_local, kind="stable")
        tokens, experts = tokens[order], experts[order]
        header = np.stack([tokens, experts], axis=1).astype(np.int32)
        parts = [header.view(np.uint8), np.ascontiguousarray(data[tokens]).view(np.uint8)]
        if scales is not None:
            parts.append(np.ascontiguousarray(scales[tokens]).view(np.uint8))
        messages = np.concatenate(parts, axis=1)
        send_counts = np.bincount(experts // num_local, minlength=num_ranks)
        mine = slice(me * num_local, (me + 1) * num_local)
        counts = np.stack([n["per_expert"][mine] if n is not None else np.zeros(num_local, np.int64)
                           for n in notes], axis=1)                                  # [L, src]
        got = self._alltoallv_rows(messages, send_counts, counts.sum(axis=0), low_latency=True)

        # Receiver: rows of expert e from source s land at begin[e, s] + (their order inside s's block).
        recv_count = counts.sum(axis=1).astype(np.int32)
        begin = np.cumsum(counts, axis=1) - counts
        got_header = np.ascontiguousarray(got[:, :8]).view(np.int32)
        local = got_header[:, 1].astype(np.int64) - me * num_local
        order = np.argsort(local, kind="stable")      # blocks arrive by source rank, (t, k) inside
        local = local[order]
        expert_start = np.cumsum(recv_count.astype(np.int64)) - recv_count
        position = np.arange(local.size) - expert_start[local]
        row_bytes = data.shape[1] * data.dtype.itemsize
        payload = np.ascontiguousarray(got[order, 8:8 + row_bytes]).view(data.dtype)
        recv_x = np.zeros((num_local, rows_per_expert, data.shape[1]), dtype=data.dtype)
        recv_x[local, position] = payload
        src_info = np.zeros((num_local, rows_per_expert), dtype=np.int32)
        src_info[local, position] = got_header[order, 0]
        layout_range = reference.low_latency_pack_range(begin, counts)

        def wrap(a, name):
            return interop.wrap(a, args.kind, name)

        out_x = wrap(recv_x, "float8_e4m3fn" if args.use_fp8 else "bfloat16")
        if scales is not None:
            scale_name = "int32" if args.use_ue8m0 else "float32"
            base = np.zeros((num_local, scales.shape[1], rows_per_expert), dtype=scales.dtype)
            got_scales = np.ascontiguousarray(got[order, 8 + row_bytes:]).view(scales.dtype)
            base.transpose(0, 2, 1)[local, position] = got_scales
            out_x = (out_x, _last_two_transposed(wrap(base, scale_name), args.kind))
        if args.stats is not None:
            args.stats += recv_count
        slots = reference.low_latency_slots(args.topk_idx, args.max_tokens, args.num_experts)
        handle = LowLatencyHandle((wrap(src_info, "int32"), wrap(layout_range, "int64"), args.max_tokens,
                                   args.hidden, args.num_experts), wrap(slots, "int32"), self.buffer_id,
                                  self._exchange.seq, routing)
        hook = self._ll_hooks.make(_ready, "low_latency_dispatch") if args.return_recv_hook else None
        return out_x, wrap(recv_count, "int32"), handle, host_event(async_finish), hook

    def _check_low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                    cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
                                    round_scale, use_ue8m0, async_finish, return_recv_hook):
        """All of low_latency_dispatch's argument checks: ``(_LowLatencyArgs, same, {"per_expert": [E]})``
        (see :meth:`_agree`); ``per_expert`` counts this rank's top-k slots per global expert."""
        self._require_low_latency_mode()
        num_ranks = self.num_ranks
        max_tokens, num_tokens, hidden, flags, routing = validate.check_low_latency_dispatch_args(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
            dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook, num_ranks,
            self.check_values)
        use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook = flags
        validate.check_low_latency_rdma_bytes(self.num_rdma_bytes, max_tokens, hidden, num_ranks, num_experts)
        num_local = num_experts // num_ranks
        stats = None
        if cumulative_local_expert_recv_stats is not None:
            stats = interop.unwrap(cumulative_local_expert_recv_stats)
        self._ll_hooks.check_next_call("low_latency_dispatch")
        idx = interop.unwrap(topk_idx).astype(np.int64)
        args = _LowLatencyArgs(kind=interop.kind_of(x), x=interop.unwrap(x), topk_idx=idx, hidden=hidden,
                               max_tokens=max_tokens, num_experts=num_experts, num_local=num_local,
                               use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
                               return_recv_hook=return_recv_hook, stats=stats,
                               routing=routing)
        same = {"num_max_dispatch_tokens_per_rank": max_tokens, "num_experts": num_experts,
                "x": f"bfloat16 [*, {hidden}]", "use_fp8": use_fp8,
                "round_scale": round_scale if use_fp8 else None, "use_ue8m0": use_ue8m0 if use_fp8 else None}
        masked = self._masked_topk(idx, num_experts)
        return args, same, {"per_expert": np.bincount(masked[masked >= 0], minlength=num_experts).astype(np.int64)}

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False, return_recv_hook: bool = False,
                            out=None, combine_wait_recv_cost_stats=None, bf16_partials: bool = False):
        """See :meth:`cupy_ep.Buffer.low_latency_combine`."""
        self.check_usable()
        args, notes = self._agree("low_latency_combine", lambda: self._check_low_latency_combine(
            x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish, return_recv_hook, out,
            combine_wait_recv_cost_stats, bf16_partials), low_latency=True)
        num_ranks, num_local = self.num_ranks, args.num_local
        taking_part = np.array([n is not None for n in notes])
        args.topk_idx = self._masked_topk(args.topk_idx, args.num_experts)
        # The routing must be the dispatch's: what each owner's handle holds for each token owner equals
        # what that token owner's topk_idx selects (checked identically on every rank, before any transfer).
        # (between ranks that both take part: a rank left out sends and receives nothing)
        none = {"layout_counts": np.zeros((num_local, num_ranks), np.int64),
                "per_expert": np.zeros(num_ranks * num_local, np.int64)}
        notes = [n if n is not None else none for n in notes]
        held = np.stack([n["layout_counts"] for n in notes])                                  # [owner, L, s]
        wanted = np.stack([n["per_expert"] for n in notes]).reshape(num_ranks, num_ranks, num_local)
        wanted = wanted.transpose(1, 2, 0)                                                    # [owner, L, s]
        both = taking_part[:, None, None] & taking_part[None, None, :]
        held, wanted = held * both, wanted * both
        count_mask = taking_part[None, :]
        if not np.array_equal(held, wanted):
            owner, e, src = (int(v[0]) for v in np.nonzero(held != wanted))
            raise ValueError(f"topk_idx: rank {src} selects local expert {e} of rank {owner} "
                             f"{wanted[owner, e, src]} times, but rank {owner}'s handle.layout_range holds "
                             f"{held[owner, e, src]} rows for it (pass the routing of the dispatch that made "
                             f"the handle)")

        # Owner side: for each token owner s, the rows of every local expert's block from s, experts ascending.
        begin, count = reference.low_latency_unpack_range(args.layout_range)
        count = count * count_mask  # nothing to a rank left out
        experts, rows = [], []
        for s in range(num_ranks):
            for e in range(num_local):
                rows.append(np.arange(begin[e, s], begin[e, s] + count[e, s], dtype=np.int64))
                experts.append(np.full(count[e, s], e, dtype=np.int64))
        send = args.y[np.concatenate(experts), np.concatenate(rows)]
        live = args.topk_idx[args.topk_idx >= 0]  # (masked again: a rank masked during this call sends nothing)
        per_owner = np.bincount(live // num_local, minlength=num_ranks)
        got = self._alltoallv_rows(send, count.sum(axis=0), per_owner, low_latency=True).view(interop.BF16)

        # Token-owner side: the block from owner r lists r's experts ascending, each in (t, k) order, so
        # sorting my (t, k) slots by expert id gives the received row of each.
        idx = args.topk_idx
        flat = np.flatnonzero(idx >= 0)
        row_of = np.full(idx.size, -1, dtype=np.int64)
        row_of[flat[np.argsort(idx.flat[flat], kind="stable")]] = np.arange(flat.size)
        row_of = row_of.reshape(idx.shape)
        # The GPU's order (reference.low_latency_combine): per expert rank an fp32 partial sum over its k
        # ascending, rounded to the wire's 24 bits (or bf16), then the partials over ranks ascending (only ranks
        # holding an entry of the token).
        partial = np.zeros((num_ranks, idx.shape[0], args.hidden), dtype=np.float32)
        has = np.zeros((num_ranks, idx.shape[0]), dtype=bool)
        for k in range(idx.shape[1]):
            sel = np.nonzero(row_of[:, k] >= 0)[0]
            owner = idx[sel, k] // num_local  # each (owner, token) pair once per k
            values = got[row_of[sel, k]].astype(np.float32)
            partial[owner, sel] = partial[owner, sel] + (args.weights[sel, k][:, None] * values).astype(np.float32)
            has[owner, sel] = True
        partial = reference.low_latency_partial_wire(partial, bf16=args.bf16_partials, logfmt=args.use_logfmt)
        acc = np.zeros((idx.shape[0], args.hidden), dtype=np.float32)
        for r in range(num_ranks):
            acc[has[r]] = acc[has[r]] + partial[r, has[r]]
        combined = acc.astype(interop.BF16).view(np.uint16)
        hook = self._ll_hooks.make(_ready, "low_latency_combine") if args.return_recv_hook else None
        if out is not None:
            interop.unwrap(out)[...] = combined
            return out, host_event(async_finish), hook
        return interop.wrap(combined, args.kind, "bfloat16"), host_event(async_finish), hook

    def _check_low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                   return_recv_hook, out, combine_wait_recv_cost_stats, bf16_partials):
        """All of low_latency_combine's argument checks: ``(_LowLatencyArgs, same, {"layout_counts": [L, R],
        "per_expert": [E]})`` (see :meth:`_agree`)."""
        self._require_low_latency_mode()
        num_ranks = self.num_ranks
        (_, layout_range, _, max_tokens, hidden, num_experts, num_tokens, num_topk,
         flags) = validate.check_low_latency_combine_args(
            x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish, return_recv_hook, out,
            combine_wait_recv_cost_stats, bf16_partials, num_ranks, self.check_values, None, self.buffer_id,
            shrink=self._shrink_mask is not None)
        use_logfmt, zero_copy, async_finish, return_recv_hook, bf16_partials = flags
        num_local = num_experts // num_ranks
        shape = (num_local, num_ranks * max_tokens, hidden)
        if zero_copy:
            buffer = self._ll_combine_buffer
            if buffer is None or buffer.shape != shape:
                raise ValueError("zero_copy: fill get_next_low_latency_combine_buffer(handle) first (no combine "
                                 f"buffer of shape {shape} was handed out)")
            y = buffer
        else:
            y = interop.unwrap(x)
        self._ll_hooks.check_next_call("low_latency_combine")
        idx = interop.unwrap(topk_idx).astype(np.int64)
        args = _LowLatencyArgs(kind=interop.kind_of(topk_idx), x=None, topk_idx=idx, hidden=hidden,
                               max_tokens=max_tokens, num_experts=num_experts, num_local=num_local,
                               return_recv_hook=return_recv_hook, use_logfmt=use_logfmt,
                               bf16_partials=bf16_partials, y=y,
                               weights=interop.unwrap(topk_weights), layout_range=layout_range)
        same = {"handle": f"num_max_dispatch_tokens_per_rank={max_tokens}, hidden={hidden}, "
                          f"num_experts={num_experts}, {_handle_origin(handle)}"}
        masked = self._masked_topk(idx, num_experts)
        notify = {"layout_counts": reference.low_latency_unpack_range(layout_range)[1],
                  "per_expert": np.bincount(masked[masked >= 0], minlength=num_experts).astype(np.int64)}
        return args, same, notify

    def get_next_low_latency_combine_buffer(self, handle):
        """See :meth:`cupy_ep.Buffer.get_next_low_latency_combine_buffer`."""
        self.check_usable()
        self._require_low_latency_mode()
        _, _, max_tokens, hidden, num_experts = self._check_low_latency_handle(handle)
        handles.check_origin(handle, self.buffer_id)
        shape = (num_experts // self.num_ranks, self.num_ranks * max_tokens, hidden)
        if self._ll_combine_buffer is None or self._ll_combine_buffer.shape != shape:
            self._ll_combine_buffer = np.zeros(shape, dtype=np.uint16)
        return interop.wrap(self._ll_combine_buffer, interop.kind_of(handle[0]), "bfloat16")

    def _require_low_latency_mode(self) -> None:
        if not self.low_latency_mode:
            raise ValueError("low_latency_mode: the low-latency calls need a Buffer created with "
                             "low_latency_mode=True")

    def _check_low_latency_handle(self, handle):
        """``(src_info raw, layout_range raw, M, H, E)`` of a low-latency dispatch handle (validate.py)."""
        return validate.check_low_latency_handle(handle, self.num_ranks, self.check_values)

    # ---- shared helpers -----------------------------------------------------------------------------
    def _check_handle(self, handle, config: Config, num_tokens: int | None,
                      dispatch_channels: int | None = None) -> tuple:
        """The dispatch handle as raw numpy arrays, after checking its types and shapes (and, when
        ``num_tokens`` is given, that it was made for that many tokens; when ``dispatch_channels`` is given,
        for a dispatch with that many channels: a cached dispatch must cut its tokens as the first did)."""
        if not isinstance(handle, (tuple, list)) or len(handle) != len(_HANDLE_FIELDS):
            got = type(handle).__name__ + (f" of {len(handle)}" if isinstance(handle, (tuple, list)) else "")
            raise ValueError(f"handle: must be the 6-tuple an intranode dispatch returned, got {got}")
        handles.check_origin(handle, self.buffer_id)
        for i, (a, (name, dtype, ndim)) in enumerate(zip(handle, _HANDLE_FIELDS)):
            validate.check_array(a, f"handle.{name}", (dtype,), ndim=ndim)
        raw = tuple(interop.unwrap(a) for a in handle)
        num_ranks, channels = self.num_ranks, raw[1].shape[1]
        num_recv, tokens = raw[3].shape[0], raw[4].shape[0]
        want = ((num_ranks, num_ranks), (num_ranks, channels), (num_ranks, channels), (num_recv,),
                (tokens, num_ranks), (tokens, num_ranks))
        for i, (a, shape) in enumerate(zip(raw, want)):
            if a.shape != shape:
                raise ValueError(f"handle.{_HANDLE_FIELDS[i][0]}: must have shape {shape}, got {a.shape}")
        if num_tokens is not None and tokens != num_tokens:
            raise ValueError(f"handle: was made for {tokens} tokens, but x has {num_tokens}")
        real = raw[0][:, self.rank]
        if self.check_values and (np.any(np.diff(real, prepend=0) < 0) or real[-1] > num_recv):
            raise ValueError("handle: rank_prefix_matrix does not fit recv_src_idx "
                             f"({real[-1]} rows > {num_recv}, or not a prefix sum)")
        if dispatch_channels is not None and dispatch_channels != channels:
            raise ValueError(f"config: a dispatch with num_sms={config.num_sms} has {dispatch_channels} channels "
                             f"at {num_ranks} ranks, but the handle was made with {channels}")
        return raw

    def _agree(self, op: str, check, low_latency: bool = False):
        """Start collective call ``op``: run this rank's argument checks ``check() -> (result, same, payload)`` and
        exchange their outcome with the ranks taking part (:class:`~cupy_ep.host.host_exchange.HostExchange`). If a rank
        is in another call, every rank that sees it raises CallMismatchError; if any rank's checks raised
        ValueError/TypeError/RuntimeError, or the ``same`` dicts (argument name -> what must match on every rank)
        differ, every rank raises. ``low_latency``: in shrink mode only the ranks unmasked here take part, and a rank
        that does not come in time is masked. Returns ``(result, [payload of each rank, None for a rank left out])``."""
        exchange = self._exchange
        exchange.begin(op)
        try:
            result, same, payload = check()
            error = None
        except (TypeError, ValueError, RuntimeError) as e:  # (RuntimeError: a recv hook not called yet)
            result, same, payload, error = None, None, None, e
        shrink = low_latency and self._shrink_mask is not None
        peers = self._taking_part(low_latency)
        try:
            got = exchange.agree((None if error is None else (type(error), str(error)), same, payload), peers)
        except PeersTimedOut as e:
            if not shrink:
                self._unusable_reason = f"rank(s) {e.peers} did not enter {op}"
                raise exchange.timeout_error(e.peers, "enter") from None
            self._shrink_mask[e.peers] = 1  # masked: the call goes on without them
            got = e.partial
        except CallMismatchError as e:
            if not e.record.get("in_step"):
                self._unusable_reason = f"the ranks are out of step: {e.record}"
            raise
        if error is not None:
            raise error
        gathered = [got.get(r) for r in range(self.num_ranks)]
        for r, g in enumerate(gathered):
            if g is not None and g[0] is not None:
                raise g[0][0](f"{g[0][1]} (raised on rank {r})")
        present = [g for g in gathered if g is not None]
        for name in same:
            values = [g[1].get(name) for g in present]
            if any(v != values[0] for v in values):
                raise ValueError(f"{name}: must agree across ranks, got {values} (by rank)")
        return result, [None if g is None else g[2] for g in gathered]

    def _taking_part(self, low_latency: bool) -> list[int]:
        """The ranks a call meets: every rank, or in a low-latency call in shrink mode the ones unmasked here."""
        if not low_latency or self._shrink_mask is None:
            return list(range(self.num_ranks))
        return [r for r in range(self.num_ranks) if r == self.rank or not self._shrink_mask[r]]

    def _masked_topk(self, topk_idx: np.ndarray, num_experts: int) -> np.ndarray:
        """``topk_idx`` with the entries of masked ranks' experts set to -1 (shrink mode; unchanged otherwise)."""
        if self._shrink_mask is None or not self._shrink_mask.any():
            return topk_idx
        return reference.mask_ranks(topk_idx, np.flatnonzero(self._shrink_mask), num_experts, self.num_ranks)

    def _alltoallv_rows(self, send: np.ndarray, send_counts, recv_counts, low_latency: bool = False) -> np.ndarray:
        """All-to-all of rows among the ranks taking part: ``send_counts[r]`` consecutive rows of ``send`` go to rank
        r; the rows from rank r arrive as block r (of ``recv_counts[r]`` rows) of the result."""
        try:
            return self._exchange.alltoallv(send, send_counts, recv_counts, self._taking_part(low_latency))
        except PeersTimedOut as e:
            self._unusable_reason = f"rank(s) {e.peers} did not send the rows of {self._exchange.op}"
            raise self._exchange.timeout_error(e.peers, "send the rows of") from None

    # ---- shrink mode (low-latency fault tolerance, as the CUDA backend's) ----------------------------------
    def _shrink(self) -> np.ndarray:
        self.check_usable()
        validate.check_shrink_enabled(self._shrink_mask is not None)
        return self._shrink_mask

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (``mask=True``) or unmask a rank in this rank's view, from the next low-latency call on (not
        collective). A masked rank is neither sent to nor waited for: its experts' top-k entries count as not
        selected, it contributes no tokens, its combine partials are absent. A rank that does not enter a
        low-latency call within the timeout is masked by itself.

        Args:
            rank_to_mask: int in ``[0, num_ranks)``.
            mask: bool; True masks, False unmasks.
        """
        shrink_mask = self._shrink()
        rank = validate.check_rank_to_mask(rank_to_mask, self.num_ranks)
        shrink_mask[rank] = 1 if validate.check_flag(mask, "mask") else 0

    def low_latency_query_mask_buffer(self, mask_status) -> None:
        """Fill ``mask_status`` with this rank's mask (1 = masked, 0 = not; not collective).

        Args:
            mask_status: ``[num_ranks]`` int32, contiguous, a numpy array or CPU torch tensor.
        """
        shrink_mask = self._shrink()
        validate.check_mask_status(mask_status, self.num_ranks)
        interop.unwrap(mask_status)[...] = shrink_mask

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank in this rank's view (not collective)."""
        self._shrink()[...] = 0

    # ---- lifetime -----------------------------------------------------------------------------------
    def check_health(self) -> None:
        """Nothing to report: a host call that fails raises at once."""
        self.check_usable()

    def barrier(self) -> None:
        """Collective: every rank meets. A numbered call like the others (one header to every peer over the private
        communicator, none awaited longer than the timeout): a rank that does not come within the timeout makes the
        others raise ``CommTimeoutError`` naming it and ``barrier`` (the Buffer is then unusable), a rank in another
        call makes them raise ``CallMismatchError``. In shrink mode too every rank takes part, masked ones included."""
        self.check_usable()
        self._agree("barrier", lambda: (None, {}, None))

    def _buffer_bytes(self, offset: int, nbytes: int, rdma: bool):
        """Host memory standing in for the device buffer, zeroed at first use, kept as long as this Buffer."""
        if rdma not in self._host_regions:
            self._host_regions[rdma] = np.zeros(self.num_rdma_bytes if rdma else self.num_nvl_bytes, dtype=np.uint8)
        return self._host_regions[rdma][offset:offset + nbytes]

    def destroy(self) -> None:
        """Collective: a barrier (``CommTimeoutError`` when a rank does not come within the timeout), then the buffer
        is unusable. Calling it again does nothing."""
        if self._destroyed:
            return
        try:
            self._exchange.close()
        finally:
            super().destroy()
