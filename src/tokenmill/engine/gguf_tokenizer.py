"""A Hugging Face fast tokenizer built from a GGUF file's `tokenizer.*` metadata.

Two kinds of vocabulary are built, by `tokenizer.ggml.model`: byte-level BPE ("gpt2") and SentencePiece BPE
("llama": Llama 2, Mistral 7B, Phi-3/3.5-mini, TinyLlama, and Gemma 2's and Gemma 3's own kind of it). Every other
kind is refused.

GGUF stores a byte-level BPE vocabulary as the token strings in the byte-to-unicode alphabet, the merges as
"left right" strings, each token's type (3: control, made a special token; 4: user-defined, matched whole
but not special), BOS/EOS/UNK/PAD ids, whether to add BOS and EOS, and the chat template. How text is
split before BPE is only named (`tokenizer.ggml.pre`); each name tokenmill knows maps to the split its
vocabulary was trained with, and with it what its tokenizer.json did besides: Qwen2's NFC normalization,
Llama 3's `ignore_merges` (a piece that is a token whole is that token, whatever the merges reach) and BOS
added where the file does not say. Unknown names are refused, since a wrong split silently changes every
token id, and so is a file naming none (llama.cpp's converters write "default" for a split they could not
identify).

A SentencePiece vocabulary is stored as its pieces (a space written U+2581), each piece's score and type
(6: a byte-fallback piece `<0xXX>`) and, mostly, no merges; it is rebuilt as transformers' GGUF reader
rebuilds it (the reference the tests compare with): BPE over merges ranked by the scores, byte fallback, a
U+2581 before the text, and a decoder that turns U+2581 back into spaces, joins byte pieces into UTF-8 and
drops the space the encoder added. A gemma2 or gemma3 file's is rebuilt as transformers' GGUF reader rebuilds
Gemma's (its GemmaTokenizer): no space before the text, every space a U+2581, the pieces of spaces alone (which
llama.cpp's converter wrote as spaces) respelled in U+2581, and the merges ranked by the pieces' order in the
vocabulary, not by their scores.
"""
from __future__ import annotations

from typing import Any

# the pre-tokenizer split patterns, by `tokenizer.ggml.pre`
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# GPT-4o's (o200k; Phi-4-mini): letters split at a case change, a contraction kept on its word, a punctuation run
# taking the newlines and slashes after it
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"qwen2": _QWEN2_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
           "gpt-4o": _GPT4O_SPLIT}
# GPT-2's own split (ByteLevel's built-in regex); the others isolate every digit first, as llama.cpp reads
# them alike (SmolLM2's, and the StarCoder-lineage vocabularies of refact and starcoder files)
_DIGITS_FIRST = ("smollm", "refact", "starcoder")
_GPT2_NAMES = ("gpt-2", *_DIGITS_FIRST)
# the names llama.cpp reads as Llama 3's (Falcon3's vocabulary included): a piece looked up whole first, BOS
# added where the file does not say
_LLAMA3_NAMES = ("llama-bpe", "llama3", "falcon3")
SUPPORTED_PRE_TOKENIZERS = tuple(sorted((*_SPLITS, *_GPT2_NAMES)))
SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")

_CONTROL, _USER_DEFINED = 3, 4
_SPACE = "\u2581"           # SentencePiece's visible space
# architectures whose SentencePiece vocabulary transformers reads with Gemma's tokenizer (`_gemma_bpe`)
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


def _pre_tokenizer(name: str, path: str):
    from tokenizers import Regex, pre_tokenizers

    # no prefix space: `tokenizer.ggml.add_space_prefix` is SentencePiece's (llama.cpp and transformers'
    # GGUF reader ignore it for byte-level BPE), and ByteLevel would put it before every split piece
    if name in _GPT2_NAMES:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if name in _DIGITS_FIRST:
            return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        return byte_level
    if name in _SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[name]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise ValueError(f"GGUF file {path!r} names pre-tokenizer {name!r}; tokenmill knows "
                     f"{', '.join(SUPPORTED_PRE_TOKENIZERS)} (pass --tokenizer DIR with the model's tokenizer)")


def _byte_level_bpe(metadata: dict[str, Any], vocab: dict[str, int], path: str):
    """The Rust tokenizer of a "gpt2" vocabulary, and whether BOS is added where the file does not say."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    merges: list[str] = metadata.get("tokenizer.ggml.merges") or []
    if not merges:
        raise ValueError(f"GGUF file {path!r} has no tokenizer.ggml.merges")
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
    return tok, pre in _LLAMA3_NAMES


def _sentencepiece_bpe(metadata: dict[str, Any], tokens: list[str], vocab: dict[str, int], path: str):
    """The Rust tokenizer of a "llama" vocabulary, and whether BOS is added where the file does not say
    (yes: llama.cpp and transformers' GGUF reader add it to such a vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    arch = metadata.get("general.architecture")
    merges = metadata.get("tokenizer.ggml.merges")
    if merges:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        scores = metadata.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            held = "none" if scores is None else len(scores)
            raise ValueError(f"GGUF file {path!r} has a SentencePiece vocabulary of {len(tokens)} tokens with "
                             f"{held} tokenizer.ggml.scores and no tokenizer.ggml.merges; the merges are ranked "
                             "by one score per token")
        pairs = _merges_from_scores(tokens, scores, vocab)
    # a character outside the vocabulary is its UTF-8 bytes' pieces (Llama 2's, Mistral's and Phi-3's
    # vocabularies hold all 256); the model names no unk_token, as transformers' reader builds it, so where a
    # byte piece is missing the character is dropped (llama.cpp gives <unk>)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True))
    # Where the word-boundary space goes before a text, transformers' GGUF reader (followed here) and
    # llama.cpp differ. llama.cpp puts one before every run of text, at the start and after each control
    # or user-defined token, even where the run begins with a space, and none at all where
    # `tokenizer.ggml.add_space_prefix` is false. transformers puts one at the start of the text alone,
    # unless the text begins with a space, whatever add_space_prefix says; for phi3 files (Phi-3's own
    # tokenizer.json prepends in its normalizer) it puts one before every run, as llama.cpp does where
    # add_space_prefix is true.
    if arch == "phi3":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), normalizers.Replace(" ", _SPACE)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE, prepend_scheme="first", split=False)
    # the pieces joined, byte pieces as UTF-8 (a run that is not UTF-8 as U+FFFD per byte), and the first
    # space dropped: the one the encoder added
    tok.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok, True


