"""gemma2 and gemma3 GGUF files, written here as llama.cpp's converter (convert_hf_to_gguf.py's Gemma2Model and
Gemma3Model) writes them from a tiny random checkpoint saved by transformers: every norm weight with Gemma's 1 added,
the tensor names of gguf's own TensorNameMap, no lm_head, the soft caps, window, RoPE bases and scaling as metadata
keys, and a SentencePiece vocabulary of Gemma's kind. Each is served with the logprobs and greedy tokens of the same
checkpoint served from safetensors and of transformers on it; its tokenizer is transformers' GGUF reader's; the
metadata llama.cpp's converter writes from the released models' config.json reads as that config.json does; what
cannot be served is refused, naming it."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

gguf = pytest.importorskip("gguf")

from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig  # noqa: E402

from tokenmill import LLM, SamplingParams                      # noqa: E402
from tokenmill.config import ModelConfig                       # noqa: E402
from tokenmill.engine.tokenizer import Tokenizer, plain_eos_ids  # noqa: E402

from served_sequence import sequence_logprobs, transformers_logprobs  # noqa: E402
from test_gguf import _finish, add_tokenizer                   # noqa: E402
from test_gguf_sentencepiece import TEXTS, sentencepiece_vocab  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Gemma's chat template, shortened: each turn between <start_of_turn> and <end_of_turn>
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else "
            "m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}"
            "<start_of_turn>model\n{% endif %}")
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
END_OF_TURN = SPECIALS.index("<end_of_turn>")


def gemma_vocab() -> dict:
    """`sentencepiece_vocab`'s pieces behind Gemma's special tokens, laid out as llama.cpp's converter writes
    Gemma's: the pieces of spaces alone, user-defined in Gemma's tokenizer, written in spaces (scored -1000, as
    every added token), a user-defined "\\n\\n", no merges, BOS added and no space before the text."""
    spm = sentencepiece_vocab()
    pieces = spm["tokens"][3:]           # without <unk> <s> </s>
    spaces = [len(t) > 1 and set(t) == {"\u2581"} for t in pieces]
    tokens = SPECIALS + [" " * len(t) if s else t for t, s in zip(pieces, spaces)] + ["\n\n"]
    types = [3, 3, 3, 2, 3, 3, 3] + [4 if s else k for k, s in zip(spm["types"][3:], spaces)] + [4]
    scores = [0.0] * len(SPECIALS) + [-1000.0 if s else x for x, s in zip(spm["scores"][3:], spaces)] + [-1000.0]
    return dict(model="llama", tokens=tokens, types=types, scores=scores, bos=2, eos=1, unk=3, add_bos=True,
                add_eos=False, add_space_prefix=False, template=TEMPLATE)


VOCAB = len(gemma_vocab()["tokens"])
SIZES = dict(vocab_size=VOCAB, hidden_size=72, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=256, sliding_window=16, bos_token_id=2, eos_token_id=1,
             pad_token_id=0)
# query_pre_attn_scalar = head_dim, as in every released model but the 27B ones (the file holds none: llama.cpp
# scales by head_dim there); gemma2's caps of 2 and 3 bite with initializer_range 0.1 (test_gemma2.py); gemma3's six
# layers are llama.cpp's fixed pattern once, five sliding then one full, its full layer on gemma-3-4b's linear
# scaling, its sliding ones on a base of their own
CHECKPOINTS = {
    "gemma2": lambda: Gemma2ForCausalLM(Gemma2Config(
        **SIZES, num_hidden_layers=4, query_pre_attn_scalar=16, attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0, initializer_range=0.1)),
    "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        **SIZES, num_hidden_layers=6, query_pre_attn_scalar=16, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e4},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})),
}
PROMPT = [(37 * i + 11) % VOCAB for i in range(100)]
# the prompt's logprobs over a prefill chunked by 32 tokens, then 20 greedy tokens with theirs: 120 tokens, past the
# sliding layers' window of 16
PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0, prompt_logprobs=0)


def gemma_to_gguf(path: str, model, tok: dict, arch: str) -> None:
    """The checkpoint as llama.cpp's converter writes it: Gemma2Model's keys (the caps and the window; no RoPE base,
    llama.cpp's 10,000) or Gemma3Model's (the full layers' RoPE base and linear scaling, the sliding layers' base as
    rope.freq_base_swa, the window), the tensors under gguf's names for the architecture with 1 added to every
    norm's weight, no lm_head (the head is the embedding), all in F32."""
    cfg = model.config
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        full, local = cfg.rope_parameters["full_attention"], cfg.rope_parameters["sliding_attention"]
        if full["rope_type"] == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        w.add_rope_freq_base(full["rope_theta"])
        w.add_rope_freq_base_swa(local["rope_theta"])
    w.add_sliding_window(cfg.sliding_window)
    add_tokenizer(w, tok)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA2 if arch == "gemma2" else gguf.MODEL_ARCH.GEMMA3,
                                     cfg.num_hidden_layers)
    for key, value in model.state_dict().items():
        if key == "lm_head.weight":
            continue
        module, kind = key.rsplit(".", 1)
        value = value.float() + 1 if key.endswith("norm.weight") else value.float()
        w.add_tensor(f"{names.get_name(module)}.{kind}", value.numpy())
    _finish(w)


