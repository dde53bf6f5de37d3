"""The scheduler's policies: the priority rank (boosts for tools and short requests, aging, no starvation),
the batching window of --scheduler-delay-factor, the flags that set them, and the default path, which
must schedule exactly as the scheduler did before these existed. The latency target is in
test_step_time.py."""
from __future__ import annotations

import hashlib
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill import cli
from tokenmill.config import EngineConfig
from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler
from tokenmill.sampling_params import SamplingParams


class FakeClock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _request(rid: str, prompt_len: int = 4, max_tokens: int = 500, priority: int = 0, t: float = 0.0,
             tools: bool = False) -> Request:
    return Request(rid, [1 + len(rid)] * prompt_len, SamplingParams(max_tokens=max_tokens), max_tokens, seed=0,
                   priority=priority, arrival_time=t, carries_tools=tools)


def _scheduler(policy="priority", num_blocks=256, max_num_seqs=8, budget=256, **kwargs) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, 4), max_num_seqs, budget, max_model_len=num_blocks * 4,
                     policy=policy, **kwargs)


def _advance(sched: Scheduler, out, token: int = 3) -> None:
    """What the engine does after a step: advance, append sampled tokens, finish at max_tokens."""
    sched.update_after_step(out)
    for req in out.requests:
        if req.num_computed_tokens == req.num_tokens:
            req.append_token(token)
            if req.num_output_tokens >= req.max_tokens:
                sched.finish(req, RequestStatus.FINISHED_LENGTH)


# ---- the priority rank -----------------------------------------------------------------------------------
def test_rank_combines_priority_boosts_and_aging():
    sched = _scheduler(aging_per_second=1.0, tool_boost=5.0, short_boost=2.0, short_max_tokens=100,
                       clock=FakeClock(0.0))
    plain = _request("plain")
    tools = _request("tools", tools=True)
    short = _request("short", max_tokens=100)          # at the threshold: short
    almost = _request("almost", max_tokens=101)        # one over: not short
    both = _request("both", max_tokens=10, tools=True)
    urgent = _request("urgent", priority=-8)
    for r in (plain, tools, short, almost, both, urgent):
        sched.add(r)
    assert [sched._rank(r, 0.0)[0] for r in (plain, tools, short, almost, both, urgent)] == [0, -5, -2, 0, -7, -8]
    out = sched.schedule()
    # ties (plain, almost) go to the earlier arrival, here the order of adding at equal times: stable sort
    assert [r.request_id for r in out.requests] == ["urgent", "both", "tools", "short", "plain", "almost"]

    # aging: a plain request that has waited 6 s is ahead of a fresh tool request (credit 6 > 5)
    old, fresh = _request("old", t=0.0), _request("fresh", t=6.0, tools=True)
    assert sched._rank(old, 6.0) < sched._rank(fresh, 6.0)
    assert sched._rank(old, 4.0) > sched._rank(_request("fresh4", t=4.0, tools=True), 4.0)


def test_boosts_do_not_touch_fcfs():
    sched = _scheduler(policy="fcfs")
    reqs = [_request("a", t=0.0), _request("b", t=1.0, tools=True, max_tokens=5, priority=-9)]
    assert sched._rank(reqs[0], 5.0) < sched._rank(reqs[1], 5.0)


@settings(max_examples=200, deadline=None)
@given(p_a=st.integers(-20, 20), p_n=st.integers(-20, 20), tools_a=st.booleans(), tools_n=st.booleans(),
       short_a=st.booleans(), short_n=st.booleans(), aging=st.floats(0.01, 10.0),
       tool_boost=st.floats(0.0, 50.0), short_boost=st.floats(0.0, 50.0), later=st.floats(0.001, 100.0),
       after=st.floats(0.0, 1000.0))
