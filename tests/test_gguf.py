"""GGUF files written here with `gguf.GGUFWriter` load into the same weights, config and tokenizer as
transformers' own GGUF reader gives (its dequantizers and its Q/K unpermutation are its own torch code,
not the `gguf` package's numpy used by tokenmill), and broken files fail with errors that name the cause.

One file per architecture mixes every supported tensor type across its tensors, so three loads cover
F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K on llama (permuted q/k), qwen2 (biases) and qwen3
(q/k norms); the low-bit types (Q2_K, Q3_K, the i-quants, TQ1_0 and TQ2_0) are read tensor by tensor. Types
`gguf` can quantize are quantized from known weights; for the K-quants and i-quants, which it cannot
quantize, the blocks are random bytes with small finite scales.
"""
from __future__ import annotations

import json
import math
import os
import re

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")       # transformers reads GGUF only with accelerate installed

from tokenmill import LLM, SamplingParams                      # noqa: E402
from tokenmill.config import ModelConfig                       # noqa: E402
from tokenmill.engine.tokenizer import Tokenizer, plain_eos_ids  # noqa: E402
from tokenmill.runner.gguf_loader import unpermute_rows        # noqa: E402
from tokenmill.tiny import bundled_model_path                  # noqa: E402

Q = gguf.GGMLQuantizationType
HIDDEN, INTER, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2
# transformers' GGUF reader takes Qwen3's head_dim from its config default (128), not the file
HEAD_DIMS = {"llama": 64, "qwen2": 64, "qwen3": 128}
# per layer: the type of each projection; norms, biases stay F32
TYPES = {
    "llama": [dict(attn_q=Q.Q4_K, attn_k=Q.Q5_K, attn_v=Q.Q6_K, attn_output=Q.Q4_0, ffn_gate=Q.Q4_1,
                   ffn_up=Q.F16, ffn_down=Q.BF16),
              dict(attn_q=Q.Q8_0, attn_k=Q.Q4_1, attn_v=Q.F32, attn_output=Q.Q5_K, ffn_gate=Q.Q6_K,
                   ffn_up=Q.Q4_K, ffn_down=Q.Q4_0)],
    "qwen2": [dict(attn_q=Q.Q6_K, attn_k=Q.Q4_K, attn_v=Q.Q5_K, attn_output=Q.Q8_0, ffn_gate=Q.BF16,
                   ffn_up=Q.Q4_0, ffn_down=Q.Q4_1)] * LAYERS,
    "qwen3": [dict(attn_q=Q.Q5_K, attn_k=Q.Q6_K, attn_v=Q.Q4_K, attn_output=Q.F16, ffn_gate=Q.Q8_0,
                   ffn_up=Q.Q4_1, ffn_down=Q.Q4_0)] * LAYERS,
}
EMBED_TYPE = {"llama": Q.Q8_0, "qwen2": Q.Q6_K, "qwen3": Q.F16}
# the types `gguf` cannot quantize: where each block keeps its fp16 scales (IQ1_M's is split into the top
# nibbles of its last four uint16, set apart in `_random_blocks`)
RANDOM_BLOCK_SCALES = {Q.Q4_K: ((0, 2), (2, 4)), Q.Q5_K: ((0, 2), (2, 4)), Q.Q6_K: ((208, 210),),
                       Q.Q2_K: ((80, 82), (82, 84)), Q.Q3_K: ((108, 110),), Q.IQ1_S: ((0, 2),), Q.IQ1_M: (),
                       Q.IQ2_XXS: ((0, 2),), Q.IQ2_XS: ((0, 2),), Q.IQ2_S: ((0, 2),), Q.IQ3_XXS: ((0, 2),),
                       Q.IQ3_S: ((0, 2),), Q.IQ4_NL: ((0, 2),), Q.IQ4_XS: ((0, 2),)}


def tiny_tokenizer_metadata() -> dict:
    """The bundled tiny model's byte-level BPE tokenizer, as GGUF stores one."""
    root = bundled_model_path()
    with open(os.path.join(root, "tokenizer.json")) as f:
        tj = json.load(f)
    vocab = tj["model"]["vocab"]
    tokens = [None] * len(vocab)
    for tok, i in vocab.items():
        tokens[i] = tok
    types = [1] * len(tokens)
    for added in tj["added_tokens"]:
        types[added["id"]] = 3 if added["special"] else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    with open(os.path.join(root, "chat_template.jinja")) as f:
        template = f.read()
    return dict(tokens=tokens, types=types, merges=merges, template=template, eos=2, pad=0)


def _random_blocks(rows: int, cols: int, qtype, rng) -> np.ndarray:
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    n = cols // block_elems
    data = rng.integers(0, 256, size=(rows, n, block_bytes), dtype=np.uint8)
    lo, hi = (1e-5, 1e-4) if qtype == Q.Q6_K else (1e-4, 5e-4)
    for a, b in RANDOM_BLOCK_SCALES[qtype]:
        scale = rng.uniform(lo, hi, size=(rows, n)).astype(np.float16)
        data[:, :, a:b] = scale.view(np.uint8).reshape(rows, n, 2)
    if qtype == Q.IQ1_M:
        scale = rng.uniform(lo, hi, size=(rows, n)).astype(np.float16).view(np.uint16)
        words = data[:, :, -8:].copy().view(np.uint16)
        for k in range(4):
            words[:, :, k] = (words[:, :, k] & 0x0FFF) | (((scale >> (4 * k)) & 0xF) << 12)
        data[:, :, -8:] = words.view(np.uint8)
    return data.reshape(rows, -1)