def _gemma_spelling(tokens: list[str]) -> list[str]:
    """Gemma's pieces as its tokenizer spells them: llama.cpp's converter wrote the user-defined pieces of spaces
    alone ("  ", up to 31) in spaces, which Gemma's tokenizer (its text's spaces made U+2581 first) spells in
    U+2581; respelled as transformers' GGUF reader respells them (any piece of whitespace alone that holds a
    space, each of its characters a U+2581)."""
    return [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]


def _gemma_bpe(metadata: dict[str, Any], tokens: list[str], vocab: dict[str, int]):
    """The Rust tokenizer of a gemma2 or gemma3 file's SentencePiece vocabulary (`tokens` and `vocab` respelled
    by `_gemma_spelling`), as transformers' GGUF reader builds it with its GemmaTokenizer: each space a U+2581
    and none added before the text, byte fallback, `<unk>` for what it cannot spell, and the merges ranked by
    the order of the pieces in the vocabulary (the file's scores do not follow Gemma's merge order); BOS added
    where the file does not say, as for any SentencePiece vocabulary."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    merges = metadata.get("tokenizer.ggml.merges")
    pairs = ([tuple(m.split(" ", 1)) for m in merges] if merges
             else _merges_from_scores(tokens, [-float(i) for i in range(len(tokens))], vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True,
                               unk_token="<unk>" if "<unk>" in vocab else None))
    tok.normalizer = normalizers.Replace(" ", _SPACE)
    # GemmaTokenizer's split at spaces, which meets none once the normalizer turned them into U+2581
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok, True


def _merges_from_scores(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges equal to SentencePiece BPE's encoding, which keeps no merges but joins, step by step, the
    adjacent pair whose joined piece scores highest: each way of cutting a piece into two pieces of the
    vocabulary is a merge, ranked by that piece's score. Ties as transformers ranks them: a longer left part
    first, then a longer right part, then the pieces in vocabulary order (the cuts of one piece never tie:
    their left parts differ in length)."""
    score_of = dict(zip(tokens, scores))        # a repeated piece is refused later, by the vocabulary size
    ranked = [(score, k, len(piece) - k, piece[:k], piece[k:])
              for piece, score in score_of.items() for k in range(1, len(piece))
              if piece[:k] in vocab and piece[k:] in vocab]
    ranked.sort(key=lambda m: (-m[0], -m[1], -m[2]))      # stable: equal keys keep vocabulary order
    return [(left, right) for _, _, _, left, right in ranked]


def build_gguf_tokenizer(metadata: dict[str, Any], path: str = "<gguf>"):
    """A `PreTrainedTokenizerFast` equal to the one transformers' GGUF reader builds from the file (for
    byte-level BPE: to the tokenizer the file was converted from)."""
    from tokenizers import AddedToken, processors
    from transformers import PreTrainedTokenizerFast

    kind = metadata.get("tokenizer.ggml.model")
    if kind not in SUPPORTED_TOKENIZER_MODELS:
        raise ValueError(f"GGUF file {path!r} has tokenizer model {kind!r}; tokenmill builds "
                         f"{' and '.join(map(repr, SUPPORTED_TOKENIZER_MODELS))} (byte-level and SentencePiece "
                         "BPE) tokenizers from GGUF (pass --tokenizer DIR for others)")
    tokens: list[str] = metadata.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ValueError(f"GGUF file {path!r} has no tokenizer.ggml.tokens")
    types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    gemma = kind == "llama" and metadata.get("general.architecture") in _GEMMA_ARCHITECTURES
    spelled = _gemma_spelling(tokens) if gemma else tokens
    vocab: dict[str, int] = {}
    for i, t in enumerate(spelled):
        vocab.setdefault(t, i)
    if kind == "gpt2":
        tok, bos_by_default = _byte_level_bpe(metadata, vocab, path)
    elif gemma:
        tok, bos_by_default = _gemma_bpe(metadata, spelled, vocab)
    else:
        tok, bos_by_default = _sentencepiece_bpe(metadata, tokens, vocab, path)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == _CONTROL])
    # as written in the file: Gemma's respelled pieces of spaces are no longer in the vocabulary under that
    # spelling, and are left to the merges, as transformers' reader leaves them
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types) if kind == _USER_DEFINED and t in vocab])

    def token(key: str) -> str | None:
        i = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    # the BOS before and the EOS after each text, as the file says (llama.cpp and transformers' GGUF
    # reader add both where it does)
    first = [bos] if metadata.get("tokenizer.ggml.add_bos_token", bos_by_default) and bos is not None else []
    last = [eos] if metadata.get("tokenizer.ggml.add_eos_token", False) and eos is not None else []
    if first or last or kind == "llama":
        # a pair's second text and its BOS/EOS are of type 1, as in transformers' templates
        tok.post_processor = processors.TemplateProcessing(
            single=[*first, "$A", *last],
            pair=[*first, "$A", *last, *(f"{t}:1" for t in first), "$B:1", *(f"{t}:1" for t in last)],
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
