"""Background responses (server/background.py) in process, on a stand-in engine whose requests run until they
finish or their stream is closed (what aborts them in the real engine): polled until done, with the body the
same request answered in its own request gets; cancelled or cut by a drain, with what they had generated kept;
cut before their task first ran, with nothing left counted and nothing logged. And GET's `include` as OpenAI's
client sends it. (The real server's cancel, freed KV blocks and resumed streams: test_hardening.py.)"""
from __future__ import annotations

import asyncio
import json
import logging

import httpx
import orjson
import pytest

from tokenmill.config import priority_refusal
from tokenmill.server import response_store
from tokenmill.server.errors import APIError

STEP_S = 0.002


def _app(tokenizer_dir: str):
    from stand_in_engine import StandInEngine
    from tokenmill.engine.tokenizer import Tokenizer
    from tokenmill.outputs import CompletionOutput, RequestOutput
    from tokenmill.sampling_params import SamplingParamError
    from tokenmill.server.app import build_app

    tok = Tokenizer(tokenizer_dir)

    class Engine(StandInEngine):
        """Writes token 40 each step up to max_tokens, and yields every `stream_interval` tokens (0: the first and
        the last only), as AsyncLLM does; `aborted` lists the requests closed unfinished, `generated` counts the
        tokens written. It refuses, as the real engine does before a first output, a priority under its `fcfs`
        policy (which it announces, as AsyncLLM does) and any grammar (as one that does not compile)."""
        scheduling_policy = "fcfs"

        def __init__(self):
            super().__init__(tok, 256)
            self.aborted: list[str] = []
            self.running = self.generated = 0

        async def generate(self, request_id, ids, params, priority, stream_interval=1, **kw):
            await asyncio.sleep(STEP_S)
            if priority_refusal(priority, self.scheduling_policy):
                raise SamplingParamError("priority", priority_refusal(priority, self.scheduling_policy))
            if params.structured_outputs is not None:
                raise SamplingParamError("structured_outputs.json", "invalid JSON schema: it did not compile")
            self.running += 1
            token_ids, finished = [], False
            try:
                while not finished:
                    await asyncio.sleep(STEP_S)
                    token_ids = token_ids + [40]
                    self.generated += 1
                    finished = len(token_ids) == params.max_tokens
                    due = len(token_ids) == 1 or stream_interval and len(token_ids) % stream_interval == 0
                    if not (finished or due):
                        continue
                    c = CompletionOutput(0, tok.decode(token_ids), token_ids, None, None, "length" if finished else None)
                    yield RequestOutput(request_id, None, ids, [c], finished)
            finally:
                self.running -= 1
                if not finished:
                    self.aborted.append(request_id)

    engine = Engine()
    return build_app(engine), engine


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://tokenmill", timeout=30)


async def _poll(c: httpx.AsyncClient, rid: str) -> tuple[list[str], dict]:
    seen = []
    while True:
        body = (await c.get(f"/v1/responses/{rid}")).json()
        if not seen or seen[-1] != body["status"]:
            seen.append(body["status"])
        if body["status"] not in ("queued", "in_progress"):
            return seen, body
        await asyncio.sleep(STEP_S)


def test_a_background_response_ends_with_the_body_a_foreground_one_has(tokenizer_dir):
    """Queued at once, then in progress, then the body the same request gets answered in its request (but its
    ids, times and `background`); the engine request ran to its end, and nothing stays counted."""
    app, engine = _app(tokenizer_dir)
    serving = app.state.serving
    body = {"input": "hello", "max_output_tokens": 30, "temperature": 0}

    async def main():
        async with _client(app) as c:
            r = await c.post("/v1/responses", json={**body, "background": True})
            assert r.status_code == 200, r.text
            queued = r.json()
            assert (queued["status"], queued["background"], queued["output"], queued["usage"]) == ("queued", True, [], None)
            seen, done = await _poll(c, queued["id"])
            foreground = (await c.post("/v1/responses", json=body)).json()
            return seen, done, foreground
    seen, done, foreground = asyncio.run(main())
    assert seen[-2:] == ["in_progress", "incomplete"] and seen[0] in ("queued", "in_progress"), seen
    assert done["background"] is True and foreground["background"] is False

    def same(b: dict) -> dict:
        return {**b, "id": None, "created_at": None, "background": None,
                "output": [{**item, "id": None} for item in b["output"]]}
    assert same(done) == same(foreground)
    assert engine.aborted == [] and engine.running == 0
    assert (serving.in_flight, serving.waiting, len(serving.background)) == (0, 0, 0)


