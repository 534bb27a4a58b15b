"""``HostBuffer``: the DeepEP V1 ``Buffer`` API on numpy + MPI, for machines without a GPU.

Every call is synchronous (the returned ``EventOverlap`` carries no event) and computes exactly what
:mod:`cupy_ep.reference` says, moving rows with ``MPI_Alltoallv`` on host memory (bf16 and fp8 travel as
raw bytes). Arguments go through the same :mod:`cupy_ep.validate` checks as the CUDA path, so errors read
the same.

Collective calls (``dispatch``, ``combine``) first agree on the argument checks with one all-gather: if
any rank's checks fail, or the ranks disagree on what must match (hidden size, dtypes, top-k, channels,
cached mode), every rank raises (a failing rank its own error, the others the same message tagged with
that rank), so a bad argument on one rank never leaves the others waiting in a collective. In non-cached
dispatch the same all-gather carries the counts DeepEP's ``notify_dispatch`` exchanges (tokens per rank,
per expert, per channel).

Decisions where DeepEP is silent or GPU-specific:

* the handle's ``rank_prefix_matrix`` is the full ``[R, R]`` matrix (every column valid);
* ``num_worst_tokens > 0`` needs ``topk_idx``/``topk_weights`` (as in DeepEP); the padding rows hold
  zeros in ``recv_x``/scales/weights and -1 in ``recv_topk_idx`` and in the handle's ``recv_src_idx``;
  a later cached dispatch or combine with that handle also has ``num_worst_tokens`` rows (the real ones
  first, counted by ``rank_prefix_matrix``); a cached dispatch ignores ``num_worst_tokens`` (as DeepEP:
  the handle fixes the row count);
* ``num_tokens_per_rdma_rank`` is ignored (intranode only); ``previous_event``, ``async_finish`` and
  ``allocate_on_comm_stream`` are only checked;
* with ``check_values`` the layout arguments are checked against each other (and against ``topk_idx``).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from . import buffer as _buffer
from . import interop, reference, validate
from .buffer import Buffer
from .config import Config
from .event import EventOverlap

_HANDLE_FIELDS = (("rank_prefix_matrix", "int32", 2), ("channel_prefix_matrix", "int32", 2),
                  ("recv_channel_prefix_matrix", "int32", 2), ("recv_src_idx", "int32", 1),
                  ("is_token_in_rank", "bool", 2), ("send_head", "int32", 2))


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


class HostBuffer(Buffer):
    """numpy + mpi4py implementation of :class:`cupy_ep.Buffer` (see the module docstring).

    Arguments as for :class:`cupy_ep.Buffer`; ``num_nvl_bytes``/``num_rdma_bytes``, ``device`` and
    ``timeout_s`` are checked and stored but not used. Inputs are numpy arrays (bf16 as
    ``ml_dtypes.bfloat16``, fp8 as ``ml_dtypes.float8_e4m3fn`` or ``uint8``) or CPU torch tensors.
    """

    backend = "host"

    def __init__(self, comm=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, *,
                 backend: str | None = None, device: int | None = None, timeout_s: float | None = None,
                 num_ranks_per_node: int | None = None, check_values: bool = True):
        super().__init__(comm, num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank,
                         allow_nvlink_for_low_latency_mode, allow_mnnvl, explicitly_destroy, enable_shrink,
                         backend=backend, device=device, timeout_s=timeout_s,
                         num_ranks_per_node=num_ranks_per_node, check_values=check_values)
        if num_ranks_per_node is not None and (not isinstance(num_ranks_per_node, int)
                                               or num_ranks_per_node <= 0
                                               or self.num_ranks % num_ranks_per_node):
            raise ValueError(f"num_ranks_per_node: must be a positive divisor of the rank count "
                             f"{self.num_ranks}, got {num_ranks_per_node!r}")
        self.num_ranks_per_node = num_ranks_per_node
        if backend is None:
            _buffer._warn_host_backend(self.rank)

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
        self._check_usable()
        validate.check_num_experts(num_experts, self.num_ranks)
        validate.check_topk_idx(topk_idx, num_experts, check_values=self.check_values)
        validate.check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        kind = interop.kind_of(topk_idx)
        outs = reference.get_dispatch_layout(interop.unwrap(topk_idx), num_experts, self.num_ranks,
                                             self.num_ranks_per_node)
        names = ("int32", "int32", "int32", "bool")
        return tuple(interop.wrap(a, kind, n) for a, n in zip(outs, names)) + (EventOverlap(),)

    # ---- dispatch -----------------------------------------------------------------------------------
    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Config | None = None,
                 previous_event=None, async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Send every token to the ranks that own its experts (collective).

        Args:
            x: bf16 ``[T, H]``, or the FP8 pair ``(x_e4m3 [T, H], scales [T, ceil(H/128)] float32)``.
            handle: a previous dispatch's handle: cached mode (same routing; ``topk_*`` must be None).
            num_tokens_per_rank ``[R] int32``, is_token_in_rank ``[T, R] bool``,
            num_tokens_per_expert ``[E] int32``: from :meth:`get_dispatch_layout` (non-cached mode).
            topk_idx ``[T, K]`` int32/int64 and topk_weights ``[T, K] float32``: both or neither.
            expert_alignment: the per-expert receive counts are rounded up to it.
            num_worst_tokens: when > 0, outputs have this many rows and the count list is empty.

        Returns:
            ``(recv_x [N, H] | (recv_x, recv_x_scales [N, S] float32), recv_topk_idx [N, K] (dtype of
            topk_idx) or None, recv_topk_weights [N, K] float32 or None, num_recv_tokens_per_expert_list
            (list of int), handle, EventOverlap)``; rows ordered by (source rank, source token). Cached
            mode returns ``(recv_x[, scales], None, None, None, None, EventOverlap)``. The handle is
            ``(rank_prefix_matrix [R, R], channel_prefix_matrix [R, C], recv_channel_prefix_matrix [R, C],
            recv_src_idx [N], is_token_in_rank [T, R] bool, send_head [T, R])``, all int32 but the bool.
        """
        self._check_usable()
        args, notes = self._agree(lambda: self._check_dispatch(
            x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
            expert_alignment, num_worst_tokens, config, previous_event, async_finish, allocate_on_comm_stream))
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
            return recv_x, None, None, None, None, EventOverlap()

        recv_topk_idx = recv_topk_weights = None
        if args.topk_idx is not None:
            got_idx, got_w = reference.local_remap_topk(exchange(args.topk_idx, -1),
                                                        exchange(args.topk_weights, 0), me, epr)
            recv_topk_idx, recv_topk_weights = wrap(got_idx, args.topk_name), wrap(got_w, "float32")
        recv_src_idx = exchange(np.arange(itr.shape[0], dtype=np.int32), -1)
        channels = args.config.num_channels
        new_handle = (
            wrap(rank_prefix, "int32"),
            wrap(reference.local_channel_prefix_matrix(itr, channels), "int32"),
            wrap(reference.recv_channel_prefix_matrix([n["channel_counts"][me] for n in notes]), "int32"),
            wrap(recv_src_idx, "int32"),
            args.user_is_token_in_rank,
            wrap(reference.local_send_head(itr, channels), "int32"),
        )
        return recv_x, recv_topk_idx, recv_topk_weights, counts_list, new_handle, EventOverlap()

    def _check_dispatch(self, x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                        topk_idx, topk_weights, expert_alignment, num_worst_tokens, config, previous_event,
                        async_finish, allocate_on_comm_stream):
        """All of dispatch's argument checks (no communication): returns ``(_DispatchArgs, same, notify)``
        (see :meth:`_agree`); ``notify`` holds this rank's counts for the others (None in cached mode)."""
        info = validate.check_x(x)
        num_tokens, num_ranks = info.num_tokens, self.num_ranks
        validate.check_expert_alignment(expert_alignment)
        validate.check_num_worst_tokens(num_worst_tokens, num_ranks, num_tokens)
        # FP8 rows are sized as BF16 for the config lookup (DeepEP's hidden_bytes convention), as the GPU path
        config = self._resolve_config(config, "dispatch", max(info.hidden_bytes, 2 * info.hidden))
        validate.check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        if (topk_idx is None) != (topk_weights is None):
            raise ValueError("topk_idx, topk_weights: give both or neither")
        args = _DispatchArgs(
            kind=interop.kind_of(info.x), x_name=interop.dtype_name(info.x), x=interop.unwrap(info.x),
            scales=None if info.scales is None else np.ascontiguousarray(interop.unwrap(info.scales)),
            topk_idx=None, topk_name=None, topk_weights=None, is_token_in_rank=None, config=config)
        scales = "" if info.scales is None else f" + scales [*, {info.num_scales}]"
        same = {"handle": "given" if handle is not None else "None",
                "x": f"{args.x_name} [*, {info.hidden}]{scales}",
                "config": f"{config.num_channels} channels", "topk_idx": None}

        if handle is not None:
            if topk_idx is not None:
                raise ValueError("topk_idx, topk_weights: must be None in cached mode (a handle was given)")
            args.handle = self._check_handle(handle, config, num_tokens)
            args.is_token_in_rank = args.handle[4]
            return args, same, None

        for name, value in (("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank", is_token_in_rank),
                            ("num_tokens_per_expert", num_tokens_per_expert)):
            if value is None:
                raise ValueError(f"{name}: required unless a handle is given")
        validate.check_array(num_tokens_per_rank, "num_tokens_per_rank", ("int32",), ndim=1)
        if tuple(num_tokens_per_rank.shape) != (num_ranks,):
            raise ValueError(f"num_tokens_per_rank: must have shape ({num_ranks},), "
                             f"got {tuple(num_tokens_per_rank.shape)}")
        validate.check_array(is_token_in_rank, "is_token_in_rank", ("bool",), ndim=2)
        if tuple(is_token_in_rank.shape) != (num_tokens, num_ranks):
            raise ValueError(f"is_token_in_rank: must have shape {(num_tokens, num_ranks)}, "
                             f"got {tuple(is_token_in_rank.shape)}")
        validate.check_array(num_tokens_per_expert, "num_tokens_per_expert", ("int32",), ndim=1)
        num_experts = int(num_tokens_per_expert.shape[0])
        try:
            validate.check_num_experts(num_experts, num_ranks)
        except ValueError as e:
            raise ValueError(f"num_tokens_per_expert: its length {num_experts} is not a valid expert count "
                             f"({e})") from None
        same["num_tokens_per_expert"] = f"{num_experts} experts"
        if topk_idx is not None:
            validate.check_topk_idx(topk_idx, num_experts, check_values=self.check_values)
            if topk_idx.shape[0] != num_tokens:
                raise ValueError(f"topk_idx: must have {num_tokens} rows (as x), got {topk_idx.shape[0]}")
            validate.check_topk_weights(topk_weights, num_tokens, topk_idx.shape[1])
            args.topk_idx, args.topk_name = interop.unwrap(topk_idx), interop.dtype_name(topk_idx)
            args.topk_weights = interop.unwrap(topk_weights)
            same["topk_idx"] = f"{args.topk_name} [*, {topk_idx.shape[1]}]"
        elif num_worst_tokens:
            raise ValueError("num_worst_tokens: needs topk_idx and topk_weights")
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
                  "channel_counts": reference.local_channel_counts(args.is_token_in_rank, config.num_channels),
                  "num_worst_tokens": num_worst_tokens}
        return args, same, notify

    # ---- combine ------------------------------------------------------------------------------------
    def combine(self, x, handle, topk_weights=None, bias=None, config: Config | None = None,
                previous_event=None, async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Send the expert outputs back to the token owners and sum them (collective).

        Args:
            x: bf16 ``[N, H]``, one row per row of the dispatch output (N = the handle's recv_src_idx).
            handle: the handle dispatch returned (not modified).
            topk_weights: ``[N, K] float32`` or None; summed the same way.
            bias: None, a bf16 ``[T, H]`` array, or a pair of them (either may be None).

        Returns:
            ``(combined_x [T, H] bf16, combined_topk_weights [T, K] float32 or None, EventOverlap)``:
            fp32 ``0 + bias0 + bias1 + contributions in ascending source-rank order``, rounded to bf16 once.
        """
        self._check_usable()
        (kind, x_raw, w_raw, biases, raw_handle), _ = self._agree(lambda: self._check_combine(
            x, handle, topk_weights, bias, config, previous_event, async_finish, allocate_on_comm_stream))
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
                EventOverlap())

    def _check_combine(self, x, handle, topk_weights, bias, config, previous_event, async_finish,
                       allocate_on_comm_stream):
        """All of combine's argument checks: ``((kind, x raw, weights raw, [bias0, bias1] bf16, raw handle),
        same, None)`` (see :meth:`_agree`)."""
        if isinstance(x, (tuple, list)):
            raise TypeError("x: combine takes one bf16 [N, H] array, not an FP8 pair")
        info = validate.check_x(x)
        handle_channels = None
        if isinstance(handle, (tuple, list)) and len(handle) == 6 and getattr(handle[2], "ndim", 0) == 2:
            handle_channels = int(handle[2].shape[1])
        config = self._resolve_config(config, "combine", info.hidden_bytes, handle_channels)
        raw_handle = self._check_handle(handle, config, None)
        num_recv, num_tokens = raw_handle[3].shape[0], raw_handle[4].shape[0]
        if info.num_tokens != num_recv:
            raise ValueError(f"x: must have {num_recv} rows (one per row of the dispatch output, as the "
                             f"handle's recv_src_idx), got {info.num_tokens}")
        w_raw = None
        if topk_weights is not None:
            validate.check_array(topk_weights, "topk_weights", ("float32",), ndim=2)
            validate.check_topk_weights(topk_weights, num_recv, topk_weights.shape[1])
            w_raw = interop.unwrap(topk_weights)
        biases = validate.check_bias(bias, num_tokens, info.hidden)
        biases = [None if b is None else interop.unwrap(b).view(interop.BF16) for b in biases]
        validate.check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        same = {"x": f"bfloat16 [*, {info.hidden}]", "config": f"{config.num_channels} channels",
                "topk_weights": None if w_raw is None else f"float32 [*, {w_raw.shape[1]}]"}
        return (interop.kind_of(x), interop.unwrap(x), w_raw, biases, raw_handle), same, None

    # ---- shared helpers -----------------------------------------------------------------------------
    def _check_handle(self, handle, config: Config, num_tokens: int | None) -> tuple:
        """The dispatch handle as raw numpy arrays, after checking its types and shapes (and, when
        ``num_tokens`` is given, that it was made for that many tokens)."""
        if not isinstance(handle, (tuple, list)) or len(handle) != len(_HANDLE_FIELDS):
            got = type(handle).__name__ + (f" of {len(handle)}" if isinstance(handle, (tuple, list)) else "")
            raise ValueError(f"handle: must be the 6-tuple an intranode dispatch returned, got {got}")
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
        if config.num_channels != channels:
            raise ValueError(f"config: has {config.num_channels} channels (num_sms={config.num_sms}), "
                             f"but the handle was made with {channels}")
        return raw

    def _agree(self, check):
        """Run this rank's argument checks ``check() -> (result, same, payload)`` and all-gather their
        outcome: if any rank's checks raised ValueError/TypeError, or the ``same`` dicts (argument name ->
        what must match on every rank) differ, every rank raises. Returns ``(result, [every payload])``."""
        try:
            result, same, payload = check()
            error = None
        except (TypeError, ValueError) as e:
            result, same, payload, error = None, None, None, e
        gathered = self.comm.allgather((None if error is None else (type(error), str(error)), same, payload))
        if error is not None:
            raise error
        for r, (err, _, _) in enumerate(gathered):
            if err is not None:
                raise err[0](f"{err[1]} (raised on rank {r})")
        for name in same:
            values = [g[1].get(name) for g in gathered]
            if any(v != values[0] for v in values):
                raise ValueError(f"{name}: must agree across ranks, got {values} (by rank)")
        return result, [g[2] for g in gathered]

    def _alltoallv_rows(self, send: np.ndarray, send_counts, recv_counts) -> np.ndarray:
        """All-to-all of rows: ``send_counts[r]`` consecutive rows of ``send`` go to rank r; the rows from
        rank r arrive as block r (of ``recv_counts[r]`` rows) of the result."""
        from mpi4py import MPI
        send = np.ascontiguousarray(send)
        row_shape = send.shape[1:]
        recv = np.empty((int(np.sum(recv_counts)),) + row_shape, dtype=send.dtype)
        row_type = MPI.BYTE.Create_contiguous(send.dtype.itemsize * int(np.prod(row_shape))).Commit()
        try:
            self.comm.Alltoallv([send, ([int(c) for c in send_counts], _displs(send_counts)), row_type],
                                [recv, ([int(c) for c in recv_counts], _displs(recv_counts)), row_type])
        finally:
            row_type.Free()
        return recv

    # ---- lifetime -----------------------------------------------------------------------------------
    def destroy(self) -> None:
        """Collective: a barrier, then the buffer is unusable. Calling it again does nothing."""
        if self._destroyed:
            return
        self.comm.Barrier()
        super().destroy()
