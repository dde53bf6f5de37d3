"""What a latency target does to the engine's steps, offline (no HTTP, no API process): mixed-chat prompts,
all submitted at once (an overload past --max-num-seqs), run with and without `--target-itl-ms`, each in
its own process. Every step's shape and its time as the engine measures it (`Scheduler.observe_step`)
are recorded, with the caps the target gave for the step after it.

    PYTHONPATH=src python lab/itl_probe.py [--model preset:qwen3-4b] [--targets none,25] [--num 512]

Prints, per variant: output tok/s, the step-time distribution (p50/p95/p99/max), the share of steps over
the target, the fitted step-time model, and the slowest steps with their shapes; JSON lines to --out.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def run_one(model: str, target: float | None, num: int, max_num_seqs: int) -> dict:
    import numpy as np

    from tokenmill import LLM, SamplingParams
    from tokenmill.bench.datasets import random_requests
    from tokenmill.engine import scheduler as scheduler_mod
    from tokenmill.models.presets import resolve_model_path

    steps: list[tuple] = []
    observe = scheduler_mod.Scheduler.observe_step

    def recording(self, num_tokens, num_seqs, seconds):
        observe(self, num_tokens, num_seqs, seconds)
        caps = (None, None)
        if self.latency is not None and self.latency.ready:
            caps = (self.latency.token_cap(len(self.running)), self.latency.seq_cap(len(self.running)))
        steps.append((num_tokens, num_seqs, seconds, len(self.running), len(self.waiting), *caps))
    scheduler_mod.Scheduler.observe_step = recording

    llm = LLM(resolve_model_path(model), max_num_seqs=max_num_seqs, target_itl_ms=target)
    # mixed-chat's shape in token ids: short chat prompts (50-1,000 characters), 100-300 tokens out
    reqs = random_requests(num, (20, 300), (100, 300), llm.engine.model_config.vocab_size, seed=0)
    prompts = [r.prompt_token_ids for r in reqs]
    llm.generate([prompts[0]], SamplingParams(max_tokens=4, ignore_eos=True))
    steps.clear()
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    secs = np.array([s[2] for s in steps]) * 1000
    res = dict(target_ms=target, num=num, steps=len(steps), elapsed_s=elapsed, out_tok_s=out_tokens / elapsed,
               p50=float(np.percentile(secs, 50)), p95=float(np.percentile(secs, 95)),
               p99=float(np.percentile(secs, 99)), max=float(secs.max()),
               prompt_tokens=int(sum(len(p) for p in prompts)))
    lat = llm.engine.scheduler.latency
    if lat is not None:
        res["over_target"] = float((secs > target).mean())
        res["coef_ms"] = [c * 1000 for c in lat.model.coef]
        res["rmse_ms"] = lat.model.rmse * 1000
    order = np.argsort(-secs)[:12]
    res["slowest"] = [dict(i=int(i), ms=round(float(secs[i]), 2), tokens=steps[i][0], seqs=steps[i][1],
                           running=steps[i][3], waiting=steps[i][4], token_cap=steps[i][5], seq_cap=steps[i][6])
                      for i in order]
    # the shapes over time, every 25th step
    res["trace"] = [dict(i=i, ms=round(float(secs[i]), 2), tokens=steps[i][0], seqs=steps[i][1],
                         token_cap=steps[i][5], seq_cap=steps[i][6]) for i in range(0, len(steps), 25)]
    return res


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="preset:qwen3-4b")
    p.add_argument("--targets", default="none,25")
    p.add_argument("--num", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--out", default=None)
    p.add_argument("--one", default=None)
    a = p.parse_args()
    if a.one is not None:
        target = None if a.one == "none" else float(a.one)
        print("RESULT " + json.dumps(run_one(a.model, target, a.num, a.max_num_seqs)), flush=True)
        return 0
    results = []
    for t in a.targets.split(","):
        proc = subprocess.run([sys.executable, __file__, "--one", t, "--model", a.model, "--num", str(a.num),
                               "--max-num-seqs", str(a.max_num_seqs)], capture_output=True, text=True)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not line:
            print(proc.stderr[-3000:], file=sys.stderr)
            continue
        results.append(json.loads(line[0][7:]))
    if a.out:
        with open(a.out, "w") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    for r in results:
        print(f"\n## target {r['target_ms']} ms: {r['out_tok_s']:.0f} out tok/s, {r['steps']} steps, step ms "
              f"p50 {r['p50']:.2f} p95 {r['p95']:.2f} p99 {r['p99']:.2f} max {r['max']:.2f}"
              + (f", over target {100 * r['over_target']:.1f}%, coef (a, b, c) ms {[round(c, 5) for c in r['coef_ms']]},"
                 f" rmse {r['rmse_ms']:.2f} ms" if "coef_ms" in r else ""))
        for s in r["slowest"]:
            print("  slow", s)
        for s in r["trace"][:40]:
            print("  trace", s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