def test_a_drain_or_the_apps_shutdown_cuts_background_responses_and_logs_nothing(tokenizer_dir, caplog):
    """SIGTERM's drain fails a background response still running (nobody's connection waits on it, and its store
    goes with the process), as the app's shutdown does: its engine request is closed at once, it counts in flight
    no more, and nothing is logged; while it ran, a continuation of it was refused, as for any response not
    completed."""
    app, engine = _app(tokenizer_dir)
    serving = app.state.serving
    caplog.set_level(logging.WARNING)

    async def start(c: httpx.AsyncClient) -> str:
        running = engine.running
        rid = (await c.post("/v1/responses", json={"input": "hello", "max_output_tokens": 200,
                                                     "background": True})).json()["id"]
        while engine.running == running:
            await asyncio.sleep(STEP_S)
        return rid

    async def main():
        async with _client(app) as c:
            drained = await start(c)
            follow = await c.post("/v1/responses", json={"input": "x", "previous_response_id": drained})
            assert follow.status_code == 400 and follow.json()["error"]["code"] == "previous_response_in_progress"
            serving.drain()
            await serving.wait_idle()
            serving.draining = False
            async with app.router.lifespan_context(app):
                stopped = await start(c)
            return [(await c.get(f"/v1/responses/{rid}")).json() for rid in (drained, stopped)]
    for body in asyncio.run(main()):
        assert body["status"] == "failed" and body["error"]["code"] == "shutting_down", body
    assert len(engine.aborted) == 2 and engine.running == 0
    assert (serving.in_flight, serving.waiting, len(serving.background)) == (0, 0, 0)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records


