"""Tokenizer and chat template from the model directory or GGUF file (never from the network)."""
from __future__ import annotations

import functools
import json
import os


class InvalidPrefix(Exception):
    """A DecodeStream step whose decode no longer begins with the text the stream already gave, which
    `tokenizers` refuses: a byte-fallback decoder (SentencePiece's) decodes a run of byte tokens whole, or
    as one U+FFFD per byte where the run is not UTF-8, so bytes that break a run turn the characters it
    already gave into U+FFFD."""


class Tokenizer:
    def __init__(self, path: str):
        """`path`: a Hugging Face tokenizer directory, or a `.gguf` file whose metadata holds one."""
        if _is_gguf(path):
            from tokenmill.engine.gguf_tokenizer import build_gguf_tokenizer
            from tokenmill.gguf_file import open_gguf
            self.hf = build_gguf_tokenizer(open_gguf(path).metadata, path)
        else:
            from transformers import AutoTokenizer
            try:
                self.hf = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
            except Exception as e:     # transformers and tokenizers raise many kinds over a damaged file
                raise ValueError(f"cannot load the tokenizer in {path!r} ({type(e).__name__}: {e}); pass "
                                 "--tokenizer DIR with the model's tokenizer") from None
        # lengths are checked against the engine's max_model_len, with an error naming both numbers;
        # the tokenizer's own limit would only log a warning for prompts that are refused anyway
        self.hf.model_max_length = 1 << 62
        self.eos_token_ids = tuple(i for i in [self.hf.eos_token_id] if i is not None)
        self.vocab_size = len(self.hf)
        self.all_special_ids = set(self.hf.all_special_ids)
        # every special token's text (the named ones and the added ones marked special, such as ChatML's
        # <|im_start|>, which some tokenizers do not name)
        added = getattr(self.hf, "added_tokens_decoder", {}) or {}
        self.all_special_tokens = tuple(dict.fromkeys(
            [*self.hf.all_special_tokens, *(t.content for t in added.values() if getattr(t, "special", False))]))
        # Decoding goes straight to the Rust tokenizer (a third of transformers' cost per call, and the
        # frontend decodes twice per generated token) unless the tokenizer asks for transformers'
        # clean-up of tokenization spaces, which only transformers applies.
        self._rust_decode = (getattr(self.hf, "_tokenizer", None) is not None
                             and not getattr(self.hf, "clean_up_tokenization_spaces", False))

    @staticmethod
    def available(path: str) -> bool:
        if _is_gguf(path):
            from tokenmill.gguf_file import open_gguf
            return "tokenizer.ggml.tokens" in open_gguf(path).metadata
        return any(os.path.isfile(os.path.join(path, f)) for f in
                   ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json"))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` of each text, in one call of the Rust tokenizer where there is one (it spreads the
        texts over the cores; transformers' fast tokenizers encode through that same call, with the
        truncation and padding of tokenizer.json, if any, turned off first, so those go through
        transformers)."""
        rust = getattr(self.hf, "_tokenizer", None)
        if rust is None or rust.truncation is not None or rust.padding is not None:
            return [self.encode(t, add_special_tokens) for t in texts]
        return [e.ids for e in rust.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._rust_decode:
            return self.hf._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, context: list[int], skip_special_tokens: bool = True):
        """An incremental decoder (`tokenizers`' DecodeStream: one call per token, where a window decode
        takes two) primed with `context`, the ids before the first token it decodes, so that the first
        token's leading space decodes as in the text. None where decoding needs transformers (no Rust
        tokenizer, or its clean-up of tokenization spaces). A context that ends inside a character, or
        that the stream refuses (`InvalidPrefix`), is dropped: the stream would hold its bytes and emit
        them with the first output token."""
        if not self._rust_decode:
            return None
        from tokenizers.decoders import DecodeStream
        stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        text = ""
        try:
            for token_id in context:
                text = self.stream_step(stream, token_id)
        except InvalidPrefix:
            text = None
        if text is None:
            stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        return stream

    def stream_step(self, stream, token_id: int) -> str | None:
        """The text `token_id` completes in `stream` (None while a character is still split). Raises
        `InvalidPrefix` where the token changes text the stream already gave (see there)."""
        try:
            return stream.step(self.hf._tokenizer, token_id)
        except Exception as e:
            if str(e).startswith("Invalid prefix encountered"):
                raise InvalidPrefix(str(e)) from None
            raise

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(ids)

    @functools.cached_property
    def skipped_special_ids(self) -> frozenset[int]:
        """The ids that decoding with skip_special_tokens leaves out of the text: of the named special tokens
        and the added ones marked special, those that such a decode drops (each tried, as the Rust decoder
        and transformers' do not skip the same set)."""
        added = getattr(self.hf, "added_tokens_decoder", {}) or {}
        candidates = self.all_special_ids | {i for i, t in added.items() if getattr(t, "special", False)}
        return frozenset(i for i in candidates if self.decode([i], skip_special_tokens=True) == ""
                         and self.decode([i], skip_special_tokens=False) != "")

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes `token_id` adds to the decoded text, whole where a token holds part of a character
        (where decoding it alone gives U+FFFD): a byte-level BPE token's bytes, a byte-fallback token's
        byte (`<0xE2>`), a SentencePiece piece with its word-boundary mark as a space; an added token's
        text as it stands."""
        added = getattr(self.hf, "added_tokens_decoder", None) or {}
        if token_id in added:
            return added[token_id].content.encode("utf-8")
        piece = self.hf.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        kinds = self._decoder_kinds
        if "ByteLevel" in kinds:
            table = _byte_level_inverse()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        if "ByteFallback" in kinds and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        if "Metaspace" in kinds or "Replace" in kinds:
            piece = piece.replace("\u2581", " ")
        return piece.encode("utf-8")

    @functools.cached_property
    def _decoder_kinds(self) -> frozenset[str]:
        # the types of the Rust tokenizer's decoder and of those in its Sequence
        rust = getattr(self.hf, "_tokenizer", None)
        decoder = json.loads(rust.to_str()).get("decoder") if rust is not None else None
        parts = (decoder or {}).get("decoders") or ([decoder] if decoder else [])
        return frozenset(d.get("type") for d in parts if isinstance(d, dict))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = False,
                            **kwargs) -> str | list[int]:
        """Renders the conversation to text (`chat_template` in kwargs replaces the model's), or with
        `tokenize` to its ids. The text already holds its special tokens, so encode it with
        `add_special_tokens=False`."""
        if not kwargs.get("chat_template") and not getattr(self.hf, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; pass one (--chat-template) or use a "
                             "completion prompt")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __getattr__(self, name: str):
        # anything else is the Hugging Face tokenizer's (what vLLM's LLM.get_tokenizer hands out):
        # eos_token_id, pad_token_id, batch_decode, get_vocab, ...
        if name == "hf":
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __call__(self, *args, **kwargs):
        return self.hf(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.hf)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        return self.apply_chat_template(messages, add_generation_prompt, tokenize=True, **kwargs)


@functools.lru_cache(maxsize=1)
def _byte_level_inverse() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): each byte as the character that stands for it in a token, here
    inverted. Printable Latin-1 bytes stand for themselves; the others, in order, for U+0100 onwards."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in kept:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


THINK_START = "<think>"
THINK_END = "</think>"


def think_tag_ids(tokenizer, needed_by: str) -> tuple[int, int]:
    """The ids of `<think>` and `</think>`; a ValueError naming what needs them (`needed_by`: a reasoning
    parser's flag, a request's field) and a tag that is not one token."""
    ids = []
    for tag in (THINK_START, THINK_END):
        got = tokenizer.encode(tag, add_special_tokens=False)
        if len(got) != 1:
            raise ValueError(f"{needed_by} needs {tag} as one token of the tokenizer's vocabulary (it counts "
                             f"reasoning tokens by it); this tokenizer encodes {tag} as {len(got)} tokens {got}")
        ids.append(got[0])
    return ids[0], ids[1]


def template_kwargs(chat_template_kwargs: dict | None, tools: list[dict] | None,
                    continue_final_message: bool | None, documents: list[dict] | None = None) -> dict:
    """The chat template's keyword arguments of a chat request (served, tokenized or offline): the
    caller's `chat_template_kwargs`, with its tools and `continue_final_message` where given, and its
    `documents` where chat_template_kwargs has none (vLLM's order: those of chat_template_kwargs win)."""
    kwargs = dict(chat_template_kwargs or {})
    if documents is not None:
        kwargs.setdefault("documents", documents)
    if tools is not None:
        kwargs["tools"] = tools
    if continue_final_message:
        kwargs["continue_final_message"] = True
    return kwargs


def import_tokenizer_modules(path: str) -> None:
    """Imports the modules `Tokenizer(path)` will: transformers' tokenizer classes and, for a Hugging Face
    directory, torch through them (`AutoTokenizer` reads the model's config through modules that import
    it). Seconds of a CPU core, which a frontend spends while its engine core starts instead of after; a
    GGUF file's tokenizer needs neither `AutoTokenizer` nor torch. Nothing where `path` holds no tokenizer."""
    if _is_gguf(path):
        from transformers import PreTrainedTokenizerFast  # noqa: F401
    elif Tokenizer.available(path):
        from transformers import AutoTokenizer  # noqa: F401


def _is_gguf(path: str) -> bool:
    return str(path).lower().endswith(".gguf") and os.path.isfile(path)


def plain_eos_ids(path: str) -> tuple[int, ...] | None:
    """`Tokenizer(path).eos_token_ids` read without transformers, where that is plain: tokenizer_config.json
    names the EOS token (special_tokens_map.json, if any, names the same one) and tokenizer.json maps it to
    an id; or a GGUF file's tokenizer.ggml.eos_token_id (`_gguf_eos_ids`). None otherwise (no tokenizer.json,
    no EOS named, an unknown token): then only the tokenizer itself can tell."""
    def eos_named(name: str):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return None
        with open(file, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token")
        return eos.get("content") if isinstance(eos, dict) else eos
    if _is_gguf(path):
        return _gguf_eos_ids(path)
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return None
    from tokenizers import Tokenizer as RustTokenizer
    try:
        eos = eos_named("tokenizer_config.json")
        if not isinstance(eos, str) or eos_named("special_tokens_map.json") not in (None, eos):
            return None
        token_id = RustTokenizer.from_file(os.path.join(path, "tokenizer.json")).token_to_id(eos)
    except Exception:       # a damaged file: `Tokenizer(path)` reads it again and names it in its error
        return None
    return None if token_id is None else (token_id,)


def _gguf_eos_ids(path: str) -> tuple[int, ...] | None:
    """The EOS id of the tokenizer `build_gguf_tokenizer` makes of a GGUF file: its token is the file's
    tokenizer.ggml.eos_token_id's, whose id is that token's first place in the vocabulary; () where the file
    names none. None for a tokenizer model that is not built (loading it names the error)."""
    from tokenmill.engine.gguf_tokenizer import SUPPORTED_TOKENIZER_MODELS
    from tokenmill.gguf_file import open_gguf
    metadata = open_gguf(path).metadata
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    if metadata.get("tokenizer.ggml.model") not in SUPPORTED_TOKENIZER_MODELS or not tokens:
        return None
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    if eos is None or not 0 <= eos < len(tokens):
        return ()
    return (tokens.index(tokens[eos]),)


def generation_eos_ids(model_dir: str) -> tuple[int, ...]:
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return ()
    from tokenmill.generation_config import parse_eos_ids, read_json_object
    return parse_eos_ids(read_json_object(path).get("eos_token_id"), path)
