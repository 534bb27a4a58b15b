"""The GPU low-latency calls' argument checks and their fast path, without a GPU (cuda_low_latency.LowLatencyState
check_dispatch / check_combine on real CuPy arrays over a fake device pointer: CuPy builds and describes them without
a driver; nothing here reads their memory).

A call whose arguments have the signature of the last call that passed skips the checks (host time per call) when
check_values is False. Every other call must behave exactly as without the fast path: here each variation of a valid
argument set must give the same result or the same exception and message, after a passing call, as on a fresh state
(which always runs every check)."""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cupy_ep.cuda import low_latency as cll  # noqa: E402
from cupy_ep import interop  # noqa: E402
from cupy_ep.ll_handle import LowLatencyHandle  # noqa: E402

R, M, H, E, T, K = 2, 16, 512, 8, 12, 3
L = E // R


def gpu_array(shape, dtype, device=0, strides=None, offset=0):
    """A CuPy array over a made-up device address (never dereferenced), ``offset`` bytes past a 16-byte boundary."""
    memory = cupy.cuda.UnownedMemory(1 << 40, 1 << 30, None, device)
    return cupy.ndarray(shape, dtype=dtype, memptr=cupy.cuda.MemoryPointer(memory, offset), strides=strides)


class FakeBuf:
    device_id = 0
    num_ranks = R


def fresh_state():
    state = cll.LowLatencyState.__new__(cll.LowLatencyState)
    state.buf = FakeBuf()
    return state


def dispatch_args(**changes):
    args = dict(x=gpu_array((T, H), interop.BF16), topk_idx=gpu_array((T, K), np.int64), max_tokens=M,
                num_experts=E, stats=None, wait_stats=None, use_fp8=True, round_scale=False, use_ue8m0=False,
                async_finish=False, return_recv_hook=False, check_values=False)
    args.update(changes)
    return args


def make_handle(src_info=None, layout_range=None, max_tokens=M, hidden=H, num_experts=E, slots=None):
    src_info = gpu_array((L, R * M), np.int32) if src_info is None else src_info
    layout_range = gpu_array((L, R), np.int64) if layout_range is None else layout_range
    slots = gpu_array((T, K), np.int32) if slots is None else slots
    return LowLatencyHandle((src_info, layout_range, max_tokens, hidden, num_experts), slots)


def combine_args(**changes):
    args = dict(x=gpu_array((L, R * M, H), interop.BF16), topk_idx=gpu_array((T, K), np.int64),
                topk_weights=gpu_array((T, K), np.float32), handle=make_handle(), use_logfmt=False, zero_copy=False,
                async_finish=False, return_recv_hook=False, out=None, wait_stats=None, bf16_partials=False,
                check_values=False)
    args.update(changes)
    return args


def outcome(call):
    """What a call gives: its result (the raw arrays of a combine's result by identity), or its exception."""
    try:
        result = call()
    except Exception as e:  # noqa: BLE001 (compared, never swallowed)
        return ("raised", type(e), str(e))
    return ("returned",) + tuple(id(r) if isinstance(r, cupy.ndarray) else r for r in result)


class _FakeTorchTensor:
    """Enough of a torch tensor for interop (its library is found by the module name)."""
    __module__ = "torch.fake"

    def __init__(self, shape, dtype="torch.bfloat16", contiguous=True, device=("cuda", 0), ptr=1 << 40):
        self.shape, self.dtype, self._contiguous, self.device = tuple(shape), dtype, contiguous, device
        self._ptr = ptr
        self.ndim, self.is_cuda = len(self.shape), device[0] == "cuda"

    def data_ptr(self):
        return self._ptr

    def is_contiguous(self):
        return self._contiguous


# ---- the signature ------------------------------------------------------------------------------------------
def test_array_signature_is_equal_for_arrays_the_checks_treat_alike():
    sig = interop.array_signature
    a, b = gpu_array((T, H), interop.BF16), gpu_array((T, H), interop.BF16)
    assert sig(a) == sig(b)
    assert sig(None) is None
    wide = gpu_array((T, 2 * H), interop.BF16)
    for other in (gpu_array((T + 1, H), interop.BF16), gpu_array((T, H), np.uint16),
                  gpu_array((T, H), interop.BF16, device=1), wide[:, :H], gpu_array((T, H, 1), interop.BF16),
                  gpu_array((T, H), interop.BF16, offset=2)):
        assert sig(other) != sig(a)
    assert not wide[:, :H].flags.c_contiguous and wide[:, :H].shape == a.shape


