"""The runner's host copies of what it reads from its requests every step (`HostCopies`)."""
from __future__ import annotations

import numpy as np

from tokenmill.engine.request import Request
from tokenmill.runner.sampling_rows import FLAGS, ROW, sampling_row


class _RowTable:
    """Arrays that keep a row per request (their first axis), grown and compacted together: a request
    takes the next free row on its first step, and when the rows run out only the requests asked for keep
    theirs (in new arrays twice as large as needed). Rows past the last taken are zero."""

    def __init__(self, *arrays: np.ndarray):
        self.arrays = list(arrays)
        self.slots: dict[Request, int] = {}

    def index(self, requests: list[Request]) -> tuple[np.ndarray, list[int]]:
        """The requests' rows, and the positions in `requests` of those that took one now (zero rows)."""
        slots = self.slots
        idx = np.fromiter((slots.get(r, -1) for r in requests), np.int64, len(requests))
        new = np.nonzero(idx < 0)[0].tolist()
        if len(slots) + len(new) > len(self.arrays[0]):
            keep = [r for r in requests if r in slots]
            old = np.fromiter((slots[r] for r in keep), np.int64, len(keep))
            size = max(64, 2 * (len(keep) + len(new)))
            grown = [np.zeros((size, *a.shape[1:]), a.dtype) for a in self.arrays]
            for g, a in zip(grown, self.arrays):
                g[:len(keep)] = a[old]
            self.arrays = grown
            slots = self.slots = {r: i for i, r in enumerate(keep)}
            idx = np.fromiter((slots.get(r, -1) for r in requests), np.int64, len(requests))
        for i in new:
            idx[i] = slots[requests[i]] = len(slots)
        return idx, new


class HostCopies:
    """The runner's int32 copies of its requests' `block_ids` (the block tables, a row per request in one
    table) and `all_token_ids` (the penalties), so that a step copies only what changed in each list since
    the last step that read it: the block manager only appends to a request's `block_ids` or replaces the
    list (a new list is copied anew), and tokens are appended, the last one perhaps resolved in place from
    a placeholder since (it is copied again). Also each request's sampling record
    (`sampling_rows.sampling_row`), built on its first step: a request's parameters do not change once it
    reaches the engine. Requests are read, never written. Copies of requests no longer asked for are
    dropped once they outnumber the asked ones, so the copies stay within about two steps' worth."""

    def __init__(self):
        # block ids a row, and per row the list it copies and how many of its entries
        self._blocks = _RowTable(np.zeros((0, 16), np.int32), np.zeros(0, object), np.zeros(0, np.int64))
        self._tokens: dict[Request, list] = {}
        self._sampling = _RowTable(np.zeros(0, ROW), np.zeros(0, FLAGS))

    def block_table(self, requests: list[Request]) -> np.ndarray:
        """The requests' `block_ids` as the rows of an int32 table [len(requests), longest], zero-padded:
        gathered from a table that keeps a row per request, into which only the entries a request's list
        gained since its last step are copied (all of a list the block manager replaced)."""
        idx, _ = self._blocks.index(requests)
        table, src, done = self._blocks.arrays
        width = 0
        for r, slot in zip(requests, idx.tolist()):
            ids = r.block_ids
            n = len(ids)
            copied = int(done[slot])
            start = copied if src[slot] is ids and copied <= n else 0
            if n > table.shape[1]:
                grown = np.zeros((len(table), max(16, 2 * n)), np.int32)
                grown[:, :table.shape[1]] = table
                table = self._blocks.arrays[0] = grown
            if start < n:
                table[slot, start:n] = ids[start:n]
            if start == 0 and n < copied:
                table[slot, n:copied] = 0               # a shorter list replaced a longer one
            src[slot], done[slot] = ids, n
            width = max(width, n)
        return table[idx, :width]

    def tokens(self, requests: list[Request]) -> list[np.ndarray]:
        """Each request's `all_token_ids` as int32 (the array may be longer)."""
        self._tokens, rows = _update(self._tokens, requests, [r.all_token_ids for r in requests], 1)
        return rows

    def sampling_rows(self, requests: list[Request], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
        """The requests' packed sampling records (`ROW`, positions 0) and their flags (`FLAGS`:
        greedy, needs penalties, logprobs asked or -1), each request's built on its first step into a table
        that a step gathers from."""
        idx, new = self._sampling.index(requests)
        records, flags = self._sampling.arrays
        for i in new:
            records[idx[i]], flags[idx[i]] = sampling_row(requests[i], vocab_size)
        return records[idx], flags[idx]


def _update(copies: dict, requests: list[Request], lists: list[list[int]], recopy: int):
    # each request's copy ([array, the list it copies, entries copied]) extended by what its list added,
    # with the last `recopy` entries copied before copied again; a list that is not the one copied, or
    # is shorter, is copied anew. Returns the copies and the requests' arrays in order.
    rows = []
    for r, ids in zip(requests, lists):
        n = len(ids)
        c = copies.get(r)
        if c is None:
            c = copies[r] = [None, None, 0]
        array, src, done = c
        start = max(done - recopy, 0) if src is ids and done <= n else 0
        if array is None or len(array) < n:
            grown = np.empty(max(64, 2 * n), dtype=np.int32)
            grown[:start] = array[:start] if start else 0
            array = c[0] = grown
        if start < n:
            array[start:n] = ids[start:n]
        c[1], c[2] = ids, n
        rows.append(array)
    if len(copies) > 2 * len(requests) + 64:
        copies = {r: copies[r] for r in requests}
    return copies, rows