# what a Gemma config's reading sets, compared between a file's and its checkpoint's
_FEATURES = ("architecture", "sliding_layers", "sliding_window", "local_rope_theta", "rope_theta", "attention_scale",
             "attn_logit_softcapping", "final_logit_softcapping", "qk_norm", "post_norms", "hidden_act",
             "embedding_multiplier", "embedding_multiplier_in_dtype", "tie_word_embeddings", "hidden_size",
             "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
             "max_position_embeddings")


def _features(cfg: ModelConfig) -> dict:
    scaling = cfg.rope_scaling or {}
    return {**{f: getattr(cfg, f) for f in _FEATURES}, "rope_scaling": (scaling.get("rope_type"),
                                                                        scaling.get("factor"))}


def _served(path: str, **engine_args):
    llm = LLM(path, device="cpu", dtype="float32", max_num_batched_tokens=32, **engine_args)
    return (llm, *sequence_logprobs(llm.generate([PROMPT], PARAMS)[0], PROMPT))


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def converted(request, tmp_path_factory):
    """(architecture, checkpoint directory, GGUF file) of one tiny checkpoint with random norm weights."""
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    torch.manual_seed(0)
    model = CHECKPOINTS[arch]()
    with torch.no_grad():           # transformers initialises the norms 0: a norm times 1 + 0
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.5)
    model.save_pretrained(root / "hf")
    gemma_to_gguf(str(root / f"{arch}.gguf"), model, gemma_vocab(), arch)
    return arch, str(root / "hf"), str(root / f"{arch}.gguf")


def test_gguf_serves_what_its_checkpoint_serves(converted):
    """The file's prompt logprobs over a chunked prefill, greedy tokens and their logprobs: the safetensors
    checkpoint's served by tokenmill, and transformers' on that checkpoint (eager attention for gemma2, whose sdpa
    cannot cap), within 1e-4; the config read from the metadata is the checkpoint's, but for the norms' offset,
    which the file's weights already hold."""
    arch, hf_dir, path = converted
    llm, tokens, ours = _served(path)
    hf_llm, hf_tokens, hf_ours = _served(hf_dir)
    assert tokens == hf_tokens
    assert torch.allclose(ours, hf_ours, atol=1e-4), (ours - hf_ours).abs().max()
    want = transformers_logprobs(hf_dir, PROMPT, tokens, **({"attn_implementation": "eager"} if arch == "gemma2"
                                                               else {}))
    assert torch.allclose(ours, want, atol=1e-4), (ours - want).abs().max()
    cfg, hf_cfg = llm.engine.runner.model.config, hf_llm.engine.runner.model.config
    assert _features(cfg) == _features(hf_cfg)
    assert (cfg.norm_unit_offset, hf_cfg.norm_unit_offset) == (False, True)
    assert cfg.sliding_layers == ((True, False) * 2 if arch == "gemma2" else (True,) * 5 + (False,))
    # <eos> and, as llama.cpp finds it by its text, <end_of_turn>
    assert llm.engine.eos_token_ids == {1, END_OF_TURN}


def test_gemma_tokenizer_is_transformers_gguf_readers(converted):
    """The file's tokenizer is the one transformers' GGUF reader builds (its GemmaTokenizer): the same tokenizer
    JSON (vocabulary with the pieces of spaces in U+2581, merges ranked by position, normalizer, decoder, BOS
    template, special and added tokens), encoding and decoding alike; a chat renders the file's template with one
    BOS, and generation stops at <end_of_turn>."""
    from transformers import AutoTokenizer
    _, _, path = converted
    ours = Tokenizer(path)
    ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    assert plain_eos_ids(path) == ours.eos_token_ids == (ref.eos_token_id,)
    assert json.loads(ours.hf.backend_tokenizer.to_str()) == json.loads(ref.backend_tokenizer.to_str())
    for text in [*TEXTS, "a\n\nb  c", "<start_of_turn>user\nHi<end_of_turn>"]:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert ours.convert_ids_to_tokens(ours.encode("a  b", add_special_tokens=False)) == ["a", "\u2581\u2581", "b"]
    llm = LLM(path, device="cpu", dtype="float32", max_num_batched_tokens=32)
    chat = [{"role": "user", "content": "Hello world!"}]
    out = llm.chat(chat, SamplingParams(temperature=0, max_tokens=5, logit_bias={END_OF_TURN: 100.0}))[0]
    assert out.prompt_token_ids == ref.encode(ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
                                              add_special_tokens=False)
    assert out.prompt_token_ids[:2] == [2, SPECIALS.index("<start_of_turn>")] and out.prompt_token_ids.count(2) == 1
    assert out.outputs[0].token_ids == [END_OF_TURN] and out.outputs[0].finish_reason == "stop"


