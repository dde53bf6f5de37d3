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


def no_tokenizer(field: str) -> str:
    """The refusal of what needs a tokenizer, on a model served without one."""
    return (f"This model is served without a tokenizer, which '{field}' needs (start the server with --tokenizer "
            "DIR; without one, prompts are lists of token ids and outputs are token ids).")


class PromptTokenizer:
    """Tokenization and chat templates run on one thread of their own, so that one long prompt never
    stalls other clients (or /health); one thread, as a Hugging Face fast tokenizer must not be used from
    two threads at once. Texts over `LONG_TEXT_CHARS` go to a second thread with a copy of the tokenizer,
    so that they delay only each other. `max_model_len` bounds a prompt's characters before it is encoded
    (`_check_chars`); `chat_template` (`--chat-template`) replaces the model's.

    Work that arrives while the thread is busy goes to it together, as one batch: each chat rendered, then
    every text encoded. A trip to the thread costs far more than a short prompt's work when the event loop
    is busy streaming (its result waits behind the loop's other callbacks), so a chat is rendered and
    encoded in one trip, and a burst of requests shares its trips."""

    def __init__(self, tokenizer, max_model_len: int, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.chat_template = chat_template
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        self._long_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenizer-long")
        # the copy the long texts' thread uses, made here where no client waits: a copy serializes the Rust
        # tokenizer holding the GIL (0.2 s and 8 MB for SmolLM2's), which the first long prompt made it
        # take from every stream (1.2 s of the event loop on the CPU machine)
        self._long_tokenizer = copy.deepcopy(tokenizer) if tokenizer is not None else None
        self._template_reads: dict[str, bool] = {}
        # what waits for the thread: ("text", text, add_special_tokens) or ("chat", messages,
        # add_generation_prompt, template kwargs, add_special_tokens, fits), each with the future its caller
        # awaits
        self._waiting: list[tuple[tuple, asyncio.Future]] = []
        self._at_thread = 0           # batches sent to the thread whose results have not come back
        # a batch's requests all wait for its last text: a few texts a core keep the cores busy without
        # holding the first of a burst back until the whole burst is encoded
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.batch_max = 4 * cores
        vocab = getattr(getattr(tokenizer, "hf", None), "get_vocab", None)
        self._max_token_chars = max((len(t) for t in vocab()), default=0) if vocab else 0

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _need_tokenizer(self, param: str) -> None:
        if self.tokenizer is None:
            raise APIError(400, no_tokenizer(param), param)

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

    async def encode(self, text: str, add_special_tokens: bool, param: str = "prompt",
                     fits: bool = True) -> list[int]:
        """The text's ids. Texts that arrive while the tokenizer thread is busy wait for it together and
        are then encoded in `encode_batch` calls of a few texts a core, which spread them over the cores:
        a burst of requests is tokenized in batches, not one by one. `fits`: a text sure not to fit the
        context is refused without tokenizing it (not for /tokenize, which counts any text)."""
        self._need_tokenizer(param)
        if fits:
            self._check_chars(text, param)
        if len(text) > LONG_TEXT_CHARS:
            return await self._encode_apart(text, add_special_tokens)
        return await self._submit(("text", text, add_special_tokens))

    async def _encode_apart(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = await asyncio.get_running_loop().run_in_executor(self._long_pool, self._encode_long, text,
                                                               add_special_tokens)
        if isinstance(ids, BaseException):
            raise ids
        return ids

    async def _submit(self, job: tuple):
        done = asyncio.get_running_loop().create_future()
        self._waiting.append((job, done))
        self._send_waiting()
        return await done

    def _send_waiting(self) -> None:
        """Sends what waits to the thread: a batch of up to `batch_max` when none is there, and a second one
        behind it only when that one is full, so that the thread starts it while the loop takes the first's
        results (which wait behind the loop's other callbacks when it is busy streaming)."""
        while self._waiting and (self._at_thread == 0 or (self._at_thread == 1 and
                                                          len(self._waiting) >= self.batch_max)):
            batch, self._waiting = self._waiting[:self.batch_max], self._waiting[self.batch_max:]
            try:
                sent = asyncio.get_running_loop().run_in_executor(self._pool, self._run_batch,
                                                                  [job for job, _ in batch])
            except RuntimeError as e:             # the pool is shut down (the process is exiting)
                self._settle(batch, [e] * len(batch))
                continue
            self._at_thread += 1
            sent.add_done_callback(lambda sent, batch=batch: self._deliver(batch, sent))

    def _deliver(self, batch: list[tuple[tuple, asyncio.Future]], sent: asyncio.Future) -> None:
        self._at_thread -= 1
        if sent.cancelled():                      # the loop is closing
            return
        self._settle(batch, [sent.exception()] * len(batch) if sent.exception() is not None else sent.result())
        self._send_waiting()

    @staticmethod
    def _settle(batch: list[tuple[tuple, asyncio.Future]], results: list) -> None:
        for (_, done), result in zip(batch, results):
            if done.done():                       # its request was cancelled meanwhile
                continue
            if isinstance(result, BaseException):
                done.set_exception(result)
            else:
                done.set_result(result)

    def _run_batch(self, jobs: list[tuple]) -> list:
        """On the tokenizer thread: each chat rendered and checked, then every text encoded (`_encode_batch`).
        A text's result is its ids, a chat's (its text, its ids), or (its text, None) when it is longer than
        `LONG_TEXT_CHARS` and must be encoded apart; a job that fails gets its error."""
        out: list = [None] * len(jobs)
        texts: list[tuple[int, str, bool]] = []        # (job, text, add_special_tokens)
        for i, job in enumerate(jobs):
            if job[0] == "text":
                texts.append((i, job[1], job[2]))
                continue
            _, messages, add_generation_prompt, template_kwargs, add_special_tokens, fits = job
            try:
                text = self._render(messages, add_generation_prompt, template_kwargs)
                if fits:
                    self._check_chars(text, "messages")
            except APIError as e:
                out[i] = e
                continue
            if len(text) > LONG_TEXT_CHARS:
                out[i] = (text, None)
            else:
                texts.append((i, text, add_special_tokens))
        for (i, text, _), ids in zip(texts, self._encode_batch([(t, a) for _, t, a in texts])):
            out[i] = ids if isinstance(ids, BaseException) or jobs[i][0] == "text" else (text, ids)
        return out

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

    async def decode(self, ids: list[int], param: str = "tokens") -> str:
        self._need_tokenizer(param)
        return await self._off_loop(lambda: self.tokenizer.decode(ids, skip_special_tokens=False))

    def template_reads(self, name: str) -> bool:
        """Whether the chat template (`--chat-template`'s, else the model's, every named one of a model with
        several) reads the variable `name`. A template Jinja cannot parse here counts as reading it, so
        that only the render decides about it."""
        if name not in self._template_reads:
            self._template_reads[name] = _template_reads(
                self.chat_template or getattr(getattr(self.tokenizer, "hf", None), "chat_template", None), name)
        return self._template_reads[name]

    async def render_chat(self, messages: list[dict], add_generation_prompt: bool, add_special_tokens: bool = False,
                          fits: bool = True, template_kwargs: dict | None = None) -> tuple[str, list[int]]:
        """The chat template rendered, and encoded (the rendered text holds its special tokens; the
        tokenizer's are added only with `add_special_tokens`). `template_kwargs` (tools,
        continue_final_message, the request's chat_template_kwargs) go to the template, as one dict: a
        client's key never meets this call's own parameters; `--chat-template` replaces the model's. `fits`
        as `encode`'s."""
        self._need_tokenizer("messages")
        template_kwargs = dict(template_kwargs or {})
        if self.chat_template is not None:
            template_kwargs["chat_template"] = self.chat_template
        text, ids = await self._submit(("chat", messages, add_generation_prompt, template_kwargs, add_special_tokens,
                                        fits))
        if ids is None:
            ids = await self._encode_apart(text, add_special_tokens)
        return text, ids

    def _render(self, messages: list[dict], add_generation_prompt: bool, template_kwargs: dict) -> str:
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      **template_kwargs)
        except Exception as e:      # template errors (e.g. a role the template refuses) are the caller's
            # the first line only: transformers appends the whole rendered prompt to some ("Rendered chat:"),
            # the operator's system prompt included
            reason = str(e).split("\n", 1)[0][:300]
            raise APIError(400, f"Cannot apply the chat template: {reason}", "messages") from None
        if not isinstance(text, str):
            raise APIError(400, "The chat template did not render to text.", "messages")
        return text


def _generation_tag():
    """A Jinja extension for transformers' `{% generation %}...{% endgeneration %}` (it marks the
    assistant's tokens; SmolLM3's template has it), read as its body alone: only to find which variables a
    template uses."""
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return GenerationTag


def _template_reads(template, name: str) -> bool:
    """`PromptTokenizer.template_reads` for a template source (or a dict of named ones; None: no template)."""
    if template is None:
        return False
    sources = template.values() if isinstance(template, dict) else [template]
    import jinja2
    from jinja2 import meta
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", "jinja2.ext.do", _generation_tag()])
    for source in sources:
        try:
            if name in meta.find_undeclared_variables(env.parse(source)):
                return True
        except jinja2.TemplateSyntaxError:       # a tag of another renderer's own
            return True
    return False
