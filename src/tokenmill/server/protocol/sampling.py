"""`_SamplingRequest`: the fields completions and chat completions share (sampling, stop conditions, output
constraints, streaming, vLLM's extensions) and how they become the engine's `SamplingParams`."""
from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar

from pydantic import Field, field_validator, model_validator

from tokenmill.sampling_params import SamplingParams
from tokenmill.server.protocol.base import (
    INT64_MAX, INT64_MIN, MAX_BAD_WORD_CHARS, MAX_BAD_WORDS, MAX_LOGPROBS, MAX_N, MAX_REQUEST_ID, MAX_STOP, MAX_XARGS,
    PROMPT_CACHE_RETENTIONS, Metadata, UnsupportedValue, _refuse_unsupported, _Strict, numbers_only,
)
from tokenmill.server.protocol.options import (Prediction, PromptCacheOptions, ResponseFormat, StreamOptions,
                                               StructuredOutputs)
from tokenmill.server.protocol.tools import check_tools_chars


class _SamplingRequest(_Strict):
    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = 1
    max_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    min_p: float | None = None
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, le=INT64_MAX)]],
                              Field(max_length=MAX_STOP, fail_fast=True)] | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # vLLM's: each prompt token's logprob and this many alternatives (completions: in each choice; chat: in
    # the response), not with stream
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    user: str | None = None
    priority: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = 0
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: Annotated[list[Annotated[int, Field(ge=0, le=INT64_MAX)]],
                                 Field(min_length=1, fail_fast=True)] | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    # vLLM's: the logprobs' tokens as "token_id:{id}" (the text of two tokens may be equal)
    return_tokens_as_token_ids: bool | None = None
    bad_words: Annotated[list[Annotated[str, Field(max_length=MAX_BAD_WORD_CHARS)]],
                         Field(max_length=MAX_BAD_WORDS, fail_fast=True)] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1, fail_fast=True)] | None = None
    guided_grammar: str | None = None
    # vLLM's: requests share prefix-cache blocks only with requests of the same salt (`SamplingParams.cache_salt`)
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    # vLLM's: the id the response is named by ("cmpl-{id}", "chatcmpl-{id}") and the request logged under,
    # unless an X-Request-Id header gives one (`Serving.response_id`)
    request_id: Annotated[str, Field(max_length=MAX_REQUEST_ID)] | None = None
    # vLLM's: the prompt's token ids and each choice's generated ones in the answer (streamed: the prompt's
    # with a choice's first chunk, and each chunk's new tokens)
    return_token_ids: bool | None = None
    # vLLM's: at most this many tokens inside the thinking block, then `</think>` (needs --reasoning-parser);
    # its lower bound is SamplingParams', whose 400 names the value
    thinking_token_budget: Annotated[int, Field(le=INT64_MAX)] | None = None
    # vLLM's: either value changes nothing (`SamplingParams.spaces_between_special_tokens`)
    spaces_between_special_tokens: bool | None = True
    # vLLM's data for sampling plugins (`SamplingParams.extra_args`), which no sampler here reads
    vllm_xargs: Annotated[dict[str, str | int | float | Annotated[list[str | int | float], Field(fail_fast=True)]],
                          Field(max_length=MAX_XARGS)] | None = None

    # Fields that change nothing here: accepted as OpenAI defines them.
    metadata: Metadata | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: PROMPT_CACHE_RETENTIONS | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    safety_identifier: str | None = None
    # OpenAI's predicted output: a guess at the answer that speeds decoding up and leaves the answer as it is
    prediction: Prediction | None = None

    # `_UNSUPPORTED` fields a request type does honor (its own field's type checks them instead)
    honored: ClassVar[frozenset[str]] = frozenset()

    _numbers_only = field_validator("logit_bias", mode="before")(numbers_only)

    # OpenAI fields accepted only at a no-op value (see `_UNSUPPORTED`).
    suffix: Any = None
    best_of: Any = None
    functions: Any = None
    function_call: Any = None
    store: Any = None
    service_tier: Any = None
    reasoning_effort: Any = None
    modalities: Any = None
    audio: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    chat_template: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structural_tag: Any = None
    logits_processors: Any = None
    kv_transfer_params: Any = None
    mm_processor_kwargs: Any = None
    media_io_kwargs: Any = None
    prompt_embeds: Any = None

    @model_validator(mode="after")
    def _check_unsupported(self):
        _refuse_unsupported(self, self.honored)
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise UnsupportedValue("best_of", "'best_of' is not supported by tokenmill (only best_of == n is accepted)")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedValue("stream_options", "'stream_options' is only allowed when 'stream' is true")
        if self.prompt_logprobs is not None and self.stream:
            raise UnsupportedValue("prompt_logprobs", "'prompt_logprobs' is not available when 'stream' is true")
        self.structured_spec()
        return self

    def structured_spec(self) -> tuple[str, dict[str, Any]] | None:
        """The one output constraint asked for, as (the field that asked, {kind: value}), or None."""
        asked: list[tuple[str, dict[str, Any]]] = []
        # OpenAI's JSON modes (and tool calls) are decoded in compact JSON, separators as json.dumps writes
        # them: free whitespace between tokens lets a model loop on newlines until max_tokens
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append(("response_format", {"json_object": True, "disable_any_whitespace": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise UnsupportedValue("response_format", "response_format of type 'json_schema' needs "
                                                          "'json_schema.schema'")
            asked.append(("response_format", {"json": rf.json_schema.schema_, "disable_any_whitespace": True}))
        if self.structured_outputs is not None:
            asked.append(("structured_outputs", self.structured_outputs.spec()))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                asked.append((name, {kind: getattr(self, name)}))
        asked += self._extra_constraints()
        if any(name == "tool_choice" for name, _ in asked):
            # a call that tool_choice forces is decoded under the tools' schemas, and leaves no message content
            # for response_format to shape: both are taken, as OpenAI and vLLM take them (the Agents SDK sends an
            # agent's output_type beside a forced tool choice)
            asked = [(name, kinds) for name, kinds in asked if name != "response_format"]
        if len(asked) > 1:
            raise UnsupportedValue(asked[1][0], "only one output constraint per request: "
                                               + ", ".join(f"'{name}'" for name, _ in asked) + " were given")
        return asked[0] if asked else None

    def _extra_constraints(self) -> list[tuple[str, dict[str, Any]]]:
        return []

    def _auto_tools(self) -> bool:
        """Whether the model may call tools or answer (tools shown, tool_choice "auto")."""
        return False

    def field_of(self, param: str | None) -> str | None:
        """The request's own field for an error about its output constraint, which the engine names by its
        `structured_outputs` (the schema of a response_format, or of the tools a tool_choice forces; in the
        structural tag of tools beside a response_format, by the path of the part it is about)."""
        if param is None or not param.startswith("structured_outputs"):
            return param
        from tokenmill.server.tool_choice import CALLS_PATH
        if param.startswith(f"structured_outputs.structural_tag.{CALLS_PATH}"):
            return "tools"
        spec = self.structured_spec()
        origin = spec[0] if spec is not None else None
        return {None: param, "structured_outputs": param, "tool_choice": "tools"}.get(origin, origin)

    def structured_params(self, call_form=None):
        """The engine's StructuredOutputsParams for the request's constraint, or None. `call_form`: how the
        server's tool-call parser writes calls (`tool_parsers.base.CallForm`), where tool_choice "auto" reads them."""
        spec = self.structured_spec()
        if spec is None:
            return None
        from tokenmill.sampling_params import StructuredOutputsParams
        field, kinds = spec
        if call_form is not None and field == "response_format" and self._auto_tools():
            # the format shapes the answer, not the calls the model may write instead (as OpenAI has it)
            from tokenmill.server.tool_choice import calls_or_format
            schema = {"type": "object"} if "json_object" in kinds else kinds["json"]
            check_tools_chars([t.function for t in self.tools])
            try:
                tag = calls_or_format(self.tools_in_use(), call_form, schema,
                                      parallel_tool_calls=getattr(self, "parallel_tool_calls", None) is not False)
            except ValueError as e:
                raise UnsupportedValue("tools", f"cannot constrain the output to these tools: {e}") from None
            # a schema's error names the part of the tag it is in (`field_of`)
            return StructuredOutputsParams(structural_tag=json.dumps(tag), disable_any_whitespace=True)
        if "tools" in kinds:
            from tokenmill.server.tool_choice import required_tools_schema
            tools, choice = kinds["tools"]
            try:
                schema = required_tools_schema(tools, choice,
                                               parallel_tool_calls=getattr(self, "parallel_tool_calls", None) is not False)
            except ValueError as e:
                raise UnsupportedValue("tool_choice", f"cannot constrain the output to these tools: {e}") from None
            return StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        try:
            return StructuredOutputsParams(**kinds)
        except ValueError as e:
            raise UnsupportedValue(field, f"{field}: {e}") from None

    def token_bias(self) -> dict[int, float] | None:
        """`logit_bias` with integer keys; range and vocabulary checks happen in SamplingParams."""
        if not self.logit_bias:
            return None
        out = {}
        for key, value in self.logit_bias.items():
            # decimal digits only: int() also takes "5_0", " 7 " and non-ASCII digits, each a mistyped key
            # that would bias some other token
            # and at most 19 digits (int64): int() refuses past 4,300 with a message about Python
            if not (key.isascii() and key.isdigit()) or len(key) > 19:
                raise UnsupportedValue("logit_bias", f"logit_bias keys are token ids, got {key[:40]!r}"
                                                     + (f" ({len(key)} characters)" if len(key) > 40 else ""))
            out[int(key)] = float(value)
        return out

    def stream_usage(self) -> tuple[bool, bool]:
        """(a last chunk with the usage, the usage so far in every chunk). vLLM's continuous_usage_stats alone
        asks for both, as vLLM reads it (its include_usage defaults to true); OpenAI's options alone give the
        usage chunk only where include_usage says so."""
        opts = self.stream_options
        if opts is None:
            return False, False
        include = bool(opts.continuous_usage_stats) if opts.include_usage is None else opts.include_usage
        return include, include and bool(opts.continuous_usage_stats)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def max_tokens_field(self) -> str:
        """The field `requested_max_tokens` reads, as refusals name it."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def sampling_params(self, logprobs: int | None, defaults: dict | None = None, call_form=None,
                        **overrides) -> SamplingParams:
        """Build the engine's parameters; raises ValueError naming a bad value and its limit. `defaults`:
        the fields a request that leaves them unset takes (`generation_config.sampling_defaults`);
        `call_form`: `structured_params`'."""
        kw: dict[str, Any] = dict(
            n=self.n or 1,
            max_tokens=self.requested_max_tokens(),
            min_tokens=self.min_tokens or 0,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs,
            skip_special_tokens=True if self.skip_special_tokens is None else self.skip_special_tokens,
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            prompt_logprobs=self.prompt_logprobs,
        )
        defaults = defaults or {}
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if value is None:
                value = defaults.get(name)
            if value is not None:
                kw[name] = float(value)
        top_k = self.top_k if self.top_k is not None else defaults.get("top_k")
        if top_k is not None:
            kw["top_k"] = int(top_k)
        if self.seed is not None:
            kw["seed"] = self.seed
        bias = self.token_bias()
        if bias:
            kw["logit_bias"] = bias
        if self.allowed_token_ids is not None:
            kw["allowed_token_ids"] = self.allowed_token_ids
        if self.truncate_prompt_tokens is not None:
            kw["truncate_prompt_tokens"] = self.truncate_prompt_tokens
        if self.bad_words:
            kw["bad_words"] = self.bad_words
        if self.cache_salt is not None:
            kw["cache_salt"] = self.cache_salt
        if self.thinking_token_budget is not None:
            kw["thinking_token_budget"] = self.thinking_token_budget
        if self.vllm_xargs is not None:
            kw["extra_args"] = self.vllm_xargs
        constraint = self.structured_params(call_form)
        if constraint is not None:
            kw["structured_outputs"] = constraint
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return SamplingParams(**kw)