def test_no_request_is_outranked_forever(p_a, p_n, tools_a, tools_n, short_a, short_n, aging, tool_boost,
                                         short_boost, later, after):
    """A request A is ahead of every request N that arrives more than (p_A - p_N + both boosts) / aging
    seconds after it, whatever N's boosts, at every time from N's arrival on: only the finitely many
    requests that arrive before then can be served ahead of A."""
    sched = _scheduler(aging_per_second=aging, tool_boost=tool_boost, short_boost=short_boost,
                       short_max_tokens=100)
    t_a = 3.0
    a = _request("a", priority=p_a, t=t_a, tools=tools_a, max_tokens=10 if short_a else 1000)
    t_n = t_a + (p_a - p_n + tool_boost + short_boost) / aging + later
    n = _request("n", priority=p_n, t=t_n, tools=tools_n, max_tokens=10 if short_n else 1000)
    now = max(t_n, t_a) + after
    assert sched._rank(a, now) < sched._rank(n, now)


def _serve_stream(aging: float, steps: int = 400):
    """One seat; an old plain request of priority 10 against a stream of favoured ones (priority 0, tools,
    short), one arriving per 0.1 s step and each served in one step: the seat is never free of them."""
    clock = FakeClock()
    sched = _scheduler(max_num_seqs=1, aging_per_second=aging, tool_boost=5.0, short_boost=2.0,
                       short_max_tokens=100, clock=clock)
    old = _request("old", priority=10, max_tokens=200, t=0.0)
    sched.add(old)
    for i in range(steps):
        sched.add(_request(f"n{i}", priority=0, max_tokens=1, t=clock.now, tools=True))
        _advance(sched, sched.schedule())
        if old.status.finished:
            break
        clock.now = round(clock.now + 0.1, 6)
    return old


def test_aging_serves_an_old_request_against_a_stream_of_favoured_ones():
    old = _serve_stream(aging=1.0, steps=1000)
    # newcomers arriving after (10 - 0 + 5 + 2) / 1.0 = 17 s rank behind it, and the one seat is free of
    # earlier ones one step after: it is scheduled at 17 s (+ one step), then decodes without preemption
    assert old.first_scheduled_time is not None and 17.0 <= old.first_scheduled_time <= 17.2
    assert old.status == RequestStatus.FINISHED_LENGTH and old.num_preemptions == 0
    starved = _serve_stream(aging=0.0)        # without aging (which the config refuses) it never runs
    assert starved.first_scheduled_time is None


# ---- the batching window -----------------------------------------------------------------------------------
def test_delay_factor_holds_new_prompts_while_requests_run():
    clock = FakeClock(0.0)
    sched = _scheduler(policy="fcfs", delay_factor=2.0, clock=clock)
    a = _request("a", max_tokens=50)
    sched.add(a)
    out = sched.schedule()
    assert out.requests == [a]          # nothing runs: a prompt is never held
    _advance(sched, out)
    sched.observe_step(out.total_tokens, len(out.requests), 0.05)     # window: 2 x 50 ms

    clock.now = 1.0
    b = _request("b", t=1.0)
    sched.add(b)
    assert sched.schedule().requests == [a]       # b waits while a decodes
    clock.now = 1.05
    c = _request("c", t=1.05)
    sched.add(c)
    assert sched.schedule().requests == [a]       # 0.05 s < 0.1 s: both wait
    clock.now = 1.1
    out = sched.schedule()
    assert out.requests == [a, b, c]              # b has waited 2 x the last step: b and c go together
    assert out.num_new_tokens == [1, 4, 4]


def test_delay_factor_releases_when_nothing_runs_or_the_step_is_full():
    clock = FakeClock(0.0)
    sched = _scheduler(policy="fcfs", delay_factor=10.0, budget=16, max_num_seqs=3, clock=clock)
    a = _request("a", max_tokens=2)
    sched.add(a)
    _advance(sched, sched.schedule())
    sched.observe_step(4, 1, 1.0)                 # a window of 10 s
    b = _request("b", prompt_len=4)
    sched.add(b)
    out = sched.schedule()
    assert out.requests == [a]                    # held: a runs
    _advance(sched, out)
    assert a.status.finished
    out = sched.schedule()
    assert out.requests == [b]                    # a finished: nothing runs, b goes at once
    _advance(sched, out)

    # the waiting prompts already fill the step's budget: waiting longer cannot make the prefill bigger
    big = _request("big", prompt_len=40)
    sched.add(big)
    out = sched.schedule()
    assert out.requests == [b, big] and out.num_new_tokens == [1, 15]