@pytest.mark.parametrize("stream", [False, True])
def test_a_cancelled_or_drained_background_response_keeps_what_it_generated(tokenizer_dir, stream):
    """Cancelled, or cut by a drain (failed), a background response keeps in its output what it had generated until
    then, its last item incomplete, and its usage counts those tokens (as OpenAI's keeps a cancelled response's
    output); streamed, its output items are those its events opened, closed by their done events, and its last
    event (`response.incomplete` for the cancelled one, `response.failed` for the drained one) carries that body."""
    from tokenmill.server.protocol.responses import ResponsesRequest
    from tokenmill.server.responses import create_response
    app, engine = _app(tokenizer_dir)
    serving = app.state.serving
    tok = engine.tokenizer

    async def start() -> str:
        req = ResponsesRequest.model_validate({"input": "hello", "max_output_tokens": 200, "background": True,
                                               "stream": stream})
        followed = await create_response(serving, req, None)
        rid = next(reversed(serving.background._jobs))
        if stream:
            await followed._close()          # its client leaves at once: the response goes on
        return rid

    async def main():
        cancelled, drained = await start(), await start()
        generated = engine.generated
        while engine.generated < generated + 20:
            await asyncio.sleep(STEP_S)
        await serving.background.cancel(cancelled)
        serving.drain()
        await serving.wait_idle()
        return [(serving.responses.get(rid), serving.responses.events_after(rid, None) if stream else [])
                for rid in (cancelled, drained)]
    ended = asyncio.run(main())
    for (body, events), status in zip(ended, ("cancelled", "failed")):
        assert body["status"] == status and body["background"] is True, body
        (item,) = body["output"]
        text, usage = item["content"][0]["text"], body["usage"]
        assert (item["type"], item["status"]) == ("message", "incomplete"), item
        assert usage["output_tokens"] >= 10 and text == tok.decode([40] * usage["output_tokens"]), body
        assert usage["input_tokens"] > 0 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
        if stream:
            events = [orjson.loads(e.split(b"data: ", 1)[1]) for e in events]
            assert [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"] == [item["id"]]
            assert [e["sequence_number"] for e in events] == list(range(len(events)))
            assert [e["type"] for e in events[-4:]] == ["response.output_text.done", "response.content_part.done",
                                                        "response.output_item.done",
                                                        "response.incomplete" if status == "cancelled" else
                                                        "response.failed"], events[-4:]
            assert events[-4]["text"] == text and events[-3]["part"] == item["content"][0], events[-4:]
            assert events[-2]["item"] == item and events[-1]["response"] == body, events[-2:]
    assert ended[1][0]["error"]["code"] == "shutting_down"
    assert len(engine.aborted) == 2 and engine.running == 0
    assert (serving.in_flight, serving.waiting, len(serving.background)) == (0, 0, 0)


def test_a_background_response_cut_before_its_task_ran_is_counted_no_more(tokenizer_dir):
    """Cut before its task first ran (deleted, dropped past the store's bound, the server stopping): its prompts
    were never read, so the engine heard of nothing, and the counts of waiting and in-flight requests are
    released."""
    from tokenmill.server.protocol.responses import ResponsesRequest
    from tokenmill.server.responses import create_response
    app, engine = _app(tokenizer_dir)
    serving = app.state.serving

    async def main():
        req = ResponsesRequest.model_validate({"input": "hello", "max_output_tokens": 50, "background": True})
        queued = orjson.loads((await create_response(serving, req, None)).body)
        assert (serving.waiting, serving.in_flight, len(serving.background)) == (1, 1, 1)
        serving.responses.delete(queued["id"])            # its task has not run yet
        await asyncio.sleep(0.05)
    asyncio.run(main())
    assert engine.running == 0 and engine.aborted == []
    assert (serving.in_flight, serving.waiting, len(serving.background)) == (0, 0, 0)


def test_background_needs_a_server_that_stores_responses(tokenizer_dir):
    """`store: false`, or a server that stores nothing (--api-server-count above 1): a 400 naming `background`."""
    from tokenmill.server.app import build_app
    app, engine = _app(tokenizer_dir)
    unstored = build_app(engine, store_responses=False)

    async def main():
        async with _client(app) as c, _client(unstored) as u:
            return (await c.post("/v1/responses", json={"input": "x", "background": True, "store": False}),
                    await u.post("/v1/responses", json={"input": "x", "background": True}))
    for r, says in zip(asyncio.run(main()), ("needs 'store' true", "--api-server-count above 1")):
        assert r.status_code == 400 and r.json()["error"]["param"] == "background", r.text
        assert says in r.json()["error"]["message"], r.text


def test_a_client_following_a_stream_is_given_every_event_past_the_bound(tokenizer_dir, monkeypatch):
    """Its events over their bound (here 2,000 bytes, a few events), a background stream still reaches the
    client that follows it live whole and in order: the events it has yet to be given are kept. Once it has
    left, the earliest go, and a replay from before them is a 400 naming `starting_after`."""
    monkeypatch.setattr(response_store, "EVENT_LOG_MAX_BYTES", 2_000)
    app, _ = _app(tokenizer_dir)

    async def main():
        async with _client(app) as c:
            r = await c.post("/v1/responses", json={"input": "hello", "max_output_tokens": 30, "background": True,
                                                     "stream": True})
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
            again = await c.get(f"/v1/responses/{events[0]['response']['id']}", params={"stream": "true"})
            return events, again
    events, again = asyncio.run(main())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.incomplete" and len(json.dumps(events)) > 5 * 2_000
    assert again.status_code == 400 and again.json()["error"]["param"] == "starting_after", again.text


def test_get_takes_openais_include_and_include_obfuscation(tokenizer_dir):
    """GET /v1/responses/{id} as the openai client asks it: `include[]` values are honored as POST's (a 400 naming
    one the stored response cannot give, or one this server has none of), and `include_obfuscation` is taken."""
    import openai
    app, _ = _app(tokenizer_dir)

    async def main():
        async with _client(app) as http:
            client = openai.AsyncOpenAI(api_key="x", base_url="http://tokenmill/v1", http_client=http, max_retries=0)
            plain = await client.responses.create(model="tiny", input="hello", max_output_tokens=3)
            with_logprobs = await client.responses.create(model="tiny", input="hello", max_output_tokens=3,
                                                          include=["message.output_text.logprobs"])
            got = await client.responses.retrieve(plain.id, include=["reasoning.encrypted_content"],
                                                  include_obfuscation=False)
            assert got == plain
            got = await client.responses.retrieve(with_logprobs.id, include=["message.output_text.logprobs"])
            assert got == with_logprobs
            for include, says in ((["message.output_text.logprobs"], "created without it"),
                                  (["web_search_call.results"], "is not supported by tokenmill")):
                with pytest.raises(openai.BadRequestError, match=says) as e:
                    await client.responses.retrieve(plain.id, include=include)
                assert e.value.param == "include" and include[0] in e.value.message
    asyncio.run(main())


def test_the_followers_of_a_stream_are_scanned_at_most_once_an_event(tokenizer_dir, monkeypatch):
    """Each follower trims the kept events after it reads, and each trim scanned every follower for the least
    event given: R x R steps an event (1,000 followers: 3.6 s of the event loop for 200 events). The followers are
    scanned only where an event could go: the events past their bound (here 2,000 bytes), and, after a read, by a
    follower that had yet to be given the earliest kept (here one that read the first and stopped). 50 followers
    are given every event, with one scan an event."""
    from tokenmill.server.protocol.responses import ResponsesRequest
    from tokenmill.server.responses import create_response
    monkeypatch.setattr(response_store, "EVENT_LOG_MAX_BYTES", 2_000)
    app, _ = _app(tokenizer_dir)
    serving = app.state.serving
    scans = []
    trim = serving.responses.trim_events
    monkeypatch.setattr(serving.responses, "trim_events", lambda *a: scans.append(a) or trim(*a))

    async def read(stream) -> list[int]:
        try:
            return [json.loads(e.split(b"data: ", 1)[1])["sequence_number"] async for e in stream.body_iterator]
        finally:
            await stream._close()

    async def main():
        req = ResponsesRequest.model_validate({"input": "hello", "max_output_tokens": 30, "background": True,
                                               "stream": True})
        own = await create_response(serving, req, None)
        rid = json.loads((await own.body_iterator.__anext__()).split(b"data: ", 1)[1])["response"]["id"]
        followers = [serving.background.stream(rid, -1) for _ in range(50)]
        stopped = serving.background.stream(rid, -1)
        await stopped.body_iterator.__anext__()
        seen = await asyncio.gather(*map(read, followers))
        await stopped._close()
        await own._close()
        return seen, serving.responses.next_sequence_number(rid)
    seen, events = asyncio.run(main())
    assert seen == [list(range(events))] * 50 and events > 30
    assert 0 < len(scans) <= events + 1, (len(scans), events)


def test_starting_after_and_the_query_name_the_value_they_refuse(tokenizer_dir):
    """A query parameter that does not parse as its type named neither the value nor what it got ("unable to
    parse string as an integer"); it says what it got now. A number past the events sent, or below 0, is refused
    with the events there are."""
    app, _ = _app(tokenizer_dir)

    async def main():
        async with _client(app) as c:
            r = await c.post("/v1/responses", json={"input": "hello", "max_output_tokens": 3, "background": True,
                                                     "stream": True})
            rid = json.loads(r.text.split("data: ", 1)[1].split("\n", 1)[0])["response"]["id"]
            query = [{"stream": "true", "starting_after": v} for v in ("1.5", "1e3", "x", "9" * 5000, "-1", "10" * 20)]
            return await asyncio.gather(*(c.get(f"/v1/responses/{rid}", params=q) for q in query),
                                        c.get(f"/v1/responses/{rid}", params={"stream": "maybe"}),
                                        c.get(f"/v1/responses/{rid}/input_items", params={"limit": "ten"}))
    answers = asyncio.run(main())
    says = ["(got string '1.5')", "(got string '1e3')", "(got string 'x')", f"(got string '{'9' * 39}",
            "must be 0 or more, got -1", f"'starting_after' is {'10' * 20}, but", "(got string 'maybe')",
            "(got string 'ten')"]
    for r, said, param in zip(answers, says, ["starting_after"] * 6 + ["stream", "limit"]):
        error = r.json()["error"]
        assert r.status_code == 400 and said in error["message"] and error["param"] == param, r.text


def test_a_follower_is_sent_a_large_event_in_pieces(tokenizer_dir, monkeypatch):
    """uvicorn copies each piece of a body it is handed into the connection's buffer, and waits for the client only
    once that buffer is past 64 KiB: a closing event (10.1 MB for 8,000 tokens with 20 top logprobs) went whole
    into the buffer of each follower that read nothing, and 100 of them held 944 MB more. A follower is sent an
    event in pieces of at most `SEND_PIECE_BYTES` (here 200 bytes), which make up the events whole."""
    from tokenmill.server import background
    from tokenmill.server.protocol.responses import ResponsesRequest
    from tokenmill.server.responses import create_response
    monkeypatch.setattr(background, "SEND_PIECE_BYTES", 200)
    app, _ = _app(tokenizer_dir)
    serving = app.state.serving

    async def main():
        req = ResponsesRequest.model_validate({"input": "hello", "max_output_tokens": 8, "background": True,
                                               "stream": True})
        own = await create_response(serving, req, None)
        try:
            pieces = [bytes(piece) async for piece in own.body_iterator]
        finally:
            await own._close()
        return pieces
    pieces = asyncio.run(main())
    events = [json.loads(e.split(b"data: ", 1)[1]) for e in b"".join(pieces).split(b"\n\n") if e]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.incomplete" and len(json.dumps(events[-1])) > 1000
    assert max(map(len, pieces)) == 200, sorted(map(len, pieces))[-3:]


def test_get_answers_the_stored_json_as_it_is_kept(tokenizer_dir, monkeypatch):
    """A poll (GET /v1/responses/{id}) decoded the stored response and encoded it again: ~0.1 s of the event loop
    for a 10 MB response (8,000 tokens with 20 top logprobs) at each poll, and a copy a connection (100 polls that
    read nothing held 458 MB more); cancel decoded it to read `background`. Both answer the kept JSON, decoding
    nothing."""
    app, _ = _app(tokenizer_dir)
    serving = app.state.serving
    decoded = []

    class Orjson:
        dumps = staticmethod(orjson.dumps)

        @staticmethod
        def loads(data):
            decoded.append(len(data))
            return orjson.loads(data)

    async def main():
        async with _client(app) as c:
            rid = (await c.post("/v1/responses", json={"input": "hello", "max_output_tokens": 5,
                                                         "background": True})).json()["id"]
            await _poll(c, rid)
            monkeypatch.setattr(response_store, "orjson", Orjson)
            polls = [await c.get(f"/v1/responses/{rid}") for _ in range(3)]
            cancelled = await c.post(f"/v1/responses/{rid}/cancel")
            return rid, polls, cancelled
    rid, polls, cancelled = asyncio.run(main())
    assert decoded == []
    kept = serving.responses.get_json(rid)
    assert [(r.status_code, r.content) for r in polls + [cancelled]] == [(200, kept)] * 4
    assert json.loads(kept)["status"] == "incomplete"


def test_an_engine_side_refusal_is_the_foregrounds_400_or_a_failed_response_naming_the_field(tokenizer_dir):
    """A priority the engine's policy refuses is known before the request is answered: background or not, the same
    400 naming `priority`, and nothing is stored or counted. A grammar the engine refuses is known only once it
    has tried: the background response is then `failed`, its error naming the field the foreground's 400 names."""
    app, engine = _app(tokenizer_dir)
    serving = app.state.serving
    body = {"input": "hello", "max_output_tokens": 5}
    schema = {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}}

    async def main():
        async with _client(app) as c:
            refused = [await c.post("/v1/responses", json={**body, "priority": 3, **extra})
                       for extra in ({}, {"background": True}, {"background": True, "stream": True})]
            failed = [await c.post("/v1/responses", json={**body, **schema, **extra})
                      for extra in ({}, {"background": True})]
            return refused, failed[0], (await _poll(c, failed[1].json()["id"]))[1]
    refused, foreground, failed = asyncio.run(main())
    for r in refused:
        assert r.status_code == 400 and r.json() == refused[0].json(), r.text
    assert refused[0].json()["error"]["param"] == "priority" and "'fcfs'" in refused[0].json()["error"]["message"]
    assert foreground.status_code == 400 and foreground.json()["error"]["param"] == "text.format", foreground.text
    assert failed["status"] == "failed" and failed["error"] == {
        "code": "invalid_request_error", "message": foreground.json()["error"]["message"], "param": "text.format"}
    assert list(serving.responses._entries) == [failed["id"]] and engine.running == 0
    assert (serving.in_flight, serving.waiting, len(serving.background)) == (0, 0, 0)


