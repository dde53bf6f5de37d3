"""The runner's host copies of what it reads from its requests every step (`HostCopies`)."""
from __future__ import annotations

import numpy as np

from tokenmill.engine.request import Request
from tokenmill.runner.sampling_rows import FLAGS, ROW, sampling_row


class HostCopies:
    """The runner's int32 copies of its requests' `block_ids` (the block tables, a row per request in one
    table) and `all_token_ids` (the penalties), so that a step copies only what changed in each list since
    the last step that read it: the
    block manager only appends to a request's `block_ids` or replaces the list (a new list is copied anew),
    and tokens are appended, the last one perhaps resolved in place from a placeholder since (it is copied
    again). Also each request's sampling record (`sampling_rows.sampling_row`), built on its first step: a
    request's parameters do not change once it reaches the engine. Requests are read, never written.
    Copies of requests no longer asked for are dropped once they outnumber the asked ones, so the copies
    stay within about two steps' worth."""

    def __init__(self):
        self._table = np.zeros((0, 16), np.int32)      # block ids, a row per request (`block_table`)
        self._table_slots: dict[Request, int] = {}
        self._table_state: dict[Request, tuple] = {}    # the list each row copies, and its entries copied
        self._tokens: dict[Request, list] = {}
        self._slots: dict[Request, int] = {}          # a request's row in the sampling tables
        self._records = self._flags = np.zeros(0)

    def block_table(self, requests: list[Request]) -> np.ndarray:
        """The requests' `block_ids` as the rows of an int32 table [len(requests), longest], zero-padded:
        gathered from a table that keeps a row per request, into which only the entries a request's list
        gained since its last step are copied (all of a list the block manager replaced)."""
        slots, state = self._table_slots, self._table_state
        idx = np.fromiter((slots.get(r, -1) for r in requests), np.int64, len(requests))
        new = np.nonzero(idx < 0)[0]
        if len(slots) + len(new) > len(self._table):       # full: keep the asked requests' rows only
            keep = [r for r in requests if r in slots]
            table = np.zeros((max(64, 2 * (len(keep) + len(new))), self._table.shape[1]), np.int32)
            table[:len(keep)] = self._table[np.fromiter((slots[r] for r in keep), np.int64, len(keep))]
            self._table = table
            slots = self._table_slots = {r: i for i, r in enumerate(keep)}
            state = self._table_state = {r: state[r] for r in keep}
            idx = np.fromiter((slots.get(r, -1) for r in requests), np.int64, len(requests))
        for i in new.tolist():
            idx[i] = slots[requests[i]] = len(slots)
            self._table[idx[i]] = 0
            state[requests[i]] = (None, 0)
        width = 0
        for r, slot in zip(requests, idx.tolist()):
            ids = r.block_ids
            n = len(ids)
            src, done = state[r]
            start = done if src is ids and done <= n else 0
            if n > self._table.shape[1]:
                grown = np.zeros((len(self._table), max(16, 2 * n)), np.int32)
                grown[:, :self._table.shape[1]] = self._table
                self._table = grown
            if start < n:
                self._table[slot, start:n] = ids[start:n]
            if start == 0 and n < done:
                self._table[slot, n:done] = 0               # a shorter list replaced a longer one
            state[r] = (ids, n)
            width = max(width, n)
        return self._table[idx, :width]

    def tokens(self, requests: list[Request]) -> list[np.ndarray]:
        """Each request's `all_token_ids` as int32 (the array may be longer)."""
        self._tokens, rows = _update(self._tokens, requests, [r.all_token_ids for r in requests], 1)
        return rows

    def sampling_rows(self, requests: list[Request], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
        """The requests' packed sampling records (`ROW`, positions 0) and their flags (`FLAGS`:
        greedy, needs penalties, logprobs asked or -1), each request's built on its first step into a table
        that a step gathers from."""
        slots = self._slots
        idx = np.fromiter((slots.get(r, -1) for r in requests), np.int64, len(requests))
        new = np.nonzero(idx < 0)[0]
        if len(new):
            if len(slots) + len(new) > len(self._records):       # full: keep the asked requests only
                keep = [r for r in requests if r in slots]
                size = max(64, 2 * (len(keep) + len(new)))
                records, flags = np.zeros(size, ROW), np.zeros(size, FLAGS)
                old = np.fromiter((slots[r] for r in keep), np.int64, len(keep))
                records[:len(keep)], flags[:len(keep)] = self._records[old], self._flags[old]
                self._records, self._flags = records, flags
                slots = self._slots = {r: i for i, r in enumerate(keep)}
                idx = np.fromiter((slots.get(r, -1) for r in requests), np.int64, len(requests))
            for i in new.tolist():
                r = requests[i]
                slot = idx[i] = slots[r] = len(slots)
                self._records[slot], self._flags[slot] = sampling_row(r, vocab_size)
        return self._records[idx], self._flags[idx]


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
