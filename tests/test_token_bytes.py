"""`Tokenizer.token_bytes`: the bytes each token adds to the text, for logprobs' `bytes` and completions'
text offsets, where a token holding part of a character decodes alone to U+FFFD: byte-level BPE (the
tests' tokenizer, Qwen's and SmolLM2's kind) and SentencePiece with byte fallback (Llama's kind)."""
from __future__ import annotations

import pytest

from tokenmill.engine.tokenizer import Tokenizer

TEXT = "hé 👏 你好, <think>"


def _joined(tok: Tokenizer, ids: list[int]) -> bytes:
    return b"".join(tok.token_bytes(i) for i in ids)


def test_byte_level_tokens_join_to_the_text(tokenizer_dir):
    tok = Tokenizer(tokenizer_dir)
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert any(tok.decode([i], skip_special_tokens=False) == "\ufffd" for i in ids)
    assert _joined(tok, ids).decode("utf-8") == TEXT
    whole = [i for i in range(tok.vocab_size) if "\ufffd" not in tok.decode([i], skip_special_tokens=False)]
    assert all(tok.token_bytes(i) == tok.decode([i], skip_special_tokens=False).encode() for i in whole)


def test_sentencepiece_byte_fallback_tokens_join_to_the_text(tmp_path):
    from tokenizers import Tokenizer as RustTokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for piece in ("\u2581", "h", "\u2581h", "é", ",", "<", ">", "t", "i", "n", "k"):
        vocab.setdefault(piece, len(vocab))
    rust = RustTokenizer(models.BPE(vocab=vocab, merges=[("\u2581", "h")], unk_token="<unk>", byte_fallback=True))
    rust.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    rust.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    PreTrainedTokenizerFast(tokenizer_object=rust, unk_token="<unk>").save_pretrained(tmp_path)
    tok = Tokenizer(str(tmp_path))
    ids = tok.encode(TEXT, add_special_tokens=False)
    pieces = tok.convert_ids_to_tokens(ids)
    assert "<0xF0>" in pieces and "\u2581h" in pieces         # the emoji's four bytes, a word-initial piece
    # the text as the decoder gives it, but for its first word's space, which only the whole text strips
    assert _joined(tok, ids).decode("utf-8") == " " + TEXT == " " + tok.decode(ids)


@pytest.mark.parametrize("text", ["x\U0001F44F", "\u4f60\u597d"])
def test_offsets_of_split_characters_stay_inside_the_text(tokenizer_dir, text):
    from tokenmill.server.completions import TextOffsets
    tok = Tokenizer(tokenizer_dir)
    ids = tok.encode(text, add_special_tokens=False)
    offsets = TextOffsets()
    starts = [offsets.take(tok.token_bytes(i)) for i in ids]
    assert starts == sorted(starts) and starts[-1] < len(text) and offsets.chars == len(text)
