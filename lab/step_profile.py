"""Where an engine core's step time goes: wall-clock phase timers around the engine's own methods.

Used as an engine factory, so the served engine is the real one with timers added in its process:

    PYTHONPATH=lab:src STEP_PROFILE_OUT=/tmp/core.json \
        tokenmill serve MODEL --engine-factory step_profile:make

Every 2 s (and on each snapshot) the cumulative seconds and call counts of each phase are written to
STEP_PROFILE_OUT as JSON; `python lab/step_profile.py A.json B.json` prints the difference B - A per
step (a benchmark level's profile is the difference of the snapshots taken around it).

Phases: schedule (Scheduler.schedule), execute (ModelRunner.execute: input preparation, graph replay or
eager launch, sampler launch, less its before_sample callback; the eager forward's launch alone is also
counted apart, as eager_forward), before_sample (scheduler bookkeeping and,
for grammar batches, the previous step's processing), wait (StepResult.fetch: blocking on the device),
process (StepReader.read less wait: appending tokens, stop checks, the step's report),
send / recv (the pipe to the API server, pickling included), and
step (LLMEngine.step in all) and loop (the core loop's iterations, idle waits excluded).
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict

_totals: dict[str, float] = defaultdict(float)
_counts: dict[str, int] = defaultdict(int)
_extra: dict[str, float] = defaultdict(float)
_last_write = [0.0]


def _write(force: bool = False) -> None:
    now = time.perf_counter()
    if not force and now - _last_write[0] < 2.0:
        return
    _last_write[0] = now
    path = os.environ.get("STEP_PROFILE_OUT")
    if not path:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"seconds": dict(_totals), "calls": dict(_counts), "extra": dict(_extra),
                   "time": time.time()}, f)
    os.replace(tmp, path)


def _timed(owner, name: str, phase: str, exclude: tuple[str, ...] = ()):
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        before = {p: _totals[p] for p in exclude}
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            _totals[phase] += dt - sum(_totals[p] - before[p] for p in exclude)
            _counts[phase] += 1
    setattr(owner, name, wrapper)


def install() -> None:
    from multiprocessing.connection import Connection

    from tokenmill.engine import core_proc
    from tokenmill.engine.engine import LLMEngine
    from tokenmill.engine.scheduler import Scheduler
    from tokenmill.engine.step_reader import StepReader
    from tokenmill.runner import step as step_mod
    from tokenmill.runner.model_runner import ModelRunner

    _timed(Scheduler, "schedule", "schedule")
    _timed(step_mod.StepResult, "fetch", "wait")
    _timed(StepReader, "read", "process", exclude=("wait",))
    _timed(Connection, "send", "send")
    _timed(Connection, "recv", "recv")
    _timed(ModelRunner, "_eager_forward", "eager_forward")

    execute = ModelRunner.execute

    def timed_execute(self, requests, num_new_tokens, prev=None, before_sample=None):
        spent = [0.0]

        def inner(result):
            t = time.perf_counter()
            try:
                before_sample(result)
            finally:
                spent[0] += time.perf_counter() - t
        t0 = time.perf_counter()
        try:
            return execute(self, requests, num_new_tokens, prev, inner if before_sample else None)
        finally:
            _totals["execute"] += time.perf_counter() - t0 - spent[0]
            _totals["before_sample"] += spent[0]
            _counts["execute"] += 1
            _extra["rows"] += len(requests)
            _extra["tokens"] += sum(num_new_tokens)
    ModelRunner.execute = timed_execute

    step = LLMEngine.step

    def timed_step(self):
        t0 = time.perf_counter()
        try:
            return step(self)
        finally:
            _totals["step"] += time.perf_counter() - t0
            _counts["step"] += 1
            _write()
    LLMEngine.step = timed_step

    apply = core_proc._Client.apply

    def timed_apply(*args):
        t0 = time.perf_counter()
        try:
            return apply(*args)
        finally:
            _totals["commands"] += time.perf_counter() - t0
            _counts["commands"] += 1
    core_proc._Client.apply = timed_apply


def _writer() -> None:
    while True:
        time.sleep(1.0)
        _write(force=True)


def make(config):
    import threading
    install()
    threading.Thread(target=_writer, daemon=True, name="step-profile").start()
    from tokenmill.engine.engine import LLMEngine
    return LLMEngine(config)


def report(a: dict, b: dict) -> str:
    steps = b["calls"].get("step", 0) - a["calls"].get("step", 0)
    if steps <= 0:
        return "no steps between the two snapshots"
    lines = [f"{steps} steps; {(b['extra'].get('rows', 0) - a['extra'].get('rows', 0)) / steps:.1f} rows and "
             f"{(b['extra'].get('tokens', 0) - a['extra'].get('tokens', 0)) / steps:.1f} tokens per step",
             "| phase | ms per step |", "|---|---|"]
    for phase in ("schedule", "execute", "before_sample", "wait", "process", "send", "recv",
                  "commands", "step"):
        dt = b["seconds"].get(phase, 0.0) - a["seconds"].get(phase, 0.0)
        lines.append(f"| {phase} | {1e3 * dt / steps:.3f} |")
    eager = b["calls"].get("eager_forward", 0) - a["calls"].get("eager_forward", 0)
    if eager:
        dt = b["seconds"].get("eager_forward", 0.0) - a["seconds"].get("eager_forward", 0.0)
        lines.append(f"\n{eager} steps ({100 * eager / steps:.1f}%) ran eagerly (no CUDA graph holds them), their "
                     f"forward's launch {1e3 * dt / eager:.2f} ms a step, {1e3 * dt / steps:.3f} ms of execute's "
                     f"share per step")
    return "\n".join(lines)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        first = json.load(f)
    with open(sys.argv[2]) as f:
        second = json.load(f)
    print(report(first, second))
