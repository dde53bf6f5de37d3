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


def sampling_row(request: Request, vocab_size: int) -> tuple[tuple, tuple]:
    """`request`'s sampling parameters as its `ROW` record (position 0: a step fills it in; temperature 0
    for greedy rows, top_k `vocab_size` where off, penalties neutral where none) and its `FLAGS` (greedy,
    needs penalties, logprobs asked or -1)."""
    p = request.params
    penalties = p.needs_penalties
    record = (request.seed, 0, p.top_k if p.top_k > 0 else vocab_size, 0.0 if p.greedy else p.temperature,
              p.top_p, p.min_p, int(p.seed is not None), p.presence_penalty if penalties else 0.0,
              p.frequency_penalty if penalties else 0.0, p.repetition_penalty if penalties else 1.0)
    return record, (p.greedy, penalties, -1 if p.logprobs is None else p.logprobs)
