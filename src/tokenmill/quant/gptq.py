"""GPTQ (Frantar et al., 2022): quantized weights whose rounding error each layer's calibration inputs
correct, onto two grids: 4-bit groups (the GPTQ checkpoint layout) and FP8 E4M3 with one scale per output
channel (compressed-tensors' layout).

For a linear layer y = W x with calibration inputs X [n, in], GPTQ minimises ||W X^T - Q X^T||^2 row by
row. The loss's Hessian H = 2 X^T X is shared by every output row. Columns are quantized one at a time;
after column i the columns not yet quantized absorb its error through H^-1: with U the upper Cholesky
factor of H^-1, w[:, j] -= (w[:, i] - q[:, i]) / U[i, i] * U[i, j] for j after i. The update reaches the
columns of the current block at once and the rest in one matrix product per block (the paper's lazy
batch updates). Only the rounding of one column differs between the grids (`gptq_columns`).

Columns go in descending order of H's diagonal (their inputs' energy: the paper's act-order), with
static grids: every scale (and 4-bit zero) is set before any update, from the weights themselves. 4-bit
groups therefore stay contiguous input rows and the checkpoint is a plain one (`desc_act: false`,
`g_idx = row // group_size`), which the products read without gathering their inputs; only the order of
rounding differs. Groups in act-order (`desc_act: true`, each group's grid set from the updated weights
when it comes up) measured no better on SmolLM2-135M (docs/BENCHMARKS.md). The 4-bit grids'
ranges are the weights' min/max shrunk by a clip search (`clipped_grid`, each weight's rounding error
weighed by its input's energy); FP8's scale is the row's absmax / 448, as at load.

`gptq_model` and `gptq_fp8_model` run the calibration tokens through a float model layer by layer; each
layer is quantized on inputs that come from the already quantized layers and sublayers before it, so
later layers also correct the error of earlier ones. The 4-bit grids go further (`output_target`): each
linear aims at the float model's output, its float weight on the float model's inputs, rather than at its
own float weight on the quantized inputs. Measured on SmolLM2-135M-Instruct against its unquantized
weights: docs/benchmarks/20261201/quant-quality.md and docs/BENCHMARKS.md.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tokenmill.layers.attention_metadata import AttentionMetadata
from tokenmill.quant.formats import W4_GROUP_SIZES
from tokenmill.quant.fp8 import FP8, FP8_MAX, scales_of
from tokenmill.quant.quantize import Grid, _groups, group_grid
from tokenmill.quant.w4 import dequantize_grid

# the model's packed linears and the checkpoint shards they hold, in order (see `LlamaForCausalLM.packed_modules`)
SHARDS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "self_attn.o_proj": ("self_attn.o_proj",),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
          "mlp.down_proj": ("mlp.down_proj",)}

# round_column(i, w, codes) -> values: input column i's weights w [out] on the grid, written to `codes` [out]
# as the checkpoint stores them (4-bit values, FP8 values in float32), and returned as the weight they stand
# for. The column loop's cost is its count of small tensor operations (a few per input of every linear):
# the codes are written in place, not returned to be copied.
RoundColumn = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


def clipped_grid(wg: torch.Tensor, sym: bool, min_zero: int = 0, steps: int = 8,
                 min_shrink: float = 0.7, weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize.group_grid` of each group [..., group] with its range shrunk by the factor in
    linspace(1, min_shrink, steps) that rounds the group with the least squared error, each weight's
    error times `weight` (broadcast to wg; GPTQ: its input's energy, H's diagonal): clipping a few extreme
    weights buys a finer step for all the others."""
    # a group's grid depends only on its min and max, which a shrink scales: the grid of the pair
    # [min, max] * f is the grid of the shrunk group
    ranges = torch.stack([wg.amin(-1), wg.amax(-1)], -1)
    best = best_err = None
    for f in torch.linspace(1, min_shrink, steps).tolist():
        s, z = group_grid(ranges * f, sym, min_zero)
        s_, z_ = s[..., None], z[..., None]
        err = torch.round(wg / s_).add_(z_).clamp_(0, 15).sub_(z_).mul_(s_).sub_(wg).square_()
        err = (err if weight is None else err.mul_(weight)).sum(-1)
        if best is None:
            best, best_err = (s, z), err
        else:
            better = err < best_err
            best = (torch.where(better, s, best[0]), torch.where(better, z, best[1]))
            best_err = torch.minimum(err, best_err)
    return best


