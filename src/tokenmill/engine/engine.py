"""The engine core: token ids in, one scheduling + model + sampling step at a time, token ids out.

A step reports only what it made (`StepOutputs`: each sampled token, finishes and the rare events);
text, stop strings and cumulative outputs are built by the frontend (`OutputProcessor`), which tells the
core which sequences a stop string ended (`stop_sequences`)."""
from __future__ import annotations

import itertools
import logging
import os
import random
import time

import torch

from tokenmill.config import EngineConfig, ModelConfig, priority_refusal
from tokenmill.engine import startup_log
from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.grammars import Grammars, failed_fills
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.thinking_budget import (ThinkingBudget, grammar_after_block, resolve_think_tags,
                                              starts_in_think, think_tags_unresolved)
from tokenmill.engine.step_outputs import StepOutputs
from tokenmill.engine.step_reader import StepReader, keep_prompt_logprobs
from tokenmill.engine.tokenizer import Tokenizer, generation_eos_ids, plain_eos_ids
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.sampling_params import SamplingParamError, SamplingParams

logger = logging.getLogger("tokenmill")


class LLMEngine:
    def __init__(self, config: EngineConfig):
        t0 = time.perf_counter()
        self.config = config
        model_dir = config.model
        if model_dir.startswith("preset:"):
            from tokenmill.models.presets import resolve_model_path
            model_dir = resolve_model_path(model_dir)
        is_gguf = model_dir.lower().endswith(".gguf")
        if not (os.path.isfile(model_dir) if is_gguf else os.path.isdir(model_dir)):
            raise FileNotFoundError(f"model {'file' if is_gguf else 'directory'} {model_dir!r} does not exist "
                                    "(tokenmill loads local directories and .gguf files only; it never downloads)")
        self.model_name = config.model
        self.model_config = (ModelConfig.from_gguf(model_dir) if is_gguf
                             else ModelConfig.from_hf(model_dir, config.hf_overrides))
        tok_dir = config.tokenizer or model_dir
        self.tokenizer_path = tok_dir if Tokenizer.available(tok_dir) else None   # where a frontend loads it
        # the tokenizer is loaded when first asked for (`tokenizer`): a served engine core, whose frontend
        # tokenizes, needs it only for structured output, and only its EOS id at start, read plainly
        # where the files allow (`plain_eos_ids`)
        self._tokenizer = None
        tokenizer_eos = ()
        if self.tokenizer_path is not None:
            tokenizer_eos = plain_eos_ids(tok_dir)
            if tokenizer_eos is None:
                tokenizer_eos = self.tokenizer.eos_token_ids
        mc = self.model_config
        self.eos_token_ids = set(mc.eos_token_ids) | set(generation_eos_ids(model_dir)) | set(tokenizer_eos)
        if config.max_model_len is not None and config.max_model_len > mc.derived_max_model_len:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's "
                             f"{mc.derived_max_model_len_source}")
        max_len = config.max_model_len or mc.derived_max_model_len
        # the model serves this context from here: LongRoPE's factors are chosen by it, the RoPE tables hold
        # it. A cache sized by hand bounds it before the model is built (the warning below says so); one sized
        # by memory is sized for max_len or refused
        served = max_len if config.num_kv_blocks is None else min(max_len, config.num_kv_blocks * config.block_size)
        self.model_config = mc = mc.serving(served)
        torch.manual_seed(config.seed)
        self.runner = ModelRunner(config, mc, model_dir, served)
        capacity = self.runner.num_blocks * config.block_size
        if config.max_model_len is not None and capacity < config.max_model_len:
            why = (f"max_model_len {config.max_model_len} needs {config.max_model_len} tokens of KV cache for one "
                   f"request, but the cache holds {capacity} ({self.runner.num_blocks} blocks of {config.block_size})")
            if config.num_kv_blocks is None:
                # as vLLM: a context length asked for must fit the cache the memory gives; the model's own
                # default is lowered to what fits
                raise ValueError(f"{why}; raise --gpu-memory-utilization (or set --num-kv-blocks) or lower "
                                 f"--max-model-len to at most {capacity}")
            # a cache sized by hand (num_kv_blocks), smaller on purpose: the length it holds
            logger.warning("%s (num_kv_blocks %d): serving at most %d tokens a request", why, config.num_kv_blocks,
                           capacity)
        self.max_model_len = min(max_len, capacity)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size,
                                          config.enable_prefix_caching, self.runner.num_cpu_blocks)
        self.scheduler = Scheduler.from_config(config, self.block_manager, self.max_model_len)
        self.groups: dict[str, list[Request]] = {}         # request id -> its n sequences
        self._seed_rng = random.Random(config.seed)
        self._ids = itertools.count()
        self.reader = StepReader(self)          # the step report and the token counts
        # overlap host work with the device: process each step after launching the next one
        self.overlap = True
        self._in_flight = None
        self.grammars = Grammars(self)
        self._errors: list[tuple[str, str, str | None]] = []     # `take_errors`'
        self.ready_seconds = time.perf_counter() - t0
        startup_log.log_startup(self)

    # ---- requests ----------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer (None without one), loaded on first use."""
        if self._tokenizer is None and self.tokenizer_path is not None:
            self._tokenizer = Tokenizer(self.tokenizer_path)
        return self._tokenizer

    def add_request(self, request_id: str | None, prompt: list[int], params: SamplingParams | None = None, *,
                    priority: int = 0, arrival_time: float | None = None, handle: int | None = None,
                    carries_tools: bool = False, grammar: tuple | None = None) -> int:
        """Queues a prompt (token ids: frontends tokenize); returns its handle, the number by which the
        step reports name it (`handle`, or a new one). The rest are keywords: vLLM's engine takes an
        arrival time fourth, which here would have been a priority. `carries_tools`: the request offers tools (the
        priority policy's boost). `grammar`: `compile_grammar(params)`'s result, compiled beforehand."""
        params = params or SamplingParams()
        refused = priority_refusal(priority, self.config.scheduling_policy)
        if refused is not None:
            raise SamplingParamError("priority", refused)
        handle = next(self._ids) if handle is None else handle
        request_id = request_id if request_id is not None else str(handle)
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            raise TypeError("the engine core takes prompts as token ids; text is tokenized by its frontend")
        prompt_ids = [int(t) for t in prompt]
        if not prompt_ids:
            raise ValueError("the prompt is empty (0 tokens); at least 1 token is required")
        bad = [t for t in prompt_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range [0, {self.model_config.vocab_size})")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens but the maximum context length is "
                             f"{self.max_model_len} tokens (prompt plus at least 1 generated token)")
        room = self.max_model_len - len(prompt_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        # a frontend resolves both itself: the tokenizer is loaded (`tokenizer`) only for a request that still
        # needs it, not by the first request of a served core
        if params.bad_words_unresolved:
            params = params.resolve_bad_words(self.tokenizer)
        if think_tags_unresolved(params):
            params = resolve_think_tags(params, self.tokenizer)
        self._check_token_ids(params)
        compiled = grammar if grammar is not None or params.structured_outputs is None else self.compile_grammar(params)
        # any integer seed, taken modulo 2**62: each choice's seed (base + index) fits the int64 sampling row
        base_seed = params.seed % (2 ** 62) if params.seed is not None else self._seed_rng.getrandbits(62)
        # the ids min_tokens holds back (read only, shared by the n sequences): end of sequence too where
        # ignore_eos is set (vLLM's rule: min_tokens counts tokens that are not it)
        held_back = [] if not params.min_tokens else sorted(set(params.stop_token_ids) | self.eos_token_ids)
        in_think = params.thinking_token_budget is not None and starts_in_think(params, prompt_ids)
        spec = params.structured_outputs
        if params.thinking_token_budget is not None:
            spec = grammar_after_block(spec, params.think_tags, in_think)
        seqs = []
        for i in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            seqs.append(Request(seq_id, prompt_ids, params, max_tokens, base_seed + i, priority,
                                arrival_time, parent_id=request_id, index=i, carries_tools=carries_tools))
            seqs[-1].handle = handle
            seqs[-1].min_tokens_ids = held_back
            if compiled is not None:
                seqs[-1].grammar = self.grammars.sequence_grammar(compiled, spec)
            if params.thinking_token_budget is not None:
                seqs[-1].thinking = ThinkingBudget(params.think_tags, params.thinking_token_budget, in_think)
        self.groups[request_id] = seqs
        for seq in seqs:
            self.scheduler.add(seq)
        return handle

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Finishes the given requests at once and frees their blocks; unknown ids are ignored."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            seqs = self.groups.pop(rid, None)
            for seq in seqs or ():
                if not seq.status.finished:
                    self.scheduler.finish(seq, RequestStatus.FINISHED_ABORTED)

    def fail_request(self, request_id: str, error: SamplingParamError) -> None:
        """Ends the request as `abort_request` does and keeps its error for `take_errors`."""
        logger.warning("request %s failed: %s", request_id, error)
        self._errors.append((request_id, str(error), error.param))
        self.abort_request(request_id)

    def take_errors(self) -> list[tuple[str, str, str | None]]:
        """The requests the engine failed since the last call, as (request id, message, param): a grammar
        slower than `MAX_FILL_SECONDS` a token, or one that left no token beside the request's allowed_token_ids
        and bad words (`failed_fills`), or bad words that banned every one of its allowed_token_ids
        (`step_reader.no_token_left`). Each is gone from the engine, its blocks freed, as an abort
        leaves it; its frontend fails it with the message (param: the field, as a SamplingParamError's)."""
        errors, self._errors = self._errors, []
        return errors

    def stop_sequences(self, sequences: list[tuple[str, int]]) -> None:
        """Finishes the given (request id, index) sequences, which a stop string ended in the frontend,
        and frees their blocks; a request whose sequences have all finished is gone. Unknown ones are
        ignored."""
        for rid, index in sequences:
            seqs = self.groups.get(rid)
            if seqs is None or not 0 <= index < len(seqs):
                continue
            if not seqs[index].status.finished:
                self.scheduler.finish(seqs[index], RequestStatus.FINISHED_STOPPED)
            if all(s.status.finished for s in seqs):
                del self.groups[rid]

    def _check_token_ids(self, params: SamplingParams) -> None:
        """Token ids a request names (logit_bias, allowed_token_ids, stop_token_ids, bad words, think tags) are in
        the vocabulary: the sampler indexes the logits with them. Its allowed_token_ids leave it a token to
        generate where min_tokens bans the model's end-of-sequence ids (`check_some_token_allowed`, which the
        params ran without them)."""
        vocab = self.model_config.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or ()), ("stop_token_ids", params.stop_token_ids),
                          ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("bad_words", [t for word in params.bad_words_token_ids or () for t in word]),
                          ("think_tags", params.think_tags or ()),
                          ("structured_outputs.think_tags",
                           params.structured_outputs and params.structured_outputs.think_tags or ())):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise SamplingParamError(name, f"{name} token id {bad} is out of range: token ids must be in "
                                         f"[0, {vocab}) (the model's vocabulary size is {vocab})")
        params.check_some_token_allowed(self.eos_token_ids)

    def compile_grammar(self, params: SamplingParams) -> tuple:
        """`params`' compiled grammar, for `add_request` (`Grammars.compile`)."""
        return self.grammars.compile(params)

    def grammar_to_compile(self, params: SamplingParams) -> bool:
        """Whether `params` need a grammar the engine core compiles off its loop (`Grammars.to_compile`)."""
        return self.grammars.to_compile(params)

    def grammar_too_slow(self, params: SamplingParams, seconds: float) -> SamplingParamError:
        """The error of a request whose grammar compiled too long (`Grammars.too_slow`)."""
        return self.grammars.too_slow(params, seconds)

    def cached_grammar(self, params: SamplingParams) -> tuple | None:
        """`compile_grammar(params)` if that grammar is in the cache, else None."""
        return self.grammars.cached(params)

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or a step still to read: one left in flight when its last requests ended
        (aborted, stopped by a string) is read by the next step at once, not when a request next arrives,
        which would count the idle time between as that step's time."""
        return bool(self.groups) or self._in_flight is not None

    # ---- the step ------------------------------------------------------------------------------------
    def step(self) -> StepOutputs:
        """Schedules and launches the next step, then processes the step launched before it: the host
        work of one step overlaps the device work of the next. A batch with a grammar processes the
        previous step while its own forward runs, before it samples."""
        sched = self.scheduler.schedule()
        # before the launch, so that a swap-out reads its blocks before this step may overwrite them
        self.runner.swap(sched.swap_out, sched.swap_in, sched.swap_out_reused)
        previous, launched = self._in_flight, None
        settled = False
        if sched:
            self.reader.report_started(sched.requests)
            constrained = any(r.grammar is not None for r in sched.requests)

            def before_sample(step):
                nonlocal settled
                self.scheduler.update_after_step(sched, step.sample_rows.tolist())
                if constrained and previous is not None:
                    # a grammar's next mask needs the previous token accepted: read that step now,
                    # while this one's forward runs, before this step samples
                    self.reader.read(previous)
                    settled = True
            t_launch = time.perf_counter()
            launched = self.runner.execute(sched.requests, sched.num_new_tokens, previous, before_sample)
            launched.shape = (sched.total_tokens, len(sched.requests), t_launch)
            if constrained:
                # that step's token is dropped: its request is finished when the step is read
                for req, error in failed_fills(sched.requests):
                    self.fail_request(req.parent_id, error)
            keep_prompt_logprobs(launched.prompt_logprobs)
        self._in_flight = launched
        if previous is not None and not settled:
            self.reader.read(previous)
        if launched is not None and not self.overlap:
            self._in_flight = None
            self.reader.read(launched)
        return self.reader.take_report()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block, as vLLM's: False (nothing forgotten) while requests are unfinished."""
        if self.groups:
            logger.warning("prefix cache not reset: %d requests are unfinished", len(self.groups))
            return False
        if self._in_flight is not None:
            # a step launched before its last requests ended (an end-of-sequence or stop token, a stop
            # string), as most requests end: its requests are all finished, so reading it reports nothing,
            # and once read no step is left to write into the blocks forgotten below
            self.step()
        self.block_manager.reset_prefix_cache()
        return True

    # ---- introspection -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stops the model runner's worker processes (tensor parallelism), if any; the engine takes no
        more steps after it. Collecting the engine does the same."""
        self.runner.shutdown()

    def get_stats(self) -> dict:
        bm = self.block_manager
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": bm.usage,
            "num_free_blocks": bm.num_free_blocks,
            "num_total_blocks": bm.num_blocks,
            "peak_blocks_used": bm.peak_blocks_used,
            "prefix_cache_queries": bm.prefix_queries,
            "prefix_cache_hits": bm.prefix_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_swapped": len(self.scheduler.swapped),
            "num_cpu_blocks": bm.num_cpu_blocks,
            "num_free_cpu_blocks": bm.num_free_cpu_blocks,
            "cpu_cache_usage": 1.0 - bm.num_free_cpu_blocks / bm.num_cpu_blocks if bm.num_cpu_blocks else 0.0,
            "swapped_out_blocks": self.scheduler.num_swapped_out_blocks,
            "swapped_in_blocks": self.scheduler.num_swapped_in_blocks,
            "swap_in_cached_blocks": self.scheduler.num_swap_in_cached_blocks,
            "swap_out_bytes": self.scheduler.num_swapped_out_blocks * self.runner.block_bytes,
            "swap_in_bytes": self.scheduler.num_swapped_in_blocks * self.runner.block_bytes,
            "prompt_tokens": self.reader.num_prompt_tokens,
            "generation_tokens": self.reader.num_generation_tokens,
            "iteration_tokens": list(self.reader.iteration_tokens),
        }
