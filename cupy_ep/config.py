"""``Config`` (SM count and ring sizes), the default tables, buffer-size hints and tuned-config loading.

The size arithmetic here is ``cuda_src/common/layout.cuh``'s, sum for sum (tests/unit/test_mirrors.py compiles
static_asserts that compare them; :mod:`cupy_ep.layout` owns the limits both use): the NVLink buffer of every rank is

    [signals: 128 B][notify area: NOTIFY_BYTES][channel area: max(dispatch carve, combine carve)]

and each carve is a sequence of ``[channel][rank][elements]`` arrays, every array rounded up to 128 bytes.
A GPU test checks :func:`dispatch_channel_bytes` / :func:`combine_channel_bytes` against the device's own
carving.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from .reference import LOW_LATENCY_MAX_TOPK

from .layout import (ALIGN, CALL_WORDS, LL_MAX_EXPERTS, LL_MAX_RANKS, LL_MAX_TOKENS, MAX_LOCAL_EXPERTS,  # noqa: F401
                     MAX_NVL_RANKS, MAX_RDMA_RANKS, MAX_TOPK, SIGNAL_BYTES)

MAX_HIDDEN_BYTES = 65536          # 32768 bf16 elements; the kernels loop, so this is only a sanity bound
WORKSPACE_BYTES = 1 << 20     # get_dispatch_layout: ticket + one accumulator int per expert, rank and node column


def align_up(value: int, alignment: int = ALIGN) -> int:
    return -(-value // alignment) * alignment


# rank matrix, per-expert counts, call words, and every rank's token count (the combine's channel split),
# each int array rounded up to ALIGN bytes as common/layout.cuh's Carver does
NOTIFY_BYTES = sum(align_up(4 * n) for n in (MAX_NVL_RANKS * MAX_NVL_RANKS, MAX_NVL_RANKS * MAX_LOCAL_EXPERTS,
                                             MAX_NVL_RANKS * CALL_WORDS, MAX_NVL_RANKS,
                                             # the zero-copy entry handshake: entry, entry_words, epoch, arrivals
                                             MAX_NVL_RANKS, 2 * MAX_NVL_RANKS * CALL_WORDS, 1, 1))


def _asym(num_channels: int, num_ranks: int, bytes_per_slice: int) -> int:
    """Bytes of one ``[channel][rank][bytes_per_slice]`` array, as common/layout.cuh's AsymBuffer carves it."""
    return align_up(num_channels * num_ranks * bytes_per_slice)


def dispatch_channel_bytes(num_channels: int, num_ranks: int, num_recv_slots: int, hidden_bytes: int,
                           num_topk: int, num_scales: int) -> int:
    """Bytes of the intranode dispatch carve (receiver side): start, end, head, tail, x, src_idx,
    topk_idx (int32 on the wire), topk_weights, x_scales."""
    q = num_recv_slots
    return (4 * _asym(num_channels, num_ranks, 4)
            + _asym(num_channels, num_ranks, q * hidden_bytes)
            + _asym(num_channels, num_ranks, q * 4)
            + 2 * _asym(num_channels, num_ranks, q * num_topk * 4)
            + _asym(num_channels, num_ranks, q * num_scales * 4))


def combine_channel_bytes(num_channels: int, num_ranks: int, num_recv_slots: int, hidden_bytes: int,
                          num_topk: int) -> int:
    """Bytes of the intranode combine carve (token-owner side): head, tail, x, topk_weights."""
    q = num_recv_slots
    return (2 * _asym(num_channels, num_ranks, 4)
            + _asym(num_channels, num_ranks, q * hidden_bytes)
            + _asym(num_channels, num_ranks, q * num_topk * 4))


def direct_dispatch_bytes(num_channels: int, capacity: int, hidden_bytes: int, num_topk: int, num_scales: int) -> int:
    """Bytes of the zero-copy dispatch carve (common/layout.cuh DirectDispatchLayout, receiver side): done counter,
    channel starts ``[MAX_NVL_RANKS][channels]``, then ``capacity`` rows of x, src_idx, topk_idx, topk_weights
    and scales."""
    n = capacity
    return (align_up(4) + align_up(4 * MAX_NVL_RANKS * num_channels) + align_up(n * hidden_bytes) + align_up(4 * n)
            + 2 * align_up(4 * n * num_topk) + align_up(4 * n * num_scales))


