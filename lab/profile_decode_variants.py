"""Where a decode step's time goes, on the GPU machine.

For each batch size: the engine's ms per step (one `LLM.generate` of equal requests, ignore_eos), the
device time of one replay of the decode CUDA graph alone (CUDA events over many replays), the share of
each step the host spent waiting for the device (0 means the host is the bottleneck), and a per-kernel
table of one graph replay from the PyTorch profiler. A cProfile of the host side at batch 1 goes to
$OUT/host_profile_bs1.txt. With --gemv-variants, the batch-1 decode graph is captured again for each
variant of the single-token product settings and the variants' replays are timed in turns, side by side
in one process. Then single-request prefill: wall time of `generate` with max_tokens 1 for
fresh prompts of each length, against the GPU kernel time of one such request.

Usage: python scripts/device/profile_decode.py --model preset:qwen3-4b --batch-sizes 1,8,64 --out DIR
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import l2_cache  # beside this script
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.runner import model_runner

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "device"))
from profile_decode import (gpu_state_under_load, graph_replay_ms, kernel_table,  # noqa: E402
                            replay_ms, timeline)


def _padded_bytes(t: torch.Tensor) -> int:
    return (t.numel() * t.element_size() + 255) // 256 * 256


def packed_copies(tensors: list[torch.Tensor], device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One allocation holding a copy of each tensor, in order, each at a 256-byte offset -> (the
    allocation, the copies)."""
    buf = torch.empty(sum(_padded_bytes(t) for t in tensors), dtype=torch.uint8, device=device)
    copies, off = [], 0
    for t in tensors:
        view = buf[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t)
        copies.append(view)
        off += _padded_bytes(t)
    return buf, copies


def l2_arena(runner) -> dict:
    """Moves the small tensors that kernels read right after their wait into one buffer, in the order
    counters (decode attention, argmax), RMSNorm weights, RoPE table, and rebinds the model to them (the
    old tensors stay alive: graphs captured before still read them). -> {"ptr", "ends": {part: end}}."""
    from tokenmill.layers.kernels import counters
    from tokenmill.layers.norm import RMSNorm
    model = runner.model
    dev = next(d for d in counters._kept if d.type == "cuda")
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    rotaries = [m for m in model.modules() if hasattr(m, "cos_sin") and isinstance(m.cos_sin, torch.Tensor)]
    parts = [("counters", [counters._kept[dev][-1]]), ("norms", [m.weight.data for m in norms]),
             ("cos_sin", [m.cos_sin for m in rotaries])]
    ends, end = {}, 0
    for part, tensors in parts:
        end = ends[part] = end + sum(_padded_bytes(t) for t in tensors)
    olds = [t for _, tensors in parts for t in tensors]
    buf, copies = packed_copies(olds, dev)
    runner._l2_kept = [buf, *olds]
    it = iter(copies)
    counters._kept[dev].append(next(it))
    for m in norms:
        m.weight.data = next(it)
    for m in rotaries:
        m.cos_sin = next(it)
    info = {"ptr": buf.data_ptr(), "ends": ends, **l2_cache.device_limits(dev.index or 0)}
    print(json.dumps({"l2_arena": info}), flush=True)
    return info


