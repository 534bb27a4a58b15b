"""The Python tables that turn a device failure record into an exception mirror the CUDA enums: a role or
kernel added on one side only would surface as a bare number (or the wrong name) in CommError messages."""
import re
from pathlib import Path

from cupy_ep import validate
from cupy_ep.cuda import runtime

SRC = Path(__file__).resolve().parent.parent / "cuda_src"


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


def test_role_names_mirror_the_cuda_enums():
    expected = {v: snake(n[len("kRole"):]) for n, v in enum_values(source("common/wait.cuh"), "Role").items()}
    for name, value in enum_values(source("internode/roles.cuh"), "WarpRole").items():
        if name == "kIdle":
            continue  # never waits, never reports
        expected[value] = snake(name[len("kRole"):]) if name.startswith("kRole") else name
    assert runtime.ROLE_NAMES == expected


def test_kernel_names_cover_every_kernel_id():
    ids = enum_values(source("common/wait.cuh"), "KernelId")
    assert sorted(runtime.KERNEL_NAMES) == sorted(ids.values())
    # the name is the kernel's own (snake case of the enum without the kKernel prefix), where it has one
    by_value = {v: snake(n[len("kKernel"):]) for n, v in ids.items()}
    for value, name in runtime.KERNEL_NAMES.items():
        assert name == by_value[value] or (value == 1 and name == "get_dispatch_layout"), (value, name)


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


def test_dispatch_sender_groups_mirror_remote_groups():
    """validate's sender-warp and batch sizes (both backends refuse by them) follow RemoteGroups in
    intranode/groups.cuh (a smaller Python value would let through a ring the sender can never fill: a hang, not an
    error)."""
    text = source("intranode/groups.cuh")
    assert "kBatchWindows = (kWarpsPerPeer * 4 + kWarpSize - 1) / kWarpSize;" in text
    assert "kWarpsPerRank = 24 / kNumRanks;" in text
    # by hand from the C++: R-1 remote peers share Groups' warps where that gives each more than 24 / R
    warps = {1: 24, 2: 24, 3: 12, 4: 8, 5: 5, 6: 4, 7: 3, 8: 3}
    for r, w in warps.items():
        assert validate.intranode_remote_warps(r) == w, r
        assert validate.intranode_dispatch_batch(r) == -(-w * 4 // 32) * 32
    assert [validate.intranode_dispatch_batch(r) for r in (2, 3, 4, 8)] == [96, 64, 32, 32]


def test_low_latency_limits_mirror_the_cuda_constants():
    from cupy_ep import config, reference

    def constant(text: str, name: str) -> int:
        return int(re.search(r"constexpr int " + name + r"\s*=\s*(\d+);", text).group(1))
    assert constant(source("common/layout.cuh"), "kLLMaxTopk") == config.LL_MAX_TOPK == reference.LOW_LATENCY_MAX_TOPK
    assert constant(source(*LL), "kLLMaxExperts") == config.LL_MAX_EXPERTS
    assert constant(source(*LL), "kLLMaxRanks") == config.LL_MAX_RANKS
    # the combine's entry code: slot << kEntrySlotShift | expert in an int32
    shift = constant(source(*LL), "kEntrySlotShift")
    assert "constexpr int kLLMaxTokens = 1 << (31 - kEntrySlotShift);" in source(*LL)
    assert config.LL_MAX_TOKENS == 1 << (31 - shift) and config.LL_MAX_EXPERTS <= 1 << shift


def test_low_latency_combine_shared_memory_mirrors_the_kernel():
    """combine_stage_bytes sizes the dynamic shared memory the kernel's stage_slot indexes: its constants are the
    kernel's, and at the largest top-k it fits a block with the kernel's static shared memory (~19 KB)."""
    from cupy_ep.cuda import low_latency as cll
    from cupy_ep import reference
    text = source(*LL)
    assert f"constexpr int kCombineChunks = {cll._COMBINE_CHUNKS};" in text
    assert f"constexpr int kLLCombineThreads = {cll._COMBINE_THREADS};" in text
    # the dispatch is launched with the block size its __launch_bounds__ and its warp roles assume
    assert f"constexpr int kLLThreads = {cll._THREADS};" in text
    assert "stage + (i * kCombineChunks + q) * kLLCombineThreads + threadIdx.x" in text
    assert cll.combine_stage_bytes(reference.LOW_LATENCY_MAX_TOPK) + 20 * 1024 <= 227 * 1024


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
