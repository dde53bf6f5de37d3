"""Whether a big step's attention can run beside its products: one step of the real model (36 layers,
no head) over a batch split into two halves by sequence, captured in CUDA graphs, four ways:

  full      the whole batch on one stream (as shipped)
  halves    half A, then half B, on one stream (what splitting costs by itself)
  streams   half A on one stream, half B on another, no order between them
  pingpong  two streams, each half's layer cut at the post-attention norm; B's attention waits for A's,
            A's next attention for B's, so one half's attention runs while the other's MLP does

    PYTHONPATH=src python lab/two_stream_overlap.py [--fp8] [--out FILE]

Cases: decode rows with contexts uniform in a range, beside prefill chunks (new sequences whose whole
context is their chunk). Prints ms per step (median of graph replays) and each way's ratio to `full`.
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import torch

CASES = [  # label, decode rows, their context range, prefill chunks
    ("short-mixed", 480, (50, 600), [256, 256]),
    ("short-decode", 512, (50, 600), []),
    ("c256-mixed", 180, (100, 700), [225]),
    ("c256-decode", 180, (100, 700), []),
    ("c64-mixed", 58, (100, 700), [67]),
    ("long-mixed", 64, (6000, 8000), [2048]),
]


def build_meta(runner, ctx: list[int], q_lens: list[int], first_block: int):
    """Inputs of one step: sequence b has ctx[b] tokens after the step, q_lens[b] of them new; blocks from
    `first_block` on, each sequence's in order. Returns (ids, positions, meta, next free block)."""
    from tokenmill.layers.attention_metadata import PREFILL_BLOCK_M, AttentionMetadata, prefill_tiles
    bs, dev = runner.block_size, runner.device
    nblocks = [-(-c // bs) for c in ctx]
    width = max(nblocks)
    table = np.zeros((len(ctx), width), dtype=np.int32)
    b0 = first_block
    for i, n in enumerate(nblocks):
        table[i, :n] = np.arange(b0, b0 + n)
        b0 += n
    ctx_a, q = np.asarray(ctx), np.asarray(q_lens)
    seq_of = np.repeat(np.arange(len(ctx)), q)
    positions = np.concatenate([np.arange(c - n, c) for c, n in zip(ctx, q_lens)])
    slots = table[seq_of, positions // bs].astype(np.int64) * bs + positions % bs
    qsl = np.concatenate(([0], np.cumsum(q))).astype(np.int32)
    t = int(q.sum())
    tiles = prefill_tiles(q, t // PREFILL_BLOCK_M + len(ctx)) if q.max() > 1 else None
    g = lambda a, dt: torch.from_numpy(np.ascontiguousarray(a)).to(dev, dt)  # noqa: E731
    meta = AttentionMetadata(g(slots, torch.int64), g(qsl, torch.int32), g(ctx_a, torch.int32),
                             g(table, torch.int32), int(q.max()), int(ctx_a.max()),
                             None if tiles is None else g(tiles, torch.int32))
    ids = torch.randint(0, 1000, (t,), device=dev)
    return ids, g(positions, torch.int64), meta, b0


def attn_part(layer, positions, hidden, residual, meta, dec):
    """DecoderLayer.forward's first half (its non-single-token path): input norm and the attention block."""
    norm1 = layer.input_layernorm
    qkv_proj = layer.self_attn.qkv_proj
    if residual is None:
        residual = hidden
        hidden = layer.backend.rms_norm(hidden, norm1.weight, norm1.eps, into=qkv_proj)
    else:
        hidden, residual = layer.backend.rms_norm(hidden, norm1.weight, norm1.eps, residual, into=qkv_proj)
    return layer.self_attn(positions, hidden, meta, dec), residual


def mlp_part(layer, hidden, residual):
    norm2 = layer.post_attention_layernorm
    hidden, residual = layer.backend.rms_norm(hidden, norm2.weight, norm2.eps, residual, into=layer.mlp.gate_up_proj)
    return layer.mlp(hidden), residual


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fp8", action="store_true", help="FP8 weights and KV cache")
    p.add_argument("--out")
    p.add_argument("--replays", type=int, default=30)
    a = p.parse_args()
    from tokenmill.llm import LLM
    from tokenmill.models.presets import resolve_model_path
    kw = dict(quantization="fp8", kv_cache_dtype="fp8") if a.fp8 else {}
    llm = LLM(resolve_model_path("preset:qwen3-4b"), enforce_eager=True, max_num_seqs=512,
              max_model_len=10240, **kw)
    runner = llm.engine.runner
    model = runner.model.model
    s1 = torch.cuda.Stream()
    rng = np.random.default_rng(0)
    rows = []

    def forward(inp):
        ids, pos, meta = inp
        return model(ids, pos, meta)

    def pingpong(A, B):
        (ia, pa, ma), (ib, pb, mb) = A, B
        s0 = torch.cuda.current_stream()     # the capture's stream under torch.cuda.graph
        ha, hb = model.embed_tokens(ia), None
        ra = rb = None
        deca, decb = model.backend.decode_attention(ia, ma), model.backend.decode_attention(ib, mb)
        s1.wait_stream(s0)
        with torch.cuda.stream(s1):
            hb = model.embed_tokens(ib)
        for layer in model.layers:
            ha, ra = attn_part(layer, pa, ha, ra, ma, deca)
            done_a = torch.cuda.Event()
            done_a.record(s0)
            with torch.cuda.stream(s1):
                s1.wait_event(done_a)
                hb, rb = attn_part(layer, pb, hb, rb, mb, decb)
                done_b = torch.cuda.Event()
                done_b.record(s1)
            ha, ra = mlp_part(layer, ha, ra)
            s0.wait_event(done_b)       # A's next attention after B's
            with torch.cuda.stream(s1):
                hb, rb = mlp_part(layer, hb, rb)
        s0.wait_stream(s1)
        return ha, hb

    def streams(A, B):
        s0 = torch.cuda.current_stream()
        s1.wait_stream(s0)
        with torch.cuda.stream(s1):
            hb = forward(B)
        ha = forward(A)
        s0.wait_stream(s1)
        return ha, hb

    ways = {"full": lambda F, A, B: forward(F), "halves": lambda F, A, B: (forward(A), forward(B)),
            "streams": lambda F, A, B: streams(A, B), "pingpong": lambda F, A, B: pingpong(A, B)}
    for label, n_dec, (lo, hi), chunks in CASES:
        ctx = rng.integers(lo, hi + 1, n_dec).tolist()
        # half A: the first half of the decode rows and the first half of the chunks
        da, pa_ = ctx[:n_dec // 2], chunks[:(len(chunks) + 1) // 2]
        db, pb_ = ctx[n_dec // 2:], chunks[(len(chunks) + 1) // 2:]
        full_ctx, full_q = ctx + chunks, [1] * n_dec + chunks
        if sum(full_ctx) // runner.block_size + len(full_ctx) >= runner.num_blocks:
            print(f"{label}: does not fit the cache", flush=True)
            continue
        ids, pos, meta, _ = build_meta(runner, full_ctx, full_q, 0)
        F = (ids, pos, meta)
        *A, free = build_meta(runner, da + pa_, [1] * len(da) + pa_, 0)
        B = build_meta(runner, db + pb_, [1] * len(db) + pb_, free)[:3]
        row = {"case": label, "tokens": int(ids.shape[0]), "halves_tokens": [int(A[0].shape[0]), int(B[0].shape[0])]}
        for name, way in ways.items():
            with torch.inference_mode():
                for _ in range(2):
                    way(F, A, B)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    way(F, A, B)
            g.replay()
            torch.cuda.synchronize()
            times = []
            for _ in range(a.replays):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                g.replay()
                e1.record()
                e1.synchronize()
                times.append(e0.elapsed_time(e1))
            row[name] = float(np.median(times))
            del g
        rows.append(row)
        print(json.dumps(row), flush=True)
    print()
    print(f"| case ({'FP8 W+KV' if a.fp8 else 'bf16'}) | tokens | full ms | halves | streams | pingpong |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        f = r["full"]
        print(f"| {r['case']} | {r['tokens']} | {f:.3f} | " + " | ".join(
            f"{r[k]:.3f} ({r[k] / f:.3f}x)" for k in ("halves", "streams", "pingpong")) + " |")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
