"""Check the Triton kernels against their PyTorch references at real model sizes, then time them.

Run on the GPU machine:  PYTHONPATH=src python scripts/device/kernels.py [--quick] [--sweep]

Shapes: bf16, head_dim 128, Qwen3-4B (32 q / 8 kv heads) and Nanbeige4.1-3B (20 / 4); decode at batch
1, 32, 256 with ~1100 cached tokens in blocks of 16; prefill as 8 chunks of 512 tokens (fresh, and after
a 1024-token cached prefix). Times are medians from `triton.testing.do_bench`. Baselines: torch SDPA on
dense, contiguous K/V (the lower bound a non-paged layout would get) and the eager PyTorch references.
`--sweep` also times a few launch configs of the attention kernels. Prints a table last and writes
`$OUT/kernels.json` when OUT is set. Errors are max |triton - reference|, relative to the largest
reference magnitude for the fused element-wise ops.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))

from tokenmill.layers.activation import silu_and_mul_torch  # noqa: E402
from tokenmill.layers.attention import paged_attention_torch, store_kvcache_torch  # noqa: E402
from tokenmill.layers.kernels import fused_ops  # noqa: E402
from tokenmill.layers.kernels import paged_attention as pa  # noqa: E402
from tokenmill.layers.norm import rms_norm_torch  # noqa: E402
from tokenmill.layers.rotary import RotaryEmbedding, apply_rotary_torch  # noqa: E402

MODELS = {"qwen3-4b": (32, 8, 2560, 9728), "nanbeige4.1-3b": (20, 4, 2560, 10496)}
HEAD_DIM, BLOCK_SIZE, DTYPE = 128, 16, torch.bfloat16
SCALE = HEAD_DIM ** -0.5
DEV = "cuda"
ROWS: list[dict] = []


def bench(fn, quick: bool) -> float:
    return do_bench(fn, warmup=10 if quick else 25, rep=30 if quick else 100, return_mode="median")


def record(kernel: str, model: str, shape: str, ms: float | None, err: float | None = None,
           tol: float = 2e-2, baseline: str | None = None, baseline_ms: float | None = None, **extra):
    row = {"kernel": kernel, "model": model, "shape": shape, "triton_ms": ms, "err": err,
           "ok": None if err is None else bool(err <= tol), "baseline": baseline,
           "baseline_ms": baseline_ms, **extra}
    ROWS.append(row)
    status = "" if err is None else f" err={err:.2e} {'ok' if row['ok'] else 'FAIL'}"
    print(f"[{kernel}] {model} {shape}: {ms if ms is None else round(ms, 4)} ms{status}", flush=True)


def paged_cache(batch: int, max_ctx: int, num_kv_heads: int, spare: int = 8):
    """Cache whose blocks are scattered over a random permutation, table sized for max_ctx tokens."""
    blocks_per_seq = triton.cdiv(max_ctx, BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + spare
    table = torch.randperm(num_blocks, device=DEV)[: batch * blocks_per_seq].view(batch, -1).int()
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM, device=DEV, dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    return k_cache, v_cache, table


def dense_kv(cache: torch.Tensor, table: torch.Tensor, ctx: int) -> torch.Tensor:
    """[B, Hkv, ctx, D] contiguous copy of each sequence's first ctx tokens."""
    b = table.shape[0]
    return cache[table.long()].view(b, -1, cache.shape[2], HEAD_DIM)[:, :ctx].transpose(1, 2).contiguous()


