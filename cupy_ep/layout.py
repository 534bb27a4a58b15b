"""The limits the buffer carves are built on, owned here and emitted into the kernels' ``common/ids.cuh``
(:func:`cupy_ep.ids.header`); cuda_src/common/layout.cuh carves with them and :mod:`cupy_ep.config` sizes with them.

The CPU test (tests/unit/test_mirrors.py) compiles :func:`layout_probe_source`: ``static_assert``s that compare
config.py's byte sums with the CUDA layout structs for a set of shapes, so a sum changed on one side only fails
at compile time, without a GPU.
"""
from __future__ import annotations

MAX_NVL_RANKS = 8                 # ranks of one NVLink domain
MAX_LOCAL_EXPERTS = 1024          # experts per rank
MAX_TOPK = 32                     # top-k of the intranode and internode paths
ALIGN = 128                       # every carved array is rounded up to this many bytes
SIGNAL_BYTES = 128                # the barrier signals at the start of an NVLink buffer
CALL_WORDS = 8                    # words of the call-agreement check of the notify kernels
MAX_RDMA_RANKS = 32               # nodes of the internode kernels (one warp lane each)
LL_MAX_EXPERTS = 4096             # low-latency experts (two shared-memory histograms)
LL_MAX_RANKS = 64                 # low-latency ranks
#: The low-latency combine's meta entry is ``slot << LL_ENTRY_SLOT_SHIFT | expert`` in an int32.
LL_ENTRY_SLOT_SHIFT = 12
LL_MAX_TOKENS = 1 << (31 - LL_ENTRY_SLOT_SHIFT)   # kLLMaxTokens: num_max_dispatch_tokens_per_rank at most


def _assert(expr: str, value: int, what: str) -> str:
    return f'static_assert({expr} == {value}LL, "{what}: Python says {value}");'


def layout_probe_source(intranode=(), internode=(), low_latency=()) -> str:
    """CUDA source whose ``static_assert``s compare config.py's sums with common/layout.cuh's structs.

    ``intranode``: ``(channels, ranks, slots, hidden_bytes, topk, scales)``; ``internode``: the arguments of
    :func:`cupy_ep.config.internode_layout`; ``low_latency``: ``(max_tokens, hidden, ranks, experts)``.
    """
    from . import config
    lines = ['#include "common/layout.cuh"', "namespace layout_probe {", "using namespace ep;"]
    lines.append(_assert("NotifyArea().end", SIGNAL_BYTES + config.NOTIFY_BYTES, "NOTIFY_BYTES"))
    for i, (c, r, q, hb, k, s) in enumerate(intranode):
        at = f"intranode {(c, r, q, hb, k, s)}"
        lines += [f"constexpr DispatchLayout d{i}({c}, {r}, {q}, {hb // 16}, {k}, {s});",
                  _assert(f"d{i}.total_end - d{i}.begin", config.dispatch_channel_bytes(c, r, q, hb, k, s),
                          f"dispatch_channel_bytes {at}"),
                  f"constexpr CombineLayout c{i}({c}, {r}, {q}, {hb // 16}, {k});",
                  _assert(f"c{i}.total_end - c{i}.begin", config.combine_channel_bytes(c, r, q, hb, k),
                          f"combine_channel_bytes {at}"),
                  f"constexpr DirectDispatchLayout dd{i}({c}, {q}, {hb // 16}, {k}, {s});",
                  _assert(f"dd{i}.total_end - dd{i}.begin", config.direct_dispatch_bytes(c, q, hb, k, s),
                          f"direct_dispatch_bytes {at}"),
                  _assert(f"dd{i}.x.offset - kSignalBytes", config.direct_dispatch_x_offset(c),
                          f"direct_dispatch_x_offset {at}"),
                  f"constexpr DirectCombineLayout dc{i}({r}, {q}, {hb // 16}, {k});",
                  _assert(f"dc{i}.total_end - dc{i}.begin", config.direct_combine_bytes(r, q, hb, k),
                          f"direct_combine_bytes {at}")]
    for i, args in enumerate(internode):
        n, g, c, qr, qn, hb, s, k = args
        want = config.internode_layout(*args)
        at = f"internode_layout{tuple(args)}"
        lines += [f"constexpr TokenFormat dt{i}({hb // 16}, {s}, {k}, true), ct{i}({hb // 16}, 0, {k}, false);",
                  f"constexpr InternodeDispatchRdma dr{i}({n}, {g}, {c}, {qr}, dt{i}.int4s);",
                  f"constexpr InternodeCombineRdma cr{i}({n}, {g}, {c}, {qr}, ct{i}.int4s);",
                  f"constexpr InternodeDispatchNvl dn{i}({n}, {g}, {c}, {qn}, dt{i}.int4s);",
                  f"constexpr InternodeCombineNvl cn{i}({n}, {g}, {c}, {qn}, ct{i}.int4s);"]
        for expr, key in ((f"dt{i}.bytes", "dispatch_token_bytes"), (f"ct{i}.bytes", "combine_token_bytes"),
                          (f"dr{i}.begin", "rdma_channel_begin"), (f"dr{i}.total_end", "rdma_dispatch_end"),
                          (f"cr{i}.total_end", "rdma_combine_end"), (f"dn{i}.begin", "nvl_channel_begin"),
                          (f"dn{i}.total_end", "nvl_dispatch_end"), (f"cn{i}.total_end", "nvl_combine_end")):
            lines.append(_assert(expr, want[key], f"{key} {at}"))
    for i, (m, h, r, e) in enumerate(low_latency):
        want = config.low_latency_layout(m, h, r, e)
        at = f"low_latency_layout{(m, h, r, e)}"
        lines.append(f"constexpr LowLatencyLayout ll{i}({m}, {h}, {r}, {e});")
        for field in ("msg_bytes", "row_bytes", "part_bytes", "meta_bytes", "signal_ints", "signal_bytes",
                      "send_bytes", "recv_bytes", "total_bytes"):
            lines.append(_assert(f"ll{i}.{field}", want[field], f"{field} {at}"))
        for expr, key in ((f"ll{i}.signal_offset(1)", "signal_offset_1"), (f"ll{i}.send_offset(0)", "send_offset_0"),
                          (f"ll{i}.recv_offset(0)", "recv_offset_0"), (f"ll{i}.index_offset", "dispatch_index_offset"),
                          (f"ll{i}.combine_offset", "combine_offset"), (f"ll{i}.meta_offset", "combine_meta_offset")):
            lines.append(_assert(expr, want[key], f"{key} {at}"))
    lines += ["}  // namespace layout_probe", "__global__ void layout_probe_kernel() {}", ""]
    return "\n".join(lines)
