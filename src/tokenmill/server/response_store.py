"""Stored responses: what `store` keeps, `previous_response_id` continues and `GET` / `DELETE
/v1/responses/{id}` reach.

A response is kept as the items it added to its conversation: its request's input items and its output
items, with the id of the response it continued. A request that names `previous_response_id` is
prefixed with the conversation so far, each stored response's input then output, oldest first (not
their `instructions`, as OpenAI's API has it). Each entry is held as its JSON bytes, so that the bound
counts what the process holds (with each entry, the bytes its items add to a conversation: their JSON without
token logprobs and encoded reasoning, which no prompt carries); past `max_bytes` the least recently used
entries go first (reading a conversation counts as a use of every response in it), and a conversation one of
whose responses is gone cannot be continued (a 400 naming it). A streamed response is kept from its start,
`in_progress`, so that GET and DELETE reach it while it streams (as OpenAI's); it cannot be continued until
done, its finished body replaces it unless it was deleted meanwhile, and a stream that fails or is cut leaves
nothing.

An input item may name an item of a stored response instead of carrying it (`item_reference`): `items` reads
it back through an index from each item id to the responses holding it (an item sent again, or read back by a
reference, is held by each response whose input it joined).

One API server process keeps what it made: with several (`--api-server-count`), a request may reach
another, so none stores (server/app.py).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import orjson

from tokenmill.server.errors import APIError
from tokenmill.server.protocol import MAX_PROMPT_CHARS

MAX_BYTES = 256 * 2 ** 20
# a conversation longer than this (its JSON) could not pass the prompt's own bound, and reading it back
# runs on the event loop
CONVERSATION_MAX_BYTES = 4 * MAX_PROMPT_CHARS
# what the index holds for each item id of an entry (its string, its holders list, its slot in the dict): ~235
# bytes measured on CPython 3.11, counted with the entry so that the bound still counts what the process holds
ITEM_INDEX_BYTES = 240


class _Entry(NamedTuple):
    blob: bytes                 # {"body": ..., "input": [...]} as JSON
    conversation_bytes: int     # what its items add to a conversation (`_conversation_bytes`)
    item_ids: tuple[str, ...]   # the ids of its input and output items, as `_holders` lists it

    def nbytes(self) -> int:
        return len(self.blob) + ITEM_INDEX_BYTES * len(self.item_ids)


class ResponseStore:
    def __init__(self, max_bytes: int = MAX_BYTES):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._in_progress: set[str] = set()
        # item id -> the stored responses holding an item with that id, latest stored last; an entry is listed
        # under each of its `item_ids` for as long as it is kept
        self._holders: dict[str, list[str]] = {}

    def put(self, body: dict, input_items: list[dict]) -> None:
        """Keeps `body` (its `previous_response_id` links it to the conversation it continued) with the
        request's input items."""
        # a copy of orjson's bytes, which keep the capacity its writer grew to (an entry of ~1 KB held ~4 KB
        # more of the heap), so that the bound counts what the process holds
        blob = bytes(memoryview(orjson.dumps({"body": body, "input": input_items})))
        items = input_items + body["output"]
        item_ids = tuple(dict.fromkeys(item["id"] for item in items if isinstance(item.get("id"), str)))
        entry = _Entry(blob, _conversation_bytes(items), item_ids)
        if entry.nbytes() > self.max_bytes:
            return
        self.discard(body["id"])
        self._entries[body["id"]] = entry
        for item_id in item_ids:
            self._holders.setdefault(item_id, []).append(body["id"])
        if body.get("status") == "in_progress":
            self._in_progress.add(body["id"])
        self.nbytes += entry.nbytes()
        while self.nbytes > self.max_bytes:
            self.discard(next(iter(self._entries)))

    def finish(self, body: dict, input_items: list[dict]) -> None:
        """Replaces the in-progress entry of `body`'s response with `body`, unless it was deleted."""
        if body["id"] in self._entries:
            self.put(body, input_items)

    def discard(self, response_id: str) -> None:
        self._in_progress.discard(response_id)
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
        return response_id in self._in_progress

    def get(self, response_id: str) -> dict:
        return self._entry(response_id)["body"]

    def input_items(self, response_id: str) -> list[dict]:
        """The input items of `response_id`'s own request, in the order sent."""
        return self._entry(response_id)["input"]

    def _entry(self, response_id: str) -> dict:
        entry = self._entries.get(response_id)
        if entry is None:
            raise not_found(response_id)
        self._entries.move_to_end(response_id)
        return orjson.loads(entry.blob)

    def delete(self, response_id: str) -> None:
        if response_id not in self._entries:
            raise not_found(response_id)
        self.discard(response_id)

    def conversation(self, previous_id: str) -> list[dict]:
        """The items of `previous_id`'s conversation, oldest first: each response's input, then its output."""
        chain, rid, size = [], previous_id, 0
        while rid is not None:
            stored = self._entries.get(rid)
            if stored is None:
                message = (f"Previous response with id '{rid}' not found." if rid == previous_id else
                           f"Response '{rid}', earlier in the conversation of '{previous_id}', is no longer "
                           "stored (deleted, or dropped as the oldest past the store's bound); send the "
                           "conversation as 'input' instead.")
                raise APIError(400, message, "previous_response_id", "previous_response_not_found")
            blob, items_bytes, _ = stored
            size += items_bytes
            if size > CONVERSATION_MAX_BYTES:
                raise APIError(400, f"the conversation of '{previous_id}' holds more than {CONVERSATION_MAX_BYTES:,} "
                               "bytes, more than one prompt may", "previous_response_id")
            self._entries.move_to_end(rid)
            entry = orjson.loads(blob)
            if rid in self._in_progress:
                raise APIError(400, f"Previous response '{rid}' is still in progress; continue it once it "
                                    "has completed.", "previous_response_id", "previous_response_in_progress")
            chain.append(entry)
            rid = entry["body"]["previous_response_id"]
        return [item for entry in reversed(chain) for item in entry["input"] + entry["body"]["output"]]

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
                    raise APIError(400, f"Item with id {item_id!r} not found: no stored response holds it (items "
                                        "of responses created with store false are not kept, nor those of a "
                                        "response deleted or dropped past the store's bound).", "input")
                rid = holders[-1]
                if rid not in read:
                    self._entries.move_to_end(rid)
                    entry = orjson.loads(self._entries[rid].blob)
                    read[rid] = {item.get("id"): item for item in entry["input"] + entry["body"]["output"]}
                found[item_id] = read[rid][item_id]
            size += _conversation_bytes([found[item_id]])
            if size > CONVERSATION_MAX_BYTES:
                raise APIError(400, f"the items that 'input' references hold more than {CONVERSATION_MAX_BYTES:,} "
                               "bytes, more than one prompt may", "input")
        return found


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
    return APIError(404, f"No response found with id '{response_id}'.", "response_id", "response_not_found")