def test_array_signature_of_torch_tensors_sees_device_and_contiguity():
    sig = interop.array_signature
    t = _FakeTorchTensor((T, H))
    assert sig(t) == sig(_FakeTorchTensor((T, H)))
    for other in (_FakeTorchTensor((T, H), device=("cuda", 1)), _FakeTorchTensor((T, H), device=("cpu", None)),
                  _FakeTorchTensor((T, H), contiguous=False), _FakeTorchTensor((T, H), dtype="torch.float32"),
                  _FakeTorchTensor((T, H + 1)), _FakeTorchTensor((T, H), ptr=(1 << 40) + 2)):
        assert sig(other) != sig(t)


@pytest.mark.parametrize("value", [np.zeros((T, H), np.uint16), [1, 2], "x", 3])
def test_array_signature_of_anything_else_matches_nothing(value):
    assert interop.array_signature(value) != interop.array_signature(value)


def test_handle_signature_needs_a_low_latency_handle():
    h = make_handle()
    assert cll.handle_signature(h) == cll.handle_signature(make_handle())
    assert cll.handle_signature(tuple(h)) != cll.handle_signature(tuple(h))
    assert cll.handle_signature(make_handle(max_tokens=np.int64(M))) != cll.handle_signature(h)
    assert cll.handle_signature(make_handle(slots=gpu_array((T, K), np.int64))) != cll.handle_signature(h)


# ---- when the checks run ----------------------------------------------------------------------------------
def _counting(state, name):
    """Count the full checks of ``name`` ("dispatch" / "combine") on ``state``."""
    calls = []
    full = getattr(state, f"_check_{name}")

    def counted(*args):
        calls.append(args)
        return full(*args)
    setattr(state, f"_check_{name}", counted)
    return calls


def test_a_repeated_dispatch_skips_the_checks():
    state = fresh_state()
    calls = _counting(state, "dispatch")
    first = state.check_dispatch(**dispatch_args())
    assert first == (M, T, H, (True, False, False, False, False), None)  # no routing digest without check_values
    again = state.check_dispatch(**dispatch_args())   # new arrays, same signature
    assert again == first and len(calls) == 1
    state.check_dispatch(**dispatch_args(use_fp8=False))
    state.check_dispatch(**dispatch_args(use_fp8=False))
    assert len(calls) == 2


def test_a_repeated_combine_skips_the_checks_but_returns_this_calls_raw_arrays():
    state = fresh_state()
    calls = _counting(state, "combine")
    state.check_combine(**combine_args())
    args = combine_args()
    result = state.check_combine(**args)
    assert len(calls) == 1
    assert result[0] is interop.unwrap(args["handle"][1]) and result[1] is args["handle"].topk_slots
    assert result[2:] == (M, H, E, T, K, (False, False, False, False, False))


@pytest.mark.parametrize("name", ["dispatch", "combine"])
def test_with_check_values_every_call_runs_the_checks(name):
    state = fresh_state()
    calls = []
    canned = (M, T, H, (True,) * 5) if name == "dispatch" else (None, None, M, H, E, T, K, (False,) * 5)
    setattr(state, f"_check_{name}", lambda *args: calls.append(args) or canned)
    check = getattr(state, f"check_{name}")
    make = dispatch_args if name == "dispatch" else combine_args
    for check_values in (False, True, True, False):
        check(**make(check_values=check_values))
    assert [c[-1] for c in calls] == [False, True, True]  # the last: the first call's signature, remembered