@pytest.mark.parametrize("then", ["drain", "delete"])
def test_a_cancel_under_way_ends_cancelled_with_its_output_whatever_comes_after(tokenizer_dir, then):
    """A drain or a delete while a cancelled response's body so far is being built (held here on an event) cuts
    it no more: the body is built whole, and the drained one stays `cancelled` with its output (not `failed`,
    `shutting_down`); the drain cuts no response already ending."""
    import threading
    from tokenmill.server.protocol.responses import ResponsesRequest
    from tokenmill.server.responses import create_response
    app, engine = _app(tokenizer_dir)
    serving = app.state.serving
    building, go, built = threading.Event(), threading.Event(), []

    async def main():
        req = ResponsesRequest.model_validate({"input": "hello", "max_output_tokens": 200, "background": True})
        rid = orjson.loads((await create_response(serving, req, None)).body)["id"]
        job = serving.background._jobs[rid]
        so_far = job.so_far

        def held() -> tuple[dict, list[dict]]:
            building.set()
            go.wait(5)
            built.append(so_far())
            return built[-1]
        job.so_far = held
        while engine.generated < 10:
            await asyncio.sleep(STEP_S)
        cancel = asyncio.create_task(serving.background.cancel(rid))
        await asyncio.to_thread(building.wait, 5)
        if then == "drain":
            serving.drain()
            again = serving.background.stop_all(APIError(503, "stopping", code="shutting_down"))
        else:
            serving.responses.delete(rid)
            again = 0
        await asyncio.sleep(0.05)
        waits = not cancel.done()       # on its body, not cut short
        go.set()
        await cancel
        await serving.wait_idle()
        return rid, job, again, waits
    rid, job, again, waits = asyncio.run(main())
    assert waits and again == 0 and job.cut and len(built) == 1 and built[0][0]["output"], built
    if then == "drain":
        body = serving.responses.get(rid)
        assert body["status"] == "cancelled" and body["error"] is None, body
        assert body["output"] == built[0][0]["output"] and body["usage"]["output_tokens"] >= 10, body
    assert engine.running == 0 and len(engine.aborted) == 1
    assert (serving.in_flight, serving.waiting, len(serving.background)) == (0, 0, 0)