def _encode(w: np.ndarray, qtype, rng) -> tuple[np.ndarray, object]:
    if qtype == Q.F32:
        return w.astype(np.float32), None
    if qtype == Q.F16:
        return w.astype(np.float16), None
    if qtype in RANDOM_BLOCK_SCALES:
        return _random_blocks(w.shape[0], w.shape[1], qtype, rng), qtype
    return gguf.quants.quantize(w.astype(np.float32), qtype), qtype


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to a llama q/k projection (the inverse of tokenmill's unpermute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gguf(path: str, arch: str, tok: dict, seed: int = 0, tied: bool | None = None,
               layer_types=None, embed_type=None, rename: dict | None = None, drop=()) -> dict:
    """Writes the file; returns each tensor's true weights (before llama's permutation) by GGUF name."""
    rng = np.random.default_rng(seed)
    truth = {}
    HEAD_DIM = HEAD_DIMS[arch]
    tied = arch != "llama" if tied is None else tied
    vocab = len(tok["tokens"])
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(2048)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_block_count(LAYERS)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    w.add_eos_token_id(tok["eos"])
    w.add_pad_token_id(tok["pad"])
    w.add_add_bos_token(False)
    w.add_chat_template(tok["template"])

    def tensor(name, array, qtype=Q.F32, true=None):
        truth[name] = array if true is None else true
        data, raw = _encode(array, qtype, rng)
        if name not in drop:
            w.add_tensor((rename or {}).get(name, name), data, raw_dtype=raw)

    def normal(*shape, std=0.05):
        return rng.normal(0, std, size=shape).astype(np.float32)

    embed_type = EMBED_TYPE[arch] if embed_type is None else embed_type
    tensor("token_embd.weight", normal(vocab, HIDDEN, std=0.5), embed_type)
    for i, types in enumerate(layer_types or TYPES[arch]):
        p = f"blk.{i}."
        tensor(p + "attn_norm.weight", 1 + normal(HIDDEN, std=0.1))
        tensor(p + "ffn_norm.weight", 1 + normal(HIDDEN, std=0.1))
        shapes = dict(attn_q=(HEADS * HEAD_DIM, HIDDEN), attn_k=(KV_HEADS * HEAD_DIM, HIDDEN),
                      attn_v=(KV_HEADS * HEAD_DIM, HIDDEN), attn_output=(HIDDEN, HEADS * HEAD_DIM),
                      ffn_gate=(INTER, HIDDEN), ffn_up=(INTER, HIDDEN), ffn_down=(HIDDEN, INTER))
        for name, shape in shapes.items():
            weight = stored = normal(*shape)
            if arch == "llama" and name in ("attn_q", "attn_k"):
                stored = _permute(weight, HEADS if name == "attn_q" else KV_HEADS)
            tensor(f"{p}{name}.weight", stored, types[name], true=weight)
        if arch == "qwen2":
            for name, rows in (("attn_q", HEADS * HEAD_DIM), ("attn_k", KV_HEADS * HEAD_DIM),
                               ("attn_v", KV_HEADS * HEAD_DIM)):
                tensor(f"{p}{name}.bias", normal(rows, std=0.1))
        if arch == "qwen3":
            tensor(p + "attn_q_norm.weight", 1 + normal(HEAD_DIM, std=0.1))
            tensor(p + "attn_k_norm.weight", 1 + normal(HEAD_DIM, std=0.1))
    tensor("output_norm.weight", 1 + normal(HIDDEN, std=0.1))
    if not tied:
        tensor("output.weight", normal(vocab, HIDDEN), Q.Q6_K)
    _finish(w)
    return truth


def hf_from_gguf(path: str):
    """transformers' model of the file. It parses the file with `gguf.GGUFReader` twice, for the config and
    then for the weights (0.6 s each here, most of it the 8,192-token vocabulary read field by field): the
    reader is a function of the file alone (a read-only view of it), so the second parse is the first's,
    and what transformers builds from it is unchanged, bit for bit."""
    import functools

    from transformers import AutoModelForCausalLM
    try:                     # transformers 5 keeps GGUF weights quantized unless asked; 4.x dequantizes
        from transformers import GgufConfig
        kwargs = dict(quantization_config=GgufConfig(dequantize=True))
    except ImportError:
        kwargs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=None)(gguf.GGUFReader))
        return AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32, **kwargs).eval()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tok_md():
    return tiny_tokenizer_metadata()


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def loaded(request, tok_md, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf")
    write_gguf(path, request.param, tok_md)
    llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=12)
    return request.param, path, llm, hf_from_gguf(path)


def test_config_from_metadata(loaded, tok_md):
    arch, path, _, hf = loaded
    cfg = ModelConfig.from_gguf(path)
    HEAD_DIM = HEAD_DIMS[arch]
    assert cfg.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                "qwen3": "Qwen3ForCausalLM"}[arch]
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (HIDDEN, INTER, LAYERS)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (HEADS, KV_HEADS, HEAD_DIM)
    assert cfg.rope_theta == 50000.0 and cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.max_position_embeddings == 2048 and cfg.vocab_size == len(tok_md["tokens"])
    assert cfg.tie_word_embeddings == (arch != "llama") == hf.config.tie_word_embeddings
    assert cfg.attention_bias == (arch == "qwen2") and cfg.qk_norm == (arch == "qwen3")
    assert cfg.eos_token_ids == (2,)


