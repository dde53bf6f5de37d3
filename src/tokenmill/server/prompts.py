"""The API server's tokenization: chat templates rendered, prompts encoded and ids decoded, on a thread of
their own, off the event loop."""
from __future__ import annotations

import asyncio
import copy
import os
from concurrent.futures import ThreadPoolExecutor

from tokenmill.server.errors import APIError

# a text longer than this (0.1-0.2 s of tokenizing on one core) is encoded on a thread of its own with a
# tokenizer of its own, one such text at a time: a prompt near the character limit takes seconds (4M
# characters: ~5 s), and the other clients' prompts must not queue behind it
LONG_TEXT_CHARS = 100_000


class PromptTokenizer:
    """Tokenization and chat templates run on one thread of their own, so that one long prompt never
    stalls other clients (or /health); one thread, as a Hugging Face fast tokenizer must not be used from
    two threads at once. Texts over `LONG_TEXT_CHARS` go to a second thread with a copy of the tokenizer,
    so that they delay only each other. `max_model_len` bounds a prompt's characters before it is encoded
    (`_check_chars`); `chat_template` (`--chat-template`) replaces the model's."""

    def __init__(self, tokenizer, max_model_len: int, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.chat_template = chat_template
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        self._long_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenizer-long")
        self._long_tokenizer = None       # the copy the long texts' thread uses, made there when first needed
        self._template_reads: dict[str, bool] = {}
        self._to_encode: list[tuple[str, bool, asyncio.Future]] = []
        self._encoder: asyncio.Task | None = None      # encoding what waits; held, as the loop keeps weak ones
        # a batch's requests all wait for its last text: a few texts a core keep the cores busy without
        # holding the first of a burst back until the whole burst is encoded
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.batch_max = 4 * cores
        vocab = getattr(getattr(tokenizer, "hf", None), "get_vocab", None)
        self._max_token_chars = max((len(t) for t in vocab()), default=0) if vocab else 0

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _check_chars(self, text: str, param: str) -> None:
        """Refuses, without tokenizing it, a text too long to fit: no token holds more than
        `_max_token_chars` characters, so the text has at least len(text) / that many tokens."""
        per_token = self._max_token_chars
        limit = self.max_model_len
        if per_token and len(text) > per_token * (limit - 1):
            at_least = -(-len(text) // per_token)
            raise APIError(400, f"This model's maximum context length is {limit} tokens, but the prompt has "
                                f"at least {at_least} tokens ({len(text)} characters, no token longer than "
                                f"{per_token}).", param, "context_length_exceeded")

    async def encode(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        """The text's ids. Texts that arrive while the tokenizer thread is busy wait for it together and
        are then encoded in `encode_batch` calls of a few texts a core, which spread them over the cores:
        a burst of requests is tokenized in batches, not one by one."""
        self._check_chars(text, param)
        loop = asyncio.get_running_loop()
        if len(text) > LONG_TEXT_CHARS:
            ids = await loop.run_in_executor(self._long_pool, self._encode_long, text, add_special_tokens)
            if isinstance(ids, BaseException):
                raise ids
            return ids
        done = loop.create_future()
        self._to_encode.append((text, add_special_tokens, done))
        if self._encoder is None or self._encoder.done():
            self._encoder = loop.create_task(self._encode_waiting())
        return await done

    async def _encode_waiting(self) -> None:
        """Encodes what waits, batch after batch, until nothing does (`_to_encode` changes on the loop only;
        after a cancellation what still waits goes with the next call's task)."""
        while self._to_encode:
            cut = self.batch_max
            batch, self._to_encode = self._to_encode[:cut], self._to_encode[cut:]
            try:
                results = await self._off_loop(self._encode_batch, [(t, a) for t, a, _ in batch])
            except asyncio.CancelledError:
                self._to_encode = batch + self._to_encode
                raise
            except Exception as e:                # the pool itself failed: every waiter hears of it
                results = [e] * len(batch)
            for (_, _, done), ids in zip(batch, results):
                if done.done():                   # its request was cancelled meanwhile
                    continue
                if isinstance(ids, BaseException):
                    done.set_exception(ids)
                else:
                    done.set_result(ids)

    def _encode_batch(self, items: list[tuple[str, bool]]) -> list:
        """Each text's ids (or the error encoding it raised), one `encode_batch` per add_special_tokens."""
        out: list = [None] * len(items)
        batched = getattr(self.tokenizer, "encode_batch", None)
        for flag in {a for _, a in items}:
            index = [i for i, (_, a) in enumerate(items) if a == flag]
            texts = [items[i][0] for i in index]
            try:
                results = batched(texts, flag) if batched is not None else None
            except Exception:                        # then one by one: a bad text fails alone
                results = None
            if results is None:
                results = [self._encode_one(t, flag) for t in texts]
            for i, ids in zip(index, results):
                out[i] = ids
        return out

    def _encode_long(self, text: str, add_special_tokens: bool):
        if self._long_tokenizer is None:
            self._long_tokenizer = copy.deepcopy(self.tokenizer)
        batched = getattr(self._long_tokenizer, "encode_batch", None)
        try:
            if batched is not None:
                return batched([text], add_special_tokens)[0]
            return self._long_tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except Exception as e:
            return e

    def _encode_one(self, text: str, add_special_tokens: bool):
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except Exception as e:
            return e

    async def decode(self, ids: list[int]) -> str:
        return await self._off_loop(lambda: self.tokenizer.decode(ids, skip_special_tokens=False))

    def template_reads(self, name: str) -> bool:
        """Whether the chat template (`--chat-template`'s, else the model's, every named one of a model with
        several) reads the variable `name`. A template Jinja cannot parse here counts as reading it, so
        that only the render decides about it."""
        if name not in self._template_reads:
            self._template_reads[name] = _template_reads(
                self.chat_template or getattr(getattr(self.tokenizer, "hf", None), "chat_template", None), name)
        return self._template_reads[name]

    async def render_chat(self, messages: list[dict], add_generation_prompt: bool,
                          **template_kwargs) -> tuple[str, list[int]]:
        """The chat template rendered, and encoded (the rendered text holds its special tokens).
        `template_kwargs` (tools, continue_final_message, the request's chat_template_kwargs) go to the
        template; `--chat-template` replaces the model's."""
        if self.chat_template is not None:
            template_kwargs["chat_template"] = self.chat_template

        def render() -> str:
            try:
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                          **template_kwargs)
            except Exception as e:      # template errors (e.g. a role the template refuses) are the caller's
                raise APIError(400, f"Cannot apply the chat template: {e}", "messages") from None
            if not isinstance(text, str):
                raise APIError(400, "The chat template did not render to text.", "messages")
            return text
        text = await self._off_loop(render)
        return text, await self.encode(text, False, "messages")


def _template_reads(template, name: str) -> bool:
    """`PromptTokenizer.template_reads` for a template source (or a dict of named ones; None: no template)."""
    if template is None:
        return False
    sources = template.values() if isinstance(template, dict) else [template]
    import jinja2
    from jinja2 import meta
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", "jinja2.ext.do"])
    for source in sources:
        try:
            if name in meta.find_undeclared_variables(env.parse(source)):
                return True
        except jinja2.TemplateSyntaxError:       # a tag of the renderer's own (e.g. {% generation %})
            return True
    return False
