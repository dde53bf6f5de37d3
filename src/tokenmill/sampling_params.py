"""Per-request sampling parameters, validated on construction (vLLM's names and meanings).

What needs the engine (token ids against the vocabulary, grammars compiled for the tokenizer) is checked
in `LLMEngine.add_request`, with the same error type.

`StructuredOutputsParams` (structured_outputs_params.py), the limits its specs are held to
(structured_output_limits.py), and `SamplingParamError` with `shown` (param_errors.py) live in modules of their
own; the names other modules import from here stay importable from here."""
from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field

from tokenmill.param_errors import MAX_SHOWN_CHARS, SamplingParamError, shown
from tokenmill.structured_output_limits import (
    MAX_JSON_DEPTH, MAX_SPEC_CHARS, SCHEMA_DATA_KEYS, SUBSCHEMA_MAPS, json_chars_at_least, json_depth,
    structural_tag_schemas,
)
from tokenmill.structured_outputs_params import THINK_TAGS, StructuredOutputsParams, valid_think_tags

__all__ = ["LOGIT_BIAS_LIMIT", "MAX_JSON_DEPTH", "MAX_SHOWN_CHARS", "MAX_SPEC_CHARS", "MIN_TEMPERATURE",
           "SCHEMA_DATA_KEYS", "SUBSCHEMA_MAPS", "RequestOutputKind", "SamplingParamError", "SamplingParams",
           "StructuredOutputsParams", "json_chars_at_least", "json_depth", "shown", "structural_tag_schemas",
           "truncated_length"]

LOGIT_BIAS_LIMIT = 100.0
# a positive temperature below this samples at this (vLLM's rule); 0 is greedy
MIN_TEMPERATURE = 1e-2


def truncated_length(truncate_prompt_tokens: int, max_model_len: int) -> int:
    """The prompt tokens `truncate_prompt_tokens` keeps (k >= 1, or -1): k, or with -1 the longest prompt the
    engine admits, `max_model_len - 1` (it leaves room for the one token every request generates)."""
    return max_model_len - 1 if truncate_prompt_tokens == -1 else truncate_prompt_tokens