# ---- metadata alone ---------------------------------------------------------------------------------------------

def _metadata_file(path: str, arch: str, values: dict) -> str:
    """A tensorless GGUF file of `arch` holding `values` (each written as a uint32, float32, bool, string or array
    by its Python type)."""
    w = gguf.GGUFWriter(path, arch)
    for key, value in values.items():
        add = {str: w.add_string, list: w.add_array, float: w.add_float32, bool: w.add_bool}.get(type(value),
                                                                                                 w.add_uint32)
        add(key, value)
    _finish(w)
    return path


def converter_metadata(hf: dict) -> tuple[str, dict]:
    """(architecture, metadata) that llama.cpp's converter writes from a Gemma config.json: Gemma2Model's keys (no
    RoPE base), Gemma3Model's (the full layers' base and linear scaling; the sliding layers' base, which only
    converters of transformers 5's rope_parameters write), each from transformers' reading of the config."""
    if hf["architectures"][0] == "Gemma2ForCausalLM":
        arch, cfg = "gemma2", Gemma2Config(**{k: v for k, v in hf.items() if k not in ("architectures", "torch_dtype")})
    else:
        arch, cfg = "gemma3", Gemma3TextConfig(**{k: v for k, v in hf.items()
                                                 if k not in ("architectures", "torch_dtype")})
    md = {"context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
          "block_count": cfg.num_hidden_layers, "feed_forward_length": cfg.intermediate_size,
          "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": cfg.num_key_value_heads,
          "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps), "attention.key_length": cfg.head_dim,
          "attention.value_length": cfg.head_dim, "attention.sliding_window": cfg.sliding_window,
          "vocab_size": cfg.vocab_size}      # the size of the vocabulary, which a real file holds whole
    if arch == "gemma2":
        md.update({"attn_logit_softcapping": cfg.attn_logit_softcapping,
                   "final_logit_softcapping": cfg.final_logit_softcapping})
    else:
        full = cfg.rope_parameters["full_attention"]
        md["rope.freq_base"] = float(full["rope_theta"])
        if full["rope_type"] == "linear":
            md.update({"rope.scaling.type": "linear", "rope.scaling.factor": float(full["factor"])})
    return arch, {f"{arch}.{k}": v for k, v in md.items()}


# the sizes of gemma-2-27b's and gemma-3-27b's config.json: their query_pre_attn_scalar is hidden_size / heads (144,
# 168), not head_dim (128)
GEMMA2_27B = dict(architectures=["Gemma2ForCausalLM"], hidden_size=4608, intermediate_size=36864, num_hidden_layers=46,
                  num_attention_heads=32, num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=144)
GEMMA3_27B = dict(architectures=["Gemma3ForCausalLM"], hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
                  num_attention_heads=32, num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=168,
                  sliding_window=1024, rope_scaling={"rope_type": "linear", "factor": 8.0})


def _released():
    from test_gemma2 import GEMMA2_2B, GEMMA2_9B
    from test_gemma3 import GEMMA3_1B, GEMMA3_4B
    return [GEMMA2_2B, GEMMA2_9B, GEMMA2_27B, GEMMA3_1B,
            {**GEMMA3_4B["text_config"], "architectures": ["Gemma3ForCausalLM"]}, GEMMA3_27B]


@pytest.mark.parametrize("index", range(6), ids=["gemma-2-2b", "gemma-2-9b", "gemma-2-27b", "gemma-3-1b",
                                                 "gemma-3-4b", "gemma-3-27b"])