def test_weights_equal_transformers_dequantized(loaded):
    """Every parameter, packed ones shard by shard, equals transformers' dequantized (and, for llama,
    unpermuted) tensor."""
    _, _, llm, hf = loaded
    ours = dict(llm.engine.runner.model.named_parameters())
    ref = hf.state_dict()
    checked = 0
    for name, param in ours.items():
        if ".qkv_proj." in name:
            parts = [ref[name.replace("qkv_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
        elif ".gate_up_proj." in name:
            parts = [ref[name.replace("gate_up_proj", p)] for p in ("gate_proj", "up_proj")]
        else:
            parts = [ref[name]]
        torch.testing.assert_close(param.detach(), torch.cat(parts), rtol=1e-6, atol=1e-6, msg=name)
        checked += 1
    assert checked == len(ours) > 10


def test_quantized_from_known_weights_round_trip(tok_md, tmp_path):
    """Where the weights are known (types `gguf` quantizes), the loaded ones are them within each
    type's rounding, and llama's q/k rows come back in Hugging Face order."""
    per_type = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 1e-2, Q.Q5_0: 0.1, Q.Q5_1: 0.1, Q.Q4_0: 0.2,
                Q.Q4_1: 0.2}
    path = str(tmp_path / "known.gguf")
    # Q5_0 and Q5_1: llama.cpp's K-quant files hold them where a row is not whole K blocks
    layer = dict(attn_q=Q.Q8_0, attn_k=Q.F16, attn_v=Q.BF16, attn_output=Q.Q4_0, ffn_gate=Q.Q4_1,
                 ffn_up=Q.Q5_0, ffn_down=Q.Q5_1)
    raw = write_gguf(path, "llama", tok_md, seed=3, layer_types=[layer] * LAYERS, embed_type=Q.F32)
    truth = {k.removesuffix(".weight"): v for k, v in raw.items()}
    llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=8)
    params = dict(llm.engine.runner.model.named_parameters())
    q_rows, kv_rows = HEADS * HEAD_DIMS["llama"], KV_HEADS * HEAD_DIMS["llama"]

    def check(got, want, qtype):
        err = (got - torch.from_numpy(want)).norm() / torch.from_numpy(want).norm()
        assert err <= per_type[qtype] + 1e-7, (qtype.name, err.item())
        if qtype != Q.F32:
            assert err > 0
    check(params["model.embed_tokens.weight"].detach(), truth["token_embd"], Q.F32)
    for i in range(LAYERS):
        qkv = params[f"model.layers.{i}.self_attn.qkv_proj.weight"].detach()
        check(qkv[:q_rows], truth[f"blk.{i}.attn_q"], layer["attn_q"])
        check(qkv[q_rows:q_rows + kv_rows], truth[f"blk.{i}.attn_k"], layer["attn_k"])
        check(qkv[q_rows + kv_rows:], truth[f"blk.{i}.attn_v"], layer["attn_v"])
        check(params[f"model.layers.{i}.self_attn.o_proj.weight"].detach(), truth[f"blk.{i}.attn_output"],
              layer["attn_output"])
        gate_up = params[f"model.layers.{i}.mlp.gate_up_proj.weight"].detach()
        check(gate_up[:INTER], truth[f"blk.{i}.ffn_gate"], layer["ffn_gate"])
        check(gate_up[INTER:], truth[f"blk.{i}.ffn_up"], layer["ffn_up"])
        check(params[f"model.layers.{i}.mlp.down_proj.weight"].detach(), truth[f"blk.{i}.ffn_down"],
              layer["ffn_down"])


def test_low_bit_types_read_as_gguf_dequantizes(tmp_path):
    """Q2_K, Q3_K, the i-quants and the ternary types read as `gguf` dequantizes their bytes, which is what
    transformers' own torch dequantizers give where it has one; ternary weights quantized by `gguf` come
    back exactly."""
    from tokenmill.gguf_file import GGUFFile
    try:
        from transformers.integrations.gguf.dequant import GGML_BLOCK, dequantize as hf_dequantize
    except ImportError:     # transformers 4 dequantizes with `gguf` itself
        GGML_BLOCK = {}
    rng = np.random.default_rng(0)
    path = str(tmp_path / "low-bit.gguf")
    w = gguf.GGUFWriter(path, "llama")
    ternary = {}
    for qtype in (Q.Q2_K, Q.Q3_K, Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ4_NL,
                  Q.IQ4_XS):
        w.add_tensor(f"{qtype.name}.weight", _random_blocks(3, 512, qtype, rng), raw_dtype=qtype)
    for qtype in (Q.TQ1_0, Q.TQ2_0):
        ternary[qtype] = 0.25 * rng.integers(-1, 2, size=(3, 512)).astype(np.float32)
        w.add_tensor(f"{qtype.name}.weight", gguf.quants.quantize(ternary[qtype], qtype), raw_dtype=qtype)
    _finish(w)
    ours = GGUFFile(path)
    for t in gguf.GGUFReader(path).tensors:
        got = ours.read(t.name)
        want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(3, 512)
        assert got.shape == (3, 512) and torch.isfinite(got).all() and got.abs().max() > 0, t.name
        assert torch.equal(got, torch.from_numpy(np.array(want, dtype=np.float32))), t.name
        if int(t.tensor_type) in GGML_BLOCK:
            ref = hf_dequantize(torch.from_numpy(np.array(t.data)).reshape(-1), int(t.tensor_type))
            assert torch.equal(got, ref.reshape(3, 512)), t.name
        if t.tensor_type in ternary:
            assert torch.equal(got, torch.from_numpy(ternary[t.tensor_type])), t.name


def test_load_streams_one_tensor_at_a_time(small_file, monkeypatch):
    """Each tensor is dequantized only when its parameter is filled and freed before the next one is
    read: at most one dequantized tensor is alive during the load."""
    import weakref

    from tokenmill.runner import gguf_loader

    alive, peak, reads = [0], [0], [0]
    real_read = gguf_loader.GGUFFile.read

    def read(self, name):
        t = real_read(self, name)
        alive[0] += 1
        reads[0] += 1
        peak[0] = max(peak[0], alive[0])
        weakref.finalize(t, lambda: alive.__setitem__(0, alive[0] - 1))
        return t
    monkeypatch.setattr(gguf_loader.GGUFFile, "read", read)
    LLM(small_file, device="cpu", dtype="float32", num_kv_blocks=8)
    assert reads[0] == len(gguf.GGUFReader(small_file).tensors)
    assert peak[0] == 1


def test_unpermute_inverts_llama_cpp_order():
    w = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(16, 3)
    stored = torch.from_numpy(_permute(w.numpy(), 2))
    assert not torch.equal(stored, w)
    assert torch.equal(unpermute_rows(stored, 2), w)
    # within a head, stored rows 2i, 2i+1 are Hugging Face rows i and i + head_dim/2
    assert torch.equal(stored[:2], w[[0, 4]])


def test_greedy_equals_transformers(loaded):
    """Greedy tokens with chunked prefill and a small block size: at every generated position the
    token is transformers' argmax over prompt + the tokens generated so far."""
    _, _, llm, hf = loaded
    prompts = [[5, 17, 300, 42, 8, 99, 1000, 7, 3, 250, 31, 64, 12, 700, 901], [4000, 12, 9]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = prompt + out.outputs[0].token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0]
        assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == out.outputs[0].token_ids


def test_tokenizer_equals_the_original(loaded, tok_md):
    """The tokenizer built from GGUF metadata encodes, decodes and renders chats as the Hugging Face
    tokenizer it was written from (the bundled tiny model's)."""
    _, path, llm, _ = loaded
    ours = llm.get_tokenizer()
    original = Tokenizer(bundled_model_path())
    texts = ["Hello world! What's the capital of France?", "  two  spaces\n\n\ttab",
             "从前有一座山，山上有一座庙。", "emoji 🎉 and 12345 digits", "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>"]
    for text in texts:
        assert ours.encode(text) == original.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert ours.encode_chat(chat) == original.encode_chat(chat)
    assert ours.eos_token_ids == (2,) and ours.vocab_size == original.vocab_size
    assert plain_eos_ids(path) == ours.eos_token_ids
    text = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert text.prompt_token_ids == original.encode("Hello")


# ---- Llama 3.1/3.2: llama3 RoPE scaling as a rope_freqs tensor ------------------------------------------

# wavelengths 2*pi*theta^(2i/d) of 6 to 20,000 positions against 256 original ones: the frequencies
# above high_freq_factor stay, those below low_freq_factor are divided by factor, the rest are blended
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 8.0, "original_max_position_embeddings": 256}


# a Llama 3 chat template, in the shape of Meta's (header tokens, eot after each message)
LLAMA3_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                   "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
                   "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                   "<|eom_id|>"]


def llama3_tokenizer_metadata() -> dict:
    """The bundled tiny vocabulary and merges with Llama 3's special tokens after them, read with Llama 3's
    split (llama-bpe); EOS and EOT are <|eot_id|> and EOM is <|eom_id|>, as in a 3.1 Instruct file. "(len"
    is a token no merge reaches: only Llama 3's split (punctuation joins the letters after it) and its
    whole-piece lookup give it."""
    tok = tiny_tokenizer_metadata()
    n = len(tok["tokens"])
    tok.update(tokens=tok["tokens"] + LLAMA3_SPECIALS + ["(len"],
               types=tok["types"] + [3] * len(LLAMA3_SPECIALS) + [1],
               pre="llama-bpe", bos=n, eos=n + 4, eom=n + 5, template=LLAMA3_TEMPLATE)
    return tok