def upper_triangular_inverse(r: torch.Tensor, leaf: int = 128) -> torch.Tensor:
    """R^-1 of an upper triangular R [n, n], by halves: [[A, B], [0, D]]^-1 = [[A^-1, -A^-1 B D^-1], [0, D^-1]],
    so that most of its work is matrix products (a triangular solve against the identity, which torch
    offers in place of LAPACK's triangular inverse, does three times the work at a lower rate)."""
    n = r.shape[0]
    if n <= leaf:
        return torch.linalg.solve_triangular(r, torch.eye(n, dtype=r.dtype), upper=True)
    k = n // 2
    a, d = upper_triangular_inverse(r[:k, :k], leaf), upper_triangular_inverse(r[k:, k:], leaf)
    out = torch.zeros_like(r)
    out[:k, :k], out[k:, k:] = a, d
    torch.mm(a @ r[:k, k:], d, out=out[:k, k:]).neg_()
    return out


def gptq_columns(w: torch.Tensor, hessian: torch.Tensor, round_column: RoundColumn, damp: float = 0.01,
                 block_size: int = 32) -> torch.Tensor:
    """The error-compensated rounding of a weight [out, in] with its inputs' Hessian [in, in] (any positive
    multiple of X^T X): the codes [in, out] that `round_column` gives each column, in input order.
    `damp`: the fraction of H's mean diagonal added to its diagonal, which keeps H invertible (fewer
    samples than inputs, dead inputs) and the updates small."""
    n = w.shape[1]
    w = w.detach().float().clone()
    h = hessian.detach().float().clone()
    diag = h.diagonal()
    dead = diag == 0                                   # an input never seen: its column cannot matter
    diag[dead] = 1
    w[:, dead] = 0
    diag += damp * diag.mean()
    # act-order: the inputs with the most energy first (the loss they would leave is the largest)
    perm = torch.argsort(diag, descending=True)
    order = perm.tolist()
    h = h.index_select(0, perm).index_select(1, perm)
    # U, upper with H^-1 = U^T U, without forming H^-1: the Cholesky factor of H in reversed order is
    # an upper R with H = R R^T, and U = R^-1
    r = torch.linalg.cholesky(h.flip(-1, -2)).flip(-1, -2)
    u = upper_triangular_inverse(r)

    # input-major ([in, out]) so that a column is a contiguous row; small blocks keep the rank-one updates
    # inside a block cheap, the rest of the update is one matrix product per block
    w = w.t().index_select(0, perm)
    codes = torch.empty_like(w)
    for b0 in range(0, n, block_size):
        b1 = min(b0 + block_size, n)
        wb, ub = w[b0:b1], u[b0:b1, b0:b1]
        err = torch.empty_like(wb)
        # the block's rows as views, taken at once rather than indexed column by column
        w_rows, u_rows, err_rows, code_rows = wb.unbind(0), ub.unbind(0), err.unbind(0), codes[b0:b1].unbind(0)
        u_diag = ub.diagonal().unbind(0)
        for i in range(b1 - b0):
            value = round_column(order[b0 + i], w_rows[i], code_rows[i])
            e = torch.sub(w_rows[i], value, out=err_rows[i]).div_(u_diag[i])
            wb[i + 1:].addr_(u_rows[i][i + 1:], e, alpha=-1)
        w[b1:].addmm_(u[b0:b1, b1:].t(), err, alpha=-1)
    return torch.empty_like(codes).index_copy_(0, perm, codes)                      # back to input order


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, group_size: int, sym: bool = False,
                  min_zero: int = 0, damp: float = 0.01) -> Grid:
    """A weight [out, in] and its inputs' Hessian [in, in] -> its 4-bit grid: q [in, out], zeros and
    scales [groups, out] (see `quantize.Grid`)."""
    w = w.float() * (hessian.diagonal() != 0)          # dead inputs' weights: see `gptq_columns`
    # the clip search weighs each weight's rounding by its input's energy, as the loss GPTQ minimises does
    # along the diagonal (SmolLM2-135M, with output targets, 2,048 tokens: long held-out text 1.139 -> 1.114)
    energy = _groups(hessian.diagonal().float()[None], group_size)
    scales, zeros = (t.t().contiguous() for t in clipped_grid(_groups(w, group_size), sym, min_zero,
                                                              weight=energy))

    scale_rows, zero_rows = scales.unbind(0), zeros.unbind(0)

    def round_column(i: int, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        s, z = scale_rows[i // group_size], zero_rows[i // group_size]
        torch.div(x, s, out=q).round_().add_(z).clamp_(0, 15)
        return torch.sub(q, z).mul_(s)
    q = gptq_columns(w, hessian, round_column, damp)
    return q.to(torch.int32), zeros.to(torch.int32), scales.half()


def gptq_fp8_quantize(w: torch.Tensor, hessian: torch.Tensor, damp: float = 0.01
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [out, in] and its inputs' Hessian -> (FP8 E4M3 weight [out, in], float32 scale [out, 1]):
    the per-channel scale of `fp8.quantize` (the row's absmax / 448), values rounded with compensation.
    A compensated weight can outgrow the row's absmax; it saturates at +-448."""
    w = w.float() * (hessian.diagonal() != 0)          # dead inputs' weights: see `gptq_columns`
    amax = w.abs().amax(1)
    scale = scales_of(amax)

    def round_column(i: int, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        q.copy_(torch.div(x, scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8))
        return q * scale
    q = gptq_columns(w, hessian, round_column, damp)
    return q.t().to(FP8).contiguous(), scale[:, None].contiguous()


# The ridge of `output_target` over the mean of X^T X's diagonal. SmolLM2-135M at 4-bit g128, long held-out
# text's perplexity against the unquantized model with 2,048 calibration tokens: 1.183 without the
# target, 1.139 at 30, 1.148 at 100, 1.307 at 0.01, where the step fits the calibration tokens.
OUTPUT_TARGET_RIDGE = 30.0


def output_target(w: torch.Tensor, hessian: torch.Tensor, x: torch.Tensor, x_float: torch.Tensor,
                  ridge: float = OUTPUT_TARGET_RIDGE) -> torch.Tensor:
    """The weight [out, in] that GPTQ rounds when a linear's calibration inputs x [n, in] (from the
    quantized layers before it) differ from the float model's x_float: W moved by the ridge regression of
    the float model's outputs x_float W^T on x, W + ((X^T X + r I)^-1 X^T (X_float - X) W^T)^T, with r =
    `ridge` x the mean of X^T X's diagonal (`hessian`). The ridge pulls it towards W, not towards zero;
    without it the step fits the calibration tokens and held-out text gets worse (GPTAQ's asymmetric
    calibration, Li et al., 2025, as one regularised least-squares step)."""
    w = w.detach().float()
    a = hessian.float().clone()
    a.diagonal().add_(ridge * a.diagonal().mean() + 1e-8)
    chol = torch.linalg.cholesky(a)
    # X^T (X_float - X) W^T in the cheaper order: through [in, in] (the solve then takes `in` right-hand
    # sides, and W^T comes last as a product) where out is wide, through [n, out] where in is
    (n, k), m = x.shape, w.shape[0]
    if n * k + k * k <= 2 * n * m:
        step = torch.cholesky_solve(x.t() @ x_float - hessian, chol)
        return torch.addmm(w, w, step.t())
    return w + torch.cholesky_solve(x.t() @ ((x_float - x) @ w.t()), chol).t()


def _prefill_metadata(num_seqs: int, seq_len: int) -> AttentionMetadata:
    """`num_seqs` sequences of `seq_len` tokens, all new, each in one cache block of `seq_len` slots."""
    return AttentionMetadata(
        slot_mapping=torch.arange(num_seqs * seq_len),
        query_start_loc=torch.arange(0, (num_seqs + 1) * seq_len, seq_len, dtype=torch.int32),
        seq_lens=torch.full((num_seqs,), seq_len, dtype=torch.int32),
        block_tables=torch.arange(num_seqs, dtype=torch.int32)[:, None],
        max_query_len=seq_len, max_seq_len=seq_len)


# quantize_linear(name, layer, x [T, in], x_float [T, in] or None, prefix): quantizes `layer` (the packed
# linear `name` of the decoder layer `prefix`) on its inputs x, whose float model's inputs were x_float
# (where asked for), and replaces its weight by the weight its quantized values stand for
QuantizeLinear = Callable[[str, nn.Linear, torch.Tensor, torch.Tensor | None, str], None]
# linear(name, layer, x) -> the layer's output on x
Linear = Callable[[str, nn.Linear, torch.Tensor], torch.Tensor]


def _layer_pass(layer: nn.Module, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                meta: AttentionMetadata, linear: Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer on `hidden` (and the residual stream, None before the first), each of its linears
    through `linear`; returns the layer's (hidden, residual)."""
    attn, mlp, backend = layer.self_attn, layer.mlp, layer.backend
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    if residual is None:
        residual, x = hidden, backend.rms_norm(hidden, norm1.weight, norm1.eps)
    else:
        x, residual = backend.rms_norm(hidden, norm1.weight, norm1.eps, residual)
    qkv = linear("self_attn.qkv_proj", attn.qkv_proj, x)
    hidden = linear("self_attn.o_proj", attn.o_proj, attn.attend_qkv(positions, qkv, meta))
    x, residual = backend.rms_norm(hidden, norm2.weight, norm2.eps, residual)
    gate_up = linear("mlp.gate_up_proj", mlp.gate_up_proj, x)
    return linear("mlp.down_proj", mlp.down_proj, backend.act_and_mul(gate_up, mlp.act)), residual


def check_calibration(calibration, cfg) -> None:
    """Calibration token ids [num_seqs, seq_len] the model reads: none at all would give every linear an
    all-zero Hessian, whose inputs count as dead, and quantize every weight to zero."""
    if not isinstance(calibration, torch.Tensor) or calibration.dim() != 2 or calibration.is_floating_point():
        got = (f"{calibration.dtype} of shape {tuple(calibration.shape)}" if isinstance(calibration, torch.Tensor)
               else type(calibration).__name__)
        raise ValueError(f"calibration must be an integer tensor of token ids [num_seqs, seq_len], got {got}")
    if not calibration.numel():
        raise ValueError(f"calibration of shape {tuple(calibration.shape)} holds no tokens")
    if calibration.shape[1] > cfg.derived_max_model_len:
        raise ValueError(f"calibration sequences of {calibration.shape[1]} tokens are longer than the model's "
                         f"context, its {cfg.derived_max_model_len_source}")
    lo, hi = int(calibration.min()), int(calibration.max())
    if lo < 0 or hi >= cfg.vocab_size:
        raise ValueError(f"calibration token ids must be in [0, {cfg.vocab_size}), got [{lo}, {hi}]")


@torch.no_grad()
def _sequential(model: nn.Module, calibration: torch.Tensor, quantize_linear: QuantizeLinear,
                float_inputs: bool) -> None:
    """Runs `calibration` [num_seqs, seq_len] through `model` (a float `LlamaForCausalLM` on the CPU) layer
    by layer, quantizing each linear on the way on inputs from the quantized ones before it. With
    `float_inputs`, each layer runs first as the float model, whose inputs each linear's quantizer gets."""
    cfg = model.config
    if cfg.residual_multiplier != 1.0:
        # the loader folded it into o_proj and down_proj (`fold_multipliers`): their grids would carry it
        # beside the config.json that names it, and a load would apply it twice
        raise ValueError(f"residual_multiplier={cfg.residual_multiplier} is folded into the loaded model's o_proj "
                         "and down_proj, which a checkpoint written from their grids would carry beside the "
                         "config.json that names it; round the checkpoint's own weights "
                         "(quantize.write_checkpoint) instead")
    if cfg.post_norms:
        raise ValueError(f"{cfg.architecture}'s layers normalise the attention's and the MLP's outputs (post_norms), "
                         "which the calibration pass (a Llama layer's) does not run; tokenmill does not calibrate "
                         "GPTQ grids for it")
    if cfg.rope_dim != cfg.head_dim:
        # the loader put q's and k's rows in the RoPE paths' order (`rotary.rotary_order`), which the grids of
        # q_proj and k_proj would carry into a checkpoint that a load reorders again
        raise ValueError(f"rotary_dim={cfg.rope_dim} of head_dim={cfg.head_dim}: the loaded model's q_proj and "
                         "k_proj rows are reordered for partial rotary, which a checkpoint written from their grids "
                         "would carry; round the checkpoint's own weights (quantize.write_checkpoint) instead")
    check_calibration(calibration, cfg)
    num_seqs, seq_len = calibration.shape
    meta = _prefill_metadata(num_seqs, seq_len)
    positions = torch.arange(seq_len).repeat(num_seqs)
    # a K/V cache for each stream that runs: the quantized one last
    caches = [[torch.zeros(num_seqs, seq_len, cfg.num_key_value_heads, cfg.head_dim) for _ in range(2)]
              for _ in range(2 if float_inputs else 1)]
    hidden = hidden_float = model.model.embed_tokens(calibration.flatten())
    residual = residual_float = None
    for i, layer in enumerate(model.model.layers):
        prefix, attn = f"model.layers.{i}", layer.self_attn
        recorded: dict[str, torch.Tensor] = {}

        def record(name: str, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
            recorded[name] = x.float()
            return linear(x)

        def quantize(name: str, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
            x = x.float()
            quantize_linear(name, linear, x, recorded.pop(name, None), prefix)
            return linear(x)
        if float_inputs:
            attn.attn.k_cache, attn.attn.v_cache = caches[0]
            hidden_float, residual_float = _layer_pass(layer, hidden_float, residual_float, positions, meta,
                                                       record)
        attn.attn.k_cache, attn.attn.v_cache = caches[-1]
        hidden, residual = _layer_pass(layer, hidden, residual, positions, meta, quantize)
        attn.attn.k_cache = attn.attn.v_cache = torch.empty(0)


def _shard_sizes(model: nn.Module, name: str, layer: nn.Linear) -> list[int]:
    return model.shard_sizes(name.rpartition(".")[2]) if len(SHARDS[name]) > 1 else [layer.out_features]


def gptq_model(model: nn.Module, calibration: torch.Tensor, group_size: int, sym: bool = False,
               min_zero: int = 0, damp: float = 0.01) -> dict[str, Grid]:
    """4-bit GPTQ grids of every decoder linear of `model` (a float `LlamaForCausalLM` on the CPU), keyed
    by the Hugging Face weight names that `quantize.write_checkpoint` takes. `calibration`: token ids
    [num_seqs, seq_len]. Each linear rounds its `output_target`. The model's linear weights are replaced by
    their quantized values on the way."""
    if group_size not in W4_GROUP_SIZES:
        raise ValueError(f"group_size={group_size!r} is not supported; supported: "
                         f"{', '.join(map(str, W4_GROUP_SIZES))}")
    grids: dict[str, Grid] = {}

    def quantize_linear(name: str, layer: nn.Linear, x: torch.Tensor, x_float: torch.Tensor, prefix: str) -> None:
        hessian = x.t() @ x
        grid = gptq_quantize(output_target(layer.weight, hessian, x, x_float), hessian, group_size, sym,
                             min_zero, damp)
        layer.weight.copy_(dequantize_grid(grid, group_size))
        sizes = _shard_sizes(model, name, layer)
        for shard, *parts in zip(SHARDS[name], *(t.split(sizes, dim=1) for t in grid)):
            grids[f"{prefix}.{shard}.weight"] = tuple(p.contiguous() for p in parts)
    _sequential(model, calibration, quantize_linear, float_inputs=True)
    return grids


def gptq_fp8_model(model: nn.Module, calibration: torch.Tensor, damp: float = 0.01
                   ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """FP8 (E4M3, per output channel) GPTQ weights of every decoder linear of `model`: (weight, scale)
    keyed by the Hugging Face weight names that `fp8.write_checkpoint` takes; otherwise as `gptq_model`, but
    each linear rounds its own weight: on SmolLM2-135M the output target left the held-out figures level
    (long text 1.0107 / 0.9926 against 1.0065 / 0.9951) at the cost of a float pass."""
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def quantize_linear(name: str, layer: nn.Linear, x: torch.Tensor, x_float: None, prefix: str) -> None:
        q, scale = gptq_fp8_quantize(layer.weight, x.t() @ x, damp)
        layer.weight.copy_(q.float() * scale)
        sizes = _shard_sizes(model, name, layer)
        for shard, wq, s in zip(SHARDS[name], q.split(sizes), scale.split(sizes)):
            weights[f"{prefix}.{shard}.weight"] = (wq.contiguous(), s.contiguous())
    _sequential(model, calibration, quantize_linear, float_inputs=False)
    return weights
