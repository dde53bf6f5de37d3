"""A request's checks before it is admitted and submitted, and its SamplingParams: the model it names, its
prompts against the context and the vocabulary, the logprob entries it could return, the fields that need a
tokenizer (`RequestChecks`, which `serving.Serving` takes in)."""
from __future__ import annotations

import asyncio

from tokenmill.engine.async_engine import AsyncLLM
from tokenmill.sampling_params import shown
from tokenmill.server.errors import APIError
from tokenmill.server.prompts import PromptTokenizer, no_tokenizer

# the most logprob entries (a token's, or one of its top alternatives) one request may ask for: 300 MB of JSON
# at the most (64 MB held flat until it finishes)
MAX_LOGPROB_ENTRIES = 4_000_000
# and all requests in flight together (admitted and not finished), counted as each could come to: without it,
# a thousand queued requests at the limit above could ask for terabytes
MAX_LOGPROB_ENTRIES_IN_FLIGHT = 4 * MAX_LOGPROB_ENTRIES


def prompt_too_long(max_model_len: int, tokens: int) -> str:
    return (f"This model's maximum context length is {max_model_len} tokens, but the prompt has {tokens} tokens "
            f"(at least 1 token must be left for the completion).")


def most_logprob_entries(prompts: list[list[int]], params, max_model_len: int, prompt_in_each_choice: bool = False
                         ) -> tuple[int, list[str]]:
    """The most logprob entries a request could return, and how they add up (for its refusal).
    `prompt_in_each_choice`: as `RequestChecks.check_room`'s."""
    entries, parts = 0, []
    if params.logprobs is not None:
        tokens = sum(params.max_tokens if params.max_tokens is not None else max_model_len - len(ids)
                     for ids in prompts)
        entries += params.n * tokens * (params.logprobs + 1)
        why = "max_tokens" if params.max_tokens is not None else "to the context's end: no max_tokens"
        parts.append(f"{params.n} choices x {tokens:,} tokens ({why}) x {params.logprobs + 1} entries a token")
    if params.prompt_logprobs is not None:
        tokens = sum(len(ids) for ids in prompts)
        copies = params.n if prompt_in_each_choice else 1
        entries += copies * tokens * (params.prompt_logprobs + 1)
        parts.append(f"{tokens:,} prompt tokens x {params.prompt_logprobs + 1} entries a token"
                     + (f" x {copies} choices each repeating them" if copies > 1 else ""))
    return entries, parts


