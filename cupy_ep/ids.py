"""What the host code and the kernels share by name: kernel ids, wait roles, warp roles, block shapes.

Python owns these values. :func:`header` renders them (with the limits of :mod:`cupy_ep.layout`) as
``common/ids.cuh``, a header that exists only in memory: :mod:`cupy_ep.jit` hands it to NVRTC with every compile
and hashes it into the kernel cache key. In CUDA they are ordinary ``enum`` members and ``constexpr`` values, so
the kernels see compile-time constants exactly as if they were written in ``cuda_src/``.
"""
from __future__ import annotations

import dataclasses

from . import layout

#: ``KernelId`` (the kernel a failure record names): CUDA enum member, name in error messages, value.
KERNELS = (
    ("kKernelLayout", "get_dispatch_layout", 1),
    ("kKernelNotifyDispatch", "notify_dispatch", 2),
    ("kKernelCachedNotifyDispatch", "cached_notify_dispatch", 3),
    ("kKernelDispatch", "dispatch", 4),
    ("kKernelCachedNotifyCombine", "cached_notify_combine", 5),
    ("kKernelCombine", "combine", 6),
    ("kKernelBarrier", "barrier", 7),
    ("kKernelLowLatencyDispatch", "low_latency_dispatch", 8),
    ("kKernelLowLatencyCombine", "low_latency_combine", 9),
    ("kKernelInternodeNotifyDispatch", "internode_notify_dispatch", 10),
    ("kKernelInternodeCachedNotify", "internode_cached_notify", 11),
    ("kKernelInternodeDispatch", "internode_dispatch", 12),
    ("kKernelInternodeCombine", "internode_combine", 13),
    ("kKernelDispatchDirect", "dispatch_direct", 14),
    ("kKernelCombineDirect", "combine_direct", 15),
)

#: ``Role`` (common/wait.cuh: what a failed wait or check was doing). 5 is unused (it named a role that is gone).
ROLES = (
    ("kRoleBarrier", "barrier", 0),
    ("kRoleSender", "sender", 1),
    ("kRoleReceiver", "receiver", 2),
    ("kRoleNotify", "notify", 3),
    ("kRoleCallCheck", "call_check", 4),  # not a wait: ranks disagree about a call
    ("kRoleBufferReuse", "buffer_reuse", 6),  # not a wait: a low-latency send phase reuses the previous buffer
    ("kRoleZeroCopyCapacity", "zero_copy_capacity", 7),  # not a wait: zero-copy rows do not fit a receiver
    ("kRoleEntry", "entry", 8),  # a zero-copy kernel waiting for a peer to enter the same call
)

#: ``internode::WarpRole`` (the warp roles of the internode kernels; they also name failure sites). kIdle never
#: waits, so it has no message name.
WARP_ROLES = (
    # dispatch
    ("kRDMASender", "kRDMASender", 10),
    ("kRDMASenderCoordinator", "kRDMASenderCoordinator", 11),
    ("kRDMAAndNVLForwarder", "kRDMAAndNVLForwarder", 12),
    ("kForwarderCoordinator", "kForwarderCoordinator", 13),
    ("kNVLReceivers", "kNVLReceivers", 14),
    # combine
    ("kNVLSender", "kNVLSender", 15),
    ("kNVLAndRDMAForwarder", "kNVLAndRDMAForwarder", 16),
    ("kRDMAReceiver", "kRDMAReceiver", 17),
    ("kCoordinator", "kCoordinator", 18),
    # notify / barriers (diagnostics only)
    ("kRoleRdmaBarrier", "rdma_barrier", 19),
    ("kRoleNvlBarrier", "nvl_barrier", 20),
    ("kIdle", None, 21),
    # not a wait: num_worst_tokens too small for what this rank receives
    ("kRoleCapacity", "capacity", 22),
)

#: ``CallOp`` (intranode/handshake.cuh) and ``internode::InternodeCallOp``: the first call word, what a call is.
CALL_OPS = (
    ("kOpDispatch", "dispatch", 1),
    ("kOpCachedDispatch", "cached dispatch", 2),
    ("kOpCombine", "combine", 3),
    ("kOpDirectDispatch", "zero-copy dispatch", 4),
    ("kOpCachedDirectDispatch", "zero-copy cached dispatch", 5),
    ("kOpDirectCombine", "zero-copy combine", 6),
)
INTERNODE_CALL_OPS = (
    ("kOpInternodeDispatch", "internode dispatch", 11),
    ("kOpInternodeCachedDispatch", "internode cached dispatch", 12),
    ("kOpInternodeCombine", "internode combine", 13),
)
#: enum member -> value of every call op.
OP = {member: value for member, _, value in CALL_OPS + INTERNODE_CALL_OPS}

#: value -> name, for failure records and call-mismatch messages.
KERNEL_NAMES = {value: name for _, name, value in KERNELS}
ROLE_NAMES = {value: name for _, name, value in ROLES + WARP_ROLES if name is not None}
CALL_OP_NAMES = {value: name for _, name, value in CALL_OPS + INTERNODE_CALL_OPS}

