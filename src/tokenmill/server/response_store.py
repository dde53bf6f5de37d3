"""Stored responses: what `store` keeps, `previous_response_id` continues and `GET` / `DELETE
/v1/responses/{id}` reach.

A response is kept as the items it added to its conversation: its request's input items and its output
items, with the id of the response it continued (and the `include` values its output carries, which GET's
`include` reads). A request that names `previous_response_id` is
prefixed with the conversation so far, each stored response's input then output, oldest first (not
their `instructions`, as OpenAI's API has it). Each entry is held as its JSON bytes, so that the bound
counts what the process holds (with each entry, the bytes its items add to a conversation: their JSON without
token logprobs and encoded reasoning, which no prompt carries); past `max_bytes` the least recently used
entries go first (reading a conversation counts as a use of every response in it), and a conversation one of
whose responses is gone cannot be continued (a 400 naming it). A streamed response is kept from its start,
`in_progress`, so that GET and DELETE reach it while it streams (as OpenAI's); it cannot be continued until
done, its finished body replaces it unless it was deleted meanwhile, and a stream that fails or is cut leaves
nothing. A background response (server/background.py) is kept from its request on, `queued`, and ends
`completed`, `incomplete`, `failed` or `cancelled`; only the first two can be continued. One created with
`stream: true` keeps its events as sent (`add_event`), for a client to read again after a sequence number
(`events_after`): they count in the store's bytes with their response and go with it, and past
`EVENT_LOG_MAX_BYTES` a response's earliest events go first. An entry dropped past the bound or deleted is
told to `on_drop` (a background response still running is then cancelled: nobody could reach it).

An input item may name an item of a stored response instead of carrying it (`item_reference`): `items` reads
it back through an index from each item id to the responses holding it (an item sent again, or read back by a
reference, is held by each response whose input it joined).

One API server process keeps what it made: with several (`--api-server-count`), a request may reach
another, so none stores (server/app.py).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, NamedTuple

import orjson

from tokenmill.sampling_params import shown
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import MAX_PROMPT_CHARS

MAX_BYTES = 256 * 2 ** 20
# a conversation longer than this (its JSON) could not pass the prompt's own bound, and reading it back
# runs on the event loop
CONVERSATION_MAX_BYTES = 4 * MAX_PROMPT_CHARS
# what the index holds for each item id of an entry (its string, its holders list, its slot in the dict): ~235
# bytes measured on CPython 3.11, counted with the entry so that the bound still counts what the process holds
ITEM_INDEX_BYTES = 240
# one streamed background response's events, but for those a client following it live has yet to be given: a
# sixteenth of the store, so that one stream pushes out no more than that of the store's other responses. Measured
# on the test model (400 tokens), a text delta's event is ~215 bytes, so a stream without logprobs keeps ~220 bytes
# a token and any output a 40,960-token context allows (~9 MB) whole; with 20 top logprobs it is ~6.4 KB a token
# (~1.3 KB in its delta, and each of the four closing events repeats them all): the latest ~2,600 tokens' events
EVENT_LOG_MAX_BYTES = MAX_BYTES // 16
# what a kept event holds beside its bytes: the bytes object's header (33) and the log's pointer to it (8)
EVENT_OVERHEAD_BYTES = 41
# the statuses of a response that cannot be continued (`conversation`): one still running, or cut short (what output
# it had stays to read, its last item unfinished)
UNFINISHED = ("queued", "in_progress")
NOT_CONTINUABLE = UNFINISHED + ("failed", "cancelled")


class _Entry(NamedTuple):
    body: bytes                 # the response object as JSON: what GET answers, as it is
    input: bytes                # its request's input items as JSON
    conversation_bytes: int     # what its items add to a conversation (`_conversation_bytes`)
    item_ids: tuple[str, ...]   # the ids of its input and output items, as `_holders` lists it
    background: bool            # made with background: true (what cancel asks, without decoding the body)
    include: tuple[str, ...] = ()   # the `include` values its output carries (GET's `include` reads them)

    def nbytes(self) -> int:
        return len(self.body) + len(self.input) + ITEM_INDEX_BYTES * len(self.item_ids)

    def read(self) -> tuple[dict, list[dict]]:
        return orjson.loads(self.body), orjson.loads(self.input)


class _EventLog:
    """A response's events as sent: event i has sequence number `base + i`, and those before `head` were dropped
    (a list, not a deque, so that a reader takes the events after its own as one slice)."""

    def __init__(self):
        self.events: list[bytes] = []
        self.base = 0
        self.head = 0
        self.nbytes = 0

    def drop_first(self) -> int:
        """Drops the earliest event kept; returns the bytes it held."""
        size = len(self.events[self.head]) + EVENT_OVERHEAD_BYTES
        self.events[self.head] = b""
        self.head += 1
        if self.head > len(self.events) // 2:        # amortized: each event is moved at most once more
            del self.events[:self.head]
            self.base += self.head
            self.head = 0
        self.nbytes -= size
        return size


class ResponseStore:
    def __init__(self, max_bytes: int = MAX_BYTES):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._status: dict[str, str] = {}       # response id -> its status, for those in NOT_CONTINUABLE
        self._events: dict[str, _EventLog] = {}
        self.on_drop: Callable[[str], None] | None = None
        # item id -> the stored responses holding an item with that id, latest stored last; an entry is listed
        # under each of its `item_ids` for as long as it is kept
        self._holders: dict[str, list[str]] = {}

    def put(self, body: dict, input_items: list[dict], include: list[str] = ()) -> bool:
        """Keeps `body` (its `previous_response_id` links it to the conversation it continued) with the
        request's input items and the `include` values its output carries (`included`), in place of the entry
        of that id (its events kept). A body larger than the whole store is not kept, nor is the entry it would
        have replaced: False."""
        items = input_items + body["output"]
        item_ids = tuple(dict.fromkeys(item["id"] for item in items if isinstance(item.get("id"), str)))
        entry = _Entry(_json(body), _json(input_items), _conversation_bytes(items), item_ids,
                       body.get("background") is True, tuple(include))
        rid = body["id"]
        events = self._events.pop(rid, None)        # counted in nbytes still
        self.discard(rid)
        if entry.nbytes() > self.max_bytes:
            if events is not None:
                self.nbytes -= events.nbytes
            return False
        self._entries[rid] = entry
        if events is not None:
            self._events[rid] = events
        for item_id in item_ids:
            self._holders.setdefault(item_id, []).append(rid)
        if body.get("status") in NOT_CONTINUABLE:
            self._status[rid] = body["status"]
        self.nbytes += entry.nbytes()
        self._bound()
        return True

    def update(self, body: dict, input_items: list[dict], include: list[str] = ()) -> None:
        """Replaces the entry of `body`'s response with `body`, unless it was dropped or deleted."""
        if body["id"] in self._entries:
            self.put(body, input_items, include)

    def set_status(self, response_id: str, status: str, error: dict | None = None,
                   body: dict | None = None) -> dict | None:
        """The stored body of `response_id` (or `body`, the response as it stands now) with this status (and
        `error`), kept in its place; None where it is no longer stored."""
        if response_id not in self._entries:
            return None
        stored = self._entries[response_id]
        kept, input_items = stored.read()
        body = {**(body or kept), "status": status, "error": error}
        self.put(body, input_items, stored.include)
        return body

    def _bound(self) -> None:
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, response_id: str) -> None:
        self.discard(response_id)
        if self.on_drop is not None:
            self.on_drop(response_id)

    def discard(self, response_id: str) -> None:
        self._status.pop(response_id, None)
        events = self._events.pop(response_id, None)
        if events is not None:
            self.nbytes -= events.nbytes
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return
        self.nbytes -= entry.nbytes()
        for item_id in entry.item_ids:
            holders = self._holders[item_id]
            holders.remove(response_id)
            if not holders:
                del self._holders[item_id]

    def in_progress(self, response_id: str) -> bool:
        return self._status.get(response_id) in UNFINISHED

    # ----- a streamed background response's events ---------------------------------------------------
    def open_events(self, response_id: str) -> None:
        """Starts keeping the events of the stored response `response_id`."""
        if response_id in self._entries:
            self._events.setdefault(response_id, _EventLog())

    def add_event(self, response_id: str, data: bytes) -> None:
        """Keeps the next event of `response_id` (nothing where it is no longer stored); a use of it."""
        log = self._events.get(response_id)
        if log is None:
            return
        log.events.append(data)
        log.nbytes += len(data) + EVENT_OVERHEAD_BYTES
        self.nbytes += len(data) + EVENT_OVERHEAD_BYTES
        self._entries.move_to_end(response_id)
        self._bound()

    def trim_events(self, response_id: str, read_through: int | None = None) -> None:
        """Drops the earliest events of `response_id` while they hold more than `EVENT_LOG_MAX_BYTES`, but none
        after sequence number `read_through`: what every client following the stream live has been given (None:
        none follows it), so that one keeps up even with a burst of events larger than the bound (the closing
        events repeat the whole output, logprobs and all)."""
        log = self._events.get(response_id)
        if log is None:
            return
        while log.nbytes > EVENT_LOG_MAX_BYTES and log.head < len(log.events) and \
                (read_through is None or log.base + log.head <= read_through):
            self.nbytes -= log.drop_first()

    def could_trim(self, response_id: str, after: int | None = None) -> bool:
        """Whether `trim_events` may drop events of `response_id`: they hold more than their bound, and where
        `after` is given (a reader had been given the events through `after` before its latest read), that reader
        had yet to be given the earliest kept one: a reader past it held none of them."""
        log = self._events.get(response_id)
        return log is not None and log.nbytes > EVENT_LOG_MAX_BYTES and \
            (after is None or after < log.base + log.head)

    def events_after(self, response_id: str, after: int | None) -> list[bytes]:
        """The kept events of `response_id` whose sequence number is above `after` (None: all of them). A 404
        where the response is gone; a 400 where events after `after` were dropped, or it keeps none."""
        if response_id not in self._entries:
            raise not_found(response_id)
        log = self._events.get(response_id)
        if log is None:
            raise APIError(400, f"Response '{response_id}' was not created with background and stream true: "
                                "it has no events to stream again (GET it without 'stream').", "stream")
        start = 0 if after is None else after + 1
        first, end = log.base + log.head, log.base + len(log.events)
        if start > end:
            raise APIError(400, f"'starting_after' is {after}, but response '{response_id}' has sent no event after "
                                f"sequence number {end - 1} yet.", "starting_after")
        if start < first:
            raise APIError(400, f"The events of response '{response_id}' before sequence number {first} are no "
                                f"longer kept (a response keeps its latest {EVENT_LOG_MAX_BYTES:,} bytes of events); "
                                f"'starting_after' must be at least {first - 1}.", "starting_after")
        return log.events[start - log.base:]

    def next_sequence_number(self, response_id: str) -> int:
        """The sequence number the next event of `response_id` takes (0 where none is kept)."""
        log = self._events.get(response_id)
        return 0 if log is None else log.base + len(log.events)

    def get(self, response_id: str) -> dict:
        return orjson.loads(self._entry(response_id).body)

    def get_json(self, response_id: str) -> bytes:
        """The stored response as JSON, as it is kept: what GET answers. Decoded and encoded again for each GET, a
        large response (10 MB: 8,000 tokens with 20 top logprobs) took ~0.18 s of the event loop each time and a
        copy a connection: 100 GETs that read nothing held 458 MB more; a connection now holds the kept bytes."""
        return self._entry(response_id).body

    def included(self, response_id: str) -> tuple[dict, list[str]]:
        """The body of `response_id`, and the `include` values its output carries (as `put` was given them)."""
        entry = self._entry(response_id)
        return orjson.loads(entry.body), list(entry.include)

    def is_background(self, response_id: str) -> bool:
        return self._entry(response_id).background

    def input_items(self, response_id: str) -> list[dict]:
        """The input items of `response_id`'s own request, in the order sent."""
        return orjson.loads(self._entry(response_id).input)

    def _entry(self, response_id: str) -> _Entry:
        entry = self._entries.get(response_id)
        if entry is None:
            raise not_found(response_id)
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> None:
        if response_id not in self._entries:
            raise not_found(response_id)
        self._drop(response_id)

    def conversation(self, previous_id: str) -> list[dict]:
        """The items of `previous_id`'s conversation, oldest first: each response's input, then its output."""
        chain, rid, size = [], previous_id, 0
        while rid is not None:
            stored = self._entries.get(rid)
            if stored is None:
                message = (f"Previous response with id {shown(rid)} not found." if rid == previous_id else
                           f"Response '{rid}', earlier in the conversation of {shown(previous_id)}, is no longer "
                           "stored (deleted, or dropped as the oldest past the store's bound); send the "
                           "conversation as 'input' instead.")
                raise APIError(400, message, "previous_response_id", "previous_response_not_found")
            size += stored.conversation_bytes
            if size > CONVERSATION_MAX_BYTES:
                raise APIError(400, f"the conversation of {shown(previous_id)} holds more than {CONVERSATION_MAX_BYTES:,} "
                               "bytes, more than one prompt may", "previous_response_id")
            self._entries.move_to_end(rid)
            body, input_items = stored.read()
            status = self._status.get(rid)
            if status in UNFINISHED:
                raise APIError(400, f"Previous response '{rid}' is still {status.replace('_', ' ')}; continue it once "
                                    "it has completed.", "previous_response_id", "previous_response_in_progress")
            if status is not None:
                raise APIError(400, f"Previous response '{rid}' is {status}: it was cut short, and only a completed "
                                    "or incomplete response can be continued (send the output items it has as input "
                                    "to go on from them).", "previous_response_id", f"previous_response_{status}")
            chain.append((body, input_items))
            rid = body["previous_response_id"]
        return [item for body, input_items in reversed(chain) for item in input_items + body["output"]]

    def items(self, item_ids: list[str]) -> dict[str, dict]:
        """The stored items with these ids (an input or output item of a stored response, of the latest stored
        that holds one), by id: what `item_reference` input items name. An id that no stored response holds is a
        400 naming it (OpenAI's wording), as are items that together hold more than a conversation may."""
        found: dict[str, dict] = {}
        read: dict[str, dict[str, dict]] = {}       # response id -> its items by id, each entry decoded once
        size = 0
        for item_id in item_ids:
            if item_id not in found:
                holders = self._holders.get(item_id)
                if not holders:
                    raise APIError(400, f"Item with id {shown(item_id)} not found: no stored response holds it (items "
                                        "of responses created with store false are not kept, nor those of a "
                                        "response deleted or dropped past the store's bound).", "input")
                rid = holders[-1]
                if rid not in read:
                    self._entries.move_to_end(rid)
                    body, input_items = self._entries[rid].read()
                    read[rid] = {item.get("id"): item for item in input_items + body["output"]}
                found[item_id] = read[rid][item_id]
            size += _conversation_bytes([found[item_id]])
            if size > CONVERSATION_MAX_BYTES:
                raise APIError(400, f"the items that 'input' references hold more than {CONVERSATION_MAX_BYTES:,} "
                               "bytes, more than one prompt may", "input")
        return found


def _json(obj) -> bytes:
    """`obj` as JSON, in bytes of their own size: orjson's keep the capacity its writer grew to (an entry of ~1 KB
    held ~4 KB more of the heap), so that the bound counts what the process holds."""
    return bytes(memoryview(orjson.dumps(obj)))


def _conversation_bytes(items: list[dict]) -> int:
    """The JSON bytes of `items` as a conversation carries them: without output text's token logprobs
    (~1 KB a token with top_logprobs 20) and reasoning's `encrypted_content` (its text again)."""
    total = 0
    for item in items:
        slim = {k: v for k, v in item.items() if k != "encrypted_content"}
        if isinstance(slim.get("content"), list):
            slim["content"] = [{k: v for k, v in p.items() if k != "logprobs"} if isinstance(p, dict) else p
                               for p in slim["content"]]
        total += len(orjson.dumps(slim))
    return total


def not_found(response_id: str) -> APIError:
    return APIError(404, f"No response found with id {shown(response_id)}.", "response_id", "response_not_found")
