"""The step-time model and the latency target (--target-itl-ms), on a simulated engine whose step time is a
synthetic function of the batch shape with noise, on a fake clock."""
from __future__ import annotations

import random

import pytest

from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.step_time import LatencyTarget, StepTimeModel
from tokenmill.sampling_params import SamplingParams

# the simulated device: 4 ms per step, 25 us per token, 150 us per sequence, noise of 0.4 ms
TRUE = (4e-3, 25e-6, 150e-6)
NOISE = 0.4e-3


def true_time(tokens: int, seqs: int, rng: random.Random) -> float:
    a, b, c = TRUE
    return max(a + b * tokens + c * seqs + rng.gauss(0.0, NOISE), 1e-4)


# ---- the model ----------------------------------------------------------------------------------------------
def test_model_converges_on_varied_shapes():
    rng = random.Random(0)
    model = StepTimeModel()
    for _ in range(600):
        seqs = rng.randrange(1, 256)
        tokens = seqs + rng.choice([0, 0, rng.randrange(1, 4096)])
        model.observe(tokens, seqs, true_time(tokens, seqs, rng))
    for got, want in zip(model.coef, TRUE):
        assert got == pytest.approx(want, rel=0.05)
    assert model.rmse == pytest.approx(NOISE, rel=0.3)          # an honest estimate of the noise


def test_model_under_pure_decode_predicts_decodes_and_stays_non_negative():
    """tokens == seqs in every step: only b + c can be learnt; the fit predicts decode steps and keeps
    every coefficient >= 0 (an unconstrained fit may trade a negative b for a larger c)."""
    rng = random.Random(1)
    model = StepTimeModel()
    for _ in range(300):
        s = rng.randrange(1, 200)
        model.observe(s, s, true_time(s, s, rng))
    a, b, c = model.coef
    assert min(a, b, c) >= 0.0
    assert b + c == pytest.approx(TRUE[1] + TRUE[2], rel=0.05)
    for s in (1, 64, 200):
        assert model.predict(s, s) == pytest.approx(TRUE[0] + (TRUE[1] + TRUE[2]) * s, rel=0.05)


def test_model_clamps_a_slope_the_data_makes_negative():
    model = StepTimeModel()
    for s in range(1, 100):
        model.observe(2 * s, s, 0.01 - 1e-6 * s)          # more sequences, (slightly) faster
    a, b, c = model.coef
    assert min(a, b, c) >= 0.0 and model.predict(100, 50) == pytest.approx(0.01, rel=0.02)


def test_model_follows_drift():
    rng = random.Random(2)
    model = StepTimeModel()
    for c in (150e-6, 400e-6):           # contexts grew: each sequence's KV reads now cost more
        for _ in range(800):
            seqs = rng.randrange(1, 200)
            tokens = seqs + rng.choice([0, rng.randrange(1, 2048)])
            model.observe(tokens, seqs, TRUE[0] + TRUE[1] * tokens + c * seqs + rng.gauss(0.0, NOISE))
    assert model.coef[2] == pytest.approx(400e-6, rel=0.05)


# ---- the latency target on a simulated engine -----------------------------------------------------------------
class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _workload(seed: int, n: int = 600) -> list[Request]:
    """An overload: `n` requests within 0.5 s, prompts of 32-512 tokens, outputs of 16-128."""
    rng = random.Random(seed)
    reqs, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(n / 0.5)
        prompt = [rng.randrange(1000) for _ in range(rng.randrange(32, 513))]
        mt = rng.randrange(16, 129)
        reqs.append(Request(f"r{i}", prompt, SamplingParams(max_tokens=mt), mt, seed=0, arrival_time=t))
    return reqs


def _serve(target_itl_ms: float | None, seed: int = 0, requests=None):
    """Runs the workload to the end; returns the steps' (tokens, seqs, seconds) and the scheduler."""
    rng = random.Random(seed + 100)
    clock = FakeClock()
    pending = requests if requests is not None else _workload(seed)
    sched = Scheduler(BlockManager(num_blocks=40_000, block_size=16), 256, 4096, max_model_len=4096,
                      target_itl_ms=target_itl_ms, clock=clock)
    steps = []
    while pending or sched.has_unfinished():
        while pending and pending[0].arrival_time <= clock.now:
            sched.add(pending.pop(0))
        if not sched.has_unfinished():
            clock.now = pending[0].arrival_time
            continue
        running = [r for r in sched.running if not r.done_generating]
        out = sched.schedule()
        assert out, "the scheduler returned an empty step with work to do"
        assert not out.preempted and set(running) <= set(out.requests)   # no running request is skipped
        seconds = true_time(out.total_tokens, len(out.requests), rng)
        sched.update_after_step(out)
        for req in out.requests:
            if req.num_computed_tokens == req.num_tokens:
                req.append_token(7)
                if req.num_output_tokens >= req.max_tokens:
                    sched.finish(req, RequestStatus.FINISHED_LENGTH)
        clock.now += seconds
        sched.observe_step(out.total_tokens, len(out.requests), seconds)
        steps.append((out.total_tokens, len(out.requests), seconds))
        assert len(steps) < 20_000
    return steps, sched


def test_latency_target_keeps_steps_under_it_where_the_baseline_exceeds_it():
    target = 0.030
    base, _ = _serve(None)
    capped, sched = _serve(target * 1000)
    base_over = sum(s > target for _, _, s in base) / len(base)
    capped_over = sum(s > target for _, _, s in capped) / len(capped)
    assert base_over > 0.5                       # the baseline runs 256 sequences: ~49 ms a decode step
    assert capped_over <= 0.01
    assert max(s for _, _, s in capped) < 1.2 * target
    # the fit converged on the shapes it saw, and the steps use the room under the target
    for got, want in zip(sched.latency.model.coef, TRUE):
        assert got == pytest.approx(want, rel=0.15)
    busy = capped[LatencyTarget.MIN_SAMPLES + 20:-100]       # past the start, before the queue drains
    assert sum(s for _, _, s in busy) / len(busy) > 0.6 * target
    assert sum(t for t, _, _ in capped) == sum(t for t, _, _ in base)    # the same work, all of it done


def test_latency_target_admits_more_when_well_below_it():
    """The same load under a looser target runs more sequences per step."""
    loose, _ = _serve(60.0)
    tight, _ = _serve(15.0)
    mean_seqs = lambda steps: sum(s for _, s, _ in steps) / len(steps)   # noqa: E731
    assert mean_seqs(loose) > 2 * mean_seqs(tight)
    assert sum(s > 0.015 for _, _, s in tight) / len(tight) <= 0.01


def test_an_unreachable_target_slows_the_engine_but_never_stalls_it():
    """A target under the fixed cost of a step (4 ms): every step is over; requests still all finish."""
    steps, sched = _serve(1.0, requests=_workload(3, n=40))
    assert not sched.has_unfinished() and len(steps) > 40


def test_the_first_steps_admit_one_request_each_until_the_model_is_trusted():
    clock = FakeClock()
    sched = Scheduler(BlockManager(1000, 16), 256, 4096, 4096, target_itl_ms=30.0, clock=clock)
    for r in _workload(4, n=50):
        r.arrival_time = 0.0
        sched.add(r)
    rng = random.Random(0)
    for step in range(LatencyTarget.MIN_SAMPLES):
        out = sched.schedule()
        assert len(sched.running) == step + 1
        sched.update_after_step(out)
        sched.observe_step(out.total_tokens, len(out.requests), true_time(out.total_tokens, len(out.requests), rng))
    assert sched.latency.ready