# ---- block shapes -------------------------------------------------------------------------------------------------
#: get_dispatch_layout's block (layout.cu; its __launch_bounds__).
LAYOUT_THREADS = 256
#: Warps of an intranode dispatch / combine block before rounding down to a multiple of the rank count
#: (intranode/groups.cuh Groups).
INTRANODE_WARPS = 24
#: Rows an intranode combine warp reduces per round (intranode/combine.cuh).
COMBINE_TOKENS_PER_WARP = 2
#: Bytes of dynamic shared memory per receiver warp for its bulk (TMA) copies (common/warp.cuh TmaCopier).
TMA_CHUNK_BYTES = 8192
#: Internode notify kernels' block (their __launch_bounds__).
INTERNODE_NOTIFY_THREADS = 256
#: Internode dispatch: RDMA sender warps of a sender SM (internode/roles.cuh DispatchShape).
INTERNODE_DISPATCH_SENDER_WARPS = 6
#: Internode combine: RDMA receiver warps (internode/roles.cuh CombineShape).
INTERNODE_COMBINE_RECV_WARPS = 6
#: Internode combine: forwarder warps at most (warp w forwards to nodes w, w + 16, ...).
INTERNODE_MAX_COMBINE_FORWARDER_WARPS = 16
#: Low-latency dispatch and combine blocks (their __launch_bounds__).
LL_DISPATCH_THREADS = 512
LL_COMBINE_THREADS = 512
#: Low-latency combine: hidden chunks a thread stages per top-k entry (its dynamic shared memory's slots).
LL_COMBINE_CHUNKS = 2


@dataclasses.dataclass(frozen=True)
class Constant:
    """One ``constexpr`` of the generated header."""
    namespace: str
    ctype: str
    name: str
    value: int
    doc: str


def constants() -> tuple:
    """Every constant the generated header defines, in the namespace the kernels use it from."""
    ep, inter, ll, intra = "ep", "ep::internode", "ep::low_latency", "ep::intranode"
    return (
        Constant(ep, "int", "kMaxNvlRanks", layout.MAX_NVL_RANKS, "ranks of one NVLink domain"),
        Constant(ep, "int", "kMaxLocalExperts", layout.MAX_LOCAL_EXPERTS, "experts per rank"),
        Constant(ep, "int", "kMaxTopk", layout.MAX_TOPK, "top-k of the intranode and internode paths"),
        Constant(ep, "long long", "kAlign", layout.ALIGN, "every carved array is rounded up to this"),
        Constant(ep, "long long", "kSignalBytes", layout.SIGNAL_BYTES, "int barrier_signal[kMaxNvlRanks], padded"),
        Constant(ep, "int", "kCallWords", layout.CALL_WORDS, "words of the call-agreement check per rank"),
        Constant(ep, "int", "kMaxRdmaRanks", layout.MAX_RDMA_RANKS, "nodes (one warp lane each)"),
        Constant(ep, "int", "kLayoutThreads", LAYOUT_THREADS, "get_dispatch_layout's block"),
        Constant(ep, "int", "kTmaChunkBytes", TMA_CHUNK_BYTES, "per receiver warp (dynamic shared memory)"),
        Constant(intra, "int", "kIntranodeWarps", INTRANODE_WARPS, "dispatch/combine block, before rounding to R"),
        Constant(intra, "int", "kCombineTokensPerWarp", COMBINE_TOKENS_PER_WARP, "combine rows per warp and round"),
        Constant(inter, "int", "kNotifyThreads", INTERNODE_NOTIFY_THREADS, "notify kernels' block"),
        Constant(inter, "int", "kDispatchSenderWarps", INTERNODE_DISPATCH_SENDER_WARPS, "RDMA senders per SM"),
        Constant(inter, "int", "kCombineRecvWarps", INTERNODE_COMBINE_RECV_WARPS, "combine RDMA receivers"),
        Constant(inter, "int", "kMaxCombineForwarderWarps", INTERNODE_MAX_COMBINE_FORWARDER_WARPS,
                 "warp w forwards to nodes w, w + 16 (in that order on every node)"),
        Constant(ll, "int", "kLLThreads", LL_DISPATCH_THREADS, "dispatch block"),
        Constant(ll, "int", "kLLCombineThreads", LL_COMBINE_THREADS, "combine block"),
        Constant(ll, "int", "kCombineChunks", LL_COMBINE_CHUNKS, "combine: staged chunks per thread and entry"),
        Constant(ll, "int", "kLLMaxExperts", layout.LL_MAX_EXPERTS, "two shared-memory histograms"),
        Constant(ll, "int", "kLLMaxRanks", layout.LL_MAX_RANKS, "ranks of the low-latency path"),
        Constant(ll, "int", "kEntrySlotShift", layout.LL_ENTRY_SLOT_SHIFT,
                 "combine meta entry: slot << shift | expert in an int32"),
    )


#: The include name of the generated header (``#include "common/ids.cuh"``); no such file exists in cuda_src/.
HEADER_NAME = "common/ids.cuh"


def _enum(name: str, members) -> str:
    body = "".join(f"    {member} = {value},\n" for member, _, value in members)
    return f"enum {name} : int {{\n{body}}};"


def header() -> str:
    """The text of ``common/ids.cuh``: the enums and constants above, namespace by namespace."""
    blocks = {"ep": [_enum("KernelId", KERNELS), _enum("Role", ROLES)],
              "ep::intranode": [_enum("CallOp", CALL_OPS)],
              "ep::internode": [_enum("WarpRole", WARP_ROLES), _enum("InternodeCallOp", INTERNODE_CALL_OPS)]}
    for c in constants():
        blocks.setdefault(c.namespace, []).append(f"constexpr {c.ctype} {c.name} = {c.value};  // {c.doc}")
    lines = ["// common/ids.cuh: generated by cupy_ep/ids.py (which owns these values), passed to NVRTC in memory.",
             "#pragma once", ""]
    for namespace, body in blocks.items():
        lines += [f"namespace {namespace} {{", *body, f"}}  // namespace {namespace}", ""]
    return "\n".join(lines)