def test_a_cancelled_stream_ends_as_the_openai_client_reads_a_whole_one(tokenizer_dir):
    """A background stream cancelled while it runs ends, on its request's own stream and on one resumed after its
    first text delta (`starting_after`), with the same events: the done events of the message and its text part,
    carrying the text as far as it went (the item `incomplete`), then `response.incomplete` carrying the response
    `cancelled`, as the cancel and GET answer it; the sequence numbers leave no gap. The openai client reads both
    streams, and its stream helper accumulates them, without an error."""
    import openai
    app, engine = _app(tokenizer_dir)

    async def main():
        async with _client(app) as http:
            client = openai.AsyncOpenAI(base_url="http://tokenmill/v1", api_key="k", http_client=http)

            async def events(stream) -> list:
                return [e async for e in stream]
            own = asyncio.create_task(client.responses.create(model="tiny", input="hello", max_output_tokens=200,
                                                              background=True, stream=True))
            while engine.generated < 10:
                await asyncio.sleep(STEP_S)
            rid = next(reversed(app.state.serving.background._jobs))
            cancelled = await client.responses.cancel(rid)
            seen = await events(await own)
            first_delta = next(e.sequence_number for e in seen if e.type == "response.output_text.delta")
            resumed = await events(await client.responses.retrieve(rid, stream=True, starting_after=first_delta))
            async with client.responses.stream(response_id=rid, starting_after=first_delta) as helper:
                helped = await events(helper)
            return seen, first_delta, resumed, helped, cancelled, await client.responses.retrieve(rid)
    seen, first_delta, resumed, helped, cancelled, stored = asyncio.run(main())
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    assert [e.model_dump() for e in resumed] == [e.model_dump() for e in seen[first_delta + 1:]]
    assert [e.sequence_number for e in helped] == [e.sequence_number for e in resumed]
    text_done, part_done, item_done, last = seen[-4:]
    (item,) = stored.output
    text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
    assert (text_done.type, text_done.text) == ("response.output_text.done", text) and text, text_done
    assert (part_done.type, part_done.part.text) == ("response.content_part.done", text), part_done
    assert (item_done.type, item_done.item.status, item_done.item.id) == ("response.output_item.done", "incomplete",
                                                                          item.id), item_done
    assert (last.type, last.response.status) == ("response.incomplete", "cancelled"), last
    assert last.response == cancelled == stored and item.content[0].text == text
    assert helped[-1].type == "response.incomplete" and helped[-1].response.output[0].content[0].text == text
    assert engine.running == 0 and len(engine.aborted) == 1


