"""Swap preemption: a preemption storm with swap space gives the outputs of a run without preemption;
swapped blocks come back bit for bit; no GPU or CPU block leaks under any add / step / abort sequence."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill import LLM, SamplingParams
from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler
from tokenmill.runner.swap import SwapSpace

_GIB = 2 ** 30
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _llm(qwen3_dir, num_kv_blocks, swap_blocks=None, **kw):
    """`swap_blocks`: swap space in blocks of the tiny model (2 layers x 2 x 4 tokens x 2 heads x 16 x 4 B)."""
    block_bytes = 2 * 2 * 4 * 2 * 16 * 4
    swap = 0.0 if swap_blocks is None else swap_blocks * block_bytes / _GIB
    llm = LLM(qwen3_dir, device="cpu", dtype="float32", block_size=4, max_model_len=64, num_kv_blocks=num_kv_blocks,
              max_num_seqs=8, swap_space=swap, **kw)
    assert llm.engine.runner.block_bytes == block_bytes
    return llm


def _prompts(n=8):
    rng = random.Random(1)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 12))] for _ in range(n)]


def _params(seeded: bool):
    if seeded:
        return [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=40, ignore_eos=True, seed=100 + i)
                for i in range(8)]
    return SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(qwen3_dir):
    """Outputs with blocks for every request at once: no preemption."""
    llm = _llm(qwen3_dir, num_kv_blocks=200)
    out = {s: [o.outputs[0].token_ids for o in llm.generate(_prompts(), _params(s))] for s in (False, True)}
    assert llm.engine.get_stats()["num_preemptions"] == 0
    return out


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_preemption_storm_with_swap_matches_no_preemption(qwen3_dir, reference, seeded):
    # 8 requests of up to 52 tokens (13 blocks each) over 16 blocks: most of them are swapped out, often
    llm = _llm(qwen3_dir, num_kv_blocks=16, swap_blocks=400)
    assert llm.engine.scheduler.preemption_mode == "swap"
    out = [o.outputs[0].token_ids for o in llm.generate(_prompts(), _params(seeded))]
    stats = llm.engine.get_stats()
    assert stats["num_preemptions"] > 0 and stats["swapped_out_blocks"] > 0
    # every swapped block came back: copied, or found where it was in the prefix cache
    assert stats["swapped_in_blocks"] > 0
    assert stats["swapped_in_blocks"] + stats["swap_in_cached_blocks"] == stats["swapped_out_blocks"]
    assert stats["num_swapped"] == 0 and stats["num_free_cpu_blocks"] == stats["num_cpu_blocks"]
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert out == reference[seeded]


def test_full_swap_space_falls_back_to_recompute(qwen3_dir, reference):
    # swap space for half a request: a preemption that does not fit recomputes; the outputs do not change
    llm = _llm(qwen3_dir, num_kv_blocks=16, swap_blocks=6)
    out = [o.outputs[0].token_ids for o in llm.generate(_prompts(), _params(False))]
    stats, sched = llm.engine.get_stats(), llm.engine.scheduler
    assert 0 < sched.num_swap_outs < stats["num_preemptions"]
    assert out == reference[False]
    assert stats["num_free_cpu_blocks"] == stats["num_cpu_blocks"]


def test_no_swap_space_recomputes(qwen3_dir, reference):
    llm = _llm(qwen3_dir, num_kv_blocks=16)
    assert llm.engine.scheduler.preemption_mode == "recompute" and llm.engine.runner.swap_space is None
    out = [o.outputs[0].token_ids for o in llm.generate(_prompts(), _params(False))]
    stats = llm.engine.get_stats()
    assert stats["num_preemptions"] > 0 and stats["swapped_out_blocks"] == 0
    assert out == reference[False]


def test_shared_prefixes_and_n_under_preemption_match_no_preemption(qwen3_dir):
    """Prompts sharing a prefix (one of them twice, one the prefix alone), two greedy choices each, prefilled in
    chunks, over a cache that holds about one request: prefix hits at admission and at swap-in, blocks shared
    between choices and between requests, swapped and recomputed victims. The outputs are those of a run with
    room for everything and no prefix cache."""
    rng = random.Random(2)
    shared = [rng.randrange(3, 500) for _ in range(9)]
    prompts = [shared + [rng.randrange(3, 500) for _ in range(rng.randrange(0, 6))] for _ in range(5)]
    prompts += [prompts[0], list(shared)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=2)

    def run(**kw):
        llm = _llm(qwen3_dir, max_num_batched_tokens=16, **kw)
        out = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
        return out, llm.engine
    reference, _ = run(num_kv_blocks=200, enable_prefix_caching=False)
    # swap space for a few blocks: some victims are swapped, the others recomputed
    out, engine = run(num_kv_blocks=14, swap_blocks=6)
    stats = engine.get_stats()
    assert 0 < engine.scheduler.num_swap_outs < stats["num_preemptions"]
    assert stats["swap_in_cached_blocks"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_free_cpu_blocks"] == stats["num_cpu_blocks"]
    assert out == reference


def test_abort_and_finish_while_swapped_free_cpu_blocks(qwen3_dir):
    llm = _llm(qwen3_dir, num_kv_blocks=16, swap_blocks=400)
    engine = llm.engine
    for i, prompt in enumerate(_prompts()):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    while not engine.scheduler.swapped:
        engine.step()
    stats = engine.get_stats()
    assert stats["num_swapped"] > 0 and stats["num_free_cpu_blocks"] < stats["num_cpu_blocks"]
    engine.abort_request([r.request_id for r in engine.scheduler.swapped])
    assert engine.get_stats()["num_swapped"] == 0
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.get_stats()
    assert stats["num_free_cpu_blocks"] == stats["num_cpu_blocks"]
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_config_validates_swap_flags(qwen3_dir):
    from tokenmill.config import EngineConfig
    with pytest.raises(ValueError, match="needs swap space"):
        EngineConfig(model=qwen3_dir, swap_space=0, preemption_mode="swap")
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig(model=qwen3_dir, preemption_mode="drop")
    with pytest.raises(ValueError, match="swap_space"):
        EngineConfig(model=qwen3_dir, swap_space=-1)
    llm = _llm(qwen3_dir, num_kv_blocks=16, swap_blocks=400, preemption_mode="recompute")
    assert llm.engine.scheduler.preemption_mode == "recompute" and llm.engine.block_manager.num_cpu_blocks == 0


# ---- the copies ------------------------------------------------------------------------------------
def _swap_roundtrip(device: str):
    torch.manual_seed(0)
    layers, blocks, block_size, heads, head_dim = 3, 10, 4, 2, 8
    kv = torch.randn(layers, 2, blocks, block_size, heads, head_dim, device=device)
    space = SwapSpace(kv, num_blocks=6)
    known = kv.clone()
    # out: GPU 7 -> CPU 2, 3 -> 3 (a run), 5 -> 0; then the GPU blocks are overwritten
    # this step writes block 7 at once (its copy goes first and the step waits for it), 3 and 5 later
    space.copy([(7, 2), (3, 3), (5, 0)], [], reused=[7])
    kv[:, :, 7] = -1.0
    space.copy([], [], reused=[])      # the next step waits for the other copies
    kv[:, :, [3, 5]] = -1.0
    # in: to other GPU blocks than they came from, in another order
    space.copy([], [(3, 1), (0, 9), (2, 4)], reused=[])
    space.copy([], [], reused=[])      # the next step waits for the swap-in
    if device == "cuda":
        torch.cuda.synchronize()
    for src, dst in ((3, 1), (5, 9), (7, 4)):
        assert torch.equal(kv[:, :, dst], known[:, :, src]), (src, dst)
    untouched = [b for b in range(blocks) if b not in (1, 9, 4, 7, 3, 5)]
    assert torch.equal(kv[:, :, untouched], known[:, :, untouched])


def test_swapped_blocks_come_back_intact():
    _swap_roundtrip("cpu")


@pytest.mark.gpu
@gpu
def test_swapped_blocks_come_back_intact_cuda():
    _swap_roundtrip("cuda")


# ---- property: no leaks with swapping ---------------------------------------------------------------
def _step(sched, live, rng):
    out = sched.schedule()
    assert not (out.swap_in and out.preempted)
    assert len(sched.running) <= sched.max_num_seqs
    for g, c in out.swap_out:
        assert 0 <= c < sched.block_manager.num_cpu_blocks
    swapped_gpu = {g for g, _ in out.swap_out}
    assert all(g in swapped_gpu and sched.block_manager.blocks[g].ref_count > 0 for g in out.swap_out_reused)
    sched.update_after_step(out)
    for req in out.requests:
        assert req.status == RequestStatus.RUNNING and req.num_computed_tokens <= req.num_tokens
        if req.num_computed_tokens == req.num_tokens:
            req.append_token(rng.randrange(100))
            if req.num_output_tokens >= req.max_tokens:
                sched.finish(live.pop(req.request_id), RequestStatus.FINISHED_LENGTH)
    for req in sched.swapped:
        assert req.status == RequestStatus.SWAPPED and req.cpu_block_ids and not req.block_ids


_ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.tuples(st.integers(1, 24), st.integers(1, 40), st.booleans(), st.integers(1, 4))),
    st.tuples(st.just("abort"), st.integers(0, 100)),
    st.tuples(st.just("step"), st.integers(1, 4)),
), max_size=40)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_ops, num_blocks=st.integers(6, 16), num_cpu_blocks=st.sampled_from([0, 3, 10, 30]),
       max_seqs=st.integers(2, 6), budget=st.integers(4, 48), policy=st.sampled_from(["fcfs", "priority"]),
       prefix=st.booleans())
def test_no_leaks_with_swapping(ops, num_blocks, num_cpu_blocks, max_seqs, budget, policy, prefix):
    block_size = 4
    bm = BlockManager(num_blocks, block_size, prefix, num_cpu_blocks=num_cpu_blocks)
    sched = Scheduler(bm, max_seqs, budget, max_model_len=num_blocks * block_size, policy=policy,
                      preemption_mode="swap" if num_cpu_blocks else "recompute")
    live: dict[str, Request] = {}
    rng = random.Random(0)
    for i, (kind, arg) in enumerate(ops):
        if kind == "add":
            plen, max_tokens, shared, count = arg
            max_tokens = min(max_tokens, num_blocks * block_size - 2)
            for k in range(count):
                prompt = ([7] * 8 if shared else []) + [rng.randrange(100) for _ in range(plen)]
                prompt = prompt[: num_blocks * block_size - max_tokens - 1] or [1]
                req = Request(f"r{i}.{k}", prompt, SamplingParams(max_tokens=max_tokens), max_tokens, seed=0,
                              priority=(i + k) % 3, arrival_time=float(i))
                live[req.request_id] = req
                sched.add(req)
        elif kind == "abort" and live:
            rid = sorted(live)[arg % len(live)]
            sched.finish(live.pop(rid), RequestStatus.FINISHED_ABORTED)
        else:
            for _ in range(arg):
                _step(sched, live, rng)
        bm.check_invariants(list(live.values()))
    for _ in range(10_000):
        if not sched.has_unfinished():
            break
        _step(sched, live, rng)
        bm.check_invariants(list(live.values()))
    assert not live and not sched.has_unfinished(), "a request was lost"
    assert bm.num_free_blocks == num_blocks and bm.num_free_cpu_blocks == num_cpu_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert sched.num_swapped_in_blocks + sched.num_swap_in_cached_blocks <= sched.num_swapped_out_blocks


_engine_ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.tuples(st.integers(1, 12), st.integers(4, 16), st.sampled_from([1, 1, 2]),
                                        st.integers(1, 3))),
    st.tuples(st.just("abort"), st.integers(0, 100)),
    st.tuples(st.just("step"), st.integers(1, 4)),
), min_size=1, max_size=10)


@pytest.fixture(scope="module")
def small_engine(qwen3_dir):
    """8 GPU blocks (a request needs up to 7) and swap space for 10: swaps, and recomputes once the swap
    space is full."""
    return _llm(qwen3_dir, num_kv_blocks=8, swap_blocks=10).engine


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(ops=_engine_ops)
def test_engine_no_leaks_with_swapping(small_engine, ops):
    """The real engine (overlapped steps, in-flight placeholders, n > 1 sharing prompt blocks): after any
    add / step / abort sequence and a drain, every GPU and CPU block is free and nothing is left."""
    engine, rng = small_engine, random.Random(0)
    added = []
    for i, (kind, arg) in enumerate(ops):
        if kind == "add":
            plen, max_tokens, n, count = arg
            for k in range(count):
                rid = f"p{i}.{k}"
                engine.add_request(rid, [rng.randrange(3, 500) for _ in range(plen)], SamplingParams(
                    max_tokens=max_tokens, ignore_eos=True, n=n, temperature=0.8, seed=i))
                added.append(rid)
        elif kind == "abort" and added:
            engine.abort_request(added[arg % len(added)])
        else:
            for _ in range(arg):
                engine.step()
        seqs = [s for g in engine.groups.values() for s in g if not s.status.finished]
        engine.block_manager.check_invariants(seqs)
    for _ in range(2_000):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    while engine._in_flight is not None:      # the last launched step, if any, is read by one more step
        engine.step()
    assert not engine.has_unfinished_requests() and not engine.scheduler.has_unfinished()
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_free_cpu_blocks"] == stats["num_cpu_blocks"]


def test_swap_metrics_are_exported():
    from tokenmill.engine.metrics import ServerMetrics
    stats = {"num_swapped": 2, "cpu_cache_usage": 0.25, "swapped_out_blocks": 7, "swapped_in_blocks": 5,
             "swap_out_bytes": 7 * 1024, "swap_in_bytes": 5 * 1024}
    text = ServerMetrics("m", lambda: stats).render().decode()
    assert 'tokenmill:num_requests_swapped{model_name="m"} 2.0' in text
    assert 'tokenmill:swapped_out_blocks_total{model_name="m"} 7.0' in text
    assert 'tokenmill:swap_in_bytes_total{model_name="m"} 5120.0' in text
    assert 'tokenmill:cpu_cache_usage_perc{model_name="m"} 0.25' in text


def test_swap_in_takes_blocks_still_in_the_prefix_cache():
    """A request sharing a prompt prefix with a running one: its shared blocks stay on the GPU while it is
    swapped out and come back without a copy; only its own blocks move."""
    bm = BlockManager(8, 4, num_cpu_blocks=8)
    prompt = list(range(10, 22))                                  # 3 full blocks
    a, b = (Request(r, prompt + [t], SamplingParams(), 4, seed=0) for r, t in (("a", 1), ("b", 2)))
    assert bm.allocate_slots(a, 13)
    a.num_computed_tokens = 13
    bm.cache_full_blocks(a)
    hits = bm.get_computed_blocks(b)
    assert hits == a.block_ids[:3] and bm.allocate_slots(b, 1, hits)
    b.num_computed_tokens = 13
    bm.cache_full_blocks(b)
    pairs = bm.swap_out(b)
    assert len(pairs) == 4 and not b.block_ids and bm.blocks[pairs[-1][0]].ref_count == 0
    assert [bm.blocks[g].ref_count for g in a.block_ids[:3]] == [1, 1, 1]
    back = bm.swap_in(b)
    assert b.block_ids[:3] == a.block_ids[:3] and [bm.blocks[g].ref_count for g in a.block_ids[:3]] == [2, 2, 2]
    assert len(back) == 1 and back[0][1] == b.block_ids[3]     # only its own last block is copied back
    bm.check_invariants([a, b])
    bm.free(a), bm.free(b)
    assert bm.num_free_blocks == 8 and bm.num_free_cpu_blocks == 8


@pytest.mark.gpu
@gpu
def test_preemption_storm_with_swap_cuda(qwen3_dir):
    """The side-stream path end to end (pinned swap space, CUDA graphs, overlapped steps): the storm swaps,
    and its greedy outputs are those of a run without preemption."""
    def run(num_kv_blocks, swap_blocks):
        block_bytes = 2 * 2 * 4 * 2 * 16 * 4
        llm = LLM(qwen3_dir, device="cuda", dtype="float32", block_size=4, max_model_len=64, max_num_seqs=8,
                  num_kv_blocks=num_kv_blocks, swap_space=swap_blocks * block_bytes / _GIB)
        out = [o.outputs[0].token_ids for o in llm.generate(_prompts(), _params(False))]
        return out, llm.engine.get_stats()
    reference, _ = run(200, 0)
    out, stats = run(16, 400)
    assert stats["swapped_out_blocks"] > 0 and stats["swapped_in_blocks"] > 0
    assert stats["num_free_cpu_blocks"] == stats["num_cpu_blocks"]
    assert out == reference


def test_a_swapped_out_block_freed_by_a_recomputed_victim_is_waited_for():
    """Two victims share a prompt prefix: the first is swapped out, the second recomputed (the swap space
    is full), which frees the shared blocks, and the preempting request takes them in the same step. Its
    forward writes them, so it must wait for their swap-out copies (`swap_out_reused`); only the blocks
    freed at the swap-out itself were listed, and on CUDA the copy raced the overwrite."""
    from tokenmill.engine.scheduler import Scheduler
    bm = BlockManager(8, 4, enable_prefix_caching=True, num_cpu_blocks=3)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32, policy="priority",
                      preemption_mode="swap", clock=lambda: 100.0)

    def req(rid, prompt, priority, max_tokens=20):
        return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), max_tokens, seed=0, priority=priority,
                       arrival_time=0.0)

    def step():
        out = sched.schedule()
        sched.update_after_step(out)
        for r in out.requests:
            if r.num_computed_tokens == r.num_tokens:
                r.append_token(3)
        return out

    v1, v2 = req("v1", [7] * 8 + [1], 5), req("v2", [7] * 8 + [2], 4)     # two full blocks shared
    sched.add(v1), step()
    sched.add(v2), step()
    r = req("r", list(range(10, 41)), 0, max_tokens=1)                   # every block of the cache
    sched.add(r), step()
    held = set(r.block_ids)
    out = step()
    assert [(p.request_id, p.status) for p in out.preempted] == [("v1", RequestStatus.SWAPPED),
                                                                  ("v2", RequestStatus.PREEMPTED)]
    taken = (set(r.block_ids) - held) & {g for g, _ in out.swap_out}
    assert taken and taken <= set(out.swap_out_reused)


def test_requests_swapped_in_together_keep_each_others_next_token_slot():
    """Two swapped requests whose next tokens each need a new block, and room for both requests' blocks but
    only one of those slots: only the first comes back. Resumed together, the second took the first's slot
    and the next step swapped it out again, its blocks moved twice for nothing."""
    bm = BlockManager(5, 4, enable_prefix_caching=False, num_cpu_blocks=16)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=20, preemption_mode="swap")
    a, b = (Request(rid, [t] * 8, SamplingParams(max_tokens=10), 10, seed=0, arrival_time=t)
            for rid, t in (("a", 1), ("b", 2)))
    sched.add(a), sched.add(b)
    out = sched.schedule()
    sched.update_after_step(out)
    for r in (a, b):
        r.append_token(3)               # 8 tokens computed in 2 full blocks: the 9th needs a third
    sched._preempt(b, out), sched._preempt(a, out)      # as the running loop does when blocks run out
    assert sched.swapped == [a, b] and bm.num_free_blocks == 5
    sched.schedule()
    assert sched.running == [a] and sched.swapped == [b]
    out = sched.schedule()
    assert out.requests == [a] and not out.preempted and sched.num_swap_outs == 2
