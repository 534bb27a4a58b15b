"""LogFMT-10 (cupy_ep/logfmt.py), the low-latency combine's compressed wire format: its definition in numpy, which
the kernel reproduces bit for bit (the GPU tests compare exactly), checked against plain float64 math here."""
import numpy as np
import pytest

from cupy_ep import logfmt, reference


def test_constants_are_the_float32_nearest_their_values():
    for name, (bits, value) in logfmt.CONSTANTS.items():
        assert np.array(bits, dtype=np.uint32).view(np.float32) == np.float32(value), name
    for i, bits in enumerate(logfmt.INV_FACTORIALS):  # 1/7! .. 1/1!
        k = 7 - i
        assert np.array(bits, dtype=np.uint32).view(np.float32) == np.float32(1 / np.prod(np.arange(1, k + 1))), k


def test_log2_and_exp2_are_accurate_to_float32():
    rng = np.random.default_rng(1)
    a = np.exp2(rng.uniform(-126, 127, 200_000)).astype(np.float32)
    a = a[(a > 0) & np.isfinite(a)]
    exact = np.log2(a.astype(np.float64))
    # within a few float32 ulps of the result (|log2| up to 127: ulp 7.6e-6)
    assert np.all(np.abs(logfmt.log2(a) - exact) <= 4e-7 * np.maximum(1, np.abs(exact)) + 1e-7)
    y = rng.uniform(-125, 127, 200_000).astype(np.float32)
    exact = np.exp2(y.astype(np.float64))
    assert np.all(np.abs(logfmt.exp2(y) - exact) <= 3e-7 * exact)
    assert logfmt.exp2(np.float32(-130)) == 0 and logfmt.exp2(np.float32(3)) == 8
    assert logfmt.log2(np.float32(1)) == 0 and logfmt.log2(np.float32(0.25)) == -2


def test_a_division_of_one_and_two():
    """lmax = 1, lmin = 0, step = 1/510: 1 and 2 come back exactly, 1.5 as code 299 (2^(298/510))."""
    x = np.zeros(128, dtype=np.float32)
    x[:3] = [1.0, 2.0, -1.5]
    codes, negative, lmin, step = logfmt.encode(x)
    assert lmin.tolist() == [0.0] and step[0] == np.float32(1) / np.float32(510)
    assert codes[:4].tolist() == [1, 511, 299, 0] and negative[:4].tolist() == [False, False, True, False]
    y = logfmt.decode(codes, negative, lmin, step)
    assert y[0] == 1 and y[1] == 2 and y[3:].tolist() == [0] * 125
    assert abs(y[2] + 2 ** (298 / 510)) < 1e-6


def test_roundtrip_error_stays_within_the_bound():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 2048)) * np.exp2(rng.integers(-20, 20, (6, 2048)))
    x[rng.random(x.shape) < 0.1] = 0
    x = x.astype(np.float32)
    codes, negative, lmin, step = logfmt.encode(x)
    y = logfmt.decode(codes, negative, lmin, step)
    assert codes.max() <= logfmt.MAX_CODE and codes.dtype == np.uint16 and lmin.shape == (6, 16)
    bound = np.repeat(logfmt.error_bound(step), 128, axis=-1)
    big = np.abs(x) >= np.repeat(np.abs(x.reshape(6, 16, 128)).max(-1), 128, axis=-1) * 2.0 ** -31
    nonzero = big & (x != 0)
    rel = np.abs(y.astype(np.float64)[nonzero] - x[nonzero]) / np.abs(x[nonzero])
    assert np.all(rel <= bound[nonzero])
    assert np.all(y[x == 0] == 0) and np.all(np.sign(y[big]) == np.sign(x[big]))
    assert np.array_equal(logfmt.roundtrip(x), y) and reference.low_latency_partial_wire(x, logfmt=True).tobytes() \
        == y.tobytes()


def test_zeros_subnormals_one_magnitude_and_the_32_octave_clip():
    x = np.zeros((4, 128), dtype=np.float32)
    x[1, :5] = [np.float32(1e-40), -np.float32(1e-39), 0, 0, 0]     # subnormals count as zero
    x[2, :3] = [0.75, -0.75, 0.75]                                   # one magnitude: step 0, code 1
    x[3, :3] = [1.0, 2.0 ** -33, 2.0 ** -31]                          # 2^-33 is more than 32 octaves below
    codes, negative, lmin, step = logfmt.encode(x)
    y = logfmt.decode(codes, negative, lmin, step)
    lmin, step = lmin[:, 0], step[:, 0]  # one division per row
    assert lmin[:2].tolist() == [0, 0] and step[:2].tolist() == [0, 0] and not codes[:2].any()
    assert step[2] == 0 and codes[2, :3].tolist() == [1, 1, 1] and codes[2, 3:].sum() == 0
    assert np.allclose(y[2, :3], [0.75, -0.75, 0.75], rtol=1e-6, atol=0)
    assert lmin[3] == -32 and codes[3, 1] == 0 and y[3, 1] == 0 and codes[3, 0] == 511
    assert abs(y[3, 2] / 2.0 ** -31 - 1) <= logfmt.error_bound(step[3])


def test_rows_must_hold_whole_divisions_and_the_wire_is_1_3125_bytes_per_value():
    with pytest.raises(ValueError, match="multiple of 128"):
        logfmt.encode(np.zeros((2, 100), dtype=np.float32))
    assert logfmt.wire_bytes(7168) == 9408 == 7168 * 21 // 16


def test_reference_combine_with_logfmt_partials_is_close_to_the_24_bit_one():
    """The owner's use_logfmt changes only the wire rounding of the partials: the result stays within the LogFMT
    bound of each partial (plus the final bf16 rounding) of the default 24-bit result."""
    rng = np.random.default_rng(3)
    R, M, H, E, T, K = 2, 8, 256, 8, 6, 3
    idx = [np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int64) for _ in range(R)]
    w = [rng.random((T, K), dtype=np.float32) for _ in range(R)]
    y = [(rng.standard_normal((E // R, R * M, H)) * 0.1).astype(reference.bfloat16) for _ in range(R)]
    for rank in range(R):
        exact = reference.low_latency_combine(y, idx, w, M, E, rank).astype(np.float32)
        got = reference.low_latency_combine(y, idx, w, M, E, rank, use_logfmt=True).astype(np.float32)
        scale = np.abs(exact).max()
        assert 0 < np.abs(got - exact).max() <= 0.05 * scale