def llama3_checkpoint(directory, vocab: int):
    """A tiny LlamaForCausalLM with llama3 RoPE scaling, saved by transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      rms_norm_eps=1e-5, rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=False,
                      initializer_range=0.2)      # peaked attention, so that a wrong rotation shows
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(directory)
    return model


def add_tokenizer(w, tok: dict) -> None:
    """`tok` as llama.cpp's converters write it: a byte-level vocabulary (`llama3_tokenizer_metadata`'s) or,
    where its "model" is "llama", a SentencePiece one as they write Llama 2's and Mistral's: pieces, scores and
    types, and the merges, add_bos_token, add_eos_token, add_space_prefix and chat template where `tok` holds
    them (Llama 2's and Mistral's files hold no merges)."""
    if tok.get("model") == "llama":
        w.add_tokenizer_model("llama")
        w.add_token_list(tok["tokens"])
        w.add_token_scores(tok["scores"])
        w.add_token_types(tok["types"])
        w.add_bos_token_id(tok["bos"])
        w.add_eos_token_id(tok["eos"])
        w.add_unk_token_id(tok["unk"])
        for key, add in (("merges", w.add_token_merges), ("add_bos", w.add_add_bos_token),
                         ("add_eos", w.add_add_eos_token), ("add_space_prefix", w.add_add_space_prefix),
                         ("template", w.add_chat_template)):
            if key in tok:
                add(tok[key])
        return
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tok["pre"])
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    w.add_bos_token_id(tok["bos"])
    w.add_eos_token_id(tok["eos"])
    w.add_eot_token_id(tok["eos"])
    w.add_eom_token_id(tok["eom"])
    w.add_add_bos_token(True)
    w.add_chat_template(tok["template"])


def llama3_to_gguf(path: str, model, tok: dict, rope_freqs=None, arch: str = "llama",
                   metadata: dict | None = None) -> None:
    """The checkpoint as llama.cpp's converter writes it: q/k permuted (for smollm3 and granite too, converted
    as llama), no output.weight where the head is tied, and a llama3 scaling as rope_freqs.weight, unscaled
    over scaled inverse frequency (transformers' own inv_freq as the scaled); `metadata`: more keys, each a
    float32 or a bool. A phi3 checkpoint as its converter (Phi3MiniModel) writes one: q/k as they are, the
    fused attn_qkv and ffn_up (gate then up), the rotated dims int(partial_rotary_factor x hidden) / heads,
    the original context, the sliding window (0: none), and LongRoPE's factors as rope_factors_short/long
    with the attention factor it computes. `tok`: as `add_tokenizer` takes it."""
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    theta = cfg.rope_parameters["rope_theta"]
    rope_dims = int(cfg.rope_parameters.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // (
        cfg.num_attention_heads)
    if rope_freqs is None and cfg.rope_parameters["rope_type"] == "llama3":
        unscaled = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        rope_freqs = (unscaled / model.model.rotary_emb.inv_freq.double()).float().numpy()
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(rope_dims)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_tokenizer(w, tok)
    for key, value in (metadata or {}).items():
        (w.add_bool if isinstance(value, bool) else w.add_float32)(key, value)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    if arch == "phi3":
        rope = cfg.rope_parameters
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        w.add_sliding_window(cfg.sliding_window or 0)
        if rope["rope_type"] == "longrope":
            scale, original = cfg.max_position_embeddings / cfg.original_max_position_embeddings, (
                cfg.original_max_position_embeddings)
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
            w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
            w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
    for key, value in model.state_dict().items():
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        value = value.float().numpy()
        if key.startswith("model.layers."):
            i, rest = key[len("model.layers."):].split(".", 1)
            module, kind = rest.rsplit(".", 1)
            name = f"blk.{i}.{names[module]}.{kind}"
            if module in ("self_attn.q_proj", "self_attn.k_proj") and arch != "phi3":
                value = _permute(value, cfg.num_attention_heads if module == "self_attn.q_proj"
                                 else cfg.num_key_value_heads)
        else:
            name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                    "lm_head.weight": "output.weight"}[key]
        w.add_tensor(name, np.ascontiguousarray(value))
    _finish(w)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    tok = llama3_tokenizer_metadata()
    root = tmp_path_factory.mktemp("llama3")
    model = llama3_checkpoint(root / "hf", len(tok["tokens"]))
    path = str(root / "llama3.gguf")
    llama3_to_gguf(path, model, tok)
    llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=12)
    return model, path, tok, llm


def test_llama3_rope_freqs_equal_transformers(llama3):
    """A Llama 3.1-style GGUF (rope_freqs.weight) computes what transformers' LlamaForCausalLM computes
    with rope_scaling llama3 on the checkpoint it was converted from: the same prompt logprobs over
    chunked prefill, the same greedy tokens; without the divisors it would not."""
    from transformers import LlamaForCausalLM
    model, path, _, llm = llama3
    factors = np.asarray(ModelConfig.from_gguf(path).rope_scaling["freq_factors"])
    assert factors.min() == pytest.approx(1.0) and factors.max() == pytest.approx(8.0)
    assert ((factors > 1.01) & (factors < 7.99)).any()          # the blended band is exercised too
    prompt = [(37 * i + 11) % model.config.vocab_size for i in range(48)]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0))[0]
    ids = prompt + out.outputs[0].token_ids
    unscaled = LlamaForCausalLM.from_pretrained(os.path.dirname(path) + "/hf", rope_parameters={
        "rope_type": "default", "rope_theta": LLAMA3_ROPE["rope_theta"]}).eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].log_softmax(-1)
        plain = unscaled(torch.tensor([ids])).logits[0].log_softmax(-1)
    assert ref[len(prompt) - 1:-1].argmax(-1).tolist() == out.outputs[0].token_ids
    ours = torch.tensor([lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], prompt[1:])])
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    wrong = plain[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert torch.allclose(ours, want, atol=1e-4), (ours - want).abs().max()
    assert (wrong - want).abs().max() > 0.1


def test_llama3_rope_freqs_of_another_length_are_refused(llama3, tmp_path):
    model, _, tok, _ = llama3
    path = str(tmp_path / "short-freqs.gguf")
    llama3_to_gguf(path, model, tok, rope_freqs=np.ones(7, dtype=np.float32))
    with pytest.raises(ValueError, match=r"rope_freqs\.weight of shape \(7,\); it must hold one divisor per "
                                         r"rotary frequency, 8 for head_dim 16"):
        ModelConfig.from_gguf(path)


def test_llama3_tokenizer_equals_transformers(llama3, tmp_path):
    """llama-bpe reads as transformers' tokenizer of the same vocabulary and merges with Llama 3's split
    (the pattern of transformers' TikTokenConverter, which converts Meta's Llama 3 tokenizer) and Llama 3's
    tokenizer.json around it: whole-token lookup before merges, BOS <|begin_of_text|>; a chat renders the
    file's template with one BOS and stops on <|eot_id|> and <|eom_id|>."""
    import inspect

    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter
    _, path, tok, llm = llama3
    pattern = inspect.signature(TikTokenConverter.__init__).parameters["pattern"].default
    bos = LLAMA3_SPECIALS[0]

    def first(type_id):
        return {"SpecialToken": {"id": bos, "type_id": type_id}}

    def text(name, type_id):
        return {"Sequence": {"id": name, "type_id": type_id}}
    tj = {"version": "1.0", "truncation": None, "padding": None,
          "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                            "normalized": False, "special": True}
                           for i, t in enumerate(tok["tokens"]) if tok["types"][i] == 3],
          "normalizer": None,
          "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
              {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
              {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
          "post_processor": {"type": "TemplateProcessing", "single": [first(0), text("A", 0)],
                             "pair": [first(0), text("A", 0), first(1), text("B", 1)],
                             "special_tokens": {bos: {"id": bos, "ids": [tok["bos"]], "tokens": [bos]}}},
          "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
          "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                    "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                    "vocab": {t: i for i, t in enumerate(tok["tokens"])},
                    "merges": [m.split(" ", 1) for m in tok["merges"]]}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    ref = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), bos_token=bos)
    ours = llm.get_tokenizer()
    texts = ["Hello world! What's the capital of France?", "I'M sure they'RE here, we'll see; it'd do",
             "1 12 123 1234 12345678 3.14159 -42,000", "  two  spaces\n\n\ttab   \n  \r\n end  ",
             "从前有一座山，山上有一座庙。日本語のテキスト", "emoji 🎉🎉 and ÅÉÎ accents",
             "x" * 40 + "!!!???...", "def f(x):\n    return x**2  # sq",
             "print(len(items)); self.value=$HOME/.config", "<|eot_id|> in text <|begin_of_text|>", ""]
    for text in texts:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == bos + text
    assert ours.encode("1234567")[1:] == [ref.convert_tokens_to_ids(t) for t in ref.tokenize("1234567")]
    assert all(len(p) <= 3 for p in ref.tokenize("1234567"))          # digits split in threes
    chat = [{"role": "user", "content": "Hi there"}]
    ids = ours.encode_chat(chat)
    assert ids == ref.encode(ref.apply_chat_template(chat, chat_template=LLAMA3_TEMPLATE, tokenize=False,
                                                     add_generation_prompt=True, bos_token=bos),
                             add_special_tokens=False)
    assert ids.count(tok["bos"]) == 1
    assert tok["tokens"].index("(len") in ours.encode("print(len(items))")
    for stop in (tok["eos"], tok["eom"]):
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=5, logit_bias={stop: 100.0}))[0]
        assert out.outputs[0].token_ids == [stop] and out.outputs[0].finish_reason == "stop"


