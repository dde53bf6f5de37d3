"""Reading a step the engine launched, once its tokens are on the host: each sampled token written into its
sequence, the token-level stop conditions applied, and the step's report (`StepOutputs`) and token counts
kept."""
from __future__ import annotations

import bisect
import time
import weakref

from tokenmill.engine.grammar_bitmask import bad_words_at
from tokenmill.engine.grammars import grammar_ended
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.step_outputs import ITERATION_TOKENS_BUCKETS, StepOutputs, StepOutputsBuilder
from tokenmill.param_errors import SamplingParamError, shown


class StepReader:
    """Writes steps' tokens into the requests of the `LLMEngine` that holds it, whose scheduler, groups, EOS ids
    and max_model_len it reads. Owns the report of the step being built and the engine's token counts."""

    def __init__(self, engine):
        # a proxy: the engine holds this, and a reference back would keep a dead engine (its weights and KV
        # cache) until a collection found the cycle
        self._engine = weakref.proxy(engine)
        self._report = StepOutputsBuilder()
        self._last_fetch = 0.0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        # steps by their tokens (prompts counted as above, plus generated), one count per bucket of
        # ITERATION_TOKENS_BUCKETS and a last one past them: vLLM's iteration_tokens_total (its sum is
        # num_prompt_tokens + num_generation_tokens, which count nothing else)
        self.iteration_tokens = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)

    def take_report(self) -> StepOutputs:
        """What was reported since the last call."""
        report, self._report = self._report.build(), StepOutputsBuilder()
        return report

    def report_started(self, requests: list[Request]) -> None:
        """Reports each request's first scheduling (once, by its first sequence)."""
        for req in requests:
            if not req.reported_start and req.index == 0:
                req.reported_start = True
                self._report.started.append((req.handle, req.first_scheduled_time, req.num_cached_tokens))

    def read(self, step) -> None:
        """Writes a finished step's sampled tokens into their requests, applies the token-level stop
        conditions (end of sequence, stop token ids, grammar end, length) and reports the tokens."""
        if not step.positions:
            return
        host = step.fetch()
        done = time.perf_counter()
        tokens, seqs, t_launch = step.shape
        # a step's time as its requests see it: from its launch, or from the previous step's tokens if
        # those came later (steps overlap); a step that samples nothing counts into the next one
        self._engine.scheduler.observe_step(tokens, seqs, done - max(t_launch, self._last_fetch))
        self._last_fetch = done
        counted = self.num_prompt_tokens + self.num_generation_tokens
        token_ids = host["token_ids"]
        lp = host.get("logprobs")
        now = time.time()
        report = self._report
        for j, row in enumerate(step.sample_rows.tolist()):
            req = step.requests[row]
            if req.status.finished:
                continue          # aborted or stopped while this step was in flight
            token = token_ids[j]
            req.resolve(step.positions[j], token)
            # allowed_token_ids are rare: the check's call stays off the other requests' tokens
            error = req.params.allowed_token_ids is not None and no_token_left(req, step.positions[j], token)
            if error:
                self._engine.fail_request(req.parent_id, error)
                continue
            if req.first_token_time is None:
                req.first_token_time = now
                # its prompt is computed: counted when prefilled, by each of n sequences as vLLM counts
                # each child request's (so it matches the request_prompt_tokens histogram's sum)
                self.num_prompt_tokens += req.num_prompt_tokens
                if req.params.prompt_logprobs is not None and req.index == 0:
                    # a one-token prompt has nothing scored: its entries are still vLLM's [None]
                    report.prompt_logprobs.append((req.handle, req.prompt_logprobs or [None] * req.num_prompt_tokens))
            # a batch samples logprobs when any of its requests asks; only those requests report them
            report.token(req.handle, req.index, token, None if lp is None or req.params.logprobs is None else
                         (lp[j], host["logprob_token_ids"][j], host["ranks"][j]))
            self._append(req, step.positions[j], token)
        tokens = self.num_prompt_tokens + self.num_generation_tokens - counted
        if tokens:                 # a step whose every row had finished while it ran samples nothing
            self.iteration_tokens[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, tokens)] += 1

    def _append(self, req: Request, position: int, token: int) -> None:
        engine = self._engine
        self.num_generation_tokens += 1
        p = req.params
        status, text = None, False
        if req.thinking is not None:
            req.thinking.accept(token)
        ended = req.grammar is not None and grammar_ended(req, token)
        # a stop or end-of-sequence token's text shows only with include_stop_str_in_output (vLLM's rule; a
        # special token's then as skip_special_tokens has it)
        if not p.ignore_eos and token in engine.eos_token_ids:
            status, req.stop_reason, text = RequestStatus.FINISHED_STOPPED, None, p.include_stop_str_in_output
        elif token in p.stop_token_ids:
            status, req.stop_reason, text = RequestStatus.FINISHED_STOPPED, token, p.include_stop_str_in_output
        elif ended:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, None
        elif position + 1 - req.num_prompt_tokens >= req.max_tokens or position + 1 >= engine.max_model_len:
            status, text = RequestStatus.FINISHED_LENGTH, True
        if status is not None:
            del req.all_token_ids[position + 1:]      # a placeholder of a step launched since
            req.num_pending = 0
            engine.scheduler.finish(req, status)
            report = self._report
            report.finished.append((req.handle, req.index, status.finish_reason, req.stop_reason,
                                    -1 if text else len(report.tokens) - 1))
            seqs = engine.groups.get(req.parent_id)
            if seqs is not None and all(s.status.finished for s in seqs):
                del engine.groups[req.parent_id]


def no_token_left(req: Request, position: int, token: int) -> SamplingParamError | None:
    """The error of a request whose allowed_token_ids its bad words (and min_tokens) left no token at
    sequence position `position`, where the sampler has drawn `token` (token 0, its draw where every
    logit is -inf); None where `token` is one the request allowed there. A word of several tokens bans its
    last only once the output ends with the rest, which the sampler decides on the device (the rest's last
    token may still be in flight when the step launches), so the host learns of it here, before the token
    is reported. A grammar's rows fail at its fill instead (`grammar_bitmask.no_token_left`), and a
    thinking budget's forced `</think>` takes no account of either list."""
    p = req.params
    if p.allowed_token_ids is None or req.grammar is not None or (req.thinking is not None and
                                                                    req.thinking.must_close()):
        return None
    index = position - req.num_prompt_tokens          # `position` is the token's place in the sequence
    banned = bad_words_at(req, index)
    held = set(req.min_tokens_ids) if index < p.min_tokens else set()
    if token in p.allowed_token_ids and token not in banned and token not in held:
        return None
    allowed = set(p.allowed_token_ids)
    also = f", and min_tokens={p.min_tokens} bans {shown(sorted(allowed & held))}" if allowed & held else ""
    return SamplingParamError("bad_words", f"at output token {index} bad_words ban {shown(sorted(allowed & banned))} "
                              f"of allowed_token_ids {shown(p.allowed_token_ids)}{also}: no token is left to generate")


def keep_prompt_logprobs(scored) -> None:
    """Stores prompt-token logprobs by position as (logprob, rank, top ids, top logprobs); a recomputed prompt,
    after preemption, rewrites the same entries."""
    for part in scored:
        req = part.request
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None] * req.num_prompt_tokens
        for j, (value, rank) in enumerate(zip(part.logprobs, part.ranks)):
            req.prompt_logprobs[part.first_token + j] = (value, rank, part.top_token_ids[j], part.top_logprobs[j])
