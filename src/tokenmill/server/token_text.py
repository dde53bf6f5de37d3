"""The text of the tokens an answer names (logprob entries' tokens, by text, bytes or id) and a prompt's
logprobs as vLLM answers them (`TokenText`, which `serving.Serving` takes in)."""
from __future__ import annotations

from tokenmill.engine.async_engine import AsyncLLM
from tokenmill.outputs import RequestOutput
from tokenmill.server.answers import _lp
from tokenmill.server.prompts import PromptTokenizer


class TokenText:
    """Token texts for answers, part of `serving.Serving`, whose attributes below they read."""
    engine: AsyncLLM                    # its processor's token texts and bytes
    prompts: PromptTokenizer            # its tokenizer (None: served without one)
    return_tokens_as_token_ids: bool    # the server's default (--return-tokens-as-token-ids)

    def tokens_as_ids(self, req) -> bool:
        """Whether the request's logprobs name tokens by id: its return_tokens_as_token_ids, else the
        server's (--return-tokens-as-token-ids)."""
        asked = req.return_tokens_as_token_ids
        return self.return_tokens_as_token_ids if asked is None else asked

    def token_text(self, token_id: int, logprob_entry=None, as_id: bool = False) -> str:
        """A logprob entry's token: its text, or with `as_id` (vLLM's return_tokens_as_token_ids, which tells
        apart tokens of equal text) "token_id:{id}"."""
        if as_id:
            return f"token_id:{token_id}"
        if logprob_entry is not None and logprob_entry.decoded_token is not None:
            return logprob_entry.decoded_token
        return self.engine.processor.token_text(token_id)

    def token_bytes(self, token_id: int, text: str, as_id: bool = False) -> bytes:
        """The bytes a token adds to the text (a part of a character's included), else its `text`'s; with
        `as_id`, those of its "token_id:{id}" (vLLM's)."""
        data = None if as_id else self.engine.processor.token_bytes(token_id)
        return data if data is not None else text.encode("utf-8")

    def skipped_special_ids(self) -> frozenset[int]:
        """The special tokens that an output decoded with skip_special_tokens leaves out of its text."""
        tokenizer = self.prompts.tokenizer
        return frozenset() if tokenizer is None else tokenizer.skipped_special_ids


def prompt_logprobs_json(serving: TokenText, out: RequestOutput, top: int) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first, else {id: {logprob, rank,
    decoded_token}}: the prompt's token and the `top` most likely (the engine may hold more, where echoed
    logprobs asked for more)."""
    if out.prompt_logprobs is None:
        return None
    return [None if entry is None else
            {str(t): {"logprob": _lp(lp.logprob), "rank": lp.rank, "decoded_token": serving.token_text(t, lp)}
             for t, lp in entry.items() if t == token or lp.rank <= top}
            for token, entry in zip(out.prompt_token_ids, out.prompt_logprobs)]