def l2_windows(runner, graph, arena: dict, spec: dict) -> int:
    """Gives each kernel node of `graph` (captured with keep_graph) one access policy window: on the
    weight it reads that matches spec["weights"] (a regex over parameter names; hit ratio
    spec["budget_mb"] over all matched weights' bytes, at most 1), else on the arena up to the end of
    spec["arena"] (a part name, or none). -> the set-aside to time it with (spec["persist_mb"], default
    the device's most)."""
    import re
    mb = 1 << 20
    weights = {}
    if spec.get("weights"):
        weights = {p.data_ptr(): p.numel() * p.element_size() for n, p in runner.model.named_parameters()
                   if re.search(spec["weights"], n)}
    hit = min(1.0, spec.get("budget_mb", 0) * mb / max(1, sum(weights.values())))
    miss = l2_cache.ACCESS_STREAMING if spec.get("miss") == "streaming" else l2_cache.ACCESS_NORMAL
    arena_end = arena["ends"][spec["arena"]] if spec.get("arena") else 0
    counts = {"weight": 0, "arena": 0, "none": 0}
    for node in l2_cache.kernel_nodes(graph.raw_cuda_graph()):
        w = next((p for p in node.pointers if p in weights), None)
        if w is not None and hit > 0:
            l2_cache.set_window(node, w, min(weights[w], arena["max_window_bytes"]), hit, miss=miss)
            counts["weight"] += 1
        elif arena_end:
            l2_cache.set_window(node, arena["ptr"], arena_end)
            counts["arena"] += 1
        else:
            counts["none"] += 1
    limit = int(spec.get("persist_mb", 0) * mb) or arena["max_persisting_bytes"]
    print(json.dumps({"l2_windows": spec, "nodes": counts, "hit_ratio": hit, "persisting_bytes": limit}),
          flush=True)
    return limit


def flat_weights(runner) -> list:
    """Copies every parameter into one allocation, in the model's order (`packed_copies`), and returns
    [(param, its own data, its copy in the allocation)]; `use_flat` switches between the two."""
    params = list(runner.model.parameters())
    buf, copies = packed_copies([p.data for p in params], runner.device)
    print(json.dumps({"flat_weights_bytes": buf.numel(), "params": len(params)}), flush=True)
    return [(p, p.data, copy) for p, copy in zip(params, copies)]


def use_flat(flat: list, on: bool) -> None:
    for p, own, view in flat:
        p.data = view if on else own