def test_delay_factor_never_holds_a_preempted_request():
    clock = FakeClock(0.0)
    sched = _scheduler(policy="fcfs", delay_factor=100.0, clock=clock)
    a, b = _request("a"), _request("b")
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    _advance(sched, out)
    sched.observe_step(out.total_tokens, 2, 1.0)
    sched._preempt(b, out)              # as the running loop does when blocks run out
    assert sched.schedule().requests == [a, b]    # a runs, b resumes at once (its arrival is recent)


# ---- the default path and the flags ------------------------------------------------------------------------
def schedule_trace(policy, seed, **kwargs):
    """Every step's schedule over a random workload with prefix sharing, chunked prefill, preemptions and
    aborts."""
    rng = random.Random(seed)
    sched = Scheduler(BlockManager(num_blocks=24, block_size=4), 5, 24, 96, policy, **kwargs)
    live, trace = {}, []
    for step in range(400):
        if step < 200 and rng.random() < 0.45:
            n = rng.randrange(1, 40)
            prompt = ([5] * 8 if rng.random() < 0.5 else []) + [rng.randrange(50) for _ in range(n)]
            mt = rng.randrange(1, 30)
            req = Request(f"r{step}", prompt, SamplingParams(max_tokens=mt), mt, seed=0,
                          priority=rng.randrange(3), arrival_time=float(step))
            live[req.request_id] = req
            sched.add(req)
        if live and rng.random() < 0.03:
            rid = sorted(live)[rng.randrange(len(live))]
            sched.finish(live.pop(rid), RequestStatus.FINISHED_ABORTED)
            trace.append(("abort", rid))
        out = sched.schedule()
        trace.append((step, [r.request_id for r in out.requests], out.num_new_tokens,
                      [r.request_id for r in out.preempted]))
        sched.update_after_step(out)
        for req in out.requests:
            if req.num_computed_tokens == req.num_tokens:
                req.append_token(rng.randrange(50))
                if req.num_output_tokens >= req.max_tokens:
                    sched.finish(live.pop(req.request_id), RequestStatus.FINISHED_LENGTH)
    return trace


# digests of `schedule_trace` as the scheduler of commit 4c066d6 (before the boosts, the window and the
# latency target) scheduled it; its priority policy had no boosts, hence tool/short boosts 0 here
BEFORE = {("fcfs", 0): "cfc34d79372d9dc6", ("fcfs", 1): "f752d7702f2adb92",
          ("priority", 0): "1cde4c8fedb3078b", ("priority", 1): "f140b2d5ee9a244f"}


@pytest.mark.parametrize("policy,seed", sorted(BEFORE))
def test_default_path_schedules_as_before(policy, seed):
    kwargs = {"tool_boost": 0.0, "short_boost": 0.0} if policy == "priority" else {}
    trace = schedule_trace(policy, seed, **kwargs)
    assert sum(len(e[3]) for e in trace if e[0] != "abort") > 40       # the workload preempts
    assert hashlib.sha256(repr(trace).encode()).hexdigest()[:16] == BEFORE[policy, seed]


def test_scheduler_defaults_are_the_configs():
    d = EngineConfig(model="")
    s = Scheduler.from_config(d, BlockManager(4, 4), 16)
    plain = _scheduler()
    for name, field in [("aging_per_second", "priority_aging_per_second"), ("tool_boost", "priority_tool_boost"),
                        ("short_boost", "priority_short_boost"),
                        ("short_max_tokens", "priority_short_max_tokens"),
                        ("delay_factor", "scheduler_delay_factor")]:
        assert getattr(s, name) == getattr(plain, name) == getattr(d, field), name
    assert s.latency is None and plain.latency is None and d.target_itl_ms is None


