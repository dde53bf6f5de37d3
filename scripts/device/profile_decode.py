"""Where a decode step's time goes, on the GPU machine.

For each batch size: the engine's ms per step (one `LLM.generate` of equal requests, ignore_eos), the
device time of one replay of the decode CUDA graph alone (CUDA events over many replays), the share of
each step the host spent waiting for the device (0 means the host is the bottleneck), and a per-kernel
table of one graph replay from the PyTorch profiler. A cProfile of the host side at batch 1 goes to
$OUT/host_profile_bs1.txt. Then single-request prefill: wall time of `generate` with max_tokens 1 for
fresh prompts of each length, against the GPU kernel time of one such request. With --timeline, the
device events of a decode graph replay and of engine steps at --timeline-batch sequences
(timeline_<model>[_bs<N>].json, which scripts/device/timeline_report.py reads).

Usage: python scripts/device/profile_decode.py --model preset:qwen3-4b --batch-sizes 1,8,64 --out DIR
       [--quantization fp8] [--kv-cache-dtype fp8] [--timeline [--timeline-batch 64]]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.runner import model_runner


def graph_replay_ms(runner, bs: int, iters: int = 200) -> float:
    return replay_ms(runner.graphs[("decode", bs)], iters)


def replay_ms(graph: torch.cuda.CUDAGraph, iters: int = 200) -> float:
    """Device time of one replay of `graph`: CUDA events around `iters` replays, after 10 warm-up ones."""
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def gpu_state_under_load(graph: torch.cuda.CUDAGraph, limit_s: float = 10.0) -> dict:
    """SM and memory clocks (MHz), temperature (C) and power (W) as nvidia-smi reads them while `graph`
    replays back to back: what a machine ran at, for comparing figures across machines. {"error"} when
    there is no reading."""
    import subprocess
    import threading
    out = {}

    def query():
        try:
            r = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw",
                                "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=limit_s)
            vals = r.stdout.strip().splitlines()[0].split(",")
            out.update(zip(("sm_mhz", "mem_mhz", "temp_c", "power_w"), (float(v) for v in vals)))
        except Exception as e:      # no nvidia-smi, or a field it cannot read: the figures stand without it
            out["error"] = repr(e)[-200:]
    t = threading.Thread(target=query)
    t.start()
    t0 = time.perf_counter()
    while t.is_alive() and time.perf_counter() - t0 < limit_s:
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
    t.join()
    return out


def kernel_table(runner, bs: int, path: str) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile
    graph = runner.graphs[("decode", bs)]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        dev_us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if dev_us > 0:
            rows.append({"name": ev.key[:90], "calls_per_step": ev.count / 5, "us_per_step": dev_us / 5})
    rows.sort(key=lambda r: -r["us_per_step"])
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    return rows


def gpu_events(prof) -> list[list]:
    """[name, start us, duration us] of every device-side event (kernels, copies) a profile holds, in
    start order."""
    rows = []
    for ev in prof.events():
        if str(getattr(ev, "device_type", "")).endswith("CUDA") and ev.time_range.elapsed_us() >= 0:
            rows.append([ev.name[:80], ev.time_range.start, ev.time_range.elapsed_us()])
    rows.sort(key=lambda r: r[1])
    t0 = rows[0][1] if rows else 0
    return [[n, s - t0, d] for n, s, d in rows]


def graph_batch(runner, batch: int) -> int | None:
    """The smallest captured decode graph that holds `batch` sequences (None: none does)."""
    return min((k[1] for k in runner.graphs if k[0] == "decode" and k[1] >= batch), default=None)


def timeline(runner, run, path: str, batch: int = 1) -> None:
    """Device events of three decode graph replays at `batch` sequences (the graph of the smallest
    captured size that holds them; the last replay kept), then of a `generate` of `batch` requests (its
    middle steps kept), to `path`: where the step's time goes between kernels, and between graph replays."""
    from torch.profiler import ProfilerActivity, profile
    gbs = graph_batch(runner, batch)
    graph = runner.graphs[("decode", gbs)]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    events = gpu_events(prof)
    per = len(events) // 3
    replay = events[-per:]
    t0 = replay[0][1]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(batch)
        torch.cuda.synchronize()
    steps = gpu_events(prof)
    mid = len(steps) // 2
    with open(path, "w") as f:
        json.dump({"batch": batch, "graph_batch": gbs, "graph": [[n, s - t0, d] for n, s, d in replay],
                   "steps": steps[mid - 2000:mid + 2000]}, f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="preset:qwen3-4b")
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--prefill-lens", default="128,1000,2000",
                    help="single-request prefill (max_tokens 1) wall time and GPU kernel time")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--timeline", action="store_true",
                    help="device events of a decode graph replay and of decode steps to timeline_<model>.json")
    ap.add_argument("--timeline-batch", type=int, default=1, help="the sequences of --timeline's steps")
    ap.add_argument("--quantization", default=None, help="as `LLM(quantization=...)`: fp8, awq, gptq")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    name = args.model.split(":")[-1]

    llm = LLM(args.model, dtype="bfloat16" if torch.cuda.is_available() else "float32", max_num_seqs=256, max_model_len=4096,
              gpu_memory_utilization=args.gpu_memory_utilization, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype)
    runner = llm.engine.runner
    waited = [0.0]
    fetch = model_runner.StepResult.fetch

    def timed_fetch(self):
        t0 = time.perf_counter()
        out = fetch(self)
        waited[0] += time.perf_counter() - t0
        return out
    model_runner.StepResult.fetch = timed_fetch

    def run(bs: int):
        prompts = [[100 + i + j for j in range(args.prompt_len)] for i in range(bs)]
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        return llm.generate(prompts, params)

    run(1)
    results = []
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        run(bs)                                          # warm-up at this size
        waited[0] = 0.0
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = run(bs)
        wall = time.perf_counter() - t0
        steps = args.output_len
        assert all(len(o.outputs[0].token_ids) == steps for o in outs)
        gbs = graph_batch(runner, bs)
        replay, kernels = float("nan"), []
        if gbs is not None:
            replay = graph_replay_ms(runner, gbs)
            kernels = kernel_table(runner, gbs, os.path.join(args.out, f"kernels_{name}_bs{bs}.json"))
        row = {"model": name, "batch": bs, "graph_bs": gbs, "step_ms": 1e3 * wall / steps,
               "graph_replay_ms": replay, "host_wait_frac": waited[0] / wall,
               "kernel_us_sum": sum(r["us_per_step"] for r in kernels),
               "kernels_per_step": sum(r["calls_per_step"] for r in kernels)}
        if gbs is not None:
            row["gpu"] = gpu_state_under_load(runner.graphs[("decode", gbs)])
        results.append(row)
        print(json.dumps(row), flush=True)
        print("  top kernels (us/step, calls):", flush=True)
        for r in kernels[:14]:
            print(f"    {r['us_per_step']:9.1f} {r['calls_per_step']:6.0f}  {r['name']}", flush=True)

    if args.timeline and torch.cuda.is_available():
        suffix = "" if args.timeline_batch == 1 else f"_bs{args.timeline_batch}"
        timeline(runner, run, os.path.join(args.out, f"timeline_{name}{suffix}.json"), args.timeline_batch)

    prefill = []
    if torch.cuda.is_available():
        from torch.profiler import ProfilerActivity, profile
        for length in [int(x) for x in args.prefill_lens.split(",") if x]:
            walls = []
            for rep in range(6):
                prompt = [(1000 + 7919 * (rep * 131 + j)) % 50000 + 100 for j in range(length)]
                params = SamplingParams(temperature=0, max_tokens=1)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if rep == 5:
                    with profile(activities=[ProfilerActivity.CUDA]) as prof_gpu:
                        llm.generate([prompt], params)
                        torch.cuda.synchronize()
                else:
                    llm.generate([prompt], params)
                walls.append(time.perf_counter() - t0)
            gpu_us = sum(getattr(e, "device_time_total", 0) or 0 for e in prof_gpu.key_averages())
            row = {"prompt_len": length, "wall_ms_median": 1e3 * sorted(walls[1:5])[2],
                   "gpu_kernel_ms": gpu_us / 1e3}
            prefill.append(row)
            print(json.dumps(row), flush=True)

    prof = cProfile.Profile()
    prof.enable()
    run(1)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(40)
    with open(os.path.join(args.out, f"host_profile_{name}_bs1.txt"), "w") as f:
        f.write(s.getvalue())
    with open(os.path.join(args.out, f"profile_{name}.json"), "w") as f:
        json.dump({"decode": results, "prefill": prefill}, f, indent=1)
    for r in prefill:
        print(f"prefill {r['prompt_len']} tokens: {r['wall_ms_median']:.1f} ms wall, "
              f"{r['gpu_kernel_ms']:.1f} ms of kernels")
    print("\n| model | batch | step ms | graph replay ms | host waits | kernels/step | kernel us sum |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['model']} | {r['batch']} | {r['step_ms']:.3f} | {r['graph_replay_ms']:.3f} | "
              f"{r['host_wait_frac']:.2f} | {r['kernels_per_step']:.0f} | {r['kernel_us_sum']:.0f} |")


if __name__ == "__main__":
    main()
