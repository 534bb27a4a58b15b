"""A step model of the low-latency combine's expert-side handoff (cuda_src/low_latency/combine.cuh,
combine_reduce_owner): compute threads store each token's partial row and hand the token to a flagger warp through two
mbarriers (`full`, `empty`, both waited on by phase parity) and a two-entry `flag_token`; the compute threads also sync
among themselves on a third mbarrier (compute_sync). Random interleavings of the agents check that the flagger flags
exactly the tokens that have a row, in order, each only after every compute thread stored its part, and that nobody
waits forever; without the `empty` wait some interleaving goes wrong. Owners come one after the other (each ends with
token -1) and the phase counts carry over, as at more than 2 ranks (not run on a GPU here: low-latency mode needs one
GPU per rank and the machine has 2).
"""
from __future__ import annotations

import random

import pytest


class MBarrier:
    """An mbarrier: ``count`` arrivals complete the current phase; a wait on parity P passes once the phase of
    parity P completed, i.e. while the number of completed phases has the other parity."""

    def __init__(self, count: int):
        self.count, self.pending, self.completed = count, count, 0

    def arrive(self):
        self.pending -= 1
        if self.pending == 0:
            self.completed += 1
            self.pending = self.count

    def done(self, parity: int) -> bool:
        return (self.completed & 1) != parity


def compute_thread(i, state, owners, kept, wait_empty, batch=0):
    """One compute thread: per owner, per token (then the owner's end, -1) store its part of the row (tokens with
    a row only), wait for the flagger to have read the previous token, publish (thread 0), sync, arrive on
    `full`. With ``batch`` > 0 the tokens come in batches of that many, each with one compute sync before its
    tokens (after prepare_batch) and one after. The phase counts carry over from owner to owner."""
    handoff = sync = 0

    def compute_sync():
        nonlocal sync
        state["compute"].arrive()
        parity = sync & 1
        yield lambda: state["compute"].done(parity)
        sync += 1

    for tokens in owners:
        groups = [tokens[b:b + batch] for b in range(0, len(tokens), batch)] if batch else [tokens]
        for g, group in enumerate(groups + [[-1]]):
            last = g == len(groups)
            if batch and not last:
                yield from compute_sync()
            for t in group:
                if t >= 0:
                    yield lambda: True
                    if not kept[t]:
                        continue
                    state["stored"][t].add(i)
                if wait_empty and handoff > 0:
                    parity = (handoff - 1) & 1
                    yield lambda: state["empty"].done(parity)
                if i == 0:
                    yield lambda: True
                    state["flag_token"][handoff & 1] = t
                yield from compute_sync()
                yield lambda: True
                state["full"].arrive()
                handoff += 1
            if batch and not last:
                yield from compute_sync()


def flagger(state, num_compute, num_owners):
    handoff = 0
    for _ in range(num_owners):
        while True:
            parity = handoff & 1
            yield lambda: state["full"].done(parity)
            t = state["flag_token"][handoff & 1]
            yield lambda: True
            state["empty"].arrive()
            handoff += 1
            if t < 0:
                state["flagged"].append("end")
                break
            if len(state["stored"][t]) != num_compute:
                state["errors"].append(f"token {t} flagged before every part was stored")
            state["flagged"].append(t)


def run(num_compute: int, tokens: list, kept: dict, seed: int, wait_empty: bool = True, num_owners: int = 1,
        batch: int = 0) -> list:
    """Errors of one random interleaving (empty = it went right); ``num_owners`` owners in a row, each with its
    own copy of ``tokens`` (numbered apart); ``batch``: see compute_thread."""
    n = len(tokens)
    owners = [[o * n + t for t in tokens] for o in range(num_owners)]
    kept = {o * n + t: kept[t] for o in range(num_owners) for t in tokens}
    state = {"full": MBarrier(num_compute), "empty": MBarrier(1), "compute": MBarrier(num_compute),
             "flag_token": [None, None], "stored": {t: set() for t in kept}, "flagged": [], "errors": []}
    agents = [compute_thread(i, state, owners, kept, wait_empty, batch) for i in range(num_compute)]
    agents.append(flagger(state, num_compute, num_owners))
    waiting = {a: next(a) for a in agents}
    rng = random.Random(seed)
    for _ in range(100_000):
        if not waiting:
            break
        ready = [a for a, cond in waiting.items() if cond()]
        if not ready:
            return state["errors"] + ["deadlock"]
        a = rng.choice(ready)
        try:
            waiting[a] = next(a)
        except StopIteration:
            del waiting[a]
    want = [t for tokens in owners for t in [t for t in tokens if kept[t]] + ["end"]]
    if state["flagged"] != want:
        state["errors"].append(f"flagged {state['flagged']}, want {want}")
    return state["errors"]


@pytest.mark.parametrize("batch", [0, 1, 2, 15])
@pytest.mark.parametrize("num_owners", [1, 3])
@pytest.mark.parametrize("num_compute", [1, 2, 3])
def test_the_flagger_flags_each_stored_row_once_in_order(num_compute, num_owners, batch):
    """As the kernel runs it (batches of kCombineBatch = 15 tokens, with their compute syncs), and with other
    batch sizes and none."""
    for seed in range(300):
        rng = random.Random(1000 + seed)
        tokens = list(range(rng.randint(0, 6)))
        kept = {t: rng.random() < 0.7 for t in tokens}
        errors = run(num_compute, tokens, kept, seed, num_owners=num_owners, batch=batch)
        assert not errors, (seed, tokens, kept, errors)


def test_without_the_empty_wait_some_interleaving_goes_wrong():
    """The compute side can then run two tokens ahead: `flag_token` is overwritten before the flagger read it,
    or `full` completes twice before the flagger looked (its parity wait then never passes)."""
    kept = {t: True for t in range(4)}
    failures = [seed for seed in range(300) if run(2, list(range(4)), kept, seed, wait_empty=False)]
    assert failures
