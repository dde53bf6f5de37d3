"""A sampled row's parameters as one record (`ROW`) and the flags a step reads from them (`FLAGS`), built
once per request (`sampling_row`): the sampler packs a step's records into one copy to the device, and the
runner keeps each request's record in `HostCopies`."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tokenmill.engine.request import Request

# One row's sampling parameters as they travel to the device: a step's rows are one copy, and the tensors of
# `SamplingTensors` are views of it. 48 bytes, so the int64 fields stay 8-byte aligned in every row.
ROW = np.dtype([("seed", "<i8"), ("position", "<i8"), ("top_k", "<i4"), ("temperature", "<f4"),
                ("top_p", "<f4"), ("min_p", "<f4"), ("seeded", "<i4"), ("presence_penalty", "<f4"),
                ("frequency_penalty", "<f4"), ("repetition_penalty", "<f4")])
FLAGS = np.dtype([("greedy", "?"), ("penalties", "?"), ("logprobs", "<i4")])


# Bounds that keep a row's values meaningful in 32 bits, each with the meaning of the value it replaces:
# a top_p below float32's smallest normal number would round to 0, which keeps no token (the top token is
# what any top_p that small keeps); a temperature past 1e30 samples as uniformly as an infinite one, whose
# float32 inf would make 0 * inf of the masked logits; a repetition penalty outside [1e-30, 1e30] would
# overflow the penalised logits (or make 0 * inf) where these bounds give the same choices.
_TOP_P_MIN = float(np.finfo(np.float32).tiny)
_TEMPERATURE_MAX = 1e30
_REPETITION_PENALTY_RANGE = (1e-30, 1e30)


def sampling_row(request: Request, vocab_size: int) -> tuple[tuple, tuple]:
    """`request`'s sampling parameters as its `ROW` record (position 0: a step fills it in; temperature 0
    for greedy rows, top_k `vocab_size` where off or larger, penalties neutral where none, every float
    within the bounds above) and its `FLAGS` (greedy, needs penalties, logprobs asked or -1)."""
    p = request.params
    penalties = p.needs_penalties
    low, high = _REPETITION_PENALTY_RANGE
    repetition_penalty = min(max(p.repetition_penalty, low), high) if penalties else 1.0
    record = (request.seed, 0, min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size,
              0.0 if p.greedy else min(p.temperature, _TEMPERATURE_MAX), max(p.top_p, _TOP_P_MIN), p.min_p,
              int(p.seed is not None), p.presence_penalty if penalties else 0.0,
              p.frequency_penalty if penalties else 0.0, repetition_penalty)
    return record, (p.greedy, penalties, -1 if p.logprobs is None else p.logprobs)
