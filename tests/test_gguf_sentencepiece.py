"""GGUF files with a SentencePiece BPE vocabulary (`tokenizer.ggml.model` "llama": Llama 2, Mistral 7B, Phi-3,
TinyLlama) get the tokenizer transformers' GGUF reader builds from them (`AutoTokenizer.from_pretrained(dir,
gguf_file=...)`), and such a model serves a chat. The vocabulary is trained here with `tokenizers`' SentencePiece
BPE and laid out as llama.cpp writes Llama 2's."""
from __future__ import annotations

import json

import pytest
import torch

gguf = pytest.importorskip("gguf")

from tokenmill import LLM, SamplingParams                      # noqa: E402
from tokenmill.engine.tokenizer import Tokenizer, plain_eos_ids  # noqa: E402

from test_gguf import _finish, add_tokenizer, llama3_to_gguf   # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# no newline and no CJK: those come out as byte pieces, as from Llama 2's vocabulary
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello world! Hello there, the theory of them.",
          "def square(x):    return x * x  # four spaces", "The capital of France is Paris; 1234 + 5678 = 6912.",
          "café, naïve, résumé and Ünïcödé", "    indented    code    lines"]
USER_DEFINED, CONTROL = ["<think>", "</think>"], ["[INST]", "[/INST]"]
# Mistral's template, whose [INST] and [/INST] are control tokens in v0.3's vocabulary
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
            "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
TEXTS = ["Hello world! The quick brown fox.", "  two leading spaces", "trailing spaces   ", "a  b   c    d",
         " ", "", "line one\nline two\n\n\tindented", "    return x * x", "1234 + 5678 = 6912.", "3.14159 -42,000",
         "café naïve Ünïcödé", "你好, 世界 🎉👏 — ½", "<think>a thought</think>answer", "[INST] hi [/INST] yes</s>",
         "<s>[INST]hello[/INST]", "<unk> stays", "x<think>y", "The theory of them, Paris; France!"]


def sentencepiece_vocab() -> dict:
    """<unk> (unknown), <s> and </s> (control) and the byte pieces <0x00>..<0xFF>, each scored 0; whitespace
    runs and the pieces a SentencePiece BPE trained on CORPUS merged, in merge order, scored -rank; its single
    characters below them; then user-defined <think> </think> and control [INST] [/INST], scored 0. As
    Llama 2's file, it holds no merges: they follow from the scores (the trained BPE's own are kept apart, as
    "trained_merges")."""
    from tokenizers import SentencePieceBPETokenizer
    trained = SentencePieceBPETokenizer()
    trained.train_from_iterator(CORPUS * 8, vocab_size=400, min_frequency=2, show_progress=False)
    model = json.loads(trained._tokenizer.to_str())["model"]
    chars = sorted((t for t in model["vocab"] if len(t) == 1), key=model["vocab"].get)
    pieces = list(dict.fromkeys(["\u2581\u2581", "\u2581\u2581\u2581", "\u2581\u2581\u2581\u2581",
                                 *("".join(m) for m in model["merges"])]))
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces, *chars, *USER_DEFINED, *CONTROL]
    types = [2, 3, 3, *[6] * 256, *[1] * (len(pieces) + len(chars)), *[4] * len(USER_DEFINED), *[3] * len(CONTROL)]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces) + len(chars))] + [0.0] * 4
    return dict(model="llama", tokens=tokens, types=types, scores=scores, unk=0, bos=1, eos=2, template=TEMPLATE,
                trained_merges=[" ".join(m) for m in model["merges"]])


@pytest.fixture(scope="module")
def vocab():
    return sentencepiece_vocab()


def _write(path: str, arch: str, tok: dict) -> None:
    w = gguf.GGUFWriter(path, arch)
    add_tokenizer(w, tok)
    _finish(w)


