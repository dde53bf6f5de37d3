"""The synchronous engine core: requests in, one scheduling + model step at a time, outputs out."""
from __future__ import annotations

import itertools
import logging
import os
import random
import time

import torch

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.engine import startup_log
from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.tokenizer import Tokenizer, generation_eos_ids
from tokenmill.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
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
        self.model_config = ModelConfig.from_gguf(model_dir) if is_gguf else ModelConfig.from_hf(model_dir)
        tok_dir = config.tokenizer or model_dir
        self.tokenizer = Tokenizer(tok_dir) if Tokenizer.available(tok_dir) else None
        mc = self.model_config
        self.eos_token_ids = set(mc.eos_token_ids) | set(generation_eos_ids(model_dir))
        if self.tokenizer is not None:
            self.eos_token_ids |= set(self.tokenizer.eos_token_ids)
        if config.max_model_len is not None and config.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's "
                             f"max_position_embeddings={mc.max_position_embeddings}")
        max_len = config.max_model_len or mc.max_position_embeddings
        torch.manual_seed(config.seed)
        self.runner = ModelRunner(config, mc, model_dir, max_len)
        capacity = self.runner.num_blocks * config.block_size
        self.max_model_len = min(max_len, capacity)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.scheduling_policy)
        self.groups: dict[str, list[Request]] = {}         # request id -> its n sequences
        self.prompts: dict[str, str | None] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._seed_rng = random.Random(config.seed)
        self._ids = itertools.count()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        # False: `step` returns only finished requests (offline use, which reads nothing else)
        self.emit_unfinished = True
        # overlap host work with the device: process each step after launching the next one
        self.overlap = True
        self._in_flight = None
        self._structured = None      # the StructuredOutputManager, built for the first constrained request
        self.ready_seconds = time.perf_counter() - t0
        startup_log.log_startup(self)

    # ---- requests ----------------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None) -> str:
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompts as lists of token ids")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
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
        self._check_logit_bias(params)
        compiled = self._compile_grammar(params) if params.structured_outputs is not None else None
        base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(62)
        seqs = []
        for i in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            seqs.append(Request(seq_id, prompt_ids, params, max_tokens, base_seed + i, priority,
                                arrival_time, parent_id=request_id, index=i))
            if compiled is not None:
                seqs[-1].grammar = self._structured.sequence_grammar(compiled)
        self.groups[request_id] = seqs
        self.num_prompt_tokens += len(prompt_ids)
        self.prompts[request_id] = text
        for seq in seqs:
            if self.tokenizer is not None:
                self.detokenizers[seq.request_id] = IncrementalDetokenizer(
                    self.tokenizer, prompt_ids, params.stop, params.skip_special_tokens,
                    params.include_stop_str_in_output)
            self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Finishes the given requests at once and frees their blocks; unknown ids are ignored."""
        outputs = []
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            seqs = self.groups.get(rid)
            if seqs is None:
                continue
            for seq in seqs:
                if not seq.status.finished:
                    self.scheduler.finish(seq, RequestStatus.FINISHED_ABORTED)
            outputs.append(self._output(rid))
            self._release(rid)
        return outputs

    def _check_logit_bias(self, params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        bad = next((t for t in params.logit_bias or () if t >= vocab), None)
        if bad is not None:
            raise SamplingParamError("logit_bias", f"logit_bias token id {bad} is out of range: token ids must "
                                     f"be in [0, {vocab}) (the model's vocabulary size is {vocab})")

    def _compile_grammar(self, params: SamplingParams):
        if self.tokenizer is None:
            raise SamplingParamError("structured_outputs", "structured output needs the model's tokenizer, and "
                                     "this model has none")
        if self._structured is None:
            from tokenmill.engine.structured_output import StructuredOutputManager
            self._structured = StructuredOutputManager(self.tokenizer.hf, self.model_config.vocab_size,
                                                       sorted(self.eos_token_ids))
        return self._structured.compile(params.structured_outputs)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    # ---- the step ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and launches the next step, then processes the step launched before it: the host
        work of one step overlaps the device work of the next. A batch with a grammar processes the
        previous step while its own forward runs, before it samples; batches that use penalties (which
        need every token's value on the host) are processed before returning."""
        sched = self.scheduler.schedule()
        previous, launched = self._in_flight, None
        outputs: list[RequestOutput] = []
        settled = False
        if sched:
            constrained = any(r.grammar is not None for r in sched.requests)

            def before_sample(step):
                nonlocal settled
                self.scheduler.update_after_step(sched, step.sample_rows.tolist())
                if constrained and previous is not None:
                    # a grammar's next mask needs the previous token accepted: read that step now,
                    # while this one's forward runs, before this step samples
                    outputs.extend(self._process(previous))
                    settled = True
            launched = self.runner.execute(sched.requests, sched.num_new_tokens, previous, before_sample)
            self._keep_prompt_logprobs(launched.prompt_logprobs)
        self._in_flight = launched
        if previous is not None and not settled:
            outputs += self._process(previous)
        if launched is not None and (not self.overlap or any(r.params.needs_penalties for r in sched.requests)):
            self._in_flight = None
            outputs += self._process(launched)
        return outputs

    def _process(self, step) -> list[RequestOutput]:
        """Writes a finished step's sampled tokens into their requests and applies stop conditions."""
        touched: dict[str, None] = {}
        if step.positions:
            host = step.fetch()
            token_ids = host["token_ids"]
            lp = host.get("logprobs")
            now = time.time()
            for j, row in enumerate(step.sample_rows.tolist()):
                req = step.requests[row]
                if req.status.finished:
                    continue          # aborted or stopped while this step was in flight
                req.resolve(step.positions[j], token_ids[j])
                self._append(req, step.positions[j], token_ids[j], now, None if lp is None else
                             (lp[j], host["logprob_token_ids"][j], host["ranks"][j]))
                touched[req.parent_id] = None
        outputs = []
        for rid in touched:
            finished = all(s.status.finished for s in self.groups[rid])
            if finished or self.emit_unfinished:
                outputs.append(self._output(rid))
            if finished:
                self._release(rid)
        return outputs

    def _append(self, req: Request, position: int, token: int, now: float, logprob_row) -> None:
        self.num_generation_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = now
        req.last_token_time = now
        # a batch samples logprobs when any of its requests asks; only those requests keep them
        if logprob_row is not None and req.logprobs is not None:
            values, ids, rank = logprob_row
            req.logprobs.append(self._logprob_entry(ids[0], values[0], rank, ids[1:], values[1:]))
            req.cumulative_logprob += values[0]
        p = req.params
        status = None
        grammar_ended = req.grammar is not None and self._grammar_ended(req, token)
        if not p.ignore_eos and token in self.eos_token_ids:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, None
        elif token in p.stop_token_ids:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif grammar_ended:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, None
        else:
            detok = self.detokenizers.get(req.request_id)
            if detok is not None and (hit := detok.add(token)) is not None:
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, hit
            elif position + 1 - req.num_prompt_tokens >= req.max_tokens or position + 1 >= self.max_model_len:
                status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            del req.all_token_ids[position + 1:]      # a placeholder of a step launched since
            req.num_pending = 0
            self.scheduler.finish(req, status)

    def _keep_prompt_logprobs(self, scored) -> None:
        """Stores prompt-token logprobs by position (a recomputed prompt, after preemption, rewrites
        the same entries)."""
        for part in scored:
            req = part.request
            if req.prompt_logprobs is None:
                req.prompt_logprobs = [None] * req.num_prompt_tokens
            for j, (value, rank) in enumerate(zip(part.logprobs, part.ranks)):
                pos = part.first_token + j
                req.prompt_logprobs[pos] = self._logprob_entry(req.prompt_token_ids[pos], value, rank,
                                                               part.top_token_ids[j], part.top_logprobs[j])

    @staticmethod
    def _grammar_ended(req: Request, token: int) -> bool:
        """Advances the sequence's grammar by `token`: True once the grammar has terminated (it accepted
        EOS, which it allows only where the output is complete), or if it refuses the token (which the
        mask rules out)."""
        if req.grammar.accept(token):
            return req.grammar.terminated
        logger.warning("request %s: sampled token %d is outside its grammar; finishing it", req.request_id, token)
        return True

    def _logprob_entry(self, token: int, value: float, rank: int, top_ids, top_values) -> dict[int, Logprob]:
        """{token id: Logprob}: the token at its rank, then the most likely ones (ranks 1, 2, ...)."""
        entry = {token: Logprob(value, rank, self._token_text(token))}
        for r, (tid, v) in enumerate(zip(top_ids, top_values)):
            entry.setdefault(tid, Logprob(v, r + 1, self._token_text(tid)))
        return entry

    def _token_text(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _output(self, rid: str) -> RequestOutput:
        seqs = self.groups[rid]
        completions = []
        for s in seqs:
            detok = self.detokenizers.get(s.request_id)
            text = detok.output_text(s.status.finished) if detok is not None else ""
            completions.append(CompletionOutput(
                index=s.index, text=text, token_ids=s.output_token_ids,
                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                logprobs=s.logprobs, finish_reason=s.status.finish_reason, stop_reason=s.stop_reason))
        first = seqs[0]
        metrics = RequestMetrics(
            arrival_time=first.arrival_time,
            first_scheduled_time=min((s.first_scheduled_time for s in seqs if s.first_scheduled_time),
                                     default=None),
            first_token_time=min((s.first_token_time for s in seqs if s.first_token_time), default=None),
            last_token_time=max((s.last_token_time for s in seqs if s.last_token_time), default=None),
            finished_time=max((s.finished_time or 0 for s in seqs), default=None)
            if all(s.status.finished for s in seqs) else None)
        return RequestOutput(request_id=rid, prompt=self.prompts.get(rid), prompt_token_ids=first.prompt_token_ids,
                             outputs=completions, finished=all(s.status.finished for s in seqs),
                             num_cached_tokens=first.num_cached_tokens, metrics=metrics,
                             prompt_logprobs=first.prompt_logprobs)

    def _release(self, rid: str) -> None:
        for s in self.groups.pop(rid):
            self.detokenizers.pop(s.request_id, None)
        self.prompts.pop(rid, None)

    # ---- introspection -----------------------------------------------------------------------------
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
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.num_generation_tokens,
        }
