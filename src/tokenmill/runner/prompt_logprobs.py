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
    return any(r.params.prompt_logprobs is not None and r.num_computed_tokens < r.num_prompt_tokens - 1
               for r, n in zip(requests, num_new_tokens))


@torch.inference_mode()
def compute(model, requests, num_new_tokens, query_start_loc: np.ndarray, hidden: torch.Tensor
            ) -> list[PromptLogprobs]:
    out = []
    for i, (req, n) in enumerate(zip(requests, num_new_tokens)):
        k = req.params.prompt_logprobs
        start = req.num_computed_tokens
        end = min(start + n, req.num_prompt_tokens - 1)     # the last prompt position samples instead
        if k is None or end <= start:
            continue
        row = int(query_start_loc[i])
        logprobs = model.compute_logits(hidden[row:row + end - start]).float().log_softmax(-1)
        targets = torch.tensor(req.prompt_token_ids[start + 1:end + 1], device=logprobs.device)
        chosen = logprobs.gather(1, targets[:, None])
        ranks = (logprobs > chosen).sum(-1) + 1
        top_v, top_i = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], targets[:, None][:, :0])
        out.append(PromptLogprobs(req, start + 1, chosen.squeeze(1).tolist(), ranks.tolist(),
                                  top_v.tolist(), top_i.tolist()))
    return out
