"""Grammar-constrained decoding (structured output) with xgrammar, on the engine core's side: compiling.

`StructuredOutputManager` is built once per engine, on first use, from the tokenizer and the model's
vocabulary size (the model may have more rows than the tokenizer has tokens; those ids are never allowed).
It compiles a request's `StructuredOutputsParams` into a grammar (an LRU of compiled grammars keyed by kind
and spec) and gives every sequence its own `SequenceGrammar` (grammar_bitmask.py, with the step's bitmask),
a matcher that accepts the sequence's tokens.
The engine core compiles a grammar not in the cache on one of `COMPILE_THREADS` threads of its own
(`core_proc._Client`: a slow compile stalls no other request's steps, nor another's compile) while its loop
looks grammars up (`cached`): the cache is locked. Requests with the same spec share one compile.
"""
from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import torch

from tokenmill.engine.grammar_bitmask import MAX_FILL_SECONDS, SequenceGrammar
from tokenmill.sampling_params import (SamplingParamError, SamplingParams, StructuredOutputsParams,
                                      shown, structural_tag_schemas)
from tokenmill.structured_output_limits import SPEC_WHAT, check_spec_chars

logger = logging.getLogger("tokenmill")

# xgrammar prefixes its messages with a time and a C++ source location
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


# xgrammar 0.2.9 writes a string with minLength or maxLength as a repetition of this class, which lets the
# control characters JSON forbids raw in a string into it; a tab there no token mask can tell from the
# whitespace between JSON's tokens. The class of xgrammar's own unbounded strings replaces it.
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'
# Grammars not cached compile on this many threads of the engine core at once, so that a slow one holds up
# no other constrained request (xgrammar's own threads work inside each compile).
COMPILE_THREADS = 4
# The compile threads run this much nicer than the engine core (`compile_pool`), and so do the 8 workers
# xgrammar starts for each compile (a thread starts with its creator's nice value). A compile holds no GIL,
# but at the core's priority its 8 workers took equal shares of the cores beside the loop thread, which
# waited, runnable, for one (3,000 tools on the loaded 2-core CPU machine: the loop ran 7-11% of the time
# while they compiled, 30-44% before). At nice 5 the 8 weigh about 2.6 loop threads: it ran 19-41%. At 10
# the compile, starved by the host's other work as well, passed MAX_COMPILE_SECONDS there (twice in two).
COMPILE_NICE = 5
# The engine core waits at most this long (wall time) for a grammar that has begun to compile; its request
# then fails (`compile_error`) and the spec is refused at once from then on. A compile cannot be interrupted:
# it runs on to its end on its thread (one of COMPILE_THREADS), with whatever memory it takes. Compile time
# grows faster than the spec (SmolLM2's vocabulary, CPU machine, other work beside: an object of 400 optional
# properties 0.95 s, of 800 5 s; an EBNF grammar of 6,400 rules, each optional before the next, over 40 s and
# 2.2 GB), and 3,000 tools (983,000 characters, just under MAX_SPEC_CHARS) took 57 s.
MAX_COMPILE_SECONDS = 60.0
# The compiled grammars kept for reuse hold at most this many bytes together (besides `cache_size`
# entries): the most recently used stay; one larger than this is used by its request and not kept.
CACHE_BYTES = 1 << 30


def compile_pool() -> ThreadPoolExecutor:
    """The engine core's COMPILE_THREADS grammar compile threads, at COMPILE_NICE below its priority."""
    return ThreadPoolExecutor(COMPILE_THREADS, "grammar", initializer=_lower_priority)


def _lower_priority() -> None:
    # Linux keeps a nice value per thread: this lowers the calling thread's only (capped at 19). Elsewhere a
    # thread id is no process id: the threads keep the core's priority (an initializer that raised would
    # break the pool, and every compile with it)
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + COMPILE_NICE))
    except OSError:
        pass


