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


def test_sampling_records_follow_their_requests_across_steps():
    """Each request's sampling record and flags, built once into the runner's table: the rows of a step
    are its requests' whatever their order, as requests leave and join, and after the table fills and keeps
    only the asked requests."""
    from tokenmill.runner.sampling_rows import FLAGS, ROW, sampling_row
    copies = HostCopies()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=5),
              SamplingParams(temperature=1.0, min_p=0.1, presence_penalty=0.5, logprobs=3)]
    live = [Request(f"r{i}", [1, 2], params[i % 3], 10, 1000 + i) for i in range(5)]
    joined = 5
    for step in range(60):
        if step % 3 == 0:                          # one leaves, two join: the table fills and compacts
            live.pop(step % len(live))
            for _ in range(2):
                live.append(Request(f"r{joined}", [1, 2], params[joined % 3], 10, 1000 + joined))
                joined += 1
        order = live[::-1] if step % 2 else live
        records, flags = copies.sampling_rows(order, 512)
        want = [sampling_row(r, 512) for r in order]
        assert np.array_equal(records, np.array([w[0] for w in want], dtype=ROW))
        assert np.array_equal(flags, np.array([w[1] for w in want], dtype=FLAGS))
    assert records["top_k"].tolist().count(512) == sum(1 for r in order if r.params.top_k == 0)
    assert len(copies._sampling.arrays[0]) < 4 * len(live) + 64    # compacted, not grown with every request seen


def test_block_table_rows_survive_requests_joining_and_leaving():
    """Many requests over many steps, each step's requests in a new order: lists grow past the table's
    width, the table fills and keeps only the asked requests' rows, and every step's table is the
    requests' lists, zero-padded."""
    copies = HostCopies()
    rng = np.random.default_rng(0)
    live = [Request(f"r{i}", [1], SamplingParams(), 10, 0) for i in range(6)]
    joined = 6
    for step in range(80):
        for r in live:
            if rng.random() < 0.5:
                r.block_ids.extend(rng.integers(1, 10_000, rng.integers(1, 9)).tolist())
            if rng.random() < 0.05:
                r.block_ids = rng.integers(1, 10_000, rng.integers(1, 4)).tolist()     # replaced, shorter
        if step % 4 == 0:
            live.pop(int(rng.integers(len(live))))
            live += [Request(f"r{joined + k}", [1], SamplingParams(), 10, 0) for k in range(2)]
            joined += 2
            for r in live[-2:]:
                r.block_ids = rng.integers(1, 10_000, rng.integers(1, 5)).tolist()
        order = [live[i] for i in rng.permutation(len(live))]
        assert np.array_equal(copies.block_table(order), _expected(order))
    assert max(len(r.block_ids) for r in live) > 16                 # the table's columns grew
    assert len(copies._blocks.arrays[0]) < 4 * len(live) + 64    # and its rows stayed bounded
