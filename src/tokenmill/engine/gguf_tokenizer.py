"""A Hugging Face fast tokenizer built from a GGUF file's `tokenizer.*` metadata.

GGUF stores a byte-level BPE vocabulary (`tokenizer.ggml.model` = "gpt2") as the token strings in the
byte-to-unicode alphabet, the merges as "left right" strings, each token's type (3: control, made a
special token; 4: user-defined, matched whole but not special), BOS/EOS/UNK/PAD ids, whether to add BOS
and EOS, and the chat template. How text is split before BPE is only named (`tokenizer.ggml.pre`); each name
tokenmill knows maps to the split its vocabulary was trained with, and with it what its tokenizer.json
did besides: Qwen2's NFC normalization, Llama 3's `ignore_merges` (a piece that is a token whole is that
token, whatever the merges reach) and BOS added where the file does not say. Unknown names are refused,
since a wrong split silently changes every token id, and so is a file naming none (llama.cpp's
converters write "default" for a split they could not identify).
"""
from __future__ import annotations

from typing import Any

# the pre-tokenizer split patterns, by `tokenizer.ggml.pre`
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"qwen2": _QWEN2_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT}
# GPT-2's own split (ByteLevel's built-in regex); "smollm" isolates every digit first
_GPT2_NAMES = ("gpt-2", "smollm")
_LLAMA3_NAMES = ("llama-bpe", "llama3")
SUPPORTED_PRE_TOKENIZERS = tuple(sorted((*_SPLITS, *_GPT2_NAMES)))

_CONTROL, _USER_DEFINED = 3, 4


def _pre_tokenizer(name: str, path: str):
    from tokenizers import Regex, pre_tokenizers

    # no prefix space: `tokenizer.ggml.add_space_prefix` is SentencePiece's (llama.cpp and transformers'
    # GGUF reader ignore it for byte-level BPE), and ByteLevel would put it before every split piece
    if name in _GPT2_NAMES:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if name == "smollm":
            return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        return byte_level
    if name in _SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[name]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise ValueError(f"GGUF file {path!r} names pre-tokenizer {name!r}; tokenmill knows "
                     f"{', '.join(SUPPORTED_PRE_TOKENIZERS)} (pass --tokenizer DIR with the model's tokenizer)")


def build_gguf_tokenizer(metadata: dict[str, Any], path: str = "<gguf>"):
    """A `PreTrainedTokenizerFast` equal to the one the GGUF file was converted from."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF file {path!r} has tokenizer model {kind!r}; tokenmill builds byte-level "
                         "BPE ('gpt2') tokenizers from GGUF only (pass --tokenizer DIR for others)")
    tokens: list[str] = metadata.get("tokenizer.ggml.tokens") or []
    merges: list[str] = metadata.get("tokenizer.ggml.merges") or []
    if not tokens or not merges:
        raise ValueError(f"GGUF file {path!r} has no tokenizer.ggml.tokens or tokenizer.ggml.merges")
    types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    pre = metadata.get("tokenizer.ggml.pre")
    if pre is None or pre == "default":
        named = "no tokenizer.ggml.pre" if pre is None else "tokenizer.ggml.pre 'default'"
        raise ValueError(f"GGUF file {path!r} has {named}: how its text is split before BPE is unknown "
                         "(pass --tokenizer DIR with the model's tokenizer)")
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False,
                     ignore_merges=pre in _LLAMA3_NAMES)
    tok = Tokenizer(bpe)
    if pre == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(pre, path)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types) if kind == _USER_DEFINED])

    def token(key: str) -> str | None:
        i = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    # the BOS before and the EOS after each text, as the file says (llama.cpp and transformers' GGUF
    # reader add both where it does)
    first = [bos] if metadata.get("tokenizer.ggml.add_bos_token", pre in _LLAMA3_NAMES) and bos is not None else []
    last = [eos] if metadata.get("tokenizer.ggml.add_eos_token", False) and eos is not None else []
    if first or last:
        tok.post_processor = processors.TemplateProcessing(
            single=[*first, "$A", *last], pair=[*first, "$A", *last, *first, "$B", *last],
            special_tokens=[(t, vocab[t]) for t in {*first, *last}])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    if len(tok.get_vocab()) != len(tokens):
        raise ValueError(f"GGUF tokenizer in {path!r}: {len(tokens)} tokens give a vocabulary of "
                         f"{len(tok.get_vocab())} (duplicate token strings?)")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"), chat_template=metadata.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False)