def _assert_served_as_transformers(path: str, model) -> None:
    """The GGUF file at `path`, served on the CPU (a prefill in chunks of 12), computes what transformers'
    `model`, the checkpoint it was converted from, computes: prompt logprobs within 1e-4, greedy tokens."""
    prompt = [(37 * i + 11) % model.config.vocab_size for i in range(48)]
    llm = LLM(path, device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=12)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0))[0]
    with torch.no_grad():
        ref = model(torch.tensor([prompt + out.outputs[0].token_ids])).logits[0].log_softmax(-1)
    assert ref[len(prompt) - 1:-1].argmax(-1).tolist() == out.outputs[0].token_ids
    ours = torch.tensor([lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], prompt[1:])])
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert torch.allclose(ours, want, atol=1e-4), (ours - want).abs().max()


def test_smollm3_leaves_rope_out_of_every_fourth_layer(tmp_path):
    """llama.cpp's smollm3 file (q/k permuted as llama's, tied head, no key for the NoPE layers: llama.cpp
    fixes them at every 4th) computes what transformers' SmolLM3 computes on the checkpoint it was converted
    from, whose default no_rope_layers is that pattern: prompt logprobs over a chunked prefill, greedy tokens."""
    from transformers import SmolLM3Config, SmolLM3ForCausalLM
    tok = llama3_tokenizer_metadata()
    torch.manual_seed(0)
    model = SmolLM3ForCausalLM(SmolLM3Config(
        vocab_size=len(tok["tokens"]), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=1e4,
        bos_token_id=tok["bos"], eos_token_id=tok["eos"], pad_token_id=None, initializer_range=0.2)).eval()
    assert model.config.no_rope_layers == [1, 1, 1, 0]
    path = str(tmp_path / "smollm3.gguf")
    llama3_to_gguf(path, model, tok, arch="smollm3")
    cfg = ModelConfig.from_gguf(path)
    assert (cfg.architecture, cfg.rope_layers, cfg.tie_word_embeddings) == (
        "SmolLM3ForCausalLM", (True, True, True, False), True)
    _assert_served_as_transformers(path, model)


def test_granite_reads_its_four_scales(tmp_path):
    """llama.cpp's granite file (q/k permuted as llama's, tied head, Granite's scalars as
    granite.embedding_scale, residual_scale, attention.scale and logit_scale) computes what transformers'
    Granite computes on the checkpoint it was converted from: prompt logprobs over a chunked prefill, greedy
    tokens. A scalar's key left out changes nothing, as llama.cpp reads it (the softmax scale 1/sqrt(head_dim));
    rope.scaling.finetuned false (no RoPE, in llama.cpp) is refused."""
    from transformers import GraniteConfig, GraniteForCausalLM
    tok = llama3_tokenizer_metadata()
    scales = dict(embedding_multiplier=12.0, residual_multiplier=0.25, attention_multiplier=0.0625, logits_scaling=4.0)
    torch.manual_seed(0)
    model = GraniteForCausalLM(GraniteConfig(
        vocab_size=len(tok["tokens"]), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=1e4,
        bos_token_id=tok["bos"], eos_token_id=tok["eos"], pad_token_id=None, tie_word_embeddings=True,
        initializer_range=0.2, **scales)).eval()
    keys = {"embedding_multiplier": "granite.embedding_scale", "residual_multiplier": "granite.residual_scale",
            "attention_multiplier": "granite.attention.scale", "logits_scaling": "granite.logit_scale"}
    path = str(tmp_path / "granite.gguf")
    llama3_to_gguf(path, model, tok, arch="granite", metadata={keys[k]: v for k, v in scales.items()})
    cfg = ModelConfig.from_gguf(path)
    assert (cfg.architecture, cfg.tie_word_embeddings, cfg.embedding_multiplier, cfg.residual_multiplier,
            cfg.attention_scale, cfg.logits_scaling) == ("GraniteForCausalLM", True, *scales.values())
    _assert_served_as_transformers(path, model)
    bare = str(tmp_path / "bare.gguf")
    llama3_to_gguf(bare, model, tok, arch="granite")
    cfg = ModelConfig.from_gguf(bare)
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_scale, cfg.logits_scaling) == (
        1.0, 1.0, 16 ** -0.5, 1.0)
    no_rope = str(tmp_path / "no-rope.gguf")
    llama3_to_gguf(no_rope, model, tok, arch="granite", metadata={"granite.rope.scaling.finetuned": False})
    with pytest.raises(ValueError, match=r"granite\.rope\.scaling\.finetuned=false, which llama\.cpp reads as no "
                                         r"RoPE in any layer"):
        ModelConfig.from_gguf(no_rope)


# the metadata `ModelConfig.from_gguf` reads, of a llama with no tensors
CONFIG_METADATA = {"llama.context_length": 2048, "llama.embedding_length": HIDDEN, "llama.feed_forward_length": INTER,
                   "llama.block_count": LAYERS, "llama.attention.head_count": HEADS,
                   "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": 300}