# ---- the same outcome as a fresh state (full checks) for every variation ----------------------------------
wide_x = gpu_array((T, 2 * H), interop.BF16)
DISPATCH_VARIATIONS = {
    "same": {},
    "x/fewer-tokens": dict(x=gpu_array((T - 1, H), interop.BF16), topk_idx=gpu_array((T - 1, K), np.int64)),
    "x/dtype": dict(x=gpu_array((T, H), np.float32)),
    "x/not-contiguous": dict(x=wide_x[:, :H]),
    "x/other-gpu": dict(x=gpu_array((T, H), interop.BF16, device=1)),
    "x/host": dict(x=np.zeros((T, H), interop.BF16)),
    "x/none": dict(x=None),
    "x/misaligned": dict(x=gpu_array((T, H), interop.BF16, offset=2)),
    "x/aligned-elsewhere": dict(x=gpu_array((T, H), interop.BF16, offset=256)),
    "x/hidden": dict(x=gpu_array((T, 384), interop.BF16)),
    "x/too-many-tokens": dict(x=gpu_array((M + 4, H), interop.BF16), topk_idx=gpu_array((M + 4, K), np.int64)),
    "topk_idx/int32": dict(topk_idx=gpu_array((T, K), np.int32)),
    "topk_idx/float": dict(topk_idx=gpu_array((T, K), np.float32)),
    "topk_idx/rows": dict(topk_idx=gpu_array((T + 1, K), np.int64)),
    "topk_idx/topk": dict(topk_idx=gpu_array((T, 33), np.int64)),
    "stats/ok": dict(stats=gpu_array((L,), np.int32)),
    "stats/shape": dict(stats=gpu_array((L + 1,), np.int32)),
    "wait_stats/dtype": dict(wait_stats=gpu_array((R,), np.int32)),
    "max_tokens/numpy": dict(max_tokens=np.int64(M)),
    "max_tokens/float": dict(max_tokens=float(M)),
    "max_tokens/bool": dict(max_tokens=True),
    "max_tokens/larger": dict(max_tokens=M + 2),
    "num_experts/numpy": dict(num_experts=np.int64(E)),
    "num_experts/other": dict(num_experts=E + 1),
    "use_fp8/int": dict(use_fp8=1),
    "use_fp8/numpy-bool": dict(use_fp8=np.bool_(True)),
    "use_fp8/false": dict(use_fp8=False),
    "round_scale/none": dict(round_scale=None),
    "use_ue8m0/without-round-scale": dict(use_ue8m0=True),
    "use_ue8m0/with-round-scale": dict(use_ue8m0=True, round_scale=True),
    "async_finish/hook": dict(async_finish=True, return_recv_hook=True),
    "two-errors/flag-first": dict(use_fp8="yes", x=gpu_array((T, H), np.float32)),
}

_handle = make_handle()
COMBINE_VARIATIONS = {
    "same": {},
    "x/shape": dict(x=gpu_array((L, R * M, H + 128), interop.BF16)),
    "x/dtype": dict(x=gpu_array((L, R * M, H), np.float32)),
    "x/none": dict(x=None),
    "x/none-zero-copy": dict(x=None, zero_copy=True),
    "x/zero-copy": dict(zero_copy=True),
    "x/other-gpu": dict(x=gpu_array((L, R * M, H), interop.BF16, device=1)),
    "topk_idx/int32": dict(topk_idx=gpu_array((T, K), np.int32)),
    "topk_idx/not-the-dispatch-shape": dict(topk_idx=gpu_array((T - 1, K), np.int64)),
    "topk_idx/too-many-rows": dict(topk_idx=gpu_array((M + 1, K), np.int64)),
    "topk_weights/dtype": dict(topk_weights=gpu_array((T, K), np.float64)),
    "topk_weights/shape": dict(topk_weights=gpu_array((T, K + 1), np.float32)),
    "handle/plain-tuple": dict(handle=tuple(_handle)),
    "handle/four-items": dict(handle=LowLatencyHandle(tuple(_handle)[:4], _handle.topk_slots)),
    "handle/list": dict(handle=list(_handle)),
    "handle/src_info-shape": dict(handle=make_handle(src_info=gpu_array((L, R * M + 4), np.int32))),
    "handle/layout_range-dtype": dict(handle=make_handle(layout_range=gpu_array((L, R), np.int32))),
    "handle/max_tokens-numpy": dict(handle=make_handle(max_tokens=np.int64(M))),
    "handle/max_tokens-bool": dict(handle=make_handle(max_tokens=True)),
    "handle/hidden": dict(handle=make_handle(hidden=H + 1)),
    "handle/slots-dtype": dict(handle=make_handle(slots=gpu_array((T, K), np.int64))),
    "handle/slots-shape": dict(handle=make_handle(slots=gpu_array((T, K + 1), np.int32))),
    "handle/slots-none": dict(handle=LowLatencyHandle(tuple(_handle), None)),
    "out/ok": dict(out=gpu_array((T, H), interop.BF16)),
    "out/shape": dict(out=gpu_array((T + 1, H), interop.BF16)),
    "out/misaligned": dict(out=gpu_array((T, H), interop.BF16, offset=8)),
    "x/misaligned": dict(x=gpu_array((L, R * M, H), interop.BF16, offset=4)),
    "wait_stats/ok": dict(wait_stats=gpu_array((R,), np.int64)),
    "use_logfmt/true": dict(use_logfmt=True),
    "use_logfmt/zero-copy": dict(use_logfmt=True, zero_copy=True),
    "use_logfmt/bf16_partials": dict(use_logfmt=True, bf16_partials=True),
    "zero_copy/int": dict(zero_copy=0),
    "bf16_partials/true": dict(bf16_partials=True),
    "async_finish/hook": dict(async_finish=True, return_recv_hook=True),
    "two-errors/handle-first": dict(handle=tuple(_handle), topk_weights=None),
}


