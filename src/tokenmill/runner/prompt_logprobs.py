"""Logprobs of prompt tokens (SamplingParams.prompt_logprobs), computed from a step's hidden states.

Position p's logits predict token p + 1, so prompt token i (i >= 1) is scored at position i - 1; the
first prompt token has no entry. A request that asks for them computes its whole prompt: the scheduler
gives it no prefix-cache hit, and the step runs eagerly so every row's hidden state is at hand.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class PromptLogprobs:
    """Prompt tokens `first_token`..`first_token + len(logprobs) - 1` of `request`, scored."""
    request: object
    first_token: int
    logprobs: list[float]            # of the prompt token itself
    ranks: list[int]                 # its rank under the model (1: the most likely)
    top_logprobs: list[list[float]]  # the k most likely tokens at that position
    top_token_ids: list[list[int]]


def wanted(requests, num_new_tokens) -> bool:
    """Whether this step computes prompt positions that score a prompt token someone asked about."""
    return any(r.scores_prompt and r.num_computed_tokens < r.num_prompt_tokens - 1
               for r, n in zip(requests, num_new_tokens))


# positions scored at once: the start-up profile sized the KV cache around the logits of at most
# max_num_seqs rows (256 by default), and a prompt chunk of max_num_batched_tokens rows at once would hold
# [8,192 x 151,936] float32 logprobs, 5 GB beyond that on qwen3-4b
ROWS_AT_ONCE = 256


@torch.inference_mode()
def compute(model, requests, num_new_tokens, query_start_loc: np.ndarray, hidden: torch.Tensor
            ) -> list[PromptLogprobs]:
    out = []
    for i, (req, n) in enumerate(zip(requests, num_new_tokens)):
        k = req.params.prompt_logprobs
        start = req.num_computed_tokens
        end = min(start + n, req.num_prompt_tokens - 1)     # the last prompt position samples instead
        if not req.scores_prompt or end <= start:
            continue
        row = int(query_start_loc[i])
        scored = PromptLogprobs(req, start + 1, [], [], [], [])
        for a in range(start, end, ROWS_AT_ONCE):
            b = min(a + ROWS_AT_ONCE, end)
            logprobs = model.compute_logits(hidden[row + a - start:row + b - start]).float().log_softmax(-1)
            targets = torch.tensor(req.prompt_token_ids[a + 1:b + 1], device=logprobs.device)
            chosen = logprobs.gather(1, targets[:, None])
            ranks = (logprobs > chosen).sum(-1) + 1
            top_v, top_i = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], targets[:, None][:, :0])
            scored.logprobs += chosen.squeeze(1).tolist()
            scored.ranks += ranks.tolist()
            scored.top_logprobs += top_v.tolist()
            scored.top_token_ids += top_i.tolist()
        out.append(scored)
    return out
