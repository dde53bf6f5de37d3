"""Sliding windows and soft caps in the Triton attention kernels, on the GPU: each kernel checked against
`attention.paged_attention_torch` and timed without a window, with the model's window, with a soft cap of 50,
and with both (Gemma 2's sliding layers), at a Mistral-7B-like layer (32 q heads over 8 kv, head_dim 128,
window 4,096; bf16 and FP8 caches) and a Gemma-3-1B-like one (4 q heads over 1 kv, head_dim 256, q/k norm,
window 512; bf16). Block size 16. Cases: the one-kernel decode (`decode_attention.fused_decode_attention`,
q/k norm, RoPE and the new token's store included) at 1, 16, 64 and 256 sequences, and a mixed step
(`paged_attention.paged_prefill_attention`: 16 decode rows beside a 2,048-token prefill chunk, tiled as the
engine's mixed graphs launch it), each at contexts up to the window and around 32k, well past it.

    PYTHONPATH=src python lab/window_attention_bench.py --device cuda          # ~2 min on an H100
    TRITON_INTERPRET=1 PYTHONPATH=src python lab/window_attention_bench.py --device cpu --tiny   # checks only

Check: the kernel's output rows of a few sequences (first, middle, last; of the chunk its first and last 64
queries) against the reference over the cache as the kernel left it (the fused decode stores the new token
first; tests/kernels check that store): the largest |out - ref|, a pass where |out - ref| <= tol (1 + |ref|)
(tol 2e-2 in bf16, 2e-3 in float16), beside how far the window and the cap move the reference from the
uncapped full-context one (so that a pass means something). q is scaled so that the scores have a standard
deviation of about Q_SCALE, which the cap of 50 bends at their top. Time: one CUDA graph of several calls
(about 2 ms of work), median of REPLAYS replays over CUDA events, in microseconds a call; each variant's
ratio to the case's no-window time, and on the 32k rows the windowed time over the no-window time at up to
the window's length: about 1 where a window's cost follows the window, not the context.

The sequences of a case share a pool of at most POOL_BYTES of K/V blocks (randomly, far beyond L2), each
with a private last block that its new token is stored in, so a 256 x 32k case needs no 34 GB cache.
Cases start until --budget-s has passed (Mistral bf16, Gemma, Mistral FP8), the rest listed as skipped; the
exit status is 1 where a check failed. The table comes last.
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# (q heads, kv heads, head_dim, window, q/k norm)
MODELS = {"mistral-7b": (32, 8, 128, 4096, False), "gemma-3-1b": (4, 1, 256, 512, True)}
TINY = {"mistral-7b": (4, 2, 32, 20, False), "gemma-3-1b": (2, 1, 64, 8, True)}
# in this order, so that the budget cuts the FP8 cache first
RUNS = (("mistral-7b", "bf16"), ("gemma-3-1b", "bf16"), ("mistral-7b", "fp8"))
BATCHES, TINY_BATCHES = (1, 16, 64, 256), (1, 3)
LONG, TINY_LONG = 32768, 61                   # the past-window context (each row up to 1/8 shorter)
MIXED_DECODES, CHUNK, TINY_CHUNK = 16, 2048, 9
BLOCK, TINY_BLOCK = 16, 4
SOFTCAP, Q_SCALE, KV_SCALE = 50.0, 5.0, 0.5
POOL_BYTES = 4 << 30
REPLAYS, GRAPH_MS = 9, 2.0
VARIANTS = {"none": (False, None), "window": (True, None), "cap": (False, SOFTCAP), "window+cap": (True, SOFTCAP)}


def paged_kv(ctxs: list[int], bs: int, hkv: int, d: int, dtype, fp8: bool, gen: torch.Generator):
    """K/V caches and the block table of sequences of contexts `ctxs`: every block but a sequence's last
    drawn at random from a shared pool of at most POOL_BYTES, the last one the sequence's own."""
    dev = gen.device
    blocks = [-(-c // bs) for c in ctxs]
    block_bytes = 2 * bs * hkv * d * (1 if fp8 else 2)
    shared = max(1, min(sum(blocks) - len(ctxs), POOL_BYTES // block_bytes))
    table = torch.randint(0, shared, (len(ctxs), max(blocks)), generator=gen, device=dev, dtype=torch.int32)
    rows = torch.arange(len(ctxs), device=dev)
    table[rows, torch.tensor(blocks, device=dev) - 1] = shared + rows.int()
    caches = []
    for _ in range(2):
        c = torch.randn(shared + len(ctxs), bs, hkv, d, generator=gen, device=dev, dtype=dtype)
        caches.append(c.to(torch.float8_e4m3fn) if fp8 else c)
    kv_scale = torch.full((2,), KV_SCALE, device=dev) if fp8 else None
    return caches[0], caches[1], table, kv_scale


def contexts(n: int, ctx: int, gen: torch.Generator) -> list[int]:
    return torch.randint(ctx - ctx // 8, ctx + 1, (n,), generator=gen, device=gen.device).tolist()


def decode_case(shape, batch: int, ctx: int, fp8: bool, dtype, bs: int, gen: torch.Generator):
    """(run(window, softcap) -> out, [(q rows, reference(window, softcap) -> their rows)])."""
    from kernel_testing import _prologue_reference
    from tokenmill.layers.attention import paged_attention_torch
    from tokenmill.layers.kernels import decode_attention as da
    from tokenmill.layers.rotary import RotaryEmbedding
    hq, hkv, d, _, qk_norm = shape
    dev = gen.device
    ctxs = contexts(batch, ctx, gen)
    k, v, table, kv_scale = paged_kv(ctxs, bs, hkv, d, dtype, fp8, gen)
    seq_lens = torch.tensor(ctxs, dtype=torch.int32, device=dev)
    positions = (seq_lens - 1).long()
    slots = table.long().gather(1, (positions // bs)[:, None])[:, 0] * bs + positions % bs
    qkv = torch.randn(batch, (hq + 2 * hkv) * d, generator=gen, device=dev, dtype=dtype)
    rope = RotaryEmbedding(d, ctx + 1, 10000.0).to(dev)
    if qk_norm:     # q's scale from its norm weight, as in a model; k's about 1
        qw = Q_SCALE * (1 + 0.1 * torch.randn(d, generator=gen, device=dev, dtype=dtype))
        kw = 1 + 0.1 * torch.randn(d, generator=gen, device=dev, dtype=dtype)
    else:
        qw = kw = None
        qkv[:, :hq * d] *= Q_SCALE
    args = (qkv, positions, rope.cos_sin, qw, kw, 1e-6, k, v, slots, table, seq_lens, d ** -0.5, hq, hkv, d)

    def run(window, softcap):
        return da.fused_decode_attention(*args, kv_scale=kv_scale, window=window, softcap=softcap)

    rows = sorted({0, batch // 2, batch - 1})
    scratch = [torch.empty(len(rows), 1, hkv, d, device=dev, dtype=k.dtype) for _ in range(2)]
    q = _prologue_reference(qkv[rows], positions[rows], rope.cos_sin, qw, kw, 1e-6, *scratch,
                            torch.arange(len(rows), device=dev), hq, hkv, d, kv_scale)
    qsl = torch.arange(len(rows) + 1, dtype=torch.int32, device=dev)

    def reference(window, softcap):
        return paged_attention_torch(q, k, v, table[rows], seq_lens[rows], qsl, d ** -0.5, kv_scale,
                                     window=window, softcap=softcap)
    return run, [(torch.tensor(rows, device=dev), reference)]


def mixed_case(shape, ctx: int, chunk: int, fp8: bool, dtype, bs: int, gen: torch.Generator):
    """MIXED_DECODES decode rows beside the last `chunk` queries of a context of `ctx`; as decode_case."""
    from tokenmill.layers.attention import paged_attention_torch
    from tokenmill.layers.attention_metadata import PREFILL_BLOCK_M, prefill_tiles
    from tokenmill.layers.kernels import paged_attention as pa
    hq, hkv, d, _, _ = shape
    dev = gen.device
    n = MIXED_DECODES
    chunk = min(chunk, ctx)
    ctxs = contexts(n, ctx, gen) + [ctx]
    k, v, table, kv_scale = paged_kv(ctxs, bs, hkv, d, dtype, fp8, gen)
    q_lens = [1] * n + [chunk]
    q = Q_SCALE * torch.randn(n + chunk, hq, d, generator=gen, device=dev, dtype=dtype)
    seq_lens = torch.tensor(ctxs, dtype=torch.int32, device=dev)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    tiles = torch.from_numpy(prefill_tiles(q_lens, (n + chunk) // PREFILL_BLOCK_M + len(q_lens))).to(dev)

    def run(window, softcap):
        return pa.paged_prefill_attention(q, k, v, table, seq_lens, qsl, chunk, d ** -0.5, tiles=tiles,
                                          kv_scale=kv_scale, window=window, softcap=softcap)

    def rows_of(q_rows, b, lens, ends):
        # sequences b with their queries q_rows, the last of each at position ends - 1
        starts = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        ends = torch.tensor(ends, dtype=torch.int32, device=dev)
        return q_rows, lambda window, softcap: paged_attention_torch(
            q[q_rows], k, v, table[b], ends, starts, d ** -0.5, kv_scale, window=window, softcap=softcap)
    r = min(64, chunk)
    decodes = torch.tensor([0, n - 1], device=dev)
    first = torch.arange(n, n + r, device=dev)
    return run, [rows_of(decodes, decodes, [1, 1], [ctxs[0], ctxs[n - 1]]),
                 rows_of(first, [n], [r], [ctx - chunk + r]),       # the chunk's first r queries
                 rows_of(first + chunk - r, [n], [r], [ctx])]       # and its last r


def check(run, refs, window: int, tol: float) -> dict:
    """Per variant (passed, the largest |out - ref|, the largest |ref - the reference without window and cap|)
    over the sampled rows; passed: |out - ref| <= tol + tol |ref| everywhere."""
    res, base = {}, {}
    for name, (windowed, softcap) in VARIANTS.items():
        out = run(window if windowed else None, softcap).float()
        passed, err, effect = True, 0.0, 0.0
        for i, (q_rows, reference) in enumerate(refs):
            ref = reference(window if windowed else None, softcap).float()
            base.setdefault(i, ref)
            passed &= torch.allclose(out[q_rows], ref, rtol=tol, atol=tol)
            err = max(err, (out[q_rows] - ref).abs().max().item())
            effect = max(effect, (ref - base[i]).abs().max().item())
        res[name] = (passed, err, effect)
    return res


def time_us(fn) -> float:
    """Microseconds a call: the calls of about GRAPH_MS of work in one CUDA graph, median of REPLAYS replays."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    fn()
    end.record()
    end.synchronize()
    calls = max(1, min(50, round(GRAPH_MS / max(start.elapsed_time(end), 1e-3))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(REPLAYS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return 1e3 * statistics.median(times) / calls


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, checks only (for TRITON_INTERPRET=1)")
    p.add_argument("--budget-s", type=float, default=100.0, help="start no case after this many seconds")
    a = p.parse_args()
    t0 = time.monotonic()
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "kernels"))
    if a.device == "cpu":
        importlib.import_module("conftest")   # the kernel tests' interpreter switch and fixes, before any kernel
    timed = a.device == "cuda" and not a.tiny
    models = TINY if a.tiny else MODELS
    batches, long_ctx = (TINY_BATCHES, TINY_LONG) if a.tiny else (BATCHES, LONG)
    bs, chunk = (TINY_BLOCK, TINY_CHUNK) if a.tiny else (BLOCK, CHUNK)
    # the interpreter keeps bfloat16 as raw bits (kernel_testing.py): float16 there
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float16
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    rows, failed = [], False
    for model, cache in RUNS:
        shape = models[model]
        window = shape[3]
        for case in [f"decode {b}" for b in batches] + [f"mixed {MIXED_DECODES} + {chunk}"]:
            for ctx in (window, long_ctx):
                row = dict(model=model, cache=cache, case=case, ctx=ctx)
                rows.append(row)
                t_case = time.monotonic()
                if t_case - t0 > a.budget_s:
                    continue
                run = refs = None       # the last case's caches go before this one's are built
                if a.device == "cuda":
                    torch.cuda.empty_cache()
                gen = torch.Generator(device=a.device).manual_seed(0)
                try:
                    if case.startswith("decode"):
                        run, refs = decode_case(shape, int(case.split()[1]), ctx, cache == "fp8", dtype, bs, gen)
                    else:
                        run, refs = mixed_case(shape, ctx, chunk, cache == "fp8", dtype, bs, gen)
                    row["check"] = check(run, refs, window, tol)
                    if timed:
                        row["us"] = {name: time_us(lambda: run(window if w else None, cap))
                                     for name, (w, cap) in VARIANTS.items()}
                except Exception as e:      # a kernel that does not compile or launch: the other cases still run
                    row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
                    print(f"{model} {cache} {case} ctx <= {ctx}: {row['error']}", flush=True)
                    failed = True
                    continue
                failed |= not all(passed for passed, _, _ in row["check"].values())
                print(f"{model} {cache} {case} ctx <= {ctx} ({time.monotonic() - t_case:.1f} s): check "
                      + ", ".join(f"{k} {'ok' if ok else 'FAIL'} {err:.1e} (effect {e:.2f})"
                                  for k, (ok, err, e) in row["check"].items())
                      + ("; us " + ", ".join(f"{k} {v:.1f}" for k, v in row["us"].items()) if timed else ""),
                      flush=True)
    print_table(rows, timed, tol)
    print(f"\n{'FAILED' if failed else 'all checks passed'} ({time.monotonic() - t0:.0f} s)")
    sys.exit(1 if failed else 0)


def print_table(rows: list[dict], timed: bool, tol: float) -> None:
    names = list(VARIANTS)
    head = ["model", "KV", "case", "ctx <="] + ([f"{n} us (x none)" for n in names] + ["decode: window vs none at <= window"]
                                                if timed else []) + ["check: max err (effect) " + ", ".join(names)]
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        cells = [r["model"], r["cache"], r["case"], str(r["ctx"])]
        if "check" not in r:
            print("| " + " | ".join(cells) + f" | {r.get('error', 'skipped (budget)')} |")
            continue
        if timed:
            us = r["us"]
            cells += [f"{us[n]:.1f} ({us[n] / us['none']:.2f})" for n in names]
            short = next((s for s in rows if s["model"] == r["model"] and s["cache"] == r["cache"] and "us" in s
                          and s["case"] == r["case"] and s["ctx"] < r["ctx"] and "decode" in s["case"]), None)
            cells.append(f"{us['window'] / short['us']['none']:.2f}" if short else "-")
        cells.append(", ".join(f"{'ok' if ok else 'FAIL'} {err:.0e} ({e:.2f})" for ok, err, e in r["check"].values()))
        print("| " + " | ".join(cells) + " |")
    print(f"\n(us a call of one layer's attention, CUDA graph replays; check: the largest |out - ref| over the sampled "
          f"rows, ok where |out - ref| <= {tol:g} (1 + |ref|); effect: the largest change of the reference from no "
          "window, no cap)")


if __name__ == "__main__":
    main()