class RequestChecks:
    """The checks of a request and the building of its SamplingParams, part of `serving.Serving`, whose
    attributes below they read."""
    engine: AsyncLLM                    # its max_model_len
    model_names: list[str]
    vocab_size: int | None              # None: unknown, and token ids are left to the engine to check
    prompts: PromptTokenizer            # its tokenizer (None: served without one)
    sampling_defaults: dict
    tool_parser: object | None          # a tool_parsers.TOOL_PARSERS entry, whose call_form a grammar learns

    def check_model(self, model: str | None):
        if model is not None and model not in self.model_names:
            raise APIError(404, f"The model {shown(model)} does not exist.", "model", "model_not_found")

    def check_prompt(self, ids: list[int], param: str = "prompt") -> list[int]:
        """`param`: the request's field the prompt came from (a chat's is its messages)."""
        if not ids:
            raise APIError(400, "The prompt is empty (0 tokens).", param)
        if len(ids) >= self.engine.max_model_len:
            raise APIError(400, prompt_too_long(self.engine.max_model_len, len(ids)), param,
                           "context_length_exceeded")
        self.check_token_ids(ids, param)
        return ids

    def check_token_ids(self, ids, param: str | None) -> None:
        """A 400 naming the first of `ids` (a list, or a logit_bias's keys) past the vocabulary (nothing to check
        where its size is unknown)."""
        if self.vocab_size is not None:
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise APIError(400, f"Token id {bad} is out of range for a vocabulary of {self.vocab_size}.", param)

    def truncate(self, ids: list[int], params) -> list[int]:
        """The prompt as the request's truncate_prompt_tokens leaves it (the engine's rule, applied here
        before the prompt's checks)."""
        try:
            return params.truncate(ids, self.engine.max_model_len)
        except ValueError as e:
            raise APIError(400, str(e), "truncate_prompt_tokens") from None

    def check_room(self, prompts: list[list[int]], params, max_tokens_param: str = "max_tokens",
                   prompt_in_each_choice: bool = False) -> None:
        """As vLLM's server does: a request whose prompt plus max_tokens exceeds the context is refused
        (the offline API instead stops such a request at the context length, finish_reason "length").
        And a request whose logprobs could come to more than `MAX_LOGPROB_ENTRIES` is refused: the frontend
        holds every entry of a request until it finishes (16 bytes each, `FlatLogprobs`) and its answer's
        JSON is ~75 bytes an entry, so one request of 128 choices x 40,960 tokens x 21 entries would be an
        8 GB answer.
        `max_tokens_param`: the field the client gave max_tokens in; `prompt_in_each_choice`: the answer
        repeats a prompt's logprobs in each of its n choices (completions), so they count n times."""
        limit = self.engine.max_model_len
        longest = max(len(ids) for ids in prompts)
        if params.max_tokens is not None and longest + params.max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{longest + params.max_tokens} tokens ({longest} in the prompt, "
                                f"{params.max_tokens} in the completion). Please reduce the length of the "
                                f"prompt or {max_tokens_param}.", max_tokens_param, "context_length_exceeded")
        entries, parts = most_logprob_entries(prompts, params, limit, prompt_in_each_choice)
        if entries > MAX_LOGPROB_ENTRIES:
            raise APIError(400, f"This request could return {entries:,} logprob entries ({' + '.join(parts)}); at "
                                f"most {MAX_LOGPROB_ENTRIES:,} are returned for one request. Lower max_tokens, n or "
                                f"the number of top logprobs.", "logprobs")

    async def params(self, req, logprobs: int | None, **overrides):
        """The request's SamplingParams; `overrides` replace fields the endpoint decides itself. A chat
        request's grammar learns how the tool-call parser writes calls (`structured_params`). Built on a
        thread: a grammar's schema is built and checked in time that grows with it (3,000 tools held the
        event loop ~0.4 s)."""
        return await asyncio.to_thread(self._params, req, logprobs, **overrides)

    def _params(self, req, logprobs: int | None, **overrides):
        call_form = self.tool_parser.call_form if self.tool_parser is not None else None
        try:
            params = req.sampling_params(logprobs, self.sampling_defaults, call_form, **overrides)
            # tokenized once for all the request's prompts (the params are the request's own)
            params = params.resolve_bad_words(self.prompts.tokenizer)
        except ValueError as e:
            raise APIError(400, str(e), req.field_of(getattr(e, "param", getattr(e, "field", None)))) from None
        if self.vocab_size is not None:
            # the token ids a request names, against the vocabulary here as the engine checks them: the 400 before
            # the request is admitted, not from the engine core after a vocabulary's worth of logit_bias got there
            for field, ids in (("logit_bias", params.logit_bias or ()), ("stop_token_ids", params.stop_token_ids),
                               ("allowed_token_ids", params.allowed_token_ids or ()),
                               ("bad_words", [t for word in params.bad_words_token_ids or () for t in word])):
                self.check_token_ids(ids, req.field_of(field))
            if params.top_k >= self.vocab_size:
                params.top_k = 0
        if self.prompts.tokenizer is None:
            # output text, stop strings and logprobs' token texts are the tokenizer's
            for needs, field in ((params.stop, "stop"), (params.logprobs is not None, "logprobs"),
                                 (params.prompt_logprobs is not None, "prompt_logprobs"),
                                 (params.structured_outputs is not None, "structured_outputs")):
                if needs:
                    raise APIError(400, no_tokenizer(field), req.field_of(field))
        return params
