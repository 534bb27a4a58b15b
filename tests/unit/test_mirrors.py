"""What Python and the kernels share. cupy_ep/ids.py and cupy_ep/layout.py own the kernel ids, roles, block shapes
and limits and emit them into the generated header common/ids.cuh; config.py's buffer sums are compared with
common/layout.cuh's structs by static_asserts compiled here with NVRTC (no GPU); the rest of the shared tables are
compared with the CUDA text."""
import re
from pathlib import Path

import pytest

from cupy_ep import config, ids, jit, layout, validate
from cupy_ep.cuda import internode as cuda_internode
from cupy_ep.cuda import runtime
from cupy_ep.errors import CompileError

SRC = Path(__file__).resolve().parents[2] / "cuda_src"


def source(*names: str) -> str:
    """The text of these files of cuda_src/ (a folder stands for every file in it), concatenated."""
    out = []
    for name in names:
        path = SRC / name
        files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
        out += [f.read_text() for f in files]
    return "\n".join(out)


#: The low-latency path: its entry file and its folder.
LL = ("low_latency.cu", "low_latency")


def enum_values(text: str, enum: str) -> dict[str, int]:
    """``{name: value}`` of ``enum <enum> : int { ... };`` in CUDA source text (explicit values only)."""
    body = re.search(r"enum\s+" + enum + r"\s*:\s*int\s*\{(.*?)\};", text, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    return {name: int(value) for name, value in re.findall(r"(\w+)\s*=\s*(\d+)", body)}


def snake(camel: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", camel).lower()


# ---- the generated header is the only definition ------------------------------------------------------------------
def test_generated_header_defines_what_python_owns_and_cuda_src_does_not():
    header = jit.generated_headers()[ids.HEADER_NAME]
    text = source(".")
    for enum, members in (("KernelId", ids.KERNELS), ("Role", ids.ROLES), ("WarpRole", ids.WARP_ROLES),
                          ("CallOp", ids.CALL_OPS), ("InternodeCallOp", ids.INTERNODE_CALL_OPS)):
        assert enum_values(header, enum) == {m: v for m, _, v in members}
        assert not re.search(r"enum\s+" + enum + r"\b", text), f"cuda_src/ defines {enum} again"
    for c in ids.constants():
        assert f"constexpr {c.ctype} {c.name} = {c.value};" in header
        assert not re.search(r"constexpr[^;=]*\b" + c.name + r"\s*=", text), f"cuda_src/ defines {c.name} again"
    # every header that uses them includes the generated one (directly or through common/warp.cuh / wait.cuh)
    assert '#include "common/ids.cuh"' in source("common/warp.cuh") and '#include "common/ids.cuh"' in \
        source("common/wait.cuh")


def test_generated_header_is_part_of_the_kernel_cache_key(monkeypatch):
    jit.source_hash.cache_clear()
    try:
        first = jit.source_hash()
        monkeypatch.setattr(ids, "LAYOUT_THREADS", ids.LAYOUT_THREADS * 2)
        jit.source_hash.cache_clear()
        assert jit.source_hash() != first
    finally:
        monkeypatch.undo()
        jit.source_hash.cache_clear()
    assert jit.source_hash() == first


def test_names_of_kernels_and_roles():
    """The name a failure record gives a kernel is the kernel's own (snake case of the enum member without the
    kKernel prefix, where it has one); a wait role's is its snake case; every value is named once."""
    for member, name, _ in ids.KERNELS:
        assert name == snake(member[len("kKernel"):]) or (member, name) == ("kKernelLayout", "get_dispatch_layout")
    for member, name, _ in ids.ROLES:
        assert name == snake(member[len("kRole"):])
    values = [v for _, _, v in ids.KERNELS]
    assert len(set(values)) == len(values)
    roles = [v for _, _, v in ids.ROLES + ids.WARP_ROLES]
    assert len(set(roles)) == len(roles)
    assert runtime.KERNEL_NAMES == ids.KERNEL_NAMES and runtime.ROLE_NAMES == ids.ROLE_NAMES
    assert ids.ROLE_NAMES[22] == "capacity" and 21 not in ids.ROLE_NAMES  # kIdle never reports


def test_failure_record_layout_matches_the_struct():
    """runtime.RECORD_DTYPE (how the host reads a failure record) has TimeoutRecord's offsets and size."""
    dtype = runtime.RECORD_DTYPE
    lines = ['#include "common/wait.cuh"']
    lines += [f"static_assert(__builtin_offsetof(ep::TimeoutRecord, {name}) == {dtype.fields[name][1]}, "
              f'"TimeoutRecord::{name}");' for name in dtype.names]
    lines += [f'static_assert(sizeof(ep::TimeoutRecord) == {dtype.itemsize}, "TimeoutRecord size");',
              "__global__ void record_probe_kernel() {}"]
    jit.compile_only("record_probe.cu", ["record_probe_kernel"], source="\n".join(lines))
    assert len(runtime.CALL_WORDS) == layout.CALL_WORDS


# ---- layout sums: config.py against common/layout.cuh, at compile time ------------------------------------------
#: (channels, ranks, slots, hidden_bytes, topk, scales): odd sizes too, so that every rounding shows.
INTRANODE = [(1, 1, 1, 16, 1, 0), (24, 8, 512, 14336, 8, 56), (20, 3, 257, 7168 + 16, 9, 57), (2, 5, 33, 48, 32, 1),
             (12, 2, 4096, 8192, 0, 0)]
#: internode_layout's arguments: (nodes, GPUs per node, channels, RDMA slots, NVL slots, hidden_bytes, scales, topk)
INTERNODE = [(2, 1, 1, 16, 32, 16, 0, 1), (2, 8, 10, 128, 256, 14336, 0, 8), (4, 8, 12, 64, 288, 7168, 56, 8),
             (3, 2, 5, 33, 65, 7168 + 16, 57, 9), (32, 8, 24, 128, 512, 14336, 112, 32)]
#: (max tokens, hidden, ranks, experts)
LOW_LATENCY = [(1, 128, 1, 1), (128, 7168, 16, 256), (257, 2048, 3, 9), (512, 7168, 64, 4096), (33, 4096, 8, 72)]


def test_layout_sums_match_the_cuda_structs():
    """config.py's sums (intranode, zero-copy, internode, low-latency) equal the carves of common/layout.cuh,
    evaluated by the compiler in static_asserts (a mismatch is a compile error naming the sum and the shape)."""
    text = layout.layout_probe_source(INTRANODE, INTERNODE, LOW_LATENCY)
    assert text.count("static_assert") == 1 + 5 * len(INTRANODE) + 8 * len(INTERNODE) + 15 * len(LOW_LATENCY)
    result = jit.compile_only("layout_probe.cu", ["layout_probe_kernel"], source=text)
    assert result.cubin[:4] == b"\x7fELF"


def test_a_layout_sum_changed_on_one_side_fails_to_compile(monkeypatch):
    monkeypatch.setattr(config, "combine_channel_bytes", lambda *a: 128)
    with pytest.raises(CompileError) as e:
        jit.compile_only("layout_probe.cu", ["layout_probe_kernel"],
                         source=layout.layout_probe_source(INTRANODE[:1]))
    assert 'static assertion failed with "combine_channel_bytes intranode (1, 1, 1, 16, 1, 0)' in e.value.log


def test_block_shapes_match_the_cuda_templates():
    """validate's intranode warp groups and cuda_internode's block sizes equal Groups / RemoteGroups
    (intranode/groups.cuh) and DispatchShape / CombineShape (internode/roles.cuh), at compile time."""
    lines = ['#include "intranode/groups.cuh"', '#include "internode/roles.cuh"', "using namespace ep;"]
    for r in range(1, 9):
        remote = f"intranode::RemoteGroups<{r}>"
        lines += [f"static_assert(intranode::Groups<{r}>::kWarps == {validate.intranode_warps(r)});",
                  f"static_assert({remote}::kWarpsPerPeer == {validate.intranode_remote_warps(r)});",
                  f"static_assert({remote}::kBatchTokens == {validate.intranode_dispatch_batch(r)});"]
    for g in range(1, 9):
        lines.append(f"static_assert(internode::DispatchShape<{g}>::kThreads == "
                     f"{cuda_internode.threads('dispatch', 2, g)});")
        for n in (2, 3, 8, 16, 17, 32):
            lines.append(f"static_assert(internode::CombineShape<{n}, {g}>::kThreads == "
                         f"{cuda_internode.threads('combine', n, g)});")
    lines.append("__global__ void shapes_probe_kernel() {}")
    jit.compile_only("shapes_probe.cu", ["shapes_probe_kernel"], source="\n".join(lines))
    # by hand from the C++: R-1 remote peers share Groups' warps where that gives each more than 24 / R
    warps = {1: 24, 2: 24, 3: 12, 4: 8, 5: 5, 6: 4, 7: 3, 8: 3}
    assert {r: validate.intranode_remote_warps(r) for r in warps} == warps
    assert [validate.intranode_dispatch_batch(r) for r in (2, 3, 4, 8)] == [96, 64, 32, 32]


def test_low_latency_top_k_bound_is_the_references():
    from cupy_ep import reference
    m = re.search(r"constexpr int kLLMaxTopk\s*=\s*(\d+);", source("common/layout.cuh"))
    assert int(m.group(1)) == config.LL_MAX_TOPK == reference.LOW_LATENCY_MAX_TOPK
    assert layout.LL_MAX_TOKENS == 1 << 19 and layout.LL_MAX_EXPERTS <= 1 << layout.LL_ENTRY_SLOT_SHIFT


def test_low_latency_stamp_names_mirror_the_enum():
    from cupy_ep.cuda import low_latency as cll
    stamps = enum_values(source(*LL), "LLStamp")
    assert [snake(n[len("kStamp"):]) for n, _ in sorted(stamps.items(), key=lambda kv: kv[1])] == \
        list(cll.STAMP_NAMES[:len(stamps)])
    assert sorted(stamps.values()) == list(range(len(stamps)))
    text = source(*LL)
    assert f"kLLStamps = {len(cll.STAMP_NAMES)};" in text


def test_phase_breakdown_is_relative_to_the_earliest_send_start():
    import numpy as np
    from cupy_ep.cuda import low_latency as cll
    col = cll.STAMP_NAMES.index
    stamps = np.zeros((3, len(cll.STAMP_NAMES)), dtype=np.int64)
    stamps[:, 0] = [1000, 3000, 2000]                        # send_start
    stamps[:, col("send_end")] = [11000, 13000, 15000]
    stamps[1, col("recv_first_data")] = 21000                # one block only
    got = cll.phase_breakdown(stamps)
    assert got == {"send_start": 1.0, "send_end": 12.0, "recv_first_data": 20.0, "last_end": 20.0}
    slowest = cll.phase_breakdown(stamps, stat=np.max)
    assert slowest["send_start"] == 2.0 and slowest["send_end"] == 14.0
    stamps[2, col("recv_end")] = 30500                       # one block only, the latest stamp
    assert cll.phase_breakdown(stamps)["last_end"] == 29.5
    assert cll.phase_breakdown(np.zeros((2, len(cll.STAMP_NAMES)), dtype=np.int64)) == {}


def test_low_latency_topk_bounds_mirror_the_kernels():
    """The kernels' top-k bounds are config's, ascending, the last the layout's kLLMaxTopk; every top-k up to it
    gets the smallest bound at or above it (top-k up to 11: the default instantiation, named without a bound)."""
    from cupy_ep import config
    from cupy_ep.cuda import low_latency as cll
    text = source(*LL)
    bounds = re.search(r"constexpr int kLLTopkBounds\[\] = \{([\d, ]+)\};", text).group(1)
    assert tuple(int(b) for b in bounds.split(",")) == config.LL_TOPK_BOUNDS
    assert list(config.LL_TOPK_BOUNDS) == sorted(set(config.LL_TOPK_BOUNDS))
    assert config.LL_TOPK_BOUNDS[-1] == config.LL_MAX_TOPK == 32
    assert "constexpr int kLLDefaultTopkBound = kLLTopkBounds[0];" in text
    for k in range(1, config.LL_MAX_TOPK + 1):
        bound = config.low_latency_topk_bound(k)
        assert bound >= k and not [b for b in config.LL_TOPK_BOUNDS if k <= b < bound]
        tail = "" if k <= 11 else f", {bound}"
        assert cll.kernel_name("dispatch", True, "int", k) == f"ep::dispatch<true, int{tail}>"
        assert cll.kernel_name("combine", False, "long long", k) == f"ep::combine<long long{tail}>"
    assert [config.low_latency_topk_bound(k) for k in (1, 8, 11, 12, 16, 17, 22, 32)] == [11] * 3 + [16] * 2 + [32] * 3
    with pytest.raises(ValueError, match="num_topk"):
        config.low_latency_topk_bound(33)


def test_low_latency_meta_flag_fields_hold_the_limits():
    """The combine's meta flag packs the owner's wire format, top-k and token count + 1 into a positive int32: the
    fields must hold K = LL_MAX_TOPK and T = LL_MAX_TOKENS without overlapping."""
    from cupy_ep import config
    text = source(*LL)
    m = re.search(r"constexpr int kMetaTopkShift = (\d+), kMetaWireShift = (\d+);", text)
    topk_shift, wire_shift = int(m.group(1)), int(m.group(2))
    assert config.LL_MAX_TOKENS + 1 < 1 << topk_shift
    assert config.LL_MAX_TOPK < 1 << (wire_shift - topk_shift)
    assert wire_shift + 2 <= 31  # wire < 4: the value stays positive
    value = (2 << wire_shift) | (config.LL_MAX_TOPK << topk_shift) | (config.LL_MAX_TOKENS + 1)
    assert value < 2 ** 31
    assert (value >> topk_shift) & ((1 << (wire_shift - topk_shift)) - 1) == config.LL_MAX_TOPK
    assert (value & ((1 << topk_shift) - 1)) - 1 == config.LL_MAX_TOKENS and (value >> wire_shift) & 3 == 2


def test_low_latency_combine_shared_memory_mirrors_the_kernel():
    """combine_stage_bytes sizes the dynamic shared memory the kernel's stage_slot indexes: its constants are the
    kernel's, and at the largest top-k it fits a block with the kernel's static shared memory."""
    from cupy_ep.cuda import low_latency as cll
    from cupy_ep import reference
    text = source(*LL)
    assert (cll._COMBINE_CHUNKS, cll._COMBINE_THREADS) == (ids.LL_COMBINE_CHUNKS, ids.LL_COMBINE_THREADS)
    # the dispatch is launched with the block size its __launch_bounds__ and its warp roles assume
    assert cll._THREADS == ids.LL_DISPATCH_THREADS and "__launch_bounds__(kLLThreads, 1)" in text
    assert "stage + (i * kCombineChunks + q) * kLLCombineThreads + threadIdx.x" in text
    assert f"constexpr int kCombineStageEntries = {cll.COMBINE_STAGE_ENTRIES};" in text
    # the stage holds min(K, kCombineStageEntries) entries: K up to 11 as many as K, above that 11
    for k in range(1, reference.LOW_LATENCY_MAX_TOPK + 1):
        assert cll.combine_stage_bytes(k) == 512 * 2 * 16 * min(k, 11)
    # with the static shared memory of the largest bound's combine (25 KB; the default one has 19 KB)
    assert cll.combine_stage_bytes(reference.LOW_LATENCY_MAX_TOPK) + 26 * 1024 <= 227 * 1024


def test_low_latency_wire_formats_mirror_the_enum():
    from cupy_ep.cuda import low_latency as cll
    assert enum_values(source(*LL), "Wire") == {"kWire24": cll.WIRE_24, "kWireBf16": cll.WIRE_BF16,
                                                           "kWireLogFmt": cll.WIRE_LOGFMT}


def test_logfmt_constants_mirror_the_kernel():
    """The kernel's LogFMT-10 constants are written by their bits; cupy_ep/logfmt.py holds the same bits (and
    test_logfmt.py checks each is the float32 nearest its value): a constant changed on one side only would make
    the GPU's decoded values differ from the reference's."""
    from cupy_ep import logfmt
    text = source(*LL)
    body = text[text.index("__device__ __forceinline__ float logfmt_log2"):text.index("struct LogFmtChunk")]
    used = {int(h, 16) for h in re.findall(r"0x([0-9a-f]{8})u", body)}
    want = {bits for bits, _ in logfmt.CONSTANTS.values()} | set(logfmt.INV_FACTORIALS)
    assert want <= used | {0x3F800000, 0x3F000000}
    assert used - {0x7FFFFF, 0x3F800000} <= want
    assert "(long long)L.hidden / 16 * 21" in text and logfmt.wire_bytes(7168) == 7168 // 16 * 21


def _kernel_parameters(text: str, name: str) -> list[str]:
    """The parameter names of ``__global__ ... name(...)`` in ``text``, in order."""
    match = re.search(r"__global__ void (?:__launch_bounds__\([^()]*(?:\([^()]*\))?[^()]*\)\s*)?%s\s*\((.*?)\)\s*\{"
                      % name, text, re.S)
    assert match, f"__global__ {name} not found"
    return [re.sub(r"\[.*\]", "", p).strip().split()[-1].lstrip("*&") for p in match.group(1).split(",")]


def test_kernel_argument_records_are_the_kernels_signatures():
    """Each launcher's record (cupy_ep/cuda/kernels.py) has its kernel's parameters, by name and in order: a
    parameter added, removed or moved on one side only would pass its neighbours' values."""
    from cupy_ep.cuda import kernels
    assert len(kernels.RECORDS) == 9
    for name, (filename, record) in kernels.RECORDS.items():
        assert list(record._fields) == _kernel_parameters(source(filename), name), name


def test_the_signature_reader_reads_a_launch_bounds_kernel():
    text = "__global__ void __launch_bounds__(Groups<kNumRanks>::kThreads, 1)\nk(int4* a, const int b) {"
    assert _kernel_parameters(text, "k") == ["a", "b"]