@pytest.mark.parametrize("first", ["cancel", "delete"])
def test_a_cancel_and_a_delete_of_one_response_each_answer_what_they_did(tokenizer_dir, first):
    """A cancel waits for the response's ending (its body so far being built, held here on an event): a delete that
    comes meanwhile deletes it, and the cancel, which came first and did cancel it, still answers the response
    `cancelled` with its output, not a 404. A delete first cancels the response itself, and a cancel after it is a
    404. Either way GET finds nothing after, the engine request was aborted, and nothing stays counted."""
    import threading
    app, engine = _app(tokenizer_dir)
    serving = app.state.serving
    building, go = threading.Event(), threading.Event()

    async def main():
        async with _client(app) as c:
            rid = (await c.post("/v1/responses", json={"input": "hello", "max_output_tokens": 200,
                                                       "background": True})).json()["id"]
            job = serving.background._jobs[rid]
            so_far = job.so_far

            def held():
                building.set()
                go.wait(5)
                return so_far()
            job.so_far = held
            while engine.generated < 10:
                await asyncio.sleep(STEP_S)
            if first == "cancel":
                cancel = asyncio.create_task(c.post(f"/v1/responses/{rid}/cancel"))
                await asyncio.to_thread(building.wait, 5)
                delete = await c.delete(f"/v1/responses/{rid}")
                go.set()
                cancel = await cancel
            else:
                go.set()
                delete = await c.delete(f"/v1/responses/{rid}")
                cancel = await c.post(f"/v1/responses/{rid}/cancel")
            await serving.wait_idle()
            return cancel, delete, await c.get(f"/v1/responses/{rid}")
    cancel, delete, get = asyncio.run(main())
    assert delete.status_code == 200 and delete.json()["deleted"] is True, delete.text
    assert get.status_code == 404, get.text
    if first == "cancel":
        body = cancel.json()
        assert cancel.status_code == 200 and (body["status"], body["error"]) == ("cancelled", None), cancel.text
        assert body["output"] and body["usage"]["output_tokens"] >= 10, body
    else:
        assert cancel.status_code == 404 and cancel.json()["error"]["code"] == "response_not_found", cancel.text
    assert engine.running == 0 and len(engine.aborted) == 1
    assert (serving.in_flight, serving.waiting, len(serving.background)) == (0, 0, 0)
