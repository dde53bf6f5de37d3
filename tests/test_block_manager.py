"""Property tests: after any sequence of add / step / abort, every block returns to the free pool,
ref counts never go negative, and every admitted request finishes or is aborted."""
from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler
from tokenmill.sampling_params import SamplingParams


def _request(rid: str, prompt: list[int], max_tokens: int, priority: int = 0, t: float = 0.0) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), max_tokens, seed=0,
                   priority=priority, arrival_time=t)


def _simulate(ops, num_blocks, block_size, max_seqs, budget, policy, prefix):
    bm = BlockManager(num_blocks, block_size, prefix)
    sched = Scheduler(bm, max_seqs, budget, max_model_len=num_blocks * block_size, policy=policy)
    live: dict[str, Request] = {}
    finished: set[str] = set()
    rng = random.Random(0)
    for i, (kind, arg) in enumerate(ops):
        if kind == "add":
            plen, max_tokens, prio, shared = arg
            prompt = ([7] * 8 if shared else []) + [rng.randrange(100) for _ in range(plen)]
            prompt = prompt[: num_blocks * block_size - max_tokens - 1] or [1]
            req = _request(f"r{i}", prompt, max_tokens, prio, t=float(i))
            live[req.request_id] = req
            sched.add(req)
        elif kind == "abort" and live:
            rid = sorted(live)[arg % len(live)]
            sched.finish(live.pop(rid), RequestStatus.FINISHED_ABORTED)
            finished.add(rid)
        else:
            _step(sched, live, finished, rng)
        bm.check_invariants(list(live.values()))
    for _ in range(10_000):
        if not sched.has_unfinished():
            break
        _step(sched, live, finished, rng)
        bm.check_invariants(list(live.values()))
    assert not live and not sched.has_unfinished()
    assert bm.num_free_blocks == num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def _step(sched, live, finished, rng):
    out = sched.schedule()
    assert out.total_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    sched.update_after_step(out)
    for req in out.requests:
        assert req.num_computed_tokens <= req.num_tokens
        if req.num_computed_tokens == req.num_tokens:       # the step produced a token
            req.append_token(rng.randrange(100))
            if req.num_output_tokens >= req.max_tokens:
                sched.finish(req, RequestStatus.FINISHED_LENGTH)
                finished.add(live.pop(req.request_id).request_id)


ops_strategy = st.lists(st.one_of(
    st.tuples(st.just("add"), st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 3),
                                        st.booleans())),
    st.tuples(st.just("abort"), st.integers(0, 100)),
    st.tuples(st.just("step"), st.none()),
), max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops_strategy, num_blocks=st.integers(16, 40), block_size=st.sampled_from([1, 4, 16]),
       max_seqs=st.integers(1, 6), budget=st.integers(4, 64), policy=st.sampled_from(["fcfs", "priority"]),
       prefix=st.booleans())
def test_no_leaks_under_any_sequence(ops, num_blocks, block_size, max_seqs, budget, policy, prefix):
    if num_blocks * block_size < 16:
        num_blocks = -(-16 // block_size)
    _simulate(ops, num_blocks, block_size, max_seqs, budget, policy, prefix)


def test_prefix_cache_shares_and_verifies_blocks():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = _request("a", list(range(10)), 4)
    assert bm.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)                      # blocks 0..1 full -> hashed
    b = _request("b", list(range(8)) + [99, 98], 4)
    hits = bm.get_computed_blocks(b)
    assert hits == a.block_ids[:2]
    assert bm.allocate_slots(b, 2, hits)
    assert bm.blocks[hits[0]].ref_count == 2
    c = _request("c", [0, 1, 2, 5, 4, 5, 6, 7, 8], 4)   # differs inside the first block
    assert bm.get_computed_blocks(c) == []
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 10
    d = _request("d", list(range(8)) + [1], 4)          # cached free blocks are reused
    assert bm.get_computed_blocks(d) == hits
    bm.check_invariants([])