@pytest.mark.parametrize("arch, keys", [
    ("llama", {}),
    ("llama", {"add_bos": False, "add_eos": True, "add_space_prefix": False}),
    ("llama", {"merges": "trained"}),        # merges the scores would not give
    ("phi3", {}),
])
def test_sentencepiece_tokenizer_equals_transformers(vocab, tmp_path, arch, keys):
    """Encoding (with and without BOS/EOS) and decoding (special tokens skipped or kept) equal transformers'
    GGUF tokenizer of the same file: merges ranked by the scores (or the file's own, where it has them),
    U+2581 for spaces and one before the text (before every run of text between special tokens for phi3),
    characters outside the vocabulary as byte pieces that decode back to UTF-8, the control and user-defined
    tokens whole."""
    from transformers import AutoTokenizer
    tok = {**vocab, **keys}
    if keys.get("merges") == "trained":
        tok["merges"] = vocab["trained_merges"]
    _write(str(tmp_path / "spm.gguf"), arch, tok)
    ours = Tokenizer(str(tmp_path / "spm.gguf"))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    assert plain_eos_ids(str(tmp_path / "spm.gguf")) == ours.eos_token_ids == (ref.eos_token_id,)
    model = json.loads(ours.hf.backend_tokenizer.to_str())["model"]
    assert model["merges"] == json.loads(ref.backend_tokenizer.to_str())["model"]["merges"]
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    pieces = ours.convert_ids_to_tokens(ours.encode("x🎉<think>[INST]", add_special_tokens=False))
    assert pieces[-6:] == ["<0xF0>", "<0x9F>", "<0x8E>", "<0x89>", "<think>", "[INST]"]
    text = "你好 🎉 café"
    ids = ours.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == text
    # 你 cut after its first byte: a run of byte pieces that is not UTF-8 is one U+FFFD per byte, 好's too
    assert ours.decode(ids[2:]) == ref.decode(ids[2:]) == "\ufffd" * 5 + " 🎉 café"
    # any run of ids, byte pieces that form no character included
    ids = list(range(len(vocab["tokens"])))
    for start in range(0, len(ids), 37):
        assert ours.decode(ids[start:start + 40], skip_special_tokens=False) == ref.decode(
            ids[start:start + 40], skip_special_tokens=False)
    assert (ours.bos_token, ours.eos_token, ours.unk_token) == ("<s>", "</s>", "<unk>")
    if not keys:
        assert ours.encode("Hi")[0] == 1            # BOS by default, as llama.cpp adds it to such a vocabulary


@pytest.mark.parametrize("arch, keys, message", [
    ("llama", {"scores": [0.0] * 7}, r"vocabulary of {n} tokens with 7 tokenizer.ggml.scores and no "
                                     r"tokenizer.ggml.merges; the merges are ranked by one score per token"),
])
def test_sentencepiece_files_that_cannot_be_built_are_named(vocab, tmp_path, arch, keys, message):
    _write(str(tmp_path / "bad.gguf"), arch, {**vocab, **keys})
    with pytest.raises(ValueError, match=message.format(n=len(vocab["tokens"]))):
        Tokenizer(str(tmp_path / "bad.gguf"))


def test_sentencepiece_model_serves_a_chat(vocab, tmp_path):
    """A Mistral-shaped llama GGUF with the SentencePiece vocabulary serves a chat: the prompt is the file's
    template rendered and encoded as transformers' GGUF tokenizer encodes it (one BOS), the greedy tokens are
    transformers' argmax over the checkpoint the file was converted from, the text is their decode, and
    generation stops on </s>."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(vocab["tokens"]), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=1e4,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, initializer_range=0.2)).eval()
    path = str(tmp_path / "mistral.gguf")
    llama3_to_gguf(path, model, vocab)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="mistral.gguf")
    chat = [{"role": "user", "content": "Hello world! 🎉"}]
    llm = LLM(path, device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=12)
    out = llm.chat(chat, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    prompt = ref.encode(ref.apply_chat_template(chat, tokenize=False), add_special_tokens=False)
    assert out.prompt_token_ids == prompt and prompt.count(1) == 1 and prompt[0] == 1
    assert out.prompt_token_ids[1] == vocab["tokens"].index("[INST]")
    generated = out.outputs[0].token_ids
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0]
    assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == generated
    assert out.outputs[0].text == ref.decode(generated, skip_special_tokens=True)
    stop = llm.chat(chat, SamplingParams(temperature=0, max_tokens=5, logit_bias={2: 100.0}))[0].outputs[0]
    assert stop.token_ids == [2] and stop.finish_reason == "stop"