class RequestOutputKind(enum.Enum):
    """vLLM's: what each output of a streamed request holds. `LLM.generate` returns every request's final
    output whatever its params say (vLLM's LLM sets FINAL_ONLY), so `output_kind` changes nothing here."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16         # None: up to the model's context length
    # tokens generated before an end-of-sequence or stop token id may be sampled, or a stop string end
    # the output (vLLM's)
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None         # number of top alternatives per token (0: the sampled one only)
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (vLLM's)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # token id -> added to its logit before any sampling step, in [-100, 100]; ids are checked against the
    # model's vocabulary when the request is added
    logit_bias: dict[int, float] | None = None
    # vLLM's: the only token ids the request may sample (checked against the vocabulary as logit_bias' are);
    # its logprobs stay those of the model's whole distribution, as logit_bias leaves them
    allowed_token_ids: list[int] | None = None
    # vLLM's: the prompt's last k tokens only (left truncation), -1 for as many as the context admits
    truncate_prompt_tokens: int | None = None
    # vLLM's: words the output may not contain, each as its tokens at the text's start and after a space
    # (`bad_words_token_ids`, which the frontend fills from the tokenizer: `resolve_bad_words`)
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: at most this many generated tokens inside the thinking block, then `</think>` is the next token
    # (engine/thinking_budget.py); None: no cap. The block is marked by `think_tags`, the (<think>, </think>) ids
    # (a server's reasoning parser's; else the tokenizer's, filled when the request is added), and opens at the
    # first generated token where `in_think` (a server's chat sets it as its reasoning parser reads the prompt;
    # None: where the prompt's last think tag is <think>), else where the output's first token is <think>
    thinking_token_budget: int | None = None
    think_tags: tuple[int, int] | None = None
    in_think: bool | None = None
    # vLLM's: a secret mixed into the hash of the prompt's first block (so into every block's, through the
    # chain): requests of different salts share no prefix-cache block, so one tenant cannot learn from its
    # time to first token whether another's prompt began as its own did (a cache-timing side channel). A
    # secret: no repr or log line shows it.
    cache_salt: str | None = field(default=None, repr=False)
    extra: dict = field(default_factory=dict)
    # vLLM's fields taken where they change nothing here (other values are refused, naming the field):
    # best_of None or n, detokenize True, no logits_processors. spaces_between_special_tokens either way: the
    # output is decoded as the fast tokenizer joins special tokens, which takes no such option (neither does
    # vLLM's detokenizer of a fast tokenizer). extra_args is data for plugins, as vLLM's, which no in-tree
    # sampler reads. output_kind any `RequestOutputKind` (see there).
    best_of: int | None = None
    detokenize: bool = True
    spaces_between_special_tokens: bool = True
    logits_processors: list | None = None
    extra_args: dict | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or [])]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.seed == -1:          # vLLM's "no seed"
            self.seed = None
        if self.logit_bias:
            self.logit_bias = self._parse_logit_bias(self.logit_bias)
        else:
            self.logit_bias = None
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise SamplingParamError("structured_outputs", "structured_outputs must be a StructuredOutputsParams")
        self._check()
        if self.think_tags is not None:
            self.think_tags = tuple(self.think_tags)
        if 0 < self.temperature < MIN_TEMPERATURE:
            # vLLM's floor: logits scaled by a smaller one can overflow to inf
            self.temperature = MIN_TEMPERATURE

    @staticmethod
    def _parse_logit_bias(bias) -> dict[int, float]:
        """Keys as ints (JSON sends them as strings), values as floats in [-100, 100]."""
        if not isinstance(bias, dict):
            raise SamplingParamError("logit_bias", "logit_bias must be a map of token ids to numbers")
        parsed = {}
        for key, value in bias.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise SamplingParamError("logit_bias", f"logit_bias key {shown(key)} is not a token id") from None
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
                raise SamplingParamError("logit_bias", f"logit_bias value for token {token} must be in "
                                         f"[-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], got {shown(value)}")
            if token < 0:
                raise SamplingParamError("logit_bias", f"logit_bias token id {token} must be >= 0")
            parsed[token] = float(value)
        return parsed

    def _check(self):
        def bad(name, value, limit):
            raise SamplingParamError(name, f"{name} must be {limit}, got {shown(value)}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            bad("n", self.n, "an integer >= 1")
        if not self.temperature >= 0:        # NaN too: the sampler would take its NaN scores' argmax, token 0
            bad("temperature", self.temperature, ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            bad("top_k", self.top_k, "an integer: 0 or -1 (disabled) or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", self.min_p, "in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            bad("repetition_penalty", self.repetition_penalty, "> 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if self.min_tokens and self.structured_outputs is not None:
            # the grammar decides where the output ends: held-back end tokens would leave it no token
            bad("min_tokens", self.min_tokens, "0 with structured outputs (the grammar decides the length)")
        # counts of alternatives: a float one fails only inside a step (topk, slicing), which kills the engine core
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= 20):
                bad(name, value, "an integer in [0, 20]")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", self.seed, "an integer")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", self.stop_token_ids, "a list of token ids (integers >= 0)")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids
                or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.allowed_token_ids)):
            bad("allowed_token_ids", self.allowed_token_ids, "a non-empty list of token ids (integers >= 0)")
        if self.bad_words is not None and (not isinstance(self.bad_words, (list, tuple))
                                           or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            bad("bad_words", self.bad_words, "a list of words (non-empty strings)")
        # the sampler bans each word's last token after the rest: a word of no tokens has no last token
        if self.bad_words_token_ids is not None and (
                not isinstance(self.bad_words_token_ids, (list, tuple))
                or any(not isinstance(w, (list, tuple)) or not w
                       or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in w)
                       for w in self.bad_words_token_ids)):
            bad("bad_words_token_ids", self.bad_words_token_ids,
                "a list of words, each a non-empty list of token ids (integers >= 0)")
        self.check_some_token_allowed()
        budget = self.thinking_token_budget
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
            bad("thinking_token_budget", budget, "an integer >= 0 (or None: no budget)")
        if self.think_tags is not None and not valid_think_tags(self.think_tags):
            bad("think_tags", self.think_tags, THINK_TAGS)
        if self.in_think is not None and not isinstance(self.in_think, bool):
            bad("in_think", self.in_think, "a bool or None")
        if self.truncate_prompt_tokens is not None and (
                not isinstance(self.truncate_prompt_tokens, int) or isinstance(self.truncate_prompt_tokens, bool)
                or self.truncate_prompt_tokens == 0 or self.truncate_prompt_tokens < -1):
            bad("truncate_prompt_tokens", self.truncate_prompt_tokens, "an integer >= 1, or -1 (the context length)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", self.stop, "non-empty strings (a string or a list of them)")
        if self.best_of is not None and self.best_of != self.n:
            bad("best_of", self.best_of, f"None or n ({self.n}): tokenmill returns every sequence it samples")
        if not self.detokenize:
            bad("detokenize", self.detokenize, "True: tokenmill always detokenizes the output")
        if self.logits_processors:
            bad("logits_processors", self.logits_processors, "None or empty: per-request logits processors are not "
                "run (logit_bias, allowed_token_ids, bad_words and structured_outputs are)")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            bad("cache_salt", self.cache_salt, "a non-empty string")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            bad("extra_args", self.extra_args, "a dict")
        if not isinstance(self.output_kind, RequestOutputKind):
            bad("output_kind", self.output_kind, "a RequestOutputKind")

    @classmethod
    def from_optional(cls, **kwargs) -> SamplingParams:
        """vLLM's: parameters where None stands for the default (as a request's unset fields), except
        `max_tokens`, where None is the model's context length."""
        return cls(**{k: v for k, v in kwargs.items() if v is not None or k == "max_tokens"})

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's), to change without changing this one."""
        return copy.deepcopy(self)

    def resolve_bad_words(self, tokenizer) -> SamplingParams:
        """These params with `bad_words_token_ids` filled from `bad_words` (vLLM's rule): each word's tokens
        at the text's start, and after a space where that gives the word a token of its own (the same number
        of tokens, a different first one). A copy where ids are filled: ids kept in the caller's params
        would outlive a change of its words, or go to a model with another tokenizer."""
        if not self.bad_words_unresolved:
            return self
        if tokenizer is None:
            raise SamplingParamError("bad_words", "bad_words needs the model's tokenizer, and this model has none")
        words = []
        for word in self.bad_words:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            words.append(plain)
            if len(spaced) == len(plain) and spaced[0] != plain[0]:
                words.append(spaced)
        resolved = copy.copy(self)
        resolved.bad_words_token_ids = [w for w in words if w]
        resolved.check_some_token_allowed()
        return resolved

    def check_some_token_allowed(self, eos_token_ids=()) -> None:
        """A SamplingParamError where allowed_token_ids leave the request no token to generate from its first
        token on (the sampler would draw token 0 from a row of -inf): bad words of one token ban them all,
        or, with min_tokens, those they leave are stop tokens or end-of-sequence ones (`eos_token_ids`, the
        model's, which the engine passes), all banned until min_tokens tokens are out."""
        if self.allowed_token_ids is None:
            return
        banned = {w[0] for w in self.bad_words_token_ids or () if len(w) == 1}
        if banned.issuperset(self.allowed_token_ids):
            raise SamplingParamError("bad_words", f"bad_words ban every token of allowed_token_ids "
                                     f"{shown(self.allowed_token_ids)}, which leaves no token to generate")
        ends = set(self.stop_token_ids).union(eos_token_ids)
        if self.min_tokens and (banned | ends).issuperset(self.allowed_token_ids):
            words = sorted(banned.intersection(self.allowed_token_ids))
            allowed = f"allowed_token_ids {shown(self.allowed_token_ids)}"
            which = f"of {allowed}, bad_words ban {shown(words)} and the rest are" if words else f"{allowed} are all"
            raise SamplingParamError("min_tokens", f"{which} stop or end-of-sequence tokens, which min_tokens="
                                     f"{self.min_tokens} bans for the first {self.min_tokens} tokens: no token is left "
                                     "to generate")

    def truncate(self, prompt: list[int], max_model_len: int) -> list[int]:
        """The prompt as `truncate_prompt_tokens` leaves it: its last k tokens; with -1 its last
        `max_model_len - 1`, the longest prompt the engine admits (it leaves room for the one token every
        request generates), so that a prompt longer than the context runs instead of being refused."""
        k = self.truncate_prompt_tokens
        if k is None:
            return prompt
        if k > max_model_len:
            raise SamplingParamError("truncate_prompt_tokens", f"truncate_prompt_tokens {k} is greater than the "
                                     f"maximum context length ({max_model_len} tokens)")
        keep = truncated_length(k, max_model_len)
        return prompt[max(0, len(prompt) - keep):]

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def bad_words_unresolved(self) -> bool:
        """Bad words whose token ids are not filled yet: `resolve_bad_words` needs a tokenizer for them."""
        return bool(self.bad_words) and self.bad_words_token_ids is None

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
