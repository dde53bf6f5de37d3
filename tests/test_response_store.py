"""The Responses store's bounds (server/response_store.py): least recently used entries dropped past its
bytes, a conversation's read counting as a use of each of its responses, and a conversation too long to
be a prompt refused before it is read back."""
from __future__ import annotations

import pytest

from tokenmill.server import response_store
from tokenmill.server.errors import APIError
from tokenmill.server.response_store import ResponseStore


def _put(store: ResponseStore, rid: str, text: str, previous: str | None = None) -> None:
    output = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}]
    store.put({"id": rid, "output": output, "previous_response_id": previous},
              [{"type": "message", "role": "user", "content": text}])


def test_the_store_drops_the_least_recently_used_past_its_bytes():
    store = ResponseStore(max_bytes=10_000)
    for i in range(3):
        _put(store, f"r{i}", "x" * 1_000)
    one = store.nbytes // 3
    store.conversation("r0")                 # r0 used last: r1 is now the oldest
    for i in range(3, 3 + (10_000 - store.nbytes) // one + 1):
        _put(store, f"r{i}", "x" * 1_000)
    assert store.nbytes <= 10_000
    assert store.get("r0")["id"] == "r0"
    with pytest.raises(APIError) as e:
        store.get("r1")
    assert e.value.status == 404
    _put(store, "huge", "x" * 20_000)        # larger than the whole store: not kept, nothing dropped for it
    assert store.nbytes <= 10_000 and store.get("r0")
    with pytest.raises(APIError):
        store.get("huge")


def test_the_stores_bytes_are_what_the_process_holds():
    """20,000 entries of ~1 KB, two items with ids each: the process's resident memory grows by about the bytes
    the store counts (1.2x measured: the dict and the allocator's headers; the item index counted, 1.8x had it
    not been), not by the ~5x that orjson's own bytes held. In a fresh interpreter, so that no free memory of other tests absorbs the entries."""
    import subprocess
    import sys
    script = """
import os, re
from tokenmill.server.response_store import ResponseStore
def rss():
    with open(f"/proc/{os.getpid()}/status") as f:
        return int(re.search(r"VmRSS:\\s+(\\d+)", f.read()).group(1)) * 1024
store, text = ResponseStore(), "alpha beta gamma " * 20
before = rss()
for i in range(20_000):
    output = [{"type": "message", "id": f"msg_{i:032x}", "role": "assistant",
               "content": [{"type": "output_text", "text": text}]}]
    store.put({"id": f"resp_{i:032x}", "output": output, "previous_response_id": None},
              [{"id": f"msg_{i:032x}_in", "content": text}])
print((rss() - before) / store.nbytes)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout) < 2.0, done.stdout


def test_a_conversation_is_its_responses_inputs_and_outputs_oldest_first():
    store = ResponseStore()
    _put(store, "a", "one")
    _put(store, "b", "two", previous="a")
    _put(store, "c", "three", previous="b")
    texts = [item["content"] if isinstance(item["content"], str) else item["content"][0]["text"]
             for item in store.conversation("c")]
    assert texts == ["one", "one", "two", "two", "three", "three"]
    store.delete("b")
    with pytest.raises(APIError, match="'b', earlier in the conversation of 'c', is no longer stored"):
        store.conversation("c")


def test_a_conversation_longer_than_a_prompt_is_refused_before_it_is_read(monkeypatch):
    monkeypatch.setattr(response_store, "CONVERSATION_MAX_BYTES", 5_000)
    store = ResponseStore()
    previous = None
    for i in range(8):
        _put(store, f"r{i}", "x" * 1_000, previous)
        previous = f"r{i}"
    with pytest.raises(APIError, match="holds more than 5,000 bytes") as e:
        store.conversation("r7")
    assert e.value.param == "previous_response_id"
    assert len(store.conversation("r1")) == 4


def test_a_conversations_bound_counts_what_its_prompt_carries(monkeypatch):
    """Token logprobs (~1 KB a token with top_logprobs 20) are kept for GET but are no part of the
    conversation a continuation sends: a chain whose text fits is not refused for them."""
    monkeypatch.setattr(response_store, "CONVERSATION_MAX_BYTES", 20_000)
    store = ResponseStore()
    logprobs = [{"token": "x", "logprob": -0.1, "bytes": [120], "top_logprobs": [{"token": "y", "logprob": -3.0}] * 20}
                for _ in range(20)]
    previous = None
    for i in range(4):
        output = [{"type": "message", "role": "assistant",
                   "content": [{"type": "output_text", "text": "x" * 100, "logprobs": logprobs}]}]
        store.put({"id": f"r{i}", "output": output, "previous_response_id": previous},
                  [{"type": "message", "role": "user", "content": "y" * 100}])
        previous = f"r{i}"
    assert store.nbytes > 4 * 20_000 // 4          # each entry holds its logprobs
    assert len(store.conversation("r3")) == 8
    assert store.get("r3")["output"][0]["content"][0]["logprobs"] == logprobs


def test_a_streamed_response_is_kept_from_its_start():
    """In progress: reachable, not continuable; finished: replaced in place (its bytes counted once);
    deleted while it streamed: stays deleted."""
    store = ResponseStore()
    body = {"id": "r", "status": "in_progress", "output": [], "previous_response_id": None}
    store.put(body, [{"type": "message", "role": "user", "content": "hi"}])
    assert store.get("r")["status"] == "in_progress" and store.in_progress("r")
    with pytest.raises(APIError, match="'r' is still in progress") as e:
        store.conversation("r")
    assert e.value.code == "previous_response_in_progress"
    done = {**body, "status": "completed", "output": [{"type": "message", "role": "assistant", "content": "yo"}]}
    store.update(done, [{"type": "message", "role": "user", "content": "hi"}])
    assert store.get("r")["status"] == "completed" and len(store.conversation("r")) == 2
    assert store.nbytes == store._entries["r"].nbytes()
    store.put({**body, "id": "s"}, [])
    store.delete("s")
    store.update({**done, "id": "s"}, [])
    with pytest.raises(APIError):
        store.get("s")
    assert not store.in_progress("s") and store.nbytes == store._entries["r"].nbytes()


def test_items_are_read_back_by_id_from_the_latest_response_holding_them(monkeypatch):
    """What item_reference reads: an input or output item of a stored response, by id. An item held by two
    responses (sent again) stays readable while either is kept; one no kept response holds is a 400 naming it,
    whether deleted or dropped past the bound; referenced items holding more than a prompt may are a 400."""
    store = ResponseStore(max_bytes=10_000)

    def put(rid: str, question: dict, answer_id: str) -> None:
        answer = {"type": "message", "id": answer_id, "role": "assistant",
                  "content": [{"type": "output_text", "text": f"answer {rid}"}]}
        store.put({"id": rid, "output": [answer], "previous_response_id": None}, [question])
    question = {"type": "message", "id": "msg_q", "role": "user", "content": [{"type": "input_text", "text": "q"}]}
    put("r0", question, "msg_a0")
    put("r1", question, "msg_a1")
    found = store.items(["msg_a0", "msg_q", "msg_a0"])
    assert found == {"msg_a0": store.get("r0")["output"][0], "msg_q": question}
    store.delete("r1")
    assert store.items(["msg_q"])["msg_q"] == question
    store.delete("r0")
    with pytest.raises(APIError, match="Item with id 'msg_q' not found") as e:
        store.items(["msg_q"])
    assert (e.value.status, e.value.param) == (400, "input")
    for i in range(40):                       # past the bound: the oldest go, and their items with them
        long = [{"type": "input_text", "text": "x" * 500}]
        put(f"s{i}", {**question, "id": f"msg_q{i}", "content": long}, f"msg_s{i}")
    kept = list(store._entries)
    assert "s0" not in kept and store.items([f"msg_s{kept[0][1:]}"])
    with pytest.raises(APIError, match="'msg_s0' not found"):
        store.items(["msg_s0"])
    assert sorted(store._holders) == sorted(f"msg_{kind}{rid[1:]}" for rid in kept for kind in ("q", "s"))
    monkeypatch.setattr(response_store, "CONVERSATION_MAX_BYTES", 2_000)
    with pytest.raises(APIError, match="more than 2,000 bytes") as e:
        store.items([f"msg_q{kept[-1][1:]}"] * 4)
    assert e.value.param == "input"


def test_a_response_is_continued_only_once_it_has_output():
    """A background response queued or in progress is refused as a streamed one in progress is; cancelled or
    failed it was cut short (its output, kept, ends unfinished); completed, it is continued."""
    store = ResponseStore()
    body = {"id": "b", "status": "queued", "output": [], "previous_response_id": None, "error": None}
    store.put(body, [{"type": "message", "role": "user", "content": "hi"}])
    for status, says, code in (("queued", "still queued", "previous_response_in_progress"),
                               ("in_progress", "still in progress", "previous_response_in_progress"),
                               ("cancelled", "is cancelled", "previous_response_cancelled"),
                               ("failed", "is failed", "previous_response_failed")):
        assert store.set_status("b", status)["status"] == status
        with pytest.raises(APIError, match=says) as e:
            store.conversation("b")
        assert (e.value.status, e.value.param, e.value.code) == (400, "previous_response_id", code)
    store.update({**body, "status": "completed"}, [{"type": "message", "role": "user", "content": "hi"}])
    assert len(store.conversation("b")) == 1 and store.set_status("gone", "cancelled") is None


def test_a_streams_events_are_kept_within_bounds_and_go_with_their_response(monkeypatch):
    """A streamed background response's events: read back after a sequence number; past the log's bound the
    earliest go (a read from before them is a 400 naming `starting_after`), but none after what a live reader
    has been given; counted in the store's bytes, kept when the body is replaced, and dropped with their
    response, which `on_drop` hears of."""
    monkeypatch.setattr(response_store, "EVENT_LOG_MAX_BYTES", 1_000)
    store = ResponseStore(max_bytes=6_000)
    dropped = []
    store.on_drop = dropped.append
    body = {"id": "s", "status": "in_progress", "output": [], "previous_response_id": None}
    store.put(body, [])
    entry_bytes = store.nbytes
    store.open_events("s")
    events = [b"%03d" % i + b"x" * 97 for i in range(30)]     # 100 bytes each, 141 as counted: 7 fit the log
    for data in events[:5]:
        store.add_event("s", data)
    assert store.events_after("s", None) == events[:5] and store.events_after("s", 2) == events[3:5]
    assert store.events_after("s", 4) == [] and store.nbytes == entry_bytes + 5 * 141
    with pytest.raises(APIError, match="no event after sequence number 4") as e:
        store.events_after("s", 5)
    assert e.value.param == "starting_after"
    for data in events[5:]:
        store.add_event("s", data)
    store.trim_events("s", read_through=9)      # a reader given up to 9 holds 10 on
    assert store.events_after("s", 9) == events[10:] and store.nbytes == entry_bytes + 20 * 141
    store.trim_events("s")
    assert store.events_after("s", 22) == events[23:] and store.nbytes == entry_bytes + 7 * 141
    with pytest.raises(APIError, match="before sequence number 23 are no longer kept") as e:
        store.events_after("s", 21)
    assert e.value.param == "starting_after"
    store.update({**body, "status": "completed"}, [])
    assert store.events_after("s", 22) == events[23:] and store.next_sequence_number("s") == 30
    _put(store, "plain", "x")
    with pytest.raises(APIError, match="not created with background and stream true") as e:
        store.events_after("plain", None)
    assert e.value.param == "stream"
    for i in range(10):                 # past the bound: "s", the least recently used, goes with its events
        _put(store, f"r{i}", "x" * 500)
    assert dropped[0] == "s" and store.nbytes == sum(entry.nbytes() for entry in store._entries.values())
    with pytest.raises(APIError) as e:
        store.events_after("s", None)
    assert e.value.status == 404
    store.delete("r9")
    assert dropped[-1] == "r9"