def test_converted_metadata_reads_as_its_config_json(tmp_path, index):
    """The metadata llama.cpp's converter writes from each released model's config.json reads as that config.json
    reads: each layer's kind and the window, the soft caps, the RoPE of each kind of layer, the softmax scale (the
    27B models' by llama.cpp's rule, the file holding no query_pre_attn_scalar), the sizes; a gemma3 file without the
    sliding layers' base (older converters write none) takes Gemma 3's 10,000."""
    hf = _released()[index]
    arch, md = converter_metadata(hf)
    cfg, want = ModelConfig.from_gguf(_metadata_file(str(tmp_path / "m.gguf"), arch, md)), ModelConfig.from_hf(hf)
    assert _features(cfg) == _features(want)
    assert cfg.attention_scale == pytest.approx(1 / math.sqrt(hf.get("query_pre_attn_scalar", 256)))


@pytest.mark.parametrize("arch, values, sliding, window", [
    ("gemma3", {"attention.sliding_window": 0}, None, None),
    ("gemma3", {"attention.sliding_window_pattern": 2}, (True, False) * 3, 8),
    ("gemma3", {"attention.sliding_window_pattern": 0}, (True,) * 6, 8),
    ("gemma3", {"attention.sliding_window_pattern": [False, True, True, False, True, False]},
     (False, True, True, False, True, False), 8),
    ("gemma2", {}, (True, False) * 3, 8),
    ("gemma2", {"attention.sliding_window_pattern": 3}, (True, True, False) * 2, 8),
])
def test_sliding_layers_read_as_llama_cpp_reads_them(tmp_path, arch, values, sliding, window):
    """attention.sliding_window_pattern, where a file has one, as llama.cpp reads it: a period n (layer i slides
    unless i % n == n - 1; 0: every layer slides) or a bool per layer; else gemma2's every other layer and gemma3's
    five of six; a gemma3 window of 0 slides nowhere."""
    md = {"block_count": 6, "embedding_length": 64, "feed_forward_length": 128, "attention.head_count": 4,
          "context_length": 256, "attention.layer_norm_rms_epsilon": 1e-6, "vocab_size": 300,
          "attention.sliding_window": 8, **values}
    cfg = ModelConfig.from_gguf(_metadata_file(str(tmp_path / "m.gguf"), arch, {f"{arch}.{k}": v
                                                                               for k, v in md.items()}))
    assert (cfg.sliding_layers, cfg.sliding_window) == (sliding, window)
    assert cfg.local_rope_theta == (10000.0 if arch == "gemma3" and sliding else None)


_BASE = {"block_count": 4, "embedding_length": 64, "feed_forward_length": 128, "attention.head_count": 4,
         "context_length": 256, "attention.layer_norm_rms_epsilon": 1e-6, "vocab_size": 300}


@pytest.mark.parametrize("arch, values, message", [
    ("gemma2", {"attn_logit_softcapping": 0.0}, r"gemma2\.attn_logit_softcapping=0\.0; it must be a positive number"),
    ("gemma3", {"final_logit_softcapping": -30.0},
     r"gemma3\.final_logit_softcapping=-30\.0; it must be a positive number"),
    ("gemma2", {"attention.sliding_window": 0},
     r"gemma2\.attention\.sliding_window=0; Gemma 2's sliding layers need a window >= 1"),
    ("gemma2", {"rope.freq_base": 10000.0, "rope.freq_base_swa": 100.0},
     r"gemma2\.rope\.freq_base_swa=100\.0 apart from gemma2\.rope\.freq_base=10000\.0; Gemma 2 rotates every layer"),
    ("gemma3", {"attention.sliding_window": 8, "attention.sliding_window_pattern": [True, False]},
     r"gemma3\.attention\.sliding_window_pattern = \[True, False\] \(2 entries\); it must be a period n >= 0 .* a "
     r"bool for each of the 4 layers"),
    ("gemma3", {"attention.sliding_window": 8, "rope.freq_base_swa": 0.0},
     r"gemma3\.rope\.freq_base_swa=0\.0; it must be a positive number"),
])
def test_what_cannot_be_served_is_named(tmp_path, arch, values, message):
    path = _metadata_file(str(tmp_path / "bad.gguf"), arch, {f"{arch}.{k}": v for k, v in {**_BASE, **values}.items()})
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_gguf(path)


def test_projector_file_is_refused(tmp_path):
    """A multimodal model's projector file (llama.cpp's mmproj, general.architecture 'clip', such as gemma-3-4b-it's
    vision encoder) is named as such, not served."""
    path = _metadata_file(str(tmp_path / "mmproj-gemma-3-4b-it-f16.gguf"), "clip",
                          {"clip.has_vision_encoder": True, "clip.projector_type": "gemma3"})
    with pytest.raises(ValueError, match=r"has architecture 'clip': it is a multimodal model's projector "
                                         r"\(llama\.cpp's mmproj file, an image or audio encoder\), not a language "
                                         r"model"):
        ModelConfig.from_gguf(path)