def test_phi3_reads_fused_tensors_partial_rotary_and_longrope(tmp_path):
    """llama.cpp's phi3 file of a Phi-4-mini-shaped checkpoint (fused attn_qkv and ffn_up, 12 of 16 dims
    rotating, LongRoPE's factors as tensors, tied head, a window past the context) computes what transformers'
    Phi3 computes on the checkpoint it was converted from: prompt logprobs over a chunked prefill, greedy tokens,
    at the file's context of 256, past the original 32 (both take the long factors over the 56 tokens)."""
    from transformers import Phi3Config, Phi3ForCausalLM
    tok = llama3_tokenizer_metadata()
    short, long = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5], [2.0, 3.0, 4.5, 6.0, 8.0, 9.5]
    torch.manual_seed(0)
    model = Phi3ForCausalLM(Phi3Config(
        vocab_size=len(tok["tokens"]), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        original_max_position_embeddings=32, partial_rotary_factor=0.75, sliding_window=1024,
        tie_word_embeddings=True, bos_token_id=tok["bos"], eos_token_id=tok["eos"], pad_token_id=None,
        initializer_range=0.2,
        rope_parameters={"rope_type": "longrope", "short_factor": short, "long_factor": long,
                         "rope_theta": 1e4})).eval()
    path = str(tmp_path / "phi3.gguf")
    llama3_to_gguf(path, model, tok, arch="phi3")
    cfg = ModelConfig.from_gguf(path)
    assert (cfg.architecture, cfg.rotary_dim, cfg.sliding_window, cfg.tie_word_embeddings) == (
        "Phi3ForCausalLM", 12, 1024, True)
    s = cfg.rope_scaling
    assert (s["rope_type"], s["original_max_position_embeddings"], s["factor"]) == ("longrope", 32, 8.0)
    assert s["short_factor"] == pytest.approx(short) and s["long_factor"] == pytest.approx(long)
    assert s["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(8) / math.log(32)))
    _assert_served_as_transformers(path, model)


def _metadata_file(path: str, values: dict) -> str:
    """A tensorless llama GGUF file holding `CONFIG_METADATA` with `values` over it (each written as a
    uint32, float32, bool, string or array by its Python type)."""
    w = gguf.GGUFWriter(path, "llama")
    for key, value in {**CONFIG_METADATA, **values}.items():
        add = {str: w.add_string, list: w.add_array, float: w.add_float32, bool: w.add_bool}.get(type(value),
                                                                                                 w.add_uint32)
        add(key, value)
    _finish(w)
    return path


def test_an_engine_core_starts_on_a_gguf_without_its_tokenizer(small_file):
    """The engine reads a GGUF tokenizer's EOS id from the metadata (`plain_eos_ids`), so a served engine core,
    whose frontend tokenizes, starts without building the tokenizer; the id is the built tokenizer's."""
    from tokenmill.config import EngineConfig
    from tokenmill.engine.engine import LLMEngine
    engine = LLMEngine(EngineConfig(model=small_file, device="cpu", num_kv_blocks=8))
    assert engine._tokenizer is None
    assert engine.tokenizer.eos_token_ids == (2,) and 2 in engine.eos_token_ids


def test_eos_eot_and_eom_are_stop_ids(tmp_path):
    """Llama 3.1 files name <|eom_id|> (the end of a turn that called a tool) beside EOS and EOT; each of
    the three a file names stops generation, as in llama.cpp."""
    path = _metadata_file(str(tmp_path / "stops.gguf"), {"tokenizer.ggml.eos_token_id": 128001,
                                                        "tokenizer.ggml.eot_token_id": 128009,
                                                        "tokenizer.ggml.eom_token_id": 128008})
    assert ModelConfig.from_gguf(path).eos_token_ids == (128001, 128009, 128008)
    path = _metadata_file(str(tmp_path / "eos.gguf"), {"tokenizer.ggml.eos_token_id": 2})
    assert ModelConfig.from_gguf(path).eos_token_ids == (2,)


# ---- broken files ------------------------------------------------------------------------------------

@pytest.mark.parametrize("key, value, held, expected", [
    ("llama.context_length", "2048", "'2048', a string", "an integer"),
    ("llama.context_length", "8k", "'8k', a string", "an integer"),
    ("llama.context_length", 2048.0, "2048.0, a float", "an integer"),
    ("llama.block_count", True, "True, a bool", "an integer"),
    ("llama.attention.head_count_kv", [2, 2, 4, 4, 2], r"\[2, 2, 4, 4\]\.\.\., an array", "an integer"),
    ("llama.attention.layer_norm_rms_epsilon", "1e-5", "'1e-5', a string", "a float"),
    ("llama.rope.scaling.type", 1, "1, an integer", "a string"),
    ("tokenizer.ggml.eos_token_id", "2", "'2', a string", "an integer"),
])
def test_wrongly_typed_metadata_is_named(tmp_path, key, value, held, expected):
    """A metadata value of the wrong type was converted where it could be ("2048" read as 2048) and failed
    with Python's own "invalid literal for int()" where not, naming no key; it is refused naming the key,
    what it holds and what was expected."""
    path = _metadata_file(str(tmp_path / "typed.gguf"), {key: value})
    with pytest.raises(ValueError, match=rf"typed\.gguf' has metadata {re.escape(key)} = {held}; tokenmill "
                                         rf"expects one value there, {expected}"):
        ModelConfig.from_gguf(path)


def test_an_integer_reads_as_a_float(tmp_path):
    path = _metadata_file(str(tmp_path / "theta.gguf"), {"llama.rope.freq_base": 500000})
    cfg = ModelConfig.from_gguf(path)
    assert cfg.rope_theta == 500000.0 and cfg.max_position_embeddings == 2048 and cfg.head_dim == HIDDEN // HEADS


def test_partial_rotary_outside_phi3_is_refused(tmp_path):
    """A llama file rotates in interleaved pairs (its q/k permuted for them): part of a head rotating is read
    in phi3 files alone, whose rotate-half layout the partial-rotary order serves."""
    path = _metadata_file(str(tmp_path / "partial.gguf"), {"llama.rope.dimension_count": HIDDEN // HEADS // 2})
    with pytest.raises(ValueError, match=rf"llama\.rope\.dimension_count={HIDDEN // HEADS // 2} rotates part of "
                                         rf"head_dim={HIDDEN // HEADS}; tokenmill rotates part of a head in phi3 "
                                         r"files only"):
        ModelConfig.from_gguf(path)


def test_yarn_metadata_reads_as_config_jsons_rope_scaling(tmp_path):
    """llama.cpp's converter writes YaRN's rope_scaling as rope.scaling.* keys; they were refused ("supported:
    none, linear"). They read back as that dict, the YaRN context (original x factor) past context_length."""
    yarn = {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
            "llama.rope.scaling.original_context_length": 1024, "llama.rope.scaling.yarn_beta_fast": 16.0}
    cfg = ModelConfig.from_gguf(_metadata_file(str(tmp_path / "yarn.gguf"), yarn))
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                                "beta_fast": 16.0}
    assert cfg.max_position_embeddings == 2048 and cfg.derived_max_model_len == 4096


@pytest.mark.parametrize("drop, extra, message", [
    ("llama.rope.scaling.original_context_length", {}, r"has llama\.rope\.scaling\.type='yarn' but lacks "
                                                       r"llama\.rope\.scaling\.original_context_length, which YaRN "
                                                       r"needs \(original_max_position_embeddings\)"),
    (None, {"llama.rope.scaling.yarn_log_multiplier": 0.1}, r"has llama\.rope\.scaling\.yarn_log_multiplier="
                                                            r"0\.1.*; tokenmill's YaRN \(transformers'\) has no such "
                                                            r"setting and reads it only at 0\.0"),
])
def test_yarn_metadata_that_cannot_be_read_is_named(tmp_path, drop, extra, message):
    values = {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
              "llama.rope.scaling.original_context_length": 1024, **extra}
    values.pop(drop, None)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_gguf(_metadata_file(str(tmp_path / "yarn.gguf"), values))


@pytest.fixture(scope="module")
def small_file(tok_md, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("broken") / "small.gguf")
    write_gguf(path, "qwen3", tok_md)
    return path


@pytest.mark.parametrize("fraction", [0.0001, 0.3, 0.999])
def test_truncated_file_is_named(small_file, tmp_path, fraction):
    data = open(small_file, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:max(8, int(len(data) * fraction))])
    with pytest.raises(ValueError, match=r"truncated") as e:
        LLM(str(cut), device="cpu", dtype="float32", num_kv_blocks=8)
    assert "cut.gguf" in str(e.value)


def test_unknown_type_id_is_named(tmp_path):
    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("zzzz.weight", np.zeros((4, 32), np.float32))
    _finish(w)
    data = bytearray(path.read_bytes())
    at = data.index(b"zzzz.weight") + len("zzzz.weight") + 4 + 2 * 8   # name, n_dims, two dims: the type
    assert data[at:at + 4] == (0).to_bytes(4, "little")
    data[at:at + 4] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"unknown GGML type id 99"):
        ModelConfig.from_gguf(str(path))