def test_a_block_ending_in_a_token_in_flight_is_hashed_once_it_is_known():
    """A placeholder (a token still being sampled) is never hashed: the block it ends waits, and is hashed
    by a later call once the token is resolved, so generated tokens reach the prefix cache."""
    from tokenmill.engine.request import PLACEHOLDER
    bm = BlockManager(num_blocks=10, block_size=4)
    a = _request("a", [1, 2, 3], 4)
    assert bm.allocate_slots(a, 4)
    a.append_placeholder(0)                      # the first output token, in flight
    a.num_computed_tokens = 4                    # the next step is launched on it
    bm.cache_full_blocks(a)
    assert a.block_hashes == [] and all(b.token_ids is None or PLACEHOLDER not in b.token_ids for b in bm.blocks)
    a.resolve(3, 77)
    bm.cache_full_blocks(a)
    assert len(a.block_hashes) == 1 and bm.get_computed_blocks(_request("b", [1, 2, 3, 77, 5], 1)) == a.block_ids[:1]


def test_sequences_of_equal_ids_keep_their_own_hash_chains():
    """The hash chain lives on the sequence: another live sequence of the same id (a request "x#0" beside
    the first sequence of "x" with n=2) neither extends nor drops it."""
    bm = BlockManager(num_blocks=10, block_size=2)
    a, b = _request("x#0", [1, 2, 3, 4], 1), _request("x#0", [5, 6, 7, 8], 1)
    for req in (a, b):
        assert bm.allocate_slots(req, 4)
        req.num_computed_tokens = 4
        bm.cache_full_blocks(req)
    # [1, 2] then b's second block: chained from a's first block, it must not hit
    assert bm.get_computed_blocks(_request("c", [1, 2, 7, 8, 9], 1)) == a.block_ids[:1]
    bm.free(b)
    assert len(a.block_hashes) == 2


def test_prefix_hashes_start_from_a_secret():
    """Two block managers hash the same prompt differently, and neither under the chain a client could
    compute from the tokens alone (Python's hash of ints is the same in every process)."""
    managers = [BlockManager(num_blocks=4, block_size=2) for _ in range(2)]
    for bm in managers:
        req = _request("a", [1, 2, 3], 1)
        assert bm.allocate_slots(req, 3)
        req.num_computed_tokens = 3
        bm.cache_full_blocks(req)
    first, second = (set(bm.cached) for bm in managers)
    assert first and first != second and hash((None, (1, 2))) not in first | second


def test_lru_evicts_least_recently_freed_and_tail_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = _request("a", [1, 2, 3, 4, 5], 1)
    assert bm.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    first, second = a.block_ids[:2]
    bm.free(a)
    # the tail block of a's prefix is evicted before its head
    x = _request("x", [9] * 3, 1)
    assert bm.allocate_slots(x, 3)    # takes the never-used block, then the freed tail blocks
    assert first not in x.block_ids
    assert bm.get_computed_blocks(_request("y", [1, 2, 3], 1)) == [first]


def test_priority_policy_preempts_lowest_priority_and_ages():
    bm = BlockManager(num_blocks=6, block_size=2)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=12, policy="priority")
    low = _request("low", [1] * 4, 8, priority=5, t=0.0)
    high = _request("high", [2] * 4, 8, priority=0, t=0.0)
    sched.add(low)
    sched.add(high)
    out = sched.schedule()
    assert [r.request_id for r in out.requests] == ["high", "low"]
    sched.update_after_step(out)
    for _ in range(6):
        for r in list(sched.running):
            r.append_token(3)
        out = sched.schedule()
        sched.update_after_step(out)
        if out.preempted:
            break
    assert [r.request_id for r in out.preempted] == ["low"]
    assert sched._rank(low, now=100.0) < sched._rank(_request("new", [1], 1, priority=0, t=100.0), 100.0)