class StructuredOutputManager:
    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: list[int], cache_size: int = 256,
                 cache_bytes: int = CACHE_BYTES):
        import xgrammar as xgr
        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids) or None)
        # our LRU is the only cache: xgrammar's own has no entry limit by default
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        # JSON never holds a raw control character (in strings they are escaped; between tokens only space,
        # \t, \n, \r), but xgrammar 0.2.9 writes one a string's pattern names raw: JSON rows clear these ids
        self._json_keep = {any_ws: _keep_words(info.decoded_vocab, vocab_size, any_ws) for any_ws in (True, False)}
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        self.cached_bytes = 0              # `memory_size_bytes` of the grammars in the cache, together
        self._lock = threading.Lock()
        self._compiling: dict[tuple, threading.Event] = {}     # set when its compile ends or is given up on
        # specs given up on (the hash of their key: a spec may be a megabyte) -> the seconds waited
        self._too_slow: OrderedDict[int, float] = OrderedDict()

    def cached(self, params: StructuredOutputsParams) -> tuple | None:
        """`compile(params)` if its grammar is in the cache, else None (nothing is compiled)."""
        with self._lock:
            return self._lookup(_key(params))

    def compile(self, params: StructuredOutputsParams) -> tuple:
        """The compiled grammar of `params` and its cache key; an invalid spec raises SamplingParamError
        with xgrammar's message and `param` "structured_outputs.<field>", and so does one given up on
        (`gave_up`). A spec that another thread compiles is waited for, not compiled twice."""
        key = _key(params)
        while True:
            with self._lock:
                hit = self._lookup(key)
                if hit is not None:
                    return hit
                if hash(key) in self._too_slow:
                    raise compile_error(key[0], self._too_slow[hash(key)])
                running = self._compiling.get(key)
                if running is None:
                    running = self._compiling[key] = threading.Event()
                    break
            running.wait()
        try:
            return self._compile_new(key)
        finally:
            with self._lock:
                if self._compiling.get(key) is running:
                    del self._compiling[key]
            running.set()

    def gave_up(self, params: StructuredOutputsParams, seconds: float) -> SamplingParamError:
        """The error of a request whose grammar compiled for `seconds`, over MAX_COMPILE_SECONDS; its spec is
        refused at once from now on (the last `cache_size` such specs), and requests waiting on its compile
        get that error too."""
        key = _key(params)
        with self._lock:
            self._too_slow[hash(key)] = seconds
            while len(self._too_slow) > self._cache_size:
                self._too_slow.popitem(last=False)
            running = self._compiling.pop(key, None)
        if running is not None:
            running.set()
        return compile_error(key[0], seconds)

    def _compile_new(self, key: tuple) -> tuple:
        kind, spec, no_whitespace = key
        if isinstance(spec, str):
            chars = len(spec)
        else:                     # the choices, one separator each; json_object's spec is a flag
            chars = sum(len(s) + 1 for s in spec) if kind == "choice" else 0
        check_spec_chars(kind, chars)
        try:
            compiled = self._compile(kind, spec, not no_whitespace)
        except RuntimeError as e:
            message = _LOG_PREFIX.sub("", str(e).strip())
            raise SamplingParamError(f"structured_outputs.{kind}", f"invalid {SPEC_WHAT[kind]}: {message}") from None
        size = compiled.memory_size_bytes
        with self._lock:
            if key not in self._cache and size <= self._cache_bytes:
                self._cache[key] = compiled
                self.cached_bytes += size
                while len(self._cache) > self._cache_size or self.cached_bytes > self._cache_bytes:
                    self.cached_bytes -= self._cache.popitem(last=False)[1].memory_size_bytes
        return compiled, key

    def _lookup(self, key: tuple) -> tuple | None:
        """The cached grammar of `key` (the caller holds the lock)."""
        compiled = self._cache.get(key)
        if compiled is None:
            return None
        self._cache.move_to_end(key)
        return compiled, key

    def _compile(self, kind: str, spec, any_whitespace: bool):
        c = self._compiler
        if kind == "json":
            grammar = self._xgr.Grammar.from_json_schema(spec, any_whitespace=any_whitespace)
            return c.compile_grammar(_fixed_strings(grammar))
        if kind == "structural_tag":
            return c.compile_grammar(structural_tag_grammar(spec, any_whitespace))
        if kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
        if kind == "regex":
            return c.compile_regex(spec)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(_ebnf_literal(s) for s in spec))
        return c.compile_grammar(spec)

    def sequence_grammar(self, compiled: tuple, params: StructuredOutputsParams | None = None) -> "SequenceGrammar":
        grammar, (kind, _, no_whitespace) = compiled
        # a structural tag's text between its JSON may hold newlines (hermes' `<tool_call>\n`)
        keep = self._json_keep[not no_whitespace or kind == "structural_tag"] \
            if kind in ("json", "json_object", "structural_tag") else None
        tags = params.think_tags if params is not None else None
        return SequenceGrammar(self._xgr.GrammarMatcher(grammar), keep, tags, params is not None and params.in_think)


