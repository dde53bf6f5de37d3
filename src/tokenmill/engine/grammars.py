"""The engine's side of structured output: a request's grammar compiled (or found cached, or given up on
when too slow) and advanced by each sampled token. The `StructuredOutputManager` is built for the first
constrained request, so an engine that serves none never loads xgrammar nor its tokenizer for it."""
from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator

from tokenmill.engine.request import Request
from tokenmill.sampling_params import SamplingParamError, SamplingParams

logger = logging.getLogger("tokenmill")


class Grammars:
    """The compiled grammars of the `LLMEngine` that holds it, whose tokenizer (loaded on first use) and EOS
    ids it reads when the first grammar is compiled."""

    def __init__(self, engine):
        # a proxy: the engine holds this, and a reference back would keep a dead engine (its weights and KV
        # cache) until a collection found the cycle
        self._engine = weakref.proxy(engine)
        self._manager = None

    def to_compile(self, params: SamplingParams) -> bool:
        """Whether `params` need a grammar, whose compile can take seconds (a schema of many tools): the
        engine core compiles one not cached off its loop (`compile`) and adds the request with it."""
        return params.structured_outputs is not None and self._engine.tokenizer is not None

    def compile(self, params: SamplingParams) -> tuple:
        """`params`' compiled grammar, for `add_request`; an invalid spec raises SamplingParamError. One thread
        compiles: the caller's, or the engine core's compile thread while the engine steps."""
        engine = self._engine
        if engine.tokenizer is None:
            raise SamplingParamError("structured_outputs", "structured output needs the model's tokenizer, and "
                                     "this model has none")
        if self._manager is None:
            from tokenmill.engine.structured_output import StructuredOutputManager
            self._manager = StructuredOutputManager(engine.tokenizer.hf, engine.model_config.vocab_size,
                                                    sorted(engine.eos_token_ids))
        return self._manager.compile(params.structured_outputs)

    def too_slow(self, params: SamplingParams, seconds: float) -> SamplingParamError:
        """The error of a request whose grammar has compiled for `seconds`, past MAX_COMPILE_SECONDS: the engine
        core stops waiting for it, and its spec is refused at once from now on."""
        if self._manager is None:        # still being built for the first grammar: nothing to give up on
            from tokenmill.engine.structured_output import compile_error
            return compile_error(params.structured_outputs.kind, seconds)
        return self._manager.gave_up(params.structured_outputs, seconds)

    def cached(self, params: SamplingParams) -> tuple | None:
        """`compile(params)` if that grammar is in the cache, else None."""
        return None if self._manager is None else self._manager.cached(params.structured_outputs)

    def sequence_grammar(self, compiled: tuple, spec):
        """A sequence's own matcher of `compiled` (a result of `compile`), for `spec`."""
        return self._manager.sequence_grammar(compiled, spec)


def failed_fills(requests: list[Request]) -> Iterator[tuple[Request, SamplingParamError]]:
    """The unfinished sequences whose grammar's fill failed in the step just launched, each with its error: a
    fill that left no token to sample beside the request's allowed_token_ids and bad words (`no_token`: the
    sampler drew token 0, which the grammar refuses), or one that took over MAX_FILL_SECONDS (each such fill
    stalls every request's steps and an ambiguous grammar's grows with each token). The engine fails their
    requests before it schedules the next step, so that step's token is dropped. Lazy: a request failed for
    one sequence has its other sequences finished before they are looked at."""
    from tokenmill.engine.structured_output import no_token_error, slow_fill_error
    for req in requests:
        grammar = req.grammar
        if grammar is None or req.status.finished:
            continue
        if grammar.no_token is not None:
            yield req, no_token_error(grammar, req.params)
        elif grammar.slow_fill is not None:
            yield req, slow_fill_error(grammar, req.params.structured_outputs.kind)


def grammar_ended(req: Request, token: int) -> bool:
    """Advances the sequence's grammar by `token`: True once the grammar has terminated (it accepted EOS, which
    it allows only where the output is complete), or if it refuses the token (which the mask rules out)."""
    if req.grammar.accept(token):
        return req.grammar.terminated
    logger.warning("request %s: sampled token %d is outside its grammar; finishing it", req.request_id, token)
    return True
