"""LogFMT-10, the low-latency combine's compressed wire format (``use_logfmt=True``), defined in numpy.

DeepEP's LogFMT idea, our own definition: per *division* of 128 consecutive values of a row, each value becomes a
sign and a 9-bit code on a log2 scale spanning the division's magnitudes, 10 bits per value plus 8 bytes per
division: 1.3125 bytes per value on the wire instead of 3 (24-bit partials) or 2 (bf16).

For a division with magnitudes ``a`` (subnormals count as 0) and ``amax = max a > 0``, ``amin`` the smallest
nonzero one:

* ``lmax = log2(amax)``, ``lmin = max(log2(amin), lmax - 32)``, ``step = (lmax - lmin) / 510``; the meta is
  ``(lmin, step)`` (two float32);
* code 0 is zero; code ``k`` in 1..511 is ``2^(lmin + (k - 1) * step)``; a nonzero value takes ``k = clip(floor(t +
  1/2) + 1, 0, 511)``, ``t = (log2(a) - lmin) * (1 / step)`` (its nearest code on the log2 scale; values more than
  32 octaves below amax become 0); with ``step == 0`` (one magnitude) every nonzero value takes code 1;
* a division that is all zero has meta ``(0, 0)`` and codes 0.

The relative error of a decoded value is at most ``2^(step/2) - 1`` (2.2 % when a division spans 32 octaves, 0.5 %
when it spans 8) plus ~1e-7 from the polynomials. Finite values below 2^127 only.

``log2`` and ``exp2`` are written out with float32 products, sums and quotients rounded to nearest (no FMA) and
constants given by their bits, so the kernel (``logfmt_encode`` / ``logfmt_decode`` in cuda_src/low_latency/combine.cuh)
reproduces every decoded value bit for bit: the tests compare exactly.
"""
from __future__ import annotations

import numpy as np

DIVISION = 128         # values per division (a half-warp's 16 chunks of 8 on the GPU)
MAX_CODE = 511         # 9 bits
CLIP_OCTAVES = 32      # lmin >= lmax - 32


def _f32(bits: int) -> np.float32:
    return np.array(bits, dtype=np.uint32).view(np.float32)[()]


# (bits, value) of every constant; tests/unit/test_logfmt.py checks each is the float32 nearest its value
CONSTANTS = {
    "sqrt2": (0x3FB504F3, 2 ** 0.5), "inv7": (0x3E124925, 1 / 7), "inv5": (0x3E4CCCCD, 1 / 5),
    "inv3": (0x3EAAAAAB, 1 / 3), "two_over_ln2": (0x4038AA3B, 2 / np.log(2)), "ln2": (0x3F317218, np.log(2)),
}
INV_FACTORIALS = (0x39500D01, 0x3AB60B61, 0x3C088889, 0x3D2AAAAB, 0x3E2AAAAB, 0x3F000000, 0x3F800000)  # 1/7! .. 1/1!
_C = {name: _f32(bits) for name, (bits, _) in CONSTANTS.items()}
_ONE, _HALF = np.float32(1.0), np.float32(0.5)


def log2(a: np.ndarray) -> np.ndarray:
    """log2 of positive normal float32 values: the exponent plus ``2/ln2 * atanh(s)``, ``s = (m - 1) / (m + 1)``,
    m the mantissa scaled into [0.707, 1.414] (four odd terms of the series)."""
    a = np.asarray(a, dtype=np.float32)
    bits = a.view(np.uint32)
    e = (bits >> 23).astype(np.int32) - 127
    m = ((bits & np.uint32(0x7FFFFF)) | np.uint32(0x3F800000)).view(np.float32)
    big = m > _C["sqrt2"]
    m = np.where(big, m * _HALF, m)
    e = e + big
    s = (m - _ONE) / (m + _ONE)
    z = s * s
    poly = _C["inv7"] * z + _C["inv5"]
    poly = poly * z + _C["inv3"]
    poly = poly * z + _ONE
    return e.astype(np.float32) + (s * poly) * _C["two_over_ln2"]