def test_duplicated_tensor_is_refused(tmp_path):
    path = tmp_path / "twice.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("aaaa.weight", np.zeros((4, 32), np.float32))
    w.add_tensor("bbbb.weight", np.ones((4, 32), np.float32))
    _finish(w)
    path.write_bytes(path.read_bytes().replace(b"bbbb.weight", b"aaaa.weight"))
    with pytest.raises(ValueError, match=r"twice\.gguf.*tensor 'aaaa\.weight' appears twice"):
        ModelConfig.from_gguf(str(path))


def test_unsupported_type_is_named(tmp_path):
    path = str(tmp_path / "mxfp4.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor("blk.0.attn_q.weight", np.zeros((4, 17), np.uint8), raw_dtype=Q.MXFP4)
    _finish(w)
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_q\.weight' .* type MXFP4; tokenmill dequantizes F32"):
        LLM(path, device="cpu", dtype="float32", num_kv_blocks=8)


def test_a_row_of_partial_blocks_is_named(tmp_path):
    """A Q8_0 row of 48 values (one and a half 32-value blocks) was opened as if whole blocks and failed on
    its first read inside `gguf`, naming neither the tensor nor the file."""
    path = tmp_path / "rows.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(np.zeros((4, 64), np.float32), Q.Q8_0), raw_dtype=Q.Q8_0)
    _finish(w)
    data = bytearray(path.read_bytes())
    at = data.index(b"blk.0.attn_q.weight") + len("blk.0.attn_q.weight") + 4    # name, n_dims: the row size
    assert data[at:at + 8] == (64).to_bytes(8, "little")
    data[at:at + 8] = (48).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_q\.weight' in .*rows\.gguf' has rows of 48 values, not a "
                                         r"multiple of the 32-value blocks of its type Q8_0"):
        ModelConfig.from_gguf(str(path))


def test_unknown_architecture_is_named(tmp_path):
    path = str(tmp_path / "gemma.gguf")
    w = gguf.GGUFWriter(path, "gemma")
    w.add_block_count(1)
    _finish(w)
    with pytest.raises(ValueError, match=r"architecture 'gemma'; tokenmill supports llama, qwen2, qwen3"):
        LLM(path, device="cpu", dtype="float32", num_kv_blocks=8)
    # an architecture of another GGUF type (an array) is named too, not an unhashable-type TypeError
    from tokenmill.gguf_file import GGUFFile
    f = GGUFFile(path)
    f.metadata["general.architecture"] = ["llama"]
    with pytest.raises(ValueError, match=r"architecture \['llama'\]; tokenmill supports"):
        f.architecture


def test_leftover_and_missing_tensors_are_named(tok_md, tmp_path):
    path = str(tmp_path / "renamed.gguf")
    write_gguf(path, "qwen3", tok_md, rename={"blk.0.ffn_up.weight": "blk.0.ffn_upp.weight"})
    with pytest.raises(ValueError, match=r"not used by Qwen3ForCausalLM: \['blk\.0\.ffn_upp\.weight'\]"):
        LLM(path, device="cpu", dtype="float32", num_kv_blocks=8)
    path = str(tmp_path / "dropped.gguf")
    write_gguf(path, "qwen3", tok_md, drop={"blk.1.ffn_up.weight"})
    with pytest.raises(ValueError, match=r"missing from the checkpoint .*dropped\.gguf.*layers\.1\.mlp\.gate_up_proj"):
        LLM(path, device="cpu", dtype="float32", num_kv_blocks=8)


def test_header_reads_as_the_gguf_packages_reader_does(tmp_path):
    """`GGUFFile` parses the header itself: every metadata value type (integers of each width, floats,
    bools, strings, arrays of numbers and of strings) and the tensors' shapes, types and offsets equal what
    gguf's own reader finds, and a tensor reads as the reader's bytes dequantize."""
    from tokenmill.gguf_file import GGUFFile
    path = str(tmp_path / "all.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for add, value in ((w.add_uint8, 200), (w.add_int8, -100), (w.add_uint16, 60000), (w.add_int16, -30000),
                       (w.add_uint32, 4_000_000_000), (w.add_int32, -2_000_000_000), (w.add_float32, 0.1),
                       (w.add_uint64, 2 ** 60), (w.add_int64, -(2 ** 60)), (w.add_float64, 0.1), (w.add_bool, True),
                       (w.add_string, "naïve ☕"), (w.add_array, [3, 1, 4]), (w.add_array, [0.5, -2.25]),
                       (w.add_array, ["a", "", "☕ b"])):
        add(f"t.{add.__name__}.{len(str(value))}", value)
    w.add_tensor("a.weight", np.arange(6 * 32, dtype=np.float32).reshape(6, 32))
    w.add_tensor("b.weight", np.ones((3, 64), np.float16))
    w.add_tensor("c.weight", gguf.quants.quantize(np.linspace(-1, 1, 4 * 64, dtype=np.float32).reshape(4, 64),
                                                  Q.Q8_0), raw_dtype=Q.Q8_0)
    _finish(w)
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    expected = {}
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            parts = [field.parts[i] for i in field.data]
            expected[key] = [bytes(p).decode() if field.types[-1] == gguf.GGUFValueType.STRING else p.tolist()[0]
                             for p in parts]
        elif field.types[0] == gguf.GGUFValueType.STRING:
            expected[key] = bytes(field.parts[field.data[0]]).decode()
        else:
            expected[key] = field.parts[field.data[0]].tolist()[0]
    assert ours.metadata == expected and len(expected) == 16         # general.architecture and the 15 above
    assert [type(ours.metadata[k]) for k in expected] == [type(v) for v in expected.values()]
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert (mine.shape, mine.tensor_type, mine.offset, mine.n_bytes) == \
            (tuple(t.shape.tolist()), t.tensor_type, int(t.data_offset), int(t.n_bytes))
        want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        assert torch.equal(ours.read(t.name), torch.from_numpy(np.array(want, dtype=np.float32)))


