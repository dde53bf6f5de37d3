"""The runner's host copies of request lists it reads every step (`HostCopies`)."""
from __future__ import annotations

import numpy as np

from tokenmill.engine.request import Request


class HostCopies:
    """The runner's int32 copies of its requests' `block_ids` (the block tables) and `all_token_ids` (the
    penalties), so that a step copies only what changed in each list since the last step that read it: the
    block manager only appends to a request's `block_ids` or replaces the list (a new list is copied anew),
    and tokens are appended, the last one perhaps resolved in place from a placeholder since (it is copied
    again). Requests are read, never written. Copies of requests no longer asked for are dropped once they
    outnumber the asked ones, so the copies stay within about two steps' worth."""

    def __init__(self):
        self._tables: dict[Request, list] = {}
        self._tokens: dict[Request, list] = {}

    def block_tables(self, requests: list[Request]) -> list[np.ndarray]:
        """Each request's `block_ids` as int32 (the array may be longer)."""
        self._tables, rows = _update(self._tables, requests, [r.block_ids for r in requests], 0)
        return rows

    def tokens(self, requests: list[Request]) -> list[np.ndarray]:
        """Each request's `all_token_ids` as int32 (the array may be longer)."""
        self._tokens, rows = _update(self._tokens, requests, [r.all_token_ids for r in requests], 1)
        return rows


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