def test_flags_reach_the_scheduler():
    parser, _ = cli.build_parser()
    args = parser.parse_args(["serve", "m", "--scheduling-policy", "priority", "--priority-aging-per-second", "0.5",
                              "--priority-tool-boost", "3", "--priority-short-boost", "1.5",
                              "--priority-short-max-tokens", "64", "--scheduler-delay-factor", "0.2",
                              "--target-itl-ms", "40"])
    s = Scheduler.from_config(cli.engine_config(args), BlockManager(4, 4), 16)
    assert (s.policy, s.aging_per_second, s.tool_boost, s.short_boost, s.short_max_tokens, s.delay_factor) == \
        ("priority", 0.5, 3.0, 1.5, 64, 0.2)
    assert s.latency.target == pytest.approx(0.040)


@pytest.mark.parametrize("field,value,words", [
    ("priority_aging_per_second", 0.0, "must be > 0"), ("priority_aging_per_second", float("inf"), "finite"),
    ("priority_tool_boost", -1.0, ">= 0"), ("priority_short_boost", float("nan"), ">= 0"),
    ("priority_short_max_tokens", -1, ">= 0"), ("scheduler_delay_factor", -0.5, ">= 0"),
    ("target_itl_ms", 0.0, "> 0"), ("target_itl_ms", -5.0, "> 0")])
def test_config_refuses_bad_values(field, value, words):
    with pytest.raises(ValueError) as e:
        EngineConfig(model="", **{field: value})
    assert field in str(e.value) and words in str(e.value) and str(value) in str(e.value)


# ---- invariants with every option on ------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.one_of(
           st.tuples(st.just("add"), st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 3),
                                               st.booleans())),
           st.tuples(st.just("abort"), st.integers(0, 100)),
           st.tuples(st.just("step"), st.none())), max_size=40),
       policy=st.sampled_from(["fcfs", "priority"]), delay=st.sampled_from([0.0, 0.5, 5.0]),
       target=st.sampled_from([None, 1.0, 3.0, 30.0]), num_blocks=st.integers(8, 30),
       max_seqs=st.integers(1, 6), budget=st.integers(4, 64))
def test_no_leaks_and_everything_finishes_with_every_option(ops, policy, delay, target, num_blocks, max_seqs,
                                                            budget):
    """Add / step / abort with the batching window and the latency target on (step times from a synthetic
    function of the batch shape, on a fake clock): no block leaks, the step stays within its limits, and
    every request finishes."""
    clock = FakeClock()
    bm = BlockManager(num_blocks, 4)
    sched = Scheduler(bm, max_seqs, budget, max_model_len=num_blocks * 4, policy=policy, delay_factor=delay,
                      target_itl_ms=target, clock=clock)
    rng = random.Random(0)
    live: dict[str, Request] = {}

    def step():
        out = sched.schedule()
        assert out.total_tokens <= budget and len(sched.running) <= max_seqs
        _advance(sched, out, token=rng.randrange(50))
        seconds = 2e-3 + 1e-5 * out.total_tokens + 5e-5 * len(out.requests)
        clock.now += seconds if out else 1e-3
        if out:
            sched.observe_step(out.total_tokens, len(out.requests), seconds)
        for rid in [rid for rid, r in live.items() if r.status.finished]:
            del live[rid]

    for i, (kind, arg) in enumerate(ops):
        if kind == "add":
            plen, max_tokens, prio, tools = arg
            prompt = [rng.randrange(100) for _ in range(min(plen, num_blocks * 4 - max_tokens - 1))] or [1]
            req = Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), max_tokens, seed=0,
                          priority=prio, arrival_time=clock.now, carries_tools=tools)
            live[req.request_id] = req
            sched.add(req)
        elif kind == "abort" and live:
            sched.finish(live.pop(sorted(live)[arg % len(live)]), RequestStatus.FINISHED_ABORTED)
        else:
            step()
        bm.check_invariants(list(live.values()))
    for _ in range(10_000):
        if not sched.has_unfinished():
            break
        step()
        bm.check_invariants(list(live.values()))
    assert not live and not sched.has_unfinished()
    assert bm.num_free_blocks == num_blocks