def slow_fill_error(grammar: SequenceGrammar, kind: str) -> SamplingParamError:
    """The error of a sequence whose grammar took over MAX_FILL_SECONDS for one token (`slow_fill`)."""
    seconds, tokens = grammar.slow_fill
    return SamplingParamError(f"structured_outputs.{kind}", f"the {SPEC_WHAT[kind]} took {seconds * 1000:,.1f} ms to "
                              f"compute the allowed tokens after {tokens} tokens; the limit is "
                              f"{MAX_FILL_SECONDS * 1000:.0f} ms a token: an ambiguous grammar grows its parse "
                              "with every token; make it unambiguous")


def no_token_error(grammar: SequenceGrammar, params: SamplingParams) -> SamplingParamError:
    """The error of a sequence whose grammar left no token to sample beside its allowed_token_ids and bad words
    (`no_token`), naming the output position and the fields that ruled the grammar's tokens out."""
    tokens, ruled_out = grammar.no_token
    what = f"after {tokens} token{'s' * (tokens != 1)} the {SPEC_WHAT[params.structured_outputs.kind]} allows"
    allowed = params.allowed_token_ids
    if allowed is not None and not ruled_out:
        return SamplingParamError("allowed_token_ids", f"{what} none of allowed_token_ids {shown(allowed)}, which "
                                  "leaves no token to generate")
    among = f" of allowed_token_ids {shown(allowed)}" if allowed is not None else ""
    return SamplingParamError("bad_words", f"{what} only {shown(ruled_out)}{among}, which bad_words ban there: no "
                              "token is left to generate")


def compile_error(kind: str, seconds: float) -> SamplingParamError:
    """The error of a spec whose grammar took over MAX_COMPILE_SECONDS to compile."""
    return SamplingParamError(f"structured_outputs.{kind}", f"the {SPEC_WHAT[kind]} did not compile in {seconds:,.1f} s; "
                              f"the limit is {MAX_COMPILE_SECONDS:g} s: compile time grows faster than the "
                              "spec (many optional properties or rules, each optional before the next); simplify it")


def _key(params: StructuredOutputsParams) -> tuple:
    kind = params.kind
    spec = getattr(params, kind)
    if kind == "json" and not isinstance(spec, str):
        spec = json.dumps(spec)          # key order kept: it is the properties' order in the output
    elif kind == "choice":
        spec = tuple(spec)
    return kind, spec, params.disable_any_whitespace


def structural_tag_grammar(spec: str, any_whitespace: bool):
    """The grammar (or its text) of a structural tag's JSON text, its JSON schemas compiled as `json`'s: with
    free whitespace only where `any_whitespace` (xgrammar's own structural tags always allow it) and strings
    held to JSON's characters (`_fixed_strings`). An invalid schema's error names its path in the tag."""
    import xgrammar as xgr
    tag = json.loads(spec)
    for path, node in structural_tag_schemas(tag):
        try:
            grammar = xgr.Grammar.from_json_schema(json.dumps(node["json_schema"]), any_whitespace=any_whitespace)
        except RuntimeError as e:
            raise SamplingParamError(f"structured_outputs.structural_tag.{path}", f"invalid JSON schema at {path}: "
                                     f"{_LOG_PREFIX.sub('', str(e).strip())}") from None
        node.clear()
        node.update(type="grammar", grammar=str(grammar))
    return _fixed_strings(xgr.Grammar.from_structural_tag(json.dumps(tag)))


def _fixed_strings(grammar):
    """`grammar`, or its text with the strings xgrammar bounds in length held to JSON's characters
    (`_BOUNDED_STRING_CHAR`)."""
    text = str(grammar)
    fixed = text.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)
    return grammar if fixed == text else fixed


def _keep_words(decoded_vocab: list[bytes], vocab_size: int, any_whitespace: bool) -> torch.Tensor:
    """Packed bits of the tokens without a byte JSON forbids outside escapes: control characters, except
    \t \n \r where whitespace may appear."""
    allowed_controls = {9, 10, 13} if any_whitespace else set()
    keep = torch.ones(-(-vocab_size // 32) * 32, dtype=torch.bool)
    for i, token in enumerate(decoded_vocab[:vocab_size]):
        if any(b < 0x20 and b not in allowed_controls for b in token):
            keep[i] = False
    words = (keep.view(-1, 32).to(torch.int64) << torch.arange(32)).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)   # as int32 bit patterns


def _ebnf_literal(text: str) -> str:
    """`text` as an EBNF string literal (the characters xgrammar's parser treats as escapes escaped)."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20:           # \u takes exactly four digits (\x would run on into a hex digit after it)
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'
