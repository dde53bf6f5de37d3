"""The frontend half of the engine: the core's token ids in, cumulative `RequestOutput`s out.

Detokenization, stop strings, logprob text and output assembly happen here, in the process that serves
the requests (the API server, or the offline `LLM` beside its engine), not in the engine core, whose
step then does scheduling, the model and sampling only. A stop string found here finishes the sequence
at once and is reported back (`process` returns it) so that the core stops it and frees its blocks;
tokens of that sequence already in flight in the core are dropped when they arrive.

Each request's `RequestOutput` is one object, updated in place: token lists grow by appending, so a
step costs the frontend work in proportion to the tokens it made. Logprobs stay the core's numbers, in
`FlatLogprobs`: their dicts of `Logprob` are built where a response is encoded, not here on the event loop.
"""
from __future__ import annotations

import logging

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.step_outputs import StepOutputs
from tokenmill.outputs import CompletionOutput, FlatLogprobs, RequestMetrics, RequestOutput

logger = logging.getLogger("tokenmill")


class _Sequence:
    __slots__ = ("out", "detok", "finished")

    def __init__(self, out: CompletionOutput, detok: IncrementalDetokenizer | None):
        self.out = out
        self.detok = detok
        self.finished = False


class _Request:
    __slots__ = ("output", "seqs", "num_finished", "logprobs")

    def __init__(self, output: RequestOutput, seqs: list[_Sequence], logprobs: int | None):
        self.output = output
        self.seqs = seqs
        self.num_finished = 0
        self.logprobs = logprobs


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._requests: dict[int, _Request] = {}
        self._handles: dict[str, int] = {}
        self._token_text: dict[int, str] = {}
        self._token_bytes: dict[int, bytes] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, handle: int, request_id: str, prompt_token_ids: list[int], params, prompt: str | None = None,
            arrival_time: float = 0.0) -> RequestMetrics:
        """Registers a request before its first report can arrive; returns its times, which the reports
        fill in."""
        seqs = []
        want_logprobs = params.logprobs is not None
        for i in range(params.n):
            out = CompletionOutput(index=i, text="", token_ids=[],
                                   cumulative_logprob=0.0 if want_logprobs else None,
                                   logprobs=FlatLogprobs(self.token_text) if want_logprobs else None)
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop,
                                               params.skip_special_tokens, params.include_stop_str_in_output,
                                               params.min_tokens)
            seqs.append(_Sequence(out, detok))
        output = RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids,
                               outputs=[s.out for s in seqs], finished=False,
                               metrics=RequestMetrics(arrival_time=arrival_time))
        self._requests[handle] = _Request(output, seqs, params.logprobs)
        self._handles[request_id] = handle
        return output.metrics

    def forget(self, request_id: str, handle: int | None = None) -> None:
        """Drops a request (aborted, failed, or its reader gone); later reports of it are ignored. With
        `handle`, only if the id still names that request (a new one may have taken the id since)."""
        if handle is not None and self._handles.get(request_id) != handle:
            return
        handle = self._handles.pop(request_id, None)
        if handle is not None:
            self._requests.pop(handle, None)

    def process(self, step: StepOutputs, now: float) -> tuple[list[RequestOutput], list[tuple[str, int]],
                                                             list[tuple[str, Exception]]]:
        """Applies one report: the outputs of the requests it changed (finished ones are forgotten), the
        (request id, index) of each sequence a stop string finished, which the core must stop, and the
        (request id, error) of each request whose output could not be made, now forgotten, which the core
        must abort. A request that fails here fails alone: the others keep every token of the step."""
        requests = self._requests
        touched: dict[int, _Request] = {}
        stops: list[tuple[str, int]] = []
        failed: list[tuple[str, Exception]] = []

        def fail(handle: int, error: Exception) -> None:
            req = requests.pop(handle)
            touched.pop(handle, None)
            rid = req.output.request_id
            self._handles.pop(rid, None)
            logger.exception("request %s: its output could not be made; it is aborted", rid)
            failure = RuntimeError(f"request {rid}: its output could not be made ({type(error).__name__}: {error})")
            failure.__cause__ = error
            failed.append((rid, failure))
        for handle, first_scheduled, cached in step.started:
            req = requests.get(handle)
            if req is not None:
                req.output.metrics.first_scheduled_time = first_scheduled
                req.output.num_cached_tokens = cached
        for handle, raw in step.prompt_logprobs:
            req = requests.get(handle)
            if req is not None:
                flat = FlatLogprobs(self.token_text)
                for token, entry in zip(req.output.prompt_token_ids, raw):
                    if entry is None:
                        flat.append_none()
                    else:
                        flat.append(token, *entry)
                req.output.prompt_logprobs = flat
        logprobs = step.logprobs
        # a sequence that ends on an end-of-sequence or stop token id: that last token is not text
        silent = {f[4] for f in step.finished if f[4] >= 0}
        for j, (handle, index, token) in enumerate(zip(step.handles.tolist(), step.indexes.tolist(),
                                                        step.tokens.tolist())):
            req = requests.get(handle)
            if req is None:
                continue
            seq = req.seqs[index]
            if seq.finished:
                continue          # a stop string ended it; the core had this token in flight
            out = seq.out
            try:
                out.token_ids.append(token)
                if req.logprobs is not None and j in logprobs:
                    # the step's rows hold as many alternatives as the batch's largest ask: this request's own
                    values, ids, rank = logprobs[j]
                    k = req.logprobs + 1
                    out.logprobs.append(ids[0], values[0], rank, ids[1:k], values[1:k])
                    out.cumulative_logprob += values[0]
                detok = seq.detok
                if detok is not None and not (silent and j in silent):
                    out.text = ""       # the detokenizer's text is then referred to once, and grows in place
                    hit = detok.add(token)
                    if hit is not None:
                        self._finish(req, seq, "stop", hit)
                        stops.append((req.output.request_id, index))
                    else:
                        out.text = detok.output_text(False)
            except Exception as e:
                fail(handle, e)
                continue
            touched[handle] = req
        for handle, index, reason, stop_reason, _ in step.finished:
            req = requests.get(handle)
            if req is None or req.seqs[index].finished:
                continue
            try:
                self._finish(req, req.seqs[index], reason, stop_reason)
            except Exception as e:
                fail(handle, e)
                continue
            touched[handle] = req
        outputs = []
        for handle, req in touched.items():
            output = req.output
            metrics = output.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            if req.num_finished == len(req.seqs):
                output.finished = True
                metrics.finished_time = now
                del requests[handle]
                self._handles.pop(output.request_id, None)
            outputs.append(output)
        return outputs, stops, failed

    def _finish(self, req: _Request, seq: _Sequence, reason: str, stop_reason) -> None:
        seq.finished = True
        req.num_finished += 1
        out = seq.out
        if seq.detok is not None:
            # the text held back inside a split character, released now, may hold a stop string: it ends
            # the output there (the core has already finished the sequence)
            hit = seq.detok.finish()
            if hit is not None:
                reason, stop_reason = "stop", hit
            out.text = seq.detok.output_text(True)
        out.finish_reason, out.stop_reason = reason, stop_reason

    def token_text(self, token_id: int) -> str | None:
        """One token's text, special tokens included (as logprobs show it)."""
        return self._memo(self._token_text, token_id,
                          lambda: self.tokenizer.decode([token_id], skip_special_tokens=False))

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes one token adds to the text (`Tokenizer.token_bytes`: whole where its text alone is
        part of a character)."""
        return self._memo(self._token_bytes, token_id, lambda: self.tokenizer.token_bytes(token_id))

    def _memo(self, cache: dict, token_id: int, make):
        # a token's text or bytes, kept for the first 200,000 tokens asked for (None without a tokenizer)
        if self.tokenizer is None:
            return None
        value = cache.get(token_id)
        if value is None:
            value = make()
            if len(cache) < 200_000:
                cache[token_id] = value
        return value