def direct_dispatch_x_offset(num_channels: int) -> int:
    """Offset of the zero-copy rows from the end of the signals (DirectDispatchLayout.x)."""
    return NOTIFY_BYTES + align_up(4) + align_up(4 * MAX_NVL_RANKS * num_channels)


def direct_dispatch_capacity(num_nvl_bytes: int, num_channels: int, hidden_bytes: int, num_topk: int,
                             num_scales: int) -> int:
    """Rows a zero-copy dispatch can receive into a buffer of ``num_nvl_bytes`` (the largest n whose
    :func:`direct_dispatch_bytes` fits after the notify area); 0 if none."""
    room = num_nvl_bytes - NOTIFY_BYTES
    per_row = hidden_bytes + 4 + 8 * num_topk + 4 * num_scales
    n = max(0, (room - direct_dispatch_bytes(num_channels, 0, hidden_bytes, num_topk, num_scales)) // per_row)
    return _largest_fitting(n, room, lambda m: direct_dispatch_bytes(num_channels, m, hidden_bytes, num_topk,
                                                                      num_scales))


def _largest_fitting(guess: int, room: int, size) -> int:
    """The largest n >= 0 with size(n) <= room (size grows with n), searched from ``guess``; capped at 2^31 - 1."""
    n = guess
    while n > 0 and size(n) > room:
        n -= 1
    while size(n + 1) <= room and n < 2**31 - 1:
        n += 1
    return n


# Rows a zero-copy combine sender warp stores before releasing them with one flag (combine_direct's rows_per_flag):
# small, so the rows land in the order the owners reduce them.
DIRECT_COMBINE_ROWS_PER_FLAG = 2


def direct_combine_bytes(num_ranks: int, capacity: int, hidden_bytes: int, num_topk: int) -> int:
    """Bytes of the zero-copy combine carve (common/layout.cuh DirectCombineLayout, token-owner side): flags
    ``[capacity][R]``, then ``capacity`` rows per source rank of x and top-k weights."""
    return (align_up(4 * num_ranks * capacity) + align_up(num_ranks * capacity * hidden_bytes)
            + align_up(4 * num_ranks * capacity * num_topk))


def direct_combine_capacity(num_nvl_bytes: int, num_ranks: int, hidden_bytes: int, num_topk: int) -> int:
    """Rows per source rank that a zero-copy combine fits in a buffer of ``num_nvl_bytes`` (a token owner
    needs its token count); 0 if none."""
    room = num_nvl_bytes - NOTIFY_BYTES
    per_row = num_ranks * (hidden_bytes + 4 * num_topk + 4)
    return _largest_fitting(max(0, room // per_row), room,
                            lambda m: direct_combine_bytes(num_ranks, m, hidden_bytes, num_topk))


def default_timeout_s() -> float:
    """Seconds any wait (device or host) may take before it becomes a Python error: ``CUPY_EP_TIMEOUT_S``, else 100."""
    return float(os.environ.get("CUPY_EP_TIMEOUT_S", "100"))


@dataclasses.dataclass
class Config:
    """Launch and ring-buffer settings of the normal (high-throughput) kernels.

    Attributes:
        num_sms: SMs the dispatch/combine kernels occupy; even. Combine (and internode): one channel per SM
            pair. Intranode dispatch: :meth:`intranode_dispatch_split` (channels of a sender and a receiver SM,
            plus SMs that copy the rank's own rows).
        num_max_nvl_chunked_send_tokens: tokens a sender writes before publishing its tail.
        num_max_nvl_chunked_recv_tokens: ring slots per (channel, rank) queue.
        num_max_rdma_chunked_send_tokens / num_max_rdma_chunked_recv_tokens: the same for the RDMA domain
            (internode only).
    """
    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"Config.{field.name} must be an int, got {type(value).__name__}")
        if self.num_sms < 2 or self.num_sms % 2:
            raise ValueError(f"Config.num_sms must be an even number >= 2, got {self.num_sms}")
        if self.num_max_nvl_chunked_send_tokens <= 0:
            raise ValueError("Config.num_max_nvl_chunked_send_tokens must be positive, got "
                             f"{self.num_max_nvl_chunked_send_tokens}")
        if self.num_max_nvl_chunked_recv_tokens <= self.num_max_nvl_chunked_send_tokens:
            raise ValueError(
                "Config.num_max_nvl_chunked_recv_tokens must be larger than num_max_nvl_chunked_send_tokens "
                f"(got {self.num_max_nvl_chunked_recv_tokens} <= {self.num_max_nvl_chunked_send_tokens})")
        if self.num_max_rdma_chunked_send_tokens <= 0:
            raise ValueError("Config.num_max_rdma_chunked_send_tokens must be positive")
        if self.num_max_rdma_chunked_recv_tokens < 2 * self.num_max_rdma_chunked_send_tokens:
            raise ValueError("Config.num_max_rdma_chunked_recv_tokens must be at least twice "
                             "num_max_rdma_chunked_send_tokens (lazy head updates)")

    @property
    def num_channels(self) -> int:
        return self.num_sms // 2

    def intranode_dispatch_split(self, num_ranks: int) -> tuple[int, int]:
        """``(channels, own_blocks)`` of an intranode dispatch: ``2 * channels + own_blocks == num_sms``.

        A channel is a sender SM (NVLink writes into the peers' rings) and a receiver SM (drains the rings
        of the R - 1 peers into the outputs); the own-row SMs copy this rank's own tokens into the outputs
        (no ring). Shares measured at R = 2: senders, receivers and
        own rows 3 : 3 : 2 (8 SMs -> 3 + 3 + 2, 16 -> 6 + 6 + 4, 24 -> 9 + 9 + 6, 32 -> 12 + 12 + 8); with
        more ranks the own rows are 1 / R of the rows and the rings R - 1 of R, so their weights scale by
        R - 1: ``channels = floor(num_sms * 3(R-1) / (6(R-1) + 2) + 1/4)``, at least one own-row SM."""
        if self.num_sms < 4:
            raise ValueError(f"config: an intranode dispatch needs num_sms >= 4 (a sender, a receiver and an "
                             f"own-row SM), got num_sms={self.num_sms}")
        remote = max(num_ranks - 1, 0)
        share = self.num_sms * 3 * remote / (6 * remote + 2)
        channels = min(max(int(share + 0.25), 1), (self.num_sms - 1) // 2)
        return channels, self.num_sms - 2 * channels

    def intranode_dispatch_channels(self, num_ranks: int) -> int:
        """Channels of an intranode dispatch (the handle's prefix matrices are ``[R, channels]``)."""
        return self.intranode_dispatch_split(num_ranks)[0]

    def zero_copy_local_blocks(self, num_ranks: int) -> int:
        """Blocks of a zero-copy dispatch (``num_sms`` in all) that copy only the rank's own rows (local HBM
        copies); the others store only the peers' rows (NVLink). 0: every block does both.

        Measured at R = 2, 4096 x 7168 bf16: the own rows need about 8
        SMs to keep pace with the NVLink stores, and the NVLink stores about 8 (steady: 16 SMs 204 us both
        ways -> 193 us with 8 + 8; 24 SMs 216 -> 196 with 16 + 8; with 16 : 4 or 24 : 6 the own rows were the
        slower side, 330 and 231 us). Below 16 SMs a split leaves either side short, so every block does both.
        Other rank counts: not measured, every block does both."""
        if num_ranks != 2 or self.num_sms < 16:
            return 0
        return min(8, self.num_sms // 2)

    def zero_copy_combine_senders(self, num_ranks: int) -> int:
        """Blocks of a zero-copy combine (``num_sms`` in all) that store rows into the owners' buffers; the
        others reduce (each token reads two rows and writes one). ``min(9, 3 * num_sms // 8)``, at least one:
        measured at R = 2, 4096 x 7168 (steady, 2 rows per flag): 24 SMs
        with 7 / 8 / 9 senders 241 / 216 / 211 us, 16 SMs with 6: 272 us, 32 SMs with 8 / 10: 215 / 216 us."""
        if num_ranks == 1:
            return 0
        return max(1, min(9, 3 * self.num_sms // 8))

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of ``num_nvl_bytes`` that dispatch and combine with this config need.

        ``hidden_bytes`` is ``hidden * max(element_size, 2)`` (size FP8 as BF16). Assumes the largest
        top-k (32) and one float scale per 128 hidden elements."""
        num_nvl_ranks = min(num_ranks, MAX_NVL_RANKS)
        hidden_elems = hidden_bytes // 2
        num_scales = -(-hidden_elems // 128)
        channel = max(
            dispatch_channel_bytes(self.num_channels, num_nvl_ranks, self.num_max_nvl_chunked_recv_tokens,
                                   hidden_bytes, MAX_TOPK, num_scales),
            combine_channel_bytes(self.num_channels, num_nvl_ranks, self.num_max_nvl_chunked_recv_tokens,
                                  hidden_bytes, MAX_TOPK))
        intranode = align_up(NOTIFY_BYTES + channel)
        if num_ranks <= MAX_NVL_RANKS:
            return intranode
        # above one NVLink domain (DeepEP: 8 GPUs per node) the internode NVLink buffer may need more
        return max(intranode, internode_buffer_bytes(num_ranks // MAX_NVL_RANKS, MAX_NVL_RANKS, hidden_bytes,
                                                     self)[0])

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """RDMA bytes (internode only): 0 while the job fits one NVLink domain, else the RDMA half of
        :func:`internode_buffer_bytes` for ``num_ranks / 8`` nodes of 8 GPUs (DeepEP's assumption)."""
        if num_ranks <= MAX_NVL_RANKS:
            return 0
        return internode_buffer_bytes(num_ranks // MAX_NVL_RANKS, MAX_NVL_RANKS, hidden_bytes, self)[1]


# (nvl_send, nvl_recv, rdma_send, rdma_recv). Dispatch: DeepEP's defaults.
# Combine: a sender copies nvl_send rows per step with all its warps for that peer (24, 8 and 3 at R = 2, 4, 8:
# validate.intranode_remote_warps), so the chunk is a multiple of them (DeepEP's 10 / 9 / 4 left warps idle).
_DEFAULT_DISPATCH = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128)}
_DEFAULT_COMBINE = {2: (48, 256, 6, 128), 4: (24, 256, 6, 128), 8: (6, 256, 6, 128)}
# Internode (more than one node): DeepEP's table for 8 GPUs per node, 16..160 ranks.
_DEFAULT_INTERNODE_DISPATCH = {16: (36, 288, 20, 128), 24: (32, 288, 8, 128), 32: (32, 288, 8, 128),
                               48: (32, 288, 8, 128), 64: (32, 288, 8, 128), 96: (20, 480, 12, 128),
                               128: (20, 560, 12, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128)}
_DEFAULT_INTERNODE_COMBINE = {16: (4, 288, 12, 128), 24: (1, 288, 8, 128), 32: (1, 288, 8, 128),
                              48: (1, 288, 8, 128), 64: (1, 288, 8, 128), 96: (1, 480, 8, 128),
                              128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}


def _default_for(table: dict, num_ranks: int) -> tuple:
    if num_ranks in table:
        return table[num_ranks]
    if 2 <= num_ranks <= MAX_NVL_RANKS:       # odd rank counts: take the next tabulated one
        return table[min(k for k in table if k >= num_ranks)]
    if table is _DEFAULT_DISPATCH or table is _DEFAULT_COMBINE:
        internode = _DEFAULT_INTERNODE_DISPATCH if table is _DEFAULT_DISPATCH else _DEFAULT_INTERNODE_COMBINE
        if num_ranks > MAX_NVL_RANKS:      # the next tabulated internode size, or the largest
            larger = [k for k in internode if k >= num_ranks]
            return internode[min(larger) if larger else max(internode)]
    raise ValueError(f"num_ranks={num_ranks} has no default config (intranode supports 2..8 ranks)")


def tuned_config_path() -> Path:
    """Where ``python -m cupy_ep.tune`` writes, and ``Buffer`` reads, tuned configs
    (``CUPY_EP_TUNED_CONFIG`` overrides)."""
    env = os.environ.get("CUPY_EP_TUNED_CONFIG")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cupy_ep" / "tuned_configs.json"


_tuned_paths: dict = {}    # (CUPY_EP_TUNED_CONFIG, XDG_CACHE_HOME, HOME) -> tuned_config_path() as a string
_tuned_tables: dict = {}   # path -> ((its mtime in ns, size, inode), its entries)


def _tuned_entries() -> dict:
    """The tuned-config file's entries ({} without one), read again only when the file changes: every call with
    the default config looks here, and building the path and reading the file took ~12 us a call."""
    env = (os.environ.get("CUPY_EP_TUNED_CONFIG"), os.environ.get("XDG_CACHE_HOME"), os.environ.get("HOME"))
    path = _tuned_paths.get(env)
    if path is None:
        path = _tuned_paths[env] = str(tuned_config_path())
    try:
        st = os.stat(path)
    except OSError:
        return {}
    stamp = (st.st_mtime_ns, st.st_size, st.st_ino)   # a rewrite moves the mtime or size, a replaced file the inode
    cached = _tuned_tables.get(path)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    try:
        entries = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        entries = {}
    if not isinstance(entries, dict):
        entries = {}
    _tuned_tables[path] = (stamp, entries)
    return entries


def load_tuned(kind: str, num_ranks: int, hidden_bytes: int | None) -> Config | None:
    """The tuned ``Config`` for (kind, num_ranks, hidden_bytes) if the tuner wrote one, else None."""
    if hidden_bytes is None:
        return None
    entries = _tuned_entries()
    if not entries:
        return None
    key = f"{kind}/{num_ranks}/{hidden_bytes}"
    entry = entries.get(key)
    if not entry:
        return None
    try:
        return Config(**entry)
    except TypeError as e:
        raise ValueError(f"CUPY_EP_TUNED_CONFIG {tuned_config_path()}: entry {key}: {e}") from None


_default_num_sms = 20


def default_num_sms() -> int:
    """SMs dispatch/combine use unless a Config says otherwise (``Buffer.num_sms``; ``Buffer.set_num_sms``)."""
    return _default_num_sms


def set_default_num_sms(num_sms: int) -> None:
    global _default_num_sms
    _default_num_sms = num_sms


def get_dispatch_config(num_ranks: int, num_sms: int, hidden_bytes: int | None = None) -> Config:
    """Default dispatch config for ``num_ranks`` (a tuned one if present for this hidden size)."""
    tuned = load_tuned("dispatch", num_ranks, hidden_bytes)
    return tuned or Config(num_sms, *_default_for(_DEFAULT_DISPATCH, num_ranks))


def get_combine_config(num_ranks: int, num_sms: int, hidden_bytes: int | None = None) -> Config:
    """Default combine config for ``num_ranks`` (a tuned one if present for this hidden size)."""
    tuned = load_tuned("combine", num_ranks, hidden_bytes)
    return tuned or Config(num_sms, *_default_for(_DEFAULT_COMBINE, num_ranks))


def low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                               num_experts: int) -> int:
    """``num_rdma_bytes`` the low-latency kernels need: DeepEP's ``get_low_latency_rdma_size_hint``.

    The total of DeepEP's ``LowLatencyLayout`` , with M = max tokens per rank,
    S = hidden / 128 scales and E experts::

        msg_dispatch = 16 + max(2H, H + 4S)      # int4 header (source token index) + bf16 row or fp8 row + scales
        msg_combine  = 4S + 2H                   # per-128-channel bf16x2 min/max (LogFMT) + bf16 row
        send   = max(M * msg_dispatch, E * M * msg_combine)
        recv   = max(E * M * msg_dispatch, E * M * msg_combine)
        signal = align_up(4E, 128)               # dispatch recv counts = combine recv flags
        total  = 2 * signal + 2 * send + 2 * recv   # two buffers, used alternately

    rounded as DeepEP does, ``((total + 128) // 128) * 128`` (so a multiple of 128 gains 128 bytes).
    ``num_ranks`` only has to divide ``num_experts``. Example: (128, 7168, R, 288) -> 2,146,961,792.
    """
    for name, value in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
                        ("hidden", hidden), ("num_ranks", num_ranks), ("num_experts", num_experts)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name}: must be a positive int, got {value!r}")
    if hidden % 128:
        raise ValueError(f"hidden: must be a multiple of 128 in low-latency mode, got {hidden}")
    if num_experts % num_ranks:
        raise ValueError(f"num_experts: must be a multiple of num_ranks={num_ranks}, got {num_experts}")
    num_scales = hidden // 128
    msg_dispatch = 16 + max(hidden * 2, hidden + num_scales * 4)
    msg_combine = num_scales * 4 + hidden * 2
    tokens = num_max_dispatch_tokens_per_rank
    send = max(tokens * msg_dispatch, num_experts * tokens * msg_combine)
    recv = max(num_experts * tokens * msg_dispatch, num_experts * tokens * msg_combine)
    signal = align_up(num_experts * 4)
    total = 2 * signal + 2 * send + 2 * recv
    # our layout is not DeepEP's (our combine keeps 24-bit partial sums per (rank, token) and flags per token): with
    # few tokens and few experts per rank it can need more than DeepEP's total
    ours = low_latency_layout(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)["total_bytes"]
    return max(((total + ALIGN) // ALIGN) * ALIGN, ours)


#: Low-latency top-k limit (the reference's; kLLMaxTopk in cuda_src/common/layout.cuh). LL_MAX_EXPERTS, LL_MAX_RANKS
#: and LL_MAX_TOKENS (a slot and an expert share one int32 in the combine's meta) are cupy_ep/layout.py's.
LL_MAX_TOPK = LOW_LATENCY_MAX_TOPK
#: The top-k bounds the low-latency kernels are built for (kLLTopkBounds in cuda_src/low_latency/common.cuh): a call
#: runs the instantiation of the smallest bound >= its top-k (:func:`low_latency_topk_bound`), so top-k up to 11
#: runs the default one and a larger top-k compiles only its bound's kernels.
LL_TOPK_BOUNDS = (11, 16, 32)


def low_latency_topk_bound(num_topk: int) -> int:
    """The low-latency kernels' top-k bound (template parameter ``kMaxTopk``) for a call of top-k ``num_topk``
    (1 <= num_topk <= ``LL_MAX_TOPK``): the smallest of ``LL_TOPK_BOUNDS`` at least ``num_topk``."""
    for bound in LL_TOPK_BOUNDS:
        if num_topk <= bound:
            return bound
    raise ValueError(f"num_topk: the low-latency kernels take at most {LL_MAX_TOPK}, got {num_topk}")


def low_latency_layout(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                       num_experts: int) -> dict:
    """Byte sizes and offsets of the GPU's ``LowLatencyLayout`` (cuda_src/common/layout.cuh), sum for sum.

    Two buffers alternate, laid out ``[sig0][sig1][send0][send1][recv0][recv1]``; M tokens, E experts, R ranks,
    K = 32 (``LL_MAX_TOPK``: the meta blocks hold the largest top-k whatever a call's, so the layout, and with it
    the buffer's size, depends on (M, H, R, E) alone)::

        msg    = 16 + 2H                         # dispatch message: header + bf16 row (>= e4m3 row + scales)
        row    = 2H                              # zero-copy combine input row (bf16)
        part   = 3H                              # combine partial sum (fp32 rounded to 24 bits: bf16 plane +
                                                 # byte plane), one per (expert rank, token)
        meta   = align_up(8 * M * K, 16)         # combine meta of one owner: int32 experts, float weights [M][K]
        signal = align_up(4 * (2E + R*M + R))    # dispatch counts int64 [L][R]; combine token flags [R][M] +
                                                 # meta flags [R]
        send   = align_up(max(M * msg, E * M * row))
        index  = R * M * msg                     # dispatch recv: messages [R][M], then int64 index [E/R][R][M]
        comb0  = align_up(index + 8 * E * M, 16) # combine recv, after the dispatch's area: partial_in [R][M],
        meta0  = comb0 + 2 * R * M * part        # partial_out [R][M], then
        recv   = align_up(meta0 + 2 * R * meta)  # meta_in [R], meta_out [R]
        total  = 2 * (signal + send + recv)

    ``dispatch_index_offset`` is ``index``; ``combine_offset`` is ``comb0``; ``combine_meta_offset`` is ``meta0``.
    The two areas do not overlap: the dispatch's index entries and message flags carry the epoch of the dispatch
    that wrote them, so a stale value there must come from an older dispatch, never from the combine's data.
    :func:`low_latency_rdma_size_hint` (DeepEP's formula) is never less than ``total``.
    """
    m, e, r = num_max_dispatch_tokens_per_rank, num_experts, num_ranks
    msg, row, part = 16 + 2 * hidden, 2 * hidden, 3 * hidden
    meta = align_up(8 * m * LL_MAX_TOPK, 16)
    signal_ints = 2 * e + r * m + r
    signal = align_up(4 * signal_ints)
    send = align_up(max(m * msg, e * m * row))
    index = r * m * msg
    comb0 = align_up(index + 8 * e * m, 16)
    meta0 = comb0 + 2 * r * m * part
    recv = align_up(meta0 + 2 * r * meta)
    return {"msg_bytes": msg, "row_bytes": row, "part_bytes": part, "meta_bytes": meta, "signal_ints": signal_ints,
            "signal_bytes": signal, "send_bytes": send, "recv_bytes": recv,
            "total_bytes": 2 * (signal + send + recv), "signal_offset_1": signal, "send_offset_0": 2 * signal,
            "recv_offset_0": 2 * (signal + send), "dispatch_index_offset": index, "combine_offset": comb0,
            "combine_meta_offset": meta0}


# ---------------------------------------------------------------------------------------------------------
# Internode buffers (the Internode* structs of cuda_src/common/layout.cuh; the layout probe compares)
# ---------------------------------------------------------------------------------------------------------
_NVL_NOTIFY_INTS = CALL_WORDS + MAX_RDMA_RANKS + MAX_LOCAL_EXPERTS   # kNvlNotifyInts


def internode_token_bytes(hidden_bytes: int, num_scales: int, num_topk: int, dispatch: bool) -> int:
    """Bytes of one token on the internode wire (common/layout.cuh ``TokenFormat``): dispatch
    ``[x | scales S float | pad to 8 | SourceMeta 8 B | topk_idx K int32 | weights K float]``, combine
    ``[x (bf16) | weights K float]``, rounded up to 16 bytes. ``hidden_bytes`` is a multiple of 16."""
    extra = align_up(4 * num_scales, 8) + 8 + 4 * num_topk if dispatch else 0
    return align_up(hidden_bytes + extra + 4 * num_topk, 16)


def _sym(num_channels: int, num_ranks: int, bytes_per_slice: int) -> int:
    """Bytes of one ``[send|recv][channel][rank][bytes_per_slice]`` SymBuffer."""
    return align_up(2 * num_channels * num_ranks * bytes_per_slice)


def internode_layout(num_nodes: int, gpus_per_node: int, num_channels: int, num_rdma_slots: int,
                     num_nvl_slots: int, hidden_bytes: int, num_scales: int, num_topk: int) -> dict:
    """End offsets of every internode carve, exactly as the GPU computes them (``internode_carve_probe``).

    RDMA buffer: ``[barrier 2*32 int][notify SymBuffer(1, N, align4(8 + G + 1 + 1024 G) int)][channel area]``,
    channel area = dispatch ``meta SymBuffer(C, N, align4(2G + 2) int) | head (C, N) | tail (C, N) |
    data SymBuffer(C, N, Qr * token)`` or combine ``head | tail | data``.
    NVLink buffer: ``[signals 128 B][notify (G, 8 + 32 + 1024 int)][channel area]``, dispatch
    ``prefix_start (C, G, N) | prefix_end | head (C, G) | tail | x (C, G, Qn * token)``, combine
    ``head (C, G, N) | tail (C, G, N) | x``. Every array rounded up to 128 bytes.

    ``hidden_bytes`` is the dispatch row size (bf16: 2H; fp8: H, with ``num_scales`` floats); the combine row
    is always bf16 of the same hidden size, i.e. ``2 * hidden`` -- pass the bf16 size for combine sizing.

    Returns:
        dict with ``rdma_channel_begin, rdma_dispatch_end, rdma_combine_end, nvl_channel_begin,
        nvl_dispatch_end, nvl_combine_end, dispatch_token_bytes, combine_token_bytes`` (same order as the
        probe's output).
    """
    n, g, c = num_nodes, gpus_per_node, num_channels
    d_tok = internode_token_bytes(hidden_bytes, num_scales, num_topk, True)
    c_tok = internode_token_bytes(hidden_bytes, 0, num_topk, False)
    rdma_notify_ints = align_up(CALL_WORDS + g + 1 + g * MAX_LOCAL_EXPERTS, 4)
    rdma_begin = align_up(2 * MAX_RDMA_RANKS * 4) + _sym(1, n, rdma_notify_ints * 4)
    meta_ints = align_up(2 * g + 2, 4)
    rdma_dispatch = (rdma_begin + _sym(c, n, meta_ints * 4) + 2 * _asym(c, n, 4)
                     + _sym(c, n, num_rdma_slots * d_tok))
    rdma_combine = rdma_begin + 2 * _asym(c, n, 4) + _sym(c, n, num_rdma_slots * c_tok)
    nvl_begin = SIGNAL_BYTES + _asym(1, g, _NVL_NOTIFY_INTS * 4)
    nvl_dispatch = nvl_begin + 2 * _asym(c, g, 4 * n) + 2 * _asym(c, g, 4) + _asym(c, g, num_nvl_slots * d_tok)
    nvl_combine = nvl_begin + 2 * _asym(c, g, 4 * n) + _asym(c, g, num_nvl_slots * c_tok)
    return {"rdma_channel_begin": rdma_begin, "rdma_dispatch_end": rdma_dispatch, "rdma_combine_end": rdma_combine,
            "nvl_channel_begin": nvl_begin, "nvl_dispatch_end": nvl_dispatch, "nvl_combine_end": nvl_combine,
            "dispatch_token_bytes": d_tok, "combine_token_bytes": c_tok}


def internode_buffer_bytes(num_nodes: int, gpus_per_node: int, hidden_bytes: int, config: Config | None = None,
                           num_topk: int = MAX_TOPK) -> tuple[int, int]:
    """``(num_nvl_bytes, num_rdma_bytes)`` that internode dispatch and combine with ``config`` need.

    ``hidden_bytes`` = ``hidden * max(element_size, 2)`` (FP8 sized as BF16, as DeepEP's hints); assumes one
    float scale per 128 elements and ``num_topk`` (default the largest, 32). ``num_nvl_bytes`` excludes the
    128 signal bytes the buffer adds itself (as for intranode). Both rounded up to 128 bytes.
    """
    config = config or Config()
    for name, value in (("num_nodes", num_nodes), ("gpus_per_node", gpus_per_node), ("hidden_bytes", hidden_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name}: must be a positive int, got {value!r}")
    if not 2 <= num_nodes <= MAX_RDMA_RANKS:
        raise ValueError(f"num_nodes: must be in [2, {MAX_RDMA_RANKS}], got {num_nodes}")
    if gpus_per_node > MAX_NVL_RANKS:
        raise ValueError(f"gpus_per_node: must be at most {MAX_NVL_RANKS}, got {gpus_per_node}")
    num_scales = -(-(hidden_bytes // 2) // 128)
    lay = internode_layout(num_nodes, gpus_per_node, config.num_channels, config.num_max_rdma_chunked_recv_tokens,
                           config.num_max_nvl_chunked_recv_tokens, hidden_bytes, num_scales, num_topk)
    nvl = max(lay["nvl_dispatch_end"], lay["nvl_combine_end"]) - SIGNAL_BYTES
    rdma = max(lay["rdma_dispatch_end"], lay["rdma_combine_end"])
    return align_up(nvl), align_up(rdma)


def internode_table(hidden: int = 7168, gpus_per_node: int = 8, nodes=(2, 3, 4, 6, 8, 12, 16, 20, 24, 32)) -> str:
    """Markdown table of :func:`internode_buffer_bytes` with the default internode configs (DeepEP's table,
    ``Buffer.num_sms`` SMs) for ``gpus_per_node`` x ``nodes``: BF16 rows of ``hidden``, top-k 32."""
    from .buffer import Buffer
    lines = [("| nodes x GPUs | ranks | dispatch config (nvl_send, nvl_recv, rdma_send, rdma_recv) | "
              "num_nvl_bytes | num_rdma_bytes |"), "|---|---|---|---|---|"]
    for n in nodes:
        r = n * gpus_per_node
        cfgs = [get_dispatch_config(r, Buffer.num_sms), get_combine_config(r, Buffer.num_sms)]
        sizes = [internode_buffer_bytes(n, gpus_per_node, 2 * hidden, cfg) for cfg in cfgs]
        nvl, rdma = max(s[0] for s in sizes), max(s[1] for s in sizes)
        d = cfgs[0]
        lines.append(f"| {n} x {gpus_per_node} | {r} | {d.num_max_nvl_chunked_send_tokens}, "
                     f"{d.num_max_nvl_chunked_recv_tokens}, {d.num_max_rdma_chunked_send_tokens}, "
                     f"{d.num_max_rdma_chunked_recv_tokens} | {nvl:,} ({nvl / 2**20:.1f} MiB) | "
                     f"{rdma:,} ({rdma / 2**20:.1f} MiB) |")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="python -m cupy_ep.config", description=__doc__.splitlines()[0])
    parser.add_argument("--internode-table", action="store_true", help="print the internode buffer-size table")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    args = parser.parse_args(argv)
    if args.internode_table:
        print(internode_table(args.hidden, args.gpus_per_node))
        return 0
    parser.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
