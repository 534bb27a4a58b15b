"""``event.RecvHooks``: the low-latency receive-hook rule on its own (no MPI, no GPU)."""
from __future__ import annotations

import pytest

from cupy_ep.event import RecvHooks


def test_a_pending_hook_blocks_the_next_call_until_it_runs():
    hooks, runs = RecvHooks(), []
    hooks.check_next_call("low_latency_dispatch")          # nothing pending yet
    hook = hooks.make(lambda: runs.append("recv"), "low_latency_dispatch")
    with pytest.raises(RuntimeError, match=r"^return_recv_hook: .*previous low_latency_dispatch.*before "
                                           r"low_latency_combine"):
        hooks.check_next_call("low_latency_combine")
    assert runs == []                                      # checking runs nothing
    hook()
    assert runs == ["recv"]
    hooks.check_next_call("low_latency_combine")           # no longer pending


def test_a_hook_runs_once():
    hooks, runs = RecvHooks(), []
    hook = hooks.make(lambda: runs.append(1), "low_latency_combine")
    hook()
    with pytest.raises(RuntimeError, match=r"^return_recv_hook: .*already ran"):
        hook()
    assert runs == [1]


def test_a_failed_run_leaves_the_hook_pending():
    hooks = RecvHooks()

    def fail():
        raise ValueError("device gone")

    hook = hooks.make(fail, "low_latency_dispatch")
    with pytest.raises(ValueError):
        hook()
    with pytest.raises(RuntimeError, match="has not run"):
        hooks.check_next_call("low_latency_dispatch")


def test_an_old_hook_does_not_clear_a_newer_one():
    hooks = RecvHooks()
    first = hooks.make(lambda: None, "low_latency_dispatch")
    first()
    hooks.make(lambda: None, "low_latency_combine")      # the newer call's hook is pending
    with pytest.raises(RuntimeError, match="already ran"):
        first()
    with pytest.raises(RuntimeError, match="previous low_latency_combine has not run"):
        hooks.check_next_call("low_latency_dispatch")