def _same_as_fresh(name, make, changes):
    check = lambda state, args: getattr(state, f"check_{name}")(**args)  # noqa: E731
    args = make(**changes)
    want = outcome(lambda: check(fresh_state(), args))
    state = fresh_state()
    valid = make()
    assert outcome(lambda: check(state, valid))[0] == "returned"
    assert outcome(lambda: check(state, args)) == want, "differs after a passing call"
    assert outcome(lambda: check(state, args)) == want, "differs the second time"
    assert outcome(lambda: check(state, valid))[0] == "returned"
    return want


@pytest.mark.parametrize("changes", DISPATCH_VARIATIONS.values(), ids=DISPATCH_VARIATIONS.keys())
def test_dispatch_checks_give_what_a_fresh_state_gives(changes):
    _same_as_fresh("dispatch", dispatch_args, changes)


@pytest.mark.parametrize("changes", COMBINE_VARIATIONS.values(), ids=COMBINE_VARIATIONS.keys())
def test_combine_checks_give_what_a_fresh_state_gives(changes):
    _same_as_fresh("combine", combine_args, changes)


PASSING = {"dispatch": {"same", "x/fewer-tokens", "x/aligned-elsewhere",
                        "topk_idx/int32", "stats/ok", "max_tokens/numpy", "max_tokens/larger",
                        "use_fp8/numpy-bool", "use_fp8/false", "use_ue8m0/with-round-scale"},
           "combine": {"same", "x/none-zero-copy", "x/zero-copy", "topk_idx/int32", "handle/max_tokens-numpy", "out/ok",
                       "wait_stats/ok", "bf16_partials/true", "use_logfmt/true"}}


def test_the_variations_cover_passing_and_failing_calls():
    """Guard for the two tests above: these variations pass, every other raises."""
    for name, make, variations in (("dispatch", dispatch_args, DISPATCH_VARIATIONS),
                                   ("combine", combine_args, COMBINE_VARIATIONS)):
        got = {k: outcome(lambda: getattr(fresh_state(), f"check_{name}")(**make(**v))) for k, v in variations.items()}
        assert {k for k, o in got.items() if o[0] == "returned"} == PASSING[name]


def test_a_misaligned_x_is_refused_by_name_even_after_an_aligned_call_passed():
    state = fresh_state()
    state.check_dispatch(**dispatch_args())  # remembered: the next call with the same signature skips the checks
    with pytest.raises(ValueError, match=r"^x: must start at a multiple of 16 bytes .* starts 2 bytes past one"):
        state.check_dispatch(**dispatch_args(x=gpu_array((T, H), interop.BF16, offset=2)))
    state.check_combine(**combine_args())
    with pytest.raises(ValueError, match=r"^out: must start at a multiple of 16 bytes"):
        state.check_combine(**combine_args(out=gpu_array((T, H), interop.BF16, offset=8)))