def exp2(y: np.ndarray) -> np.ndarray:
    """2^y for float32 y: ``2^n * e^(f ln2)``, ``n = floor(y + 1/2)``, ``e^x`` by its Taylor polynomial to x^7;
    0 below 2^-126; n is capped at 127 (values of 2^127.5 and more come back halved: not a partial sum's range)."""
    y = np.asarray(y, dtype=np.float32)
    n = np.floor(y + _HALF)
    x = (y - n) * _C["ln2"]
    p = np.full_like(x, _f32(INV_FACTORIALS[0]))
    for bits in INV_FACTORIALS[1:]:
        p = p * x + _f32(bits)
    p = p * x + _ONE
    ni = n.astype(np.int32)
    scale = ((np.clip(ni, -126, 127) + 127).astype(np.uint32) << np.uint32(23)).view(np.float32)
    return np.where(ni < -126, np.float32(0), p * scale).astype(np.float32)


def encode(values: np.ndarray):
    """``values [..., H]`` float32 (``H % 128 == 0``) -> ``(codes [..., H] uint16 (0..511), negative [..., H] bool,
    lmin [..., H/128] float32, step [..., H/128] float32)``."""
    v = np.asarray(values, dtype=np.float32)
    shape = v.shape
    if v.shape[-1] % DIVISION:
        raise ValueError(f"values: the last dimension must be a multiple of {DIVISION}, got {v.shape[-1]}")
    v = v.reshape(v.shape[:-1] + (v.shape[-1] // DIVISION, DIVISION))
    bits = v.view(np.uint32)
    a = np.where(((bits >> 23) & np.uint32(0xFF)) != 0, np.abs(v), np.float32(0))
    amax = a.max(axis=-1)
    amin = np.where(a > 0, a, np.float32(np.inf)).min(axis=-1)
    nonzero = amax > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        lmax = log2(np.where(nonzero, amax, _ONE))
        lmin = np.maximum(log2(np.where(nonzero, amin, _ONE)), lmax - np.float32(CLIP_OCTAVES))
        step = (lmax - lmin) / np.float32(MAX_CODE - 1)
        lmin, step = np.where(nonzero, lmin, np.float32(0)), np.where(nonzero, step, np.float32(0))
        inv_step = _ONE / step
        t = (log2(np.where(a > 0, a, _ONE)) - lmin[..., None]) * inv_step[..., None]
        k = np.clip(np.floor(t + _HALF) + _ONE, np.float32(0), np.float32(MAX_CODE))
    k = np.where(step[..., None] == 0, np.float32(1), k)
    codes = np.where(a > 0, k, np.float32(0)).astype(np.uint16)
    negative = (codes > 0) & ((bits >> 31) != 0)
    return codes.reshape(shape), negative.reshape(shape), lmin.astype(np.float32), step.astype(np.float32)


def decode(codes: np.ndarray, negative: np.ndarray, lmin: np.ndarray, step: np.ndarray) -> np.ndarray:
    """The float32 values of :func:`encode`'s output (``lmin + (code - 1) * step`` in float32, then exp2)."""
    codes = np.asarray(codes)
    shape = codes.shape
    c = codes.reshape(shape[:-1] + (shape[-1] // DIVISION, DIVISION))
    y = lmin[..., None] + (c.astype(np.float32) - _ONE) * step[..., None]
    value = np.where(c == 0, np.float32(0), exp2(y))
    value = np.where(np.asarray(negative).reshape(c.shape), -value, value)
    return value.astype(np.float32).reshape(shape)


def roundtrip(values: np.ndarray) -> np.ndarray:
    """``values`` as the LogFMT-10 wire carries them (decode of encode)."""
    return decode(*encode(values))


def wire_bytes(hidden: int) -> int:
    """Bytes of one LogFMT-10 row of ``hidden`` values: 8 per division + 10 bits per value."""
    return hidden // DIVISION * 8 + hidden * 10 // 8


def error_bound(step: np.ndarray) -> np.ndarray:
    """The largest relative error of a decoded value in a division with this ``step`` (plus 1e-6 for the
    polynomials and roundings)."""
    return np.exp2(np.asarray(step, dtype=np.float64) / 2) - 1 + 1e-6
