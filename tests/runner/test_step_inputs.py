"""`prepare_inputs`' block tables: each request's row comes from the runner's int32 copy of its `block_ids`
(`HostCopies`), which only the entries added since the last step are copied into; a list the block
manager replaces (swap-in, a request freed and scheduled again) is copied anew."""
from __future__ import annotations

import numpy as np

from tokenmill.engine.request import Request
from tokenmill.runner.host_copies import HostCopies
from tokenmill.runner.step import prepare_inputs

COPIES = HostCopies()
from tokenmill.sampling_params import SamplingParams


def _tables(requests):
    for r in requests:
        r.num_computed_tokens = len(r.block_ids) * 4 - 1      # one token left to compute, in the last block
    return prepare_inputs(requests, [1] * len(requests), 4, COPIES).tables


def _expected(requests):
    width = max(len(r.block_ids) for r in requests)
    return np.array([r.block_ids + [0] * (width - len(r.block_ids)) for r in requests], dtype=np.int32)


def test_block_tables_follow_appends_replacements_and_reallocation():
    a = Request("a", list(range(1, 200)), SamplingParams(), 10, 0)
    b = Request("b", list(range(1, 200)), SamplingParams(), 10, 0)
    a.block_ids, b.block_ids = [7, 3], [9]
    steps = [
        lambda: None,
        lambda: a.block_ids.append(11),                          # a block appended
        lambda: b.block_ids.extend(range(20, 60)),               # many: the copy grows its capacity
        lambda: setattr(a, "block_ids", [5, 6, 8]),              # a new list of the same length (swap-in)
        lambda: setattr(b, "block_ids", []),                     # freed ...
        lambda: b.block_ids.extend([1, 2]),                      # ... and allocated again, shorter
        lambda: setattr(a, "block_ids", list(range(100, 130))),  # a longer new list
    ]
    for change in steps:
        change()
        if not b.block_ids:
            continue
        assert np.array_equal(_tables([a, b]), _expected([a, b]))
    # the same requests in another order (a request's row follows it)
    assert np.array_equal(_tables([b, a]), _expected([b, a]))