def sdpa(q, k, v, **kw):
    try:
        return F.scaled_dot_product_attention(q, k, v, scale=SCALE, enable_gqa=True, **kw)
    except (TypeError, RuntimeError):
        group = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1),
                                              v.repeat_interleave(group, 1), scale=SCALE, **kw)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the largest reference magnitude (one bf16 ulp ~ 4e-3)."""
    return max_err(a, b) / max(b.float().abs().max().item(), 1e-6)


# ------------------------------------------------------------------------------------------- decode


def run_decode(model: str, batch: int, ctx_len: int, quick: bool) -> None:
    hq, hkv = MODELS[model][:2]
    k_cache, v_cache, table = paged_cache(batch, ctx_len, hkv)
    q = torch.randn(batch, hq, HEAD_DIM, device=DEV, dtype=DTYPE)
    qsl = torch.arange(batch + 1, device=DEV, dtype=torch.int32)
    ctx = torch.full((batch,), ctx_len, device=DEV, dtype=torch.int32)
    ragged = torch.randint(1, ctx_len + 1, (batch,), device=DEV, dtype=torch.int32)
    err = max(max_err(pa.paged_decode_attention(q, k_cache, v_cache, table, c, SCALE),
                      paged_attention_torch(q, k_cache, v_cache, table, c, qsl, SCALE)) for c in (ctx, ragged))
    splits = pa.decode_num_splits(batch, hkv, table.shape[1], BLOCK_SIZE, q.device)
    ms = bench(lambda: pa.paged_decode_attention(q, k_cache, v_cache, table, ctx, SCALE), quick)
    kd, vd = dense_kv(k_cache, table, ctx_len), dense_kv(v_cache, table, ctx_len)
    q4 = q.unsqueeze(2)
    base = bench(lambda: sdpa(q4, kd, vd), quick)
    kv_bytes = 2 * batch * ctx_len * hkv * HEAD_DIM * k_cache.element_size()
    record("decode", model, f"B={batch} ctx={ctx_len} bs={BLOCK_SIZE}", ms, err,
           baseline="sdpa dense KV", baseline_ms=base, num_splits=splits,
           kv_gb_per_s=round(kv_bytes / ms / 1e6, 1))


def run_decode_cuda_graph(quick: bool) -> None:
    """Capture the decode kernel once, change lengths and tables in place, replay, compare."""
    hq, hkv = MODELS["nanbeige4.1-3b"][:2]
    batch, max_ctx = 8, 1100
    k_cache, v_cache, table = paged_cache(batch, max_ctx, hkv)
    q = torch.randn(batch, hq, HEAD_DIM, device=DEV, dtype=DTYPE)
    ctx = torch.full((batch,), 5, device=DEV, dtype=torch.int32)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        pa.paged_decode_attention(q, k_cache, v_cache, table, ctx, SCALE)  # compile outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pa.paged_decode_attention(q, k_cache, v_cache, table, ctx, SCALE)
    qsl = torch.arange(batch + 1, device=DEV, dtype=torch.int32)
    err = 0.0
    for _ in range(3):
        ctx.copy_(torch.randint(0, max_ctx + 1, (batch,), device=DEV, dtype=torch.int32))
        ctx[0] = max_ctx
        table.copy_(table[torch.randperm(batch, device=DEV)])
        q.normal_()
        graph.replay()
        ref = paged_attention_torch(q, k_cache, v_cache, table, ctx, qsl, SCALE)
        live = ctx > 0
        err = max(err, max_err(out[live], ref[live]), out[~live].abs().max().item() if (~live).any() else 0)
    ms = bench(graph.replay, quick)
    record("decode (cuda graph replay)", "nanbeige4.1-3b", f"B={batch} ctx<={max_ctx}", ms, err)


# ------------------------------------------------------------------------------------------ prefill


def run_prefill(model: str, num_chunks: int, chunk: int, prefix: int, quick: bool) -> None:
    hq, hkv = MODELS[model][:2]
    ctx_len = prefix + chunk
    k_cache, v_cache, table = paged_cache(num_chunks, ctx_len, hkv)
    q = torch.randn(num_chunks * chunk, hq, HEAD_DIM, device=DEV, dtype=DTYPE)
    qsl = torch.arange(0, num_chunks * chunk + 1, chunk, device=DEV, dtype=torch.int32)
    ctx = torch.full((num_chunks,), ctx_len, device=DEV, dtype=torch.int32)
    run = lambda: pa.paged_prefill_attention(q, k_cache, v_cache, table, ctx, qsl, chunk, SCALE)  # noqa: E731
    err = max_err(run(), paged_attention_torch(q, k_cache, v_cache, table, ctx, qsl, SCALE))
    ms = bench(run, quick)
    kd, vd = dense_kv(k_cache, table, ctx_len), dense_kv(v_cache, table, ctx_len)
    qd = q.view(num_chunks, chunk, hq, HEAD_DIM).transpose(1, 2).contiguous()
    base = None
    try:
        if prefix == 0:
            base = bench(lambda: sdpa(qd, kd, vd, is_causal=True), quick)
        else:
            from torch.nn.attention.bias import causal_lower_right
            mask = causal_lower_right(chunk, ctx_len)
            base = bench(lambda: sdpa(qd, kd, vd, attn_mask=mask), quick)
    except Exception as exc:  # a baseline is optional; report why it is missing
        print(f"  sdpa baseline unavailable: {exc!r}")
    visible = num_chunks * sum(prefix + i + 1 for i in range(chunk))
    flops = 4 * visible * hq * HEAD_DIM
    record("prefill", model, f"{num_chunks}x{chunk} prefix={prefix}", ms, err,
           baseline="sdpa dense KV", baseline_ms=base, tflops=round(flops / ms / 1e9, 1))


def run_store(model: str, num_tokens: int, quick: bool) -> None:
    hq, hkv = MODELS[model][:2]
    k_cache, v_cache, _ = paged_cache(1, num_tokens * 2, hkv)
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * HEAD_DIM, device=DEV, dtype=DTYPE)
    _, k, v = qkv.split([hq * HEAD_DIM, hkv * HEAD_DIM, hkv * HEAD_DIM], -1)
    k, v = k.view(num_tokens, hkv, HEAD_DIM), v.view(num_tokens, hkv, HEAD_DIM)
    slots = torch.randperm(k_cache.shape[0] * BLOCK_SIZE, device=DEV)[:num_tokens]
    slots[::7] = -1
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kvcache_torch(k, v, ref_k, ref_v, slots)
    pa.store_kvcache(k, v, k_cache, v_cache, slots)
    err = max(max_err(k_cache, ref_k), max_err(v_cache, ref_v))
    ms = bench(lambda: pa.store_kvcache(k, v, k_cache, v_cache, slots), quick)
    base = bench(lambda: store_kvcache_torch(k, v, ref_k, ref_v, slots), quick)
    record("store_kvcache", model, f"T={num_tokens}", ms, err, tol=0.0, baseline="torch index_put",
           baseline_ms=base)


# ---------------------------------------------------------------------------------------- fused ops


def run_fused(model: str, num_tokens: int, quick: bool) -> None:
    hq, hkv, hidden, inter = MODELS[model]
    x = torch.randn(num_tokens, hidden, device=DEV, dtype=DTYPE)
    res = torch.randn_like(x)
    w = torch.randn(hidden, device=DEV, dtype=DTYPE)
    ref, ref_res = rms_norm_torch(x, w, 1e-6, res)
    out, out_res = fused_ops.rms_norm(x, w, 1e-6, res)
    err = max(rel_err(out, ref), rel_err(out_res, ref_res))
    record("rms_norm+residual", model, f"T={num_tokens} H={hidden}",
           bench(lambda: fused_ops.rms_norm(x, w, 1e-6, res), quick), err,
           baseline="torch eager", baseline_ms=bench(lambda: rms_norm_torch(x, w, 1e-6, res), quick))

    gate_up = torch.randn(num_tokens, 2 * inter, device=DEV, dtype=DTYPE)
    err = rel_err(fused_ops.silu_and_mul(gate_up), silu_and_mul_torch(gate_up))
    record("silu_and_mul", model, f"T={num_tokens} I={inter}",
           bench(lambda: fused_ops.silu_and_mul(gate_up), quick), err,
           baseline="torch eager", baseline_ms=bench(lambda: silu_and_mul_torch(gate_up), quick))

    rope = RotaryEmbedding(HEAD_DIM, 32768, 1e6).to(DEV)
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * HEAD_DIM, device=DEV, dtype=DTYPE)
    q, k, _ = qkv.split([hq * HEAD_DIM, hkv * HEAD_DIM, hkv * HEAD_DIM], -1)
    q, k = q.view(num_tokens, hq, HEAD_DIM), k.view(num_tokens, hkv, HEAD_DIM)
    pos = torch.randint(0, 32768, (num_tokens,), device=DEV)

    def rope_torch():
        cos, sin = rope.cos_sin[pos].chunk(2, dim=-1)
        return apply_rotary_torch(q, cos, sin), apply_rotary_torch(k, cos, sin)

    ref_q, ref_k = rope_torch()
    out_q, out_k = fused_ops.apply_rotary(pos, q.clone(), k.clone(), rope.cos_sin)
    err = max(rel_err(out_q, ref_q), rel_err(out_k, ref_k))
    # in place: timing rotates the same buffer repeatedly, which costs the same as fresh data
    record("apply_rotary", model, f"T={num_tokens}",
           bench(lambda: fused_ops.apply_rotary(pos, q, k, rope.cos_sin), quick), err,
           baseline="torch eager", baseline_ms=bench(rope_torch, quick))


# -------------------------------------------------------------------------------------------- sweep


def run_sweep(quick: bool) -> None:
    hq, hkv = MODELS["qwen3-4b"][:2]
    for batch in (1, 256):
        k_cache, v_cache, table = paged_cache(batch, 1100, hkv)
        q = torch.randn(batch, hq, HEAD_DIM, device=DEV, dtype=DTYPE)
        ctx = torch.full((batch,), 1100, device=DEV, dtype=torch.int32)
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                for stages in (1, 2, 3):
                    cfg = {"block_n": block_n, "num_warps": warps, "num_stages": stages}
                    try:
                        ms = bench(lambda: pa.paged_decode_attention(q, k_cache, v_cache, table, ctx,
                                                                     SCALE, config=cfg), quick)
                    except Exception as exc:
                        print(f"  decode {cfg} failed: {exc!r}")
                        continue
                    record("sweep decode", "qwen3-4b", f"B={batch} {cfg}", ms)
    k_cache, v_cache, table = paged_cache(8, 512, hkv)
    q = torch.randn(8 * 512, hq, HEAD_DIM, device=DEV, dtype=DTYPE)
    qsl = torch.arange(0, 8 * 512 + 1, 512, device=DEV, dtype=torch.int32)
    ctx = torch.full((8,), 512, device=DEV, dtype=torch.int32)
    for block_m, block_n in ((64, 64), (128, 64), (128, 32), (64, 32)):
        for warps in (4, 8):
            for stages in (1, 2, 3):
                cfg = {"block_m": block_m, "block_n": block_n, "num_warps": warps, "num_stages": stages}
                try:
                    ms = bench(lambda: pa.paged_prefill_attention(q, k_cache, v_cache, table, ctx, qsl,
                                                                  512, SCALE, config=cfg), quick)
                except Exception as exc:
                    print(f"  prefill {cfg} failed: {exc!r}")
                    continue
                record("sweep prefill", "qwen3-4b", f"8x512 {cfg}", ms)


# --------------------------------------------------------------------------------------------- main


def print_table() -> None:
    header = ["kernel", "model", "shape", "triton ms", "baseline ms", "speedup", "err", "ok", "extra"]
    lines = []
    for r in ROWS:
        extra = {k: v for k, v in r.items() if k not in ("kernel", "model", "shape", "triton_ms",
                                                         "err", "ok", "baseline", "baseline_ms")}
        speed = (f"{r['baseline_ms'] / r['triton_ms']:.2f}x" if r["baseline_ms"] and r["triton_ms"] else "")
        lines.append([r["kernel"], r["model"], r["shape"],
                      "" if r["triton_ms"] is None else f"{r['triton_ms']:.4f}",
                      "" if r["baseline_ms"] is None else f"{r['baseline_ms']:.4f} ({r['baseline']})",
                      speed, "" if r["err"] is None else f"{r['err']:.1e}",
                      "" if r["ok"] is None else ("ok" if r["ok"] else "FAIL"),
                      " ".join(f"{k}={v}" for k, v in extra.items())])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    print("\n" + " | ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("-+-".join("-" * w for w in widths))
    for line in lines:
        print(" | ".join(c.ljust(w) for c, w in zip(line, widths)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one model, fewer shapes, short timings")
    parser.add_argument("--sweep", action="store_true", help="also time launch configs of attention")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    models = ["qwen3-4b"] if args.quick else list(MODELS)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    for model in models:
        for batch in (1, 32, 256):
            run_decode(model, batch, 1100, args.quick)
        run_prefill(model, 8, 512, 0, args.quick)
        if not args.quick:
            run_prefill(model, 8, 512, 1024, args.quick)
        run_store(model, 4096, args.quick)
        for num_tokens in ((4096,) if args.quick else (256, 4096)):
            run_fused(model, num_tokens, args.quick)
    run_decode_cuda_graph(args.quick)
    if args.sweep:
        run_sweep(args.quick)
    print_table()
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "kernels.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "rows": ROWS}, f, indent=1)
    return 0 if all(r["ok"] is not False for r in ROWS) else 1


if __name__ == "__main__":
    sys.exit(main())