def test_alignment_not_a_power_of_two_is_named(tmp_path):
    path = tmp_path / "align.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    w.add_tensor("aaaa.weight", np.zeros((4, 32), np.float32))
    _finish(w)
    data = bytearray(path.read_bytes())
    at = data.index(b"general.alignment") + len(b"general.alignment") + 4     # past the value's type
    data[at:at + 4] = (0).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"general.alignment 0 is not a power of two"):
        ModelConfig.from_gguf(str(path))


def _bpe_metadata(pre: str | None, extra_tokens: list[str], merges: list[str]) -> dict:
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    tokens = list(bytes_to_unicode().values()) + extra_tokens
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
          "tokenizer.ggml.bos_token_id": len(tokens) - 1}
    if pre is not None:
        md["tokenizer.ggml.pre"] = pre
    return md


def test_each_pre_tokenizer_brings_what_its_tokenizer_json_did():
    """Llama 3 looks a piece up whole before merging (`ignore_merges`: "abc" is one token though the
    merges reach only a + bc) and adds BOS where the file does not say; Qwen2 composes text (NFC) first;
    a file naming no split is refused, not read with GPT-2's."""
    import unicodedata

    from tokenmill.engine.gguf_tokenizer import build_gguf_tokenizer
    extra, merges = ["bc", "ab", "abc", "<s>"], ["b c", "a b"]
    llama3 = build_gguf_tokenizer(_bpe_metadata("llama-bpe", extra, merges))
    gpt2 = build_gguf_tokenizer(_bpe_metadata("gpt-2", extra, merges))
    assert llama3.convert_ids_to_tokens(llama3.encode("abc")) == ["<s>", "abc"]
    assert gpt2.convert_ids_to_tokens(gpt2.encode("abc")) == ["a", "bc"]
    md = _bpe_metadata("qwen2", ["Ã©"], ["Ã ©"])
    qwen2 = build_gguf_tokenizer(md)
    assert qwen2.encode(unicodedata.normalize("NFD", "é")) == qwen2.encode("é") == [md["tokenizer.ggml.tokens"].index("Ã©")]
    for pre in (None, "default"):
        with pytest.raises(ValueError, match="how its text is split before BPE is unknown"):
            build_gguf_tokenizer(_bpe_metadata(pre, extra, merges))


def test_bos_and_eos_are_added_as_the_file_says(tmp_path):
    """`tokenizer.ggml.add_bos_token` and `add_eos_token` put BOS before and EOS after each text, as
    transformers' GGUF reader (and llama.cpp) add them."""
    from transformers import AutoTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    tokens = [*bytes_to_unicode().values(), "Ġh", "Ġhe", "<s>", "</s>"]
    bos, eos = len(tokens) - 2, len(tokens) - 1
    for add_bos, add_eos in ((False, True), (True, True), (True, False)):
        path = tmp_path / f"bos{add_bos:d}-eos{add_eos:d}.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(tokens)
        w.add_token_types([1] * (len(tokens) - 2) + [3, 3])
        w.add_token_merges(["Ġ h", "Ġh e"])
        w.add_bos_token_id(bos)
        w.add_eos_token_id(eos)
        w.add_add_bos_token(add_bos)
        w.add_add_eos_token(add_eos)
        _finish(w)
        ours = Tokenizer(str(path))
        ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
        assert ours.encode(" he") == [bos] * add_bos + [tokens.index("Ġhe")] + [eos] * add_eos
        for text in [" he he", ""]:
            assert ours.encode(text) == ref.encode(text), (add_bos, add_eos, text)


def test_gpt4o_falcon3_refact_and_starcoder_splits():
    """llama.cpp's gpt-4o (Phi-4-mini's o200k vocabulary) splits letters at a case change, keeps a contraction on
    its word and digits in threes, where Llama 3's split keeps "HelloWorld" whole and cuts "'s" off; it looks
    nothing up whole before merging and adds no BOS unless the file says. falcon3 is read as Llama 3's."""
    from tokenmill.engine.gguf_tokenizer import build_gguf_tokenizer
    extra, merges = ["bc", "ab", "abc", "<s>"], ["b c", "a b"]
    pieces = {}
    for pre in ("gpt-4o", "llama-bpe", "falcon3"):
        tok = build_gguf_tokenizer(_bpe_metadata(pre, extra, merges))
        split = tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str("HelloWorld it's 12345 x\n/y")
        pieces[pre] = [p for p, _ in split]
        pieces[pre, "abc"] = tok.convert_ids_to_tokens(tok.encode("abc"))
    assert pieces["gpt-4o"] == ["Hello", "World", "Ġit's", "Ġ", "123", "45", "Ġx", "Ċ", "/y"]
    assert pieces["llama-bpe"][:4] == ["HelloWorld", "Ġit", "'s", "Ġ"]
    assert pieces["gpt-4o", "abc"] == ["a", "bc"]
    assert pieces["falcon3"] == pieces["llama-bpe"] and pieces["falcon3", "abc"] == ["<s>", "abc"]
    # refact and starcoder (StarCoder-lineage vocabularies) split as smollm: every digit alone
    splits = {pre: build_gguf_tokenizer(_bpe_metadata(pre, extra, merges)).backend_tokenizer.pre_tokenizer
              .pre_tokenize_str("a 123") for pre in ("smollm", "refact", "starcoder")}
    assert [p for p, _ in splits["refact"]] == ["a", "Ġ", "1", "2", "3"]
    assert splits["refact"] == splits["starcoder"] == splits["smollm"]


@pytest.mark.parametrize("pre", ["gpt-2", "smollm", "qwen2", "llama-bpe", "gpt-4o", "falcon3", "refact"])
def test_add_space_prefix_leaves_byte_level_text_alone(pre):
    """`tokenizer.ggml.add_space_prefix` is SentencePiece's: llama.cpp and transformers' GGUF reader
    ignore it for byte-level BPE, so a file that sets it encodes as one that does not (it once put a space
    before every split piece: "a,b 12" read as " a ,b  1 2")."""
    from tokenmill.engine.gguf_tokenizer import build_gguf_tokenizer
    md = {**_bpe_metadata(pre, ["ab"], ["a b"]), "tokenizer.ggml.add_bos_token": False}
    plain = build_gguf_tokenizer(md)
    flagged = build_gguf_tokenizer({**md, "tokenizer.ggml.add_space_prefix": True})
    for text in ["a,b 12\n", " ab", ""]:
        assert flagged.encode(text) == plain.encode(text), text
        assert flagged.decode(flagged.encode(text)) == text
