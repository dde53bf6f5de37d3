"""An experiment, measured before it moves into src: a decoder layer's MLP with per-channel FP8 weights
(gate_up, SiLU-and-mul, down) in one kernel launch, against the shipped three (`fp8_gemm.fp8_linear` for
gate_up, `fused_ops.silu_and_mul` quantizing its rows, `fp8_linear` for down).

Why: at 64 rows a product costs about 7 us beyond its bytes whatever its size (docs/BENCHMARKS.md, "FP8
products of 64-256 rows by stream-K"); qwen3-4b's MLP at 64 rows takes ~40 us (gate_up ~22, SiLU ~5.5,
down ~12.5) for 74.7 MB of weights (17.4 us at 4.3 TB/s). Within one launch the down product's work
starts as soon as the part of the SiLU output it reads is written, while other programs still run
gate_up, so the ramp-up and tail of each product overlap the other's, and the SiLU kernel disappears.

How: one persistent grid takes tasks from a queue (an atomic ticket), in an order where every task
depends only on tasks with lower tickets, so no program waits for work that no running program holds
(no co-residency needed; under Triton's interpreter one program takes every task in order):
- gate_up tasks (j, mb): intermediate columns j*BI .. +BI for input row block mb: the gate and up rows'
  products on the FP8 tensor cores, scaled, rounded to the activation dtype, SiLU-and-mul as
  `silu_and_mul_torch` rounds it, then quantized to E4M3 with a scale per (row, BI columns) into a
  scratch, and one `release` increment of the counter of the down slice those columns fall in;
- down tasks (s, nb, mb): output channels nb*BLOCK_N .. +BLOCK_N over the K slice s (GPS groups of BI
  columns): wait (`acquire`) until the slice's gate_up tasks are all done, then each group's product
  times its rows' scales; the slices' partial sums meet as in `split_k.gather` (the last to arrive adds
  them in slice order: deterministic) and are scaled by the channels' scales.
The queue, exit and slice counters return to zero when the last program leaves, so the scratch needs no
clearing between launches and CUDA graphs replay it as is. The down input's scales per BI columns are
finer than the shipped per-row ones (the SiLU output's row is never whole in one program).

    python lab/fp8_mlp_fused.py check             # CPU (interpreter) or GPU: against the float reference
    python lab/fp8_mlp_fused.py sm90              # CPU: each variant compiled for sm90: registers, spills, wgmma
    python lab/fp8_mlp_fused.py bench --out DIR   # GPU: shipped vs fused in CUDA graphs, qwen3-4b and nanbeige shapes
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch

if __name__ == "__main__" and sys.argv[1:2] == ["check"] and not torch.cuda.is_available():
    # the interpreter, with the kernel tests' fixes (NumPy scalars as loop bounds, E4M3 rounding)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "kernels"))
    import conftest  # noqa: F401  (sets TRITON_INTERPRET before triton is imported, and patches it)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tokenmill.layers.kernels import pdl  # noqa: E402


@dataclass(frozen=True)
class MlpTile:
    """bi: intermediate columns a gate_up task takes (and the down input's scale group); block_ka: gate_up's
    K step; block_n: output channels a down task takes; slices: K slices of down (a down task's share);
    programs_per_sm: the persistent grid; num_warps; stages_a / stages_b: K steps in flight."""
    bi: int = 64
    block_ka: int = 128
    block_n: int = 64
    slices: int = 8
    programs_per_sm: int = 1
    num_warps: int = 4
    stages_a: int = 3
    stages_b: int = 3


VARIANTS = [MlpTile(), MlpTile(slices=4), MlpTile(slices=16), MlpTile(programs_per_sm=2),
            MlpTile(block_ka=256, stages_a=2), MlpTile(bi=128, num_warps=8), MlpTile(block_n=128, num_warps=8),
            MlpTile(stages_a=4, stages_b=4), MlpTile(bi=32, slices=16),
            MlpTile(bi=128, block_n=128, num_warps=8, stages_b=4), MlpTile(bi=128, stages_b=5)]
SPIN_LIMIT = 1 << 20      # a down task that waits longer (~1 s) sets the error flag instead of hanging the GPU

@triton.jit(do_not_specialize=["M"])
def mlp_kernel(xq_ptr, xs_ptr, wgu_ptr, sgu_ptr, wd_ptr, sd_ptr, hq_ptr, hs_ptr, out_ptr, part_ptr, sync_ptr, M,
               x_stride, out_stride, H: tl.constexpr, I: tl.constexpr, BLOCK_M: tl.constexpr, BI: tl.constexpr,
               BLOCK_KA: tl.constexpr, BLOCK_N: tl.constexpr, SLICES: tl.constexpr, STAGES_A: tl.constexpr,
               STAGES_B: tl.constexpr, SPIN: tl.constexpr, PDL: tl.constexpr):
    # sync_ptr (int32): [0] the task queue, [1] programs gone, [2] the error flag, then a done counter per
    # (row block, down slice), then an arrival counter per (row block, down channel block)
    pdl.enter(PDL)
    P = tl.num_programs(0)
    m_blocks = tl.cdiv(M, BLOCK_M)
    G: tl.constexpr = I // BI
    GPS: tl.constexpr = (G + SLICES - 1) // SLICES
    NB: tl.constexpr = H // BLOCK_N
    FP8_MAX: tl.constexpr = 448.0
    a_tasks = G * m_blocks
    tasks = a_tasks + NB * SLICES * m_blocks
    done_ptr = sync_ptr + 3
    count_ptr = done_ptr + SLICES * m_blocks
    width = m_blocks * BLOCK_M
    dtype = out_ptr.dtype.element_ty
    r = tl.arange(0, BI)
    ca = tl.arange(0, BLOCK_KA)
    rn = tl.arange(0, BLOCK_N)
    mm = tl.arange(0, BLOCK_M)
    task = tl.atomic_add(sync_ptr, 1)
    while task < tasks:
        if task < a_tasks:
            j = task // m_blocks
            m = (task % m_blocks) * BLOCK_M + mm
            m_mask = m < M
            g_rows = wgu_ptr + (j * BI + r).to(tl.int64)[:, None] * H
            u_rows = g_rows + I * H
            x_cols = xq_ptr + m.to(tl.int64)[None, :] * x_stride
            acc_g = tl.zeros([BI, BLOCK_M], tl.float32)
            acc_u = tl.zeros([BI, BLOCK_M], tl.float32)
            for k0 in tl.range(0, H, BLOCK_KA, num_stages=STAGES_A):
                kk = k0 + ca
                xq = tl.load(x_cols + kk[:, None], mask=m_mask[None, :], other=0.0)
                acc_g += tl.dot(tl.load(g_rows + kk[None, :]), xq)
                acc_u += tl.dot(tl.load(u_rows + kk[None, :]), xq)
            # as fp8_rows scales its sums, then silu_and_mul_torch's roundings
            xs = tl.load(xs_ptr + m, mask=m_mask, other=0.0)
            gate = (acc_g * (xs[None, :] * tl.load(sgu_ptr + j * BI + r)[:, None])).to(dtype).to(tl.float32)
            up = (acc_u * (xs[None, :] * tl.load(sgu_ptr + I + j * BI + r)[:, None])).to(dtype).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            h = (act * up).to(dtype).to(tl.float32)
            scale = tl.maximum(tl.max(tl.abs(h), 0), 1e-12) / FP8_MAX
            q = tl.clamp(h / scale[None, :], -FP8_MAX, FP8_MAX)
            tl.store(hq_ptr + m.to(tl.int64)[None, :] * I + (j * BI + r)[:, None],
                     q.to(hq_ptr.dtype.element_ty), mask=m_mask[None, :])
            tl.store(hs_ptr + m * G + j, scale, mask=m_mask)
            tl.debug_barrier()      # every thread's stores issued before the release
            tl.atomic_add(done_ptr + (task % m_blocks) * SLICES + j // GPS, 1, sem="release")
        else:
            b = task - a_tasks
            mb = b % m_blocks
            nb = (b // m_blocks) % NB
            s = b // (m_blocks * NB)
            g0 = s * GPS
            g1 = tl.minimum(g0 + GPS, G)
            spins = 0
            while (tl.atomic_add(done_ptr + mb * SLICES + s, 0, sem="acquire") < g1 - g0) & (spins < SPIN):
                spins += 1
            if spins >= SPIN:
                tl.atomic_xchg(sync_ptr + 2, 1)
            m = mb * BLOCK_M + mm
            m_mask = m < M
            rows = nb * BLOCK_N + rn
            w_rows = wd_ptr + rows.to(tl.int64)[:, None] * I
            h_cols = hq_ptr + m.to(tl.int64)[None, :] * I
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for g in tl.range(g0, g1, num_stages=STAGES_B):
                kk = g * BI + r
                hq = tl.load(h_cols + kk[:, None], mask=m_mask[None, :], other=0.0, cache_modifier=".cg")
                hs = tl.load(hs_ptr + m * G + g, mask=m_mask, other=0.0, cache_modifier=".cg")
                acc += tl.dot(tl.load(w_rows + kk[None, :]), hq) * hs[None, :]
            tile = rows.to(tl.int64)[:, None] * width + m[None, :]
            tl.store(part_ptr + s * H * width + tile, acc, mask=m_mask[None, :])
            tl.debug_barrier()
            last = tl.atomic_add(count_ptr + mb * NB + nb, 1, sem="acq_rel") == SLICES - 1
            if last:
                acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
                for i in range(SLICES):
                    acc += tl.load(part_ptr + i * H * width + tile, mask=m_mask[None, :], other=0.0,
                                   cache_modifier=".cg")
                acc *= tl.load(sd_ptr + rows)[:, None]
                tl.store(out_ptr + m.to(tl.int64)[None, :] * out_stride + rows[:, None], acc.to(dtype),
                         mask=m_mask[None, :])
                tl.store(count_ptr + mb * NB + nb, 0)
        task = tl.atomic_add(sync_ptr, 1)
    # the last program to leave: every task is done and no ticket will be taken again in this launch
    if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel") == P - 1:
        tl.store(sync_ptr, 0)
        tl.store(sync_ptr + 1, 0)
        for i in range(SLICES * m_blocks):
            tl.store(done_ptr + i, 0)



_SYNC: dict[torch.device, torch.Tensor] = {}


def sync_buffer(device: torch.device) -> torch.Tensor:
    if device not in _SYNC:
        _SYNC[device] = torch.zeros(4096, dtype=torch.int32, device=device)
    return _SYNC[device]


def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def fp8_mlp(xq, xs, wgu, sgu, wd, sd, dtype=torch.bfloat16, tile: MlpTile = MlpTile(), block_m: int | None = None):
    """down(silu(gate) * up) for input rows xq [M, H] (E4M3, scales xs [M, 1]) and per-channel FP8 weights
    wgu [2I, H] (gate rows then up rows, scales sgu [2I, 1]) and wd [H, I] (sd [H, 1]); [M, H] in dtype."""
    kernel = mlp_kernel
    M, H = xq.shape
    I = wd.shape[1]
    if wgu.shape != (2 * I, H) or H % tile.block_ka or I % tile.bi or H % tile.block_n:
        raise ValueError(f"fp8_mlp: shapes {tuple(wgu.shape)}, {tuple(wd.shape)} do not fit {tile}")
    block_m = block_m or min(64, max(16, triton.next_power_of_2(M)))
    m_blocks = triton.cdiv(M, block_m)
    g = I // tile.bi
    sync = sync_buffer(xq.device)
    if 3 + m_blocks * (tile.slices + H // tile.block_n) > sync.numel():
        raise ValueError(f"fp8_mlp: {M} rows need more counters than {sync.numel()}")
    hq = torch.empty(M, I, dtype=xq.dtype, device=xq.device)
    hs = torch.empty(M, g, dtype=torch.float32, device=xq.device)
    part = torch.empty(tile.slices, H, m_blocks * block_m, dtype=torch.float32, device=xq.device)
    out = torch.empty(M, H, dtype=dtype, device=xq.device)
    if M == 0:
        return out
    tasks = m_blocks * (g + tile.slices * (H // tile.block_n))
    grid = (min(tasks, tile.programs_per_sm * num_sms(xq.device)),)
    pdl_on = pdl.enabled(xq.device)
    kernel[grid](xq, xs, wgu, sgu, wd, sd, hq, hs, out, part, sync, M, xq.stride(0), out.stride(0), H=H, I=I,
                 BLOCK_M=block_m, BI=tile.bi, BLOCK_KA=tile.block_ka, BLOCK_N=tile.block_n, SLICES=tile.slices,
                 STAGES_A=tile.stages_a, STAGES_B=tile.stages_b, SPIN=SPIN_LIMIT, PDL=pdl_on,
                 num_warps=tile.num_warps, launch_pdl=pdl_on)
    return out


def reference(xq, xs, wgu, sgu, wd, sd, dtype, bi):
    """The same arithmetic in torch: gate_up of the dequantized operands in float32, rounded to dtype,
    SiLU-and-mul with `silu_and_mul_torch`'s roundings, the result quantized per (row, bi columns) and
    multiplied by the dequantized down weight."""
    from tokenmill.layers.activation import silu_and_mul_torch
    x = xq.float() * xs
    y = (x @ (wgu.float() * sgu).t()).to(dtype)
    h = silu_and_mul_torch(y).float()
    M, I = h.shape
    groups = h.view(M, I // bi, bi)
    scale = groups.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0
    hq = (groups / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale
    return (hq.view(M, I) @ (wd.float() * sd).t()).to(dtype), h


def weights(h: int, i: int, device, seed: int = 0):
    """gate_up [2i, h] and down [h, i], E4M3 with per-channel scales, drawn on `device`."""
    from tokenmill.quant import fp8
    gen = torch.Generator(device).manual_seed(seed)
    wgu, sgu = fp8.quantize(torch.randn(2 * i, h, generator=gen, device=device) * 0.05, None)
    wd, sd = fp8.quantize(torch.randn(h, i, generator=gen, device=device) * 0.05, None)
    return wgu, sgu, wd, sd


def rows_in(m: int, h: int, device, seed: int = 1):
    from tokenmill.layers.kernels.fp8_gemm import quantize_rows_torch
    x = torch.randn(m, h, generator=torch.Generator().manual_seed(seed)) * torch.linspace(0.2, 3.0, m)[:, None]
    xq, xs = quantize_rows_torch(x.to(torch.bfloat16).float())
    return xq.to(device), xs.to(device)


def check() -> None:
    """Each shape against `reference`: several row counts (one row block and two, the last partial), two
    tiles; a second call gives the same bits; the counters are back at zero. On the CPU the activations
    are float32: the interpreter rounds float32 to bfloat16 by truncation, where the GPU rounds to nearest."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    h, i, rows, dtype = (256, 512, (1, 5, 40), torch.float32) if device.type == "cpu" else \
        (2560, 9728, (1, 16, 64, 100, 192), torch.bfloat16)
    wgu, sgu, wd, sd = weights(h, i, device)
    tiles = [MlpTile(slices=4), MlpTile(bi=128, block_n=128, slices=3, stages_a=2)]
    for tile in tiles:
        for m in rows:
            xq, xs = rows_in(m, h, device)
            block_m = 32 if m == 40 else None
            got = fp8_mlp(xq, xs, wgu, sgu, wd, sd, dtype, tile=tile, block_m=block_m)
            want, _ = reference(xq.cpu(), xs.cpu(), wgu.cpu(), sgu.cpu(), wd.cpu(), sd.cpu(), dtype, tile.bi)
            err = ((got.float().cpu() - want.float()).abs().max() / want.float().abs().max()).item()
            again = fp8_mlp(xq, xs, wgu, sgu, wd, sd, dtype, tile=tile, block_m=block_m)
            sync = sync_buffer(device)
            print(f"check {tile} rows {m}: max err {err:.2e} of the largest output, repeat equal "
                  f"{torch.equal(again, got)}, counters zero {not sync.any().item()}", flush=True)
            # float32 on the CPU: only the order of the sums differs; bfloat16 on the GPU: a rounding flip
            # before the E4M3 quantization moves a value by one E4M3 step
            assert err < (1e-5 if dtype == torch.float32 else 1.5e-2), err
            assert torch.equal(again, got) and not sync.any(), sync[:8]


def sm90() -> None:
    """Each variant compiled for sm90 on this machine (no GPU): registers, spills, whether the products
    run as wgmma."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    kernel = mlp_kernel
    types = {n: "*fp8e4nv" for n in ("xq_ptr", "wgu_ptr", "wd_ptr", "hq_ptr")}
    types.update({n: "*fp32" for n in ("xs_ptr", "sgu_ptr", "sd_ptr", "hs_ptr", "part_ptr")})
    types.update(out_ptr="*bf16", sync_ptr="*i32")
    for tile in VARIANTS:
        for block_m in (16, 64):
            const = dict(H=2560, I=9728, BLOCK_M=block_m, BI=tile.bi, BLOCK_KA=tile.block_ka, BLOCK_N=tile.block_n,
                         SLICES=tile.slices, STAGES_A=tile.stages_a, STAGES_B=tile.stages_b, SPIN=SPIN_LIMIT,
                         PDL=True)
            sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in kernel.arg_names}
            attrs = {(k,): [["tt.divisibility", 16]] for k, n in enumerate(kernel.arg_names)
                     if sig[n].startswith("*") or n in ("x_stride", "out_stride")}
            t0 = time.perf_counter()
            compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=const, attrs=attrs),
                                      target=GPUTarget("cuda", 90, 32), options={"num_warps": tile.num_warps})
            print(f"{tile} block_m {block_m}: {_resource_usage(compiled.asm['cubin'])}, wgmma "
                  f"{compiled.asm['ptx'].count('wgmma.mma_async')}, cp.async {compiled.asm['ptx'].count('cp.async.cg')}, "
                  f"dynamic shared {compiled.metadata.shared}, "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)


def _resource_usage(cubin: bytes) -> str:
    """cuobjdump's line for the kernel: registers, stack (spills land there) and shared memory."""
    import re
    import subprocess
    import tempfile
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    return f"REG {m[1]} STACK {m[2]} SHARED {m[3]} LOCAL {m[4]}" if m else text.strip()[-200:]


def _best(results: list[dict], variants: list[MlpTile], count: int) -> list[MlpTile]:
    """The `count` variants with the smallest geometric mean of us over the rows timed (ran everywhere)."""
    import math
    score = {}
    for tile in variants:
        times = [row["fused"].get(json.dumps(asdict(tile)), {}).get("us") for row in results]
        if times and all(times):
            score[tile] = math.exp(sum(math.log(t) for t in times) / len(times))
    return sorted(score, key=score.get)[:count]


MODELS = {"qwen3-4b": (2560, 9728), "nanbeige4.1-3b": (2560, 10496)}      # hidden, intermediate
ROWS = (8, 16, 32, 64, 128, 192)       # one row takes the single-token products (gemv.py)


def graph_timer(fn, layers: int) -> float:
    """us a layer: `fn` (every layer's MLP) captured in a CUDA graph and replayed
    (scripts/device/fp8_products.py's `graph_us`)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "device"))
    from fp8_products import graph_us
    return graph_us([fn]) / layers


def bench(out_dir: str, models=MODELS, rows_list=ROWS, layers: int = 8, variants=VARIANTS, timer=graph_timer,
          device=torch.device("cuda")) -> None:
    """The shipped path (as the engine runs a layer's MLP: gate_up on the rows the norm quantized, the
    SiLU-and-mul quantizing for down, down unscaled where the norm after it scales) and the fused kernel,
    each in CUDA graphs running the MLPs of `layers` distinct layers (weights beyond L2) one after the
    other: us a layer, and each variant's error against `reference`."""
    from tokenmill.layers.kernels import fp8_gemm, fused_ops
    from tokenmill.quant.fp8 import Fp8Rows
    results = []
    for n_model, (model, (h, i)) in enumerate(models.items()):
        if n_model == 1:      # the later models time the first one's four best tiles (compiles are slow there)
            variants = _best(results, variants, 4)
        ws = [weights(h, i, device, seed) for seed in range(layers)]
        group = fp8_gemm.input_group((h, i), (1, i), device)
        for m in rows_list:
            xq, xs = rows_in(m, h, device)

            def shipped():
                for wgu, sgu, wd, sd in ws:
                    y = fp8_gemm.fp8_linear(Fp8Rows(xq, xs, h, torch.bfloat16), wgu, sgu, (1, h))
                    out = fp8_gemm.fp8_linear(fused_ops.silu_and_mul(y, fp8_group=group), wd, sd, (1, i),
                                              unscaled=True)
                return out

            def fused(tile):
                def run():
                    for wgu, sgu, wd, sd in ws:
                        out = fp8_mlp(xq, xs, wgu, sgu, wd, sd, tile=tile)
                    return out
                return run

            row = dict(model=model, rows=m, shipped_us=timer(shipped, layers), fused={})
            for tile in variants:
                key = json.dumps(asdict(tile))
                try:
                    got = fused(tile)()
                    if sync_buffer(device)[2].item():
                        raise RuntimeError("a down task gave up waiting")
                    want, _ = reference(xq, xs, *ws[-1], torch.bfloat16, tile.bi)
                    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
                    row["fused"][key] = dict(us=timer(fused(tile), layers), err=err)
                except Exception as e:       # a variant that fails to compile or run is reported, not fatal
                    row["fused"][key] = dict(us=None, err=None, error=repr(e)[:300])
                    sync_buffer(device).zero_()
                    print(f"{model} rows {m} {tile}: {e!r}"[:400], flush=True)
            results.append(row)
            best = min(((v["us"], k) for k, v in row["fused"].items() if v["us"]), default=(None, None))
            print(f"{model} rows {m}: shipped {row['shipped_us']:.2f} us, fused best {best[0]} ({best[1]})", flush=True)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "fp8_mlp_fused.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("\n| model | rows | shipped us | fused best us | ratio | best tile | its max err |")
    print("|---|---|---|---|---|---|---|")
    for row in results:
        ok = [(v["us"], k, v["err"]) for k, v in row["fused"].items() if v["us"]]
        if ok:
            us, k, err = min(ok)
            print(f"| {row['model']} | {row['rows']} | {row['shipped_us']:.2f} | {us:.2f} | "
                  f"{us / row['shipped_us']:.3f} | {k} | {err:.1e} |")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["check", "sm90", "bench"])
    p.add_argument("--out", default="/tmp/fp8_mlp_fused")
    a = p.parse_args()
    {"check": check, "sm90": sm90, "bench": lambda: bench(a.out)}[a.mode]()
