"""Every row of docs/bad_inputs.md, run on the host backend: the call raises the exception the row names, with the
fragment it shows in the message, on every rank, and the same Buffer then gives the reference's answers (so the
table cannot drift from the code)."""
from __future__ import annotations

import re
import types
from pathlib import Path

import numpy as np
import pytest

import cupy_ep
from cupy_ep import Buffer, Config, config, reference
from tests.helpers import (BF16, all_ok, gather_all, make_inputs, random_bf16, reference_combine,
                           reference_dispatch, same_bytes)

pytestmark = pytest.mark.mpi(min_size=2)

TABLE = Path(__file__).resolve().parents[2] / "docs" / "bad_inputs.md"
_ROW = re.compile(r"^\| `(?P<case>[^`]+)` \| `(?P<call>.+)` \| `(?P<exc>\w+)` \| `(?P<fragment>[^`]+)` \| "
                  r"(?P<after>\w+) \|$")
M, HL = 8, 128


def _rows() -> dict:
    rows = {}
    for line in TABLE.read_text().splitlines():
        match = _ROW.match(line)
        if match:
            rows[match["case"]] = match.groupdict()
    return rows


ROWS = _rows()


def test_the_table_has_enough_rows_and_every_one_parses():
    table_lines = [line for line in TABLE.read_text().splitlines() if line.startswith("| `")]
    assert len(ROWS) == len(table_lines) >= 30
    assert all(row["after"] == "works" for row in ROWS.values())


@pytest.fixture(scope="module")
def ctx(comm):
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    num_experts, hidden = 4 * num_ranks, 64
    nvl = Buffer.get_nvl_buffer_size_hint(2 * HL, num_ranks)
    rdma = config.low_latency_rdma_size_hint(M, HL, num_ranks, num_experts)
    buf = Buffer(comm, nvl, rdma, low_latency_mode=True, enable_shrink=True, timeout_s=30, backend="host")
    other = Buffer(comm, nvl, rdma, low_latency_mode=True, timeout_s=30, backend="host")
    zero = Buffer(comm, 0, rdma, low_latency_mode=True, timeout_s=30, backend="host")
    c = types.SimpleNamespace(comm=comm, rank=rank, R=num_ranks, E=num_experts, H=hidden, M=M, buf=buf, other=other,
                              zero=zero)
    rng = np.random.default_rng([77, rank])
    inp = make_inputs(rng, 20 + rank, hidden, 3, num_experts, num_ranks)
    c.x, c.topk_idx, c.w, c.T = inp.x, inp.topk_idx, inp.topk_weights, inp.x.shape[0]
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(c.topk_idx, num_experts)
    c.layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    c.topk = dict(topk_idx=c.topk_idx, topk_weights=c.w)
    c.recv_x, _, c.recv_w, _, c.handle, _ = buf.dispatch(c.x, **c.layout, **c.topk)
    c.recv_x2, _, _, _, c.handle2, _ = buf.dispatch(c.x, **c.layout, **c.topk)
    c.N = c.recv_x.shape[0]
    c.other_handle = other.dispatch(c.x, **c.layout, **c.topk)[4]
    ll = make_inputs(rng, 5 + rank % 3, 16, 3, num_experts, num_ranks)  # distinct experts per row
    c.llx, c.ll_idx, c.llw = random_bf16(rng, (5 + rank % 3, HL)), ll.topk_idx, ll.topk_weights
    _, _, c.ll_handle, _, _ = buf.low_latency_dispatch(c.llx, c.ll_idx, M, num_experts, use_fp8=False)
    c.y = random_bf16(rng, (num_experts // num_ranks, num_ranks * M, HL))
    buf.low_latency_combine(c.y, c.ll_idx, c.llw, c.ll_handle)
    c.other_ll_handle = other.low_latency_dispatch(c.llx, c.ll_idx, M, num_experts, use_fp8=False)[2]
    other.low_latency_combine(c.y, c.ll_idx, c.llw, c.other_ll_handle)
    yield c
    zero.destroy()
    other.destroy()
    buf.destroy()


def _works(c) -> list:
    """What differs from the reference in a fresh normal-mode and low-latency round trip on ``c.buf``."""
    bad = []
    recv_x, _, recv_w, _, handle, _ = c.buf.dispatch(c.x, **c.layout, **c.topk)
    want = reference_dispatch(c.comm, c.x, c.topk_idx, c.w, c.E)
    combined, combined_w, _ = c.buf.combine(recv_x, handle, topk_weights=recv_w)
    want_x, want_w = reference_combine(c.comm, recv_x, want.is_token_in_rank, recv_w)
    for name, got, expected in (("recv_x", recv_x, want.recv_x), ("combined", combined, want_x),
                                ("combined_w", combined_w, want_w)):
        if not same_bytes(got, expected):
            bad.append(name)
    recv, count, ll_handle, _, _ = c.buf.low_latency_dispatch(c.llx, c.ll_idx, M, c.E, use_fp8=False)
    got = c.buf.low_latency_combine(c.y, c.ll_idx, c.llw, ll_handle)[0]
    gathered = gather_all(c.comm, (c.llx, c.ll_idx, c.llw, c.y))
    want_ll = reference.low_latency_dispatch([g[0] for g in gathered], [g[1] for g in gathered], M, c.E, c.rank,
                                             use_fp8=False)
    want_combined = reference.low_latency_combine([g[3] for g in gathered], [g[1] for g in gathered],
                                                  [g[2] for g in gathered], M, c.E, c.rank)
    for name, a, b in (("ll.recv_x", recv, want_ll.recv_x), ("ll.recv_count", count, want_ll.recv_count),
                       ("ll.combined", got, want_combined)):
        if not same_bytes(a, b):
            bad.append(name)
    return bad


@pytest.mark.parametrize("case", list(ROWS))
def test_row_raises_what_the_table_says_and_the_buffer_works(comm, ctx, case):
    row = ROWS[case]
    want = {"TypeError": TypeError, "ValueError": ValueError}.get(row["exc"]) or getattr(cupy_ep, row["exc"])
    names = {"c": ctx, "np": np, "BF16": BF16, "Buffer": Buffer, "Config": Config}
    problem = None
    try:
        eval(row["call"], names)  # the table's own text: docs/bad_inputs.md
        problem = "no exception"
    except Exception as e:  # noqa: BLE001  (the type is what is checked)
        if type(e) is not want:
            problem = f"{type(e).__name__}({e}), the table says {row['exc']}"
        elif row["fragment"] not in str(e):
            problem = f"{e!s} does not contain {row['fragment']!r}"
    bad = _works(ctx)
    assert all_ok(comm, problem is None and not bad), f"rank {comm.Get_rank()}: {problem}; afterwards: {bad}"
