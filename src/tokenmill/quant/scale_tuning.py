"""The group scales of a 4-bit grid trained end to end after the rounding (the scale-only training of
PEQA and of EfficientQAT's last phase): each linear's codes and zeros stay as GPTQ set them, and every
(group, output row) scale s0 becomes s0 exp(m), with m trained by Adam on the KL divergence from the
unquantized model's next-token distributions to the quantized model's over the calibration sequences.

GPTQ makes each linear's output close on its own; the KL divergence scores the whole model at once, so
the scales of early layers also answer for what their errors do downstream. The forward pass that
autograd runs is transformers' model of the checkpoint's architecture on the same weights (the engine's
own forward writes a paged KV cache in place and is not differentiable). Measured on SmolLM2-135M-Instruct:
docs/BENCHMARKS.md, "4-bit GPTQ with its group scales trained end to end" (FP8's per-channel scales,
trained the same way after FP8 GPTQ, gained nothing there).
"""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.quant.quantize import Grid


class _TunedLinear(nn.Module):
    """A 4-bit linear with trainable scales: W[o, i] = codes[o, i] * s0[o, g] exp(m[o, g]), g = rows[i] the
    input's group; `bias`: that of the linear it stands in for (Qwen2's q/k/v), set by `_train`."""

    def __init__(self, codes: torch.Tensor, s0: torch.Tensor, rows: torch.Tensor):
        super().__init__()
        self.codes, self.s0, self.rows = codes.float(), s0.float(), rows                 # [out, in], [out, G]
        self.m = nn.Parameter(torch.zeros_like(self.s0))
        self.bias: torch.Tensor | None = None

    def scales(self) -> torch.Tensor:
        return self.s0 * torch.exp(self.m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.codes * self.scales()[:, self.rows], self.bias)


def _reference_model(state: dict[str, torch.Tensor], hf_config: dict) -> nn.Module:
    """transformers' model of `hf_config`'s architecture with `state` (Hugging Face names), float32."""
    import transformers
    cls = getattr(transformers, hf_config["architectures"][0])
    config = cls.config_class(**{k: v for k, v in hf_config.items()
                                 if k not in ("architectures", "torch_dtype", "quantization_config")})
    model = cls(config).float().eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"the state does not fit {cls.__name__}: missing {missing[:4]}, unexpected {unexpected[:4]}")
    model.tie_weights()
    return model.requires_grad_(False)


def _train(state: dict[str, torch.Tensor], hf_config: dict, layers: dict[str, _TunedLinear],
           calibration: torch.Tensor, steps: int, lr: float, batch: int, seed: int) -> None:
    """Trains `layers` (Hugging Face weight name -> its tuned linear) in place of those weights."""
    model = _reference_model(state, hf_config)
    with torch.no_grad():
        target = torch.log_softmax(model(calibration).logits.float(), -1)
    for key, layer in layers.items():
        parent, _, leaf = key.removesuffix(".weight").rpartition(".")
        module = model.get_submodule(parent)
        # the bias is not quantized and stays in the product: the scales are fitted to the float model's
        # output, bias included, and without it would learn to make up for the missing bias
        layer.bias = getattr(module, leaf).bias
        setattr(module, leaf, layer)
    opt = torch.optim.Adam([layer.m for layer in layers.values()], lr=lr)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        pick = torch.randperm(calibration.shape[0], generator=g)[:batch]
        logp, want = torch.log_softmax(model(calibration[pick]).logits.float(), -1), target[pick]
        loss = (want.exp() * (want - logp)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def tune_scales(state: dict[str, torch.Tensor], hf_config: dict, grids: dict[str, Grid],
                calibration: torch.Tensor, group_size: int, steps: int = 80, lr: float = 2e-3,
                batch: int = 2, seed: int = 0) -> dict[str, Grid]:
    """`grids` (Hugging Face weight name -> 4-bit grid, as `gptq.gptq_model` returns them) with their scales
    trained for `steps` Adam steps of `batch` calibration sequences each (`calibration`: token ids
    [num_seqs, seq_len]); `state` and `hf_config`: the unquantized checkpoint. The codes and zeros are
    returned as given, the scales as fp16. The unquantized model's log-probabilities of every calibration
    token are held throughout (num_seqs x seq_len x vocab floats: 400 MB for SmolLM2's 2,048 tokens)."""
    layers = {}
    for key, (q, zeros, scales) in grids.items():
        rows = torch.arange(q.shape[0]) // group_size                                # input -> group
        layers[key] = _TunedLinear((q - zeros[rows]).t(), scales.t(), rows)
    _train(state, hf_config, layers, calibration, steps, lr, batch, seed)
    return {key: (q, zeros, layers[key].scales().detach().t().half()) for key, (q, zeros, _) in grids.items()}