def gemv_variants(runner, variants: list[dict], rounds: int = 5) -> list[dict]:
    """Batch-1 decode graph replay per variant of the product tiles ({"name", "configs": [[N, K, silu,
    tile], ...]} over `gemv.CONFIGS`), each captured on the runner's static buffers as they are after
    the last step; the variants are timed in `rounds` turns and the median replay of each is kept. A
    variant's "pdl_attention" (1 or 2) sets the decode attention kernel's launch mode (`pdl.py`), its
    "attention" ({"min_split_len": 128, "l2_prefetch": {...}, ...}) entries of
    `decode_attention.CONFIG`, its "l2" the persisting L2 windows of its graph (`l2_windows`), with the
    set-aside on while it is timed; with "flat" its graph reads every weight from one allocation (`flat_weights`); "pool": "engine"
    captures it into the engine's graph pool (else a pool of its own), after "pad_kb" KB of padding;
    "engine_graph" times the engine's own batch-1 graph in the same turns."""
    from tokenmill.layers.kernels import decode_attention, gemv, gemv_smem, pdl
    saved, saved_mode, saved_attention = dict(gemv.CONFIGS), pdl.ATTENTION_MODE, dict(decode_attention.CONFIG)
    graphs, limits, arena, flat = {}, {}, None, None
    for v in variants:
        if v.get("engine_graph"):       # the engine's own batch-1 graph, timed in the same turns
            graphs[v["name"]] = runner.graphs[("decode", 1)]
            continue
        configs = {(n, k, bool(silu)): tuple(tile) for n, k, silu, tile in v.get("configs", [])}
        bad = [f"{key}: {why}" for key, tile in configs.items() if tile[0] == "smem"
               and (why := gemv_smem.check_tile(*key, runner.dtype, tile))]
        if bad:      # fused_linear would fall back to its default tile and time something else
            print(json.dumps({"variant": v["name"], "skipped": bad}), flush=True)
            continue
        pdl.ATTENTION_MODE = v.get("pdl_attention", saved_mode)
        gemv.CONFIGS = {**saved, **configs}
        decode_attention.CONFIG = {**saved_attention, **v.get("attention", {})}
        if "l2" in v and arena is None:
            arena = l2_arena(runner)
        if v.get("flat") and flat is None:
            flat = flat_weights(runner)
        if flat is not None:
            use_flat(flat, bool(v.get("flat")))
        forward = runner.graph_runner.static_forward(("decode", 1))
        try:
            forward()
        except Exception as e:   # a tile that does not compile: the other variants still run
            print(json.dumps({"variant": v["name"], "skipped": repr(e)[-500:]}), flush=True)
            continue
        graph = torch.cuda.CUDAGraph(keep_graph="l2" in v)
        pool = runner.graphs[("decode", 1)].pool() if v.get("pool") == "engine" else None
        with torch.cuda.graph(graph, pool=pool):
            pad = torch.empty(int(v.get("pad_kb", 0) * 1024), dtype=torch.uint8, device=runner.device)
            forward()
        del pad
        if "l2" in v:
            limits[v["name"]] = l2_windows(runner, graph, arena, v["l2"])
            graph.instantiate()
        graphs[v["name"]] = graph
    gemv.CONFIGS, pdl.ATTENTION_MODE, decode_attention.CONFIG = saved, saved_mode, saved_attention
    if flat is not None:
        use_flat(flat, False)
    times = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, graph in graphs.items():
            if limits:
                l2_cache.set_persisting(limits.get(name, 0))
            times[name].append(replay_ms(graph))
    if limits:
        l2_cache.set_persisting(0)
    rows = [{"variant": name, "graph_replay_ms": sorted(t)[len(t) // 2], "all_ms": t} for name, t in times.items()]
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="preset:qwen3-4b")
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--prefill-lens", default="128,1000,2000",
                    help="single-request prefill (max_tokens 1) wall time and GPU kernel time")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--gemv-variants", default="",
                    help='JSON list (or @file) of {"name", "configs": [[N, K, silu, tile], ...]}: batch-1 '
                         'decode graph replay of each, in turns')
    ap.add_argument("--timeline", action="store_true",
                    help="device events of a batch-1 graph replay and of batch-1 steps to timeline_<model>.json")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    name = args.model.split(":")[-1]

    llm = LLM(args.model, dtype="bfloat16" if torch.cuda.is_available() else "float32", max_num_seqs=256, max_model_len=4096,
              gpu_memory_utilization=args.gpu_memory_utilization)
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
        gbs = next((k[1] for k in sorted(runner.graphs) if k[0] == "decode" and k[1] >= bs), None)
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
        timeline(runner, run, os.path.join(args.out, f"timeline_{name}.json"))

    variants = []
    if args.gemv_variants and torch.cuda.is_available():
        spec = args.gemv_variants
        variants = gemv_variants(runner, json.load(open(spec[1:])) if spec.startswith("@") else json.loads(spec))

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
        json.dump({"decode": results, "prefill": prefill, "gemv_variants": variants}, f, indent=1)
    for r in prefill:
        print(f"prefill {r['prompt_len']} tokens: {r['wall_ms_median']:.1f} ms wall, "
              f"{r['gpu_kernel_ms']:.1f} ms of kernels")
    print("\n| model | batch | step ms | graph replay ms | host waits | kernels/step | kernel us sum |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['model']} | {r['batch']} | {r['step_ms']:.3f} | {r['graph_replay_ms']:.3f} | "
              f"{r['host_wait_frac']:.2f} | {r['kernels_per_step']:.0f} | {r['kernel_us_sum']:.0f} |")
    if variants:
        print("\n| model | gemv variant (batch 1) | graph replay ms, median of turns | all turns |")
        print("|---|---|---|---|")
        for r in variants:
            print(f"| {name} | {r['variant']} | {r['graph_replay_ms']:.3f} | "
                  f"{' '.join(f'{t:.3f}' for t in r['all_ms'])} |")


if __name__ == "__main__":
    main()
