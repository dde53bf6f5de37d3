"""`tokenmill serve --api-server-count N`: N API server processes share the port and one engine core.

The core's side (each client's part of a step's report; a client whose pipe closes has its requests
aborted while the others are served) is tested on the core itself; the processes' side on a real
`tokenmill serve --api-server-count 2` whose steps take at least 20 ms (tests/slow_engine.py), so that
streams outlast the test's actions."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from test_server import ServerProcess, alive, completion_text
from tokenmill.engine.core_client import EngineCore
from tokenmill.engine.core_messages import AbortRequests, AddRequest, CoreUpdate, Shutdown
from tokenmill.engine.step_outputs import StepOutputs
from tokenmill.sampling_params import SamplingParams

TESTS = os.path.dirname(os.path.abspath(__file__))


# ----- the core ------------------------------------------------------------------------------------------
def test_a_report_splits_by_handle_with_rows_renumbered():
    # clients 0, 1, 2 of 3 own handles 0 mod 3, 1 mod 3, 2 mod 3
    handles = np.array([3, 4, 0, 4, 5, 3], np.int64)
    step = StepOutputs(handles, np.array([0, 0, 0, 1, 0, 0], np.int32), np.array([10, 11, 12, 13, 14, 15], np.int64),
                       started=[(4, 1.0, 0), (0, 2.0, 8)],
                       finished=[(3, 0, "length", None, -1), (4, 1, "stop", None, 3), (5, 0, "stop", 7, 4)],
                       logprobs={1: "lp-row1", 5: "lp-row5"}, prompt_logprobs=[(0, ["p"])])
    zero, one, two = step.split(3)
    assert zero.handles.tolist() == [3, 0, 3] and zero.tokens.tolist() == [10, 12, 15]
    assert one.handles.tolist() == [4, 4] and one.indexes.tolist() == [0, 1] and one.tokens.tolist() == [11, 13]
    assert two.handles.tolist() == [5] and two.tokens.tolist() == [14]
    assert zero.started == [(0, 2.0, 8)] and one.started == [(4, 1.0, 0)] and not two.started
    assert zero.finished == [(3, 0, "length", None, -1)]
    assert one.finished == [(4, 1, "stop", None, 1)]          # global row 3 is its second row
    assert two.finished == [(5, 0, "stop", 7, 0)]
    assert zero.logprobs == {2: "lp-row5"} and one.logprobs == {0: "lp-row1"} and not two.logprobs
    assert zero.prompt_logprobs == [(0, ["p"])] and not one.prompt_logprobs
    assert [bool(p) for p in StepOutputs(started=[(1, 0.0, 0)]).split(2)] == [False, True]


def test_the_core_forgets_a_clients_request_once_each_sequence_has_ended():
    """What the core keeps of a client's requests (to abort them if the client goes away) empties as
    they end: sequences finished in the engine or by a stop string, reported twice or not, or aborted."""
    from tokenmill.engine.core_messages import StopSequences
    from tokenmill.engine.core_proc import _Client

    class Engine:
        def __init__(self):
            self.calls = []

        def add_request(self, request_id, *args, **kw):
            self.calls.append(("add", request_id))

        def stop_sequences(self, sequences):
            self.calls.append(("stop", sequences))

        def abort_request(self, request_ids):
            self.calls.append(("abort", request_ids))

    engine, update = Engine(), CoreUpdate()
    client = _Client(1, 2, conn=_pipe_end())
    client.apply(engine, AddRequest("two", [1], SamplingParams(n=2), handle=1), update)
    client.apply(engine, AddRequest("one", [1], SamplingParams(), handle=3), update)
    client.apply(engine, AddRequest("gone", [1], SamplingParams(), handle=5), update)
    assert engine.calls[:3] == [("add", "1:two"), ("add", "1:one"), ("add", "1:gone")]
    client.reported(StepOutputs(finished=[(1, 0, "length", None, -1), (3, 0, "stop", None, -1)]))
    assert set(client.handles) == {"two", "gone"}
    client.apply(engine, StopSequences([("two", 1), ("two", 0)]), update)     # 0 had finished already
    client.apply(engine, AbortRequests(["gone"]), update)
    assert engine.calls[3:] == [("stop", [("1:two", 1), ("1:two", 0)]), ("abort", ["1:gone"])]
    assert not client.handles and not client.live and not update.errors


def test_a_request_the_engine_failed_goes_to_its_own_client_and_is_forgotten():
    """A request the engine failed (`LLMEngine.take_errors`: a grammar over its time limit) is named with its
    client's prefix: of two clients with the same request id, only the owner takes the error, by its own id,
    and forgets the request."""
    from tokenmill.engine.core_proc import _Client

    class Engine:
        def add_request(self, request_id, *args, **kw):
            pass

    engine, update = Engine(), CoreUpdate()
    clients = [_Client(i, 2, conn=_pipe_end()) for i in range(2)]
    for i, client in enumerate(clients):
        client.apply(engine, AddRequest("r", [1], SamplingParams(), handle=i), update)
    assert clients[0].failed("1:r") is None and clients[1].failed("1:r") == "r"
    assert not clients[1].handles and not clients[1].live and clients[0].handles == {"r": 0}
    assert clients[1].failed("1:r") is None and _Client(0, 1, conn=_pipe_end()).failed("r") is None


def _updates(conn, until, timeout: float = 30.0) -> list[CoreUpdate]:
    """Reads the core's updates on `conn` until `until(update)` holds."""
    got = []
    deadline = time.monotonic() + timeout
    while True:
        assert conn.poll(max(0.0, deadline - time.monotonic())), f"no update in {timeout} s: {got[-1:]}"
        got.append(conn.recv())
        if until(got[-1]):
            return got


def test_the_core_serves_each_client_its_own_requests_and_frees_a_gone_clients(qwen3_dir):
    from tokenmill.config import EngineConfig
    config = EngineConfig(model=qwen3_dir, device="cpu", dtype="float32", max_model_len=512, num_kv_blocks=256,
                          block_size=4)
    core = EngineCore(config, num_clients=2, in_process=True)
    a, b = (c.conn for c in core.clients)
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    try:
        # the same request id from both clients: the core keeps them apart
        a.send([AddRequest("r", [5, 6, 7], long, handle=0)])
        b.send([AddRequest("r", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True), handle=1)])
        seen_b = _updates(b, lambda u: u.outputs is not None and u.outputs.finished)
        assert all(u.errors == [] for u in seen_b)
        tokens_b = [t for u in seen_b if u.outputs is not None for t in u.outputs.tokens.tolist()]
        assert {h for u in seen_b if u.outputs is not None for h in u.outputs.handles.tolist()} == {1}
        assert len(tokens_b) == 8
        seen_a = _updates(a, lambda u: u.outputs is not None and len(u.outputs.tokens))
        assert {h for u in seen_a if u.outputs is not None for h in u.outputs.handles.tolist()} == {0}
        # a handle of another client is refused
        b.send([AddRequest("x", [5], long, handle=2)])
        assert _updates(b, lambda u: u.errors)[-1].errors[0][0] == "x"
        # client a goes away mid-generation: its request is aborted and its blocks freed
        a.close()
        b.send([AbortRequests([])])        # asks for stats
        idle = _updates(b, lambda u: u.stats and u.stats["num_running"] == 0)[-1].stats
        assert idle["kv_cache_usage"] == 0 and idle["num_waiting"] == 0
        assert idle["num_free_blocks"] == idle["num_total_blocks"]
        # and b is still served
        b.send([AddRequest("r2", [9, 8], SamplingParams(max_tokens=3, ignore_eos=True), handle=3)])
        done = _updates(b, lambda u: u.outputs is not None and u.outputs.finished)
        assert sum(len(u.outputs.tokens) for u in done if u.outputs is not None) == 3
        b.send([Shutdown()])
        core.join(10)
        assert not core._proc.is_alive()
    finally:
        for conn in (a, b):
            conn.close()


def test_a_client_that_reads_nothing_and_holds_no_request_stalls_no_other(qwen3_dir):
    """An API server whose loop stalls (here: never reads) while it has no request gets no update from the
    core: the core's sends block once that pipe is full, which had frozen every other client's streams."""
    from tokenmill.config import EngineConfig
    config = EngineConfig(model=qwen3_dir, device="cpu", dtype="float32", max_model_len=512, num_kv_blocks=256,
                          block_size=4)
    core = EngineCore(config, num_clients=2, in_process=True)
    a, b = (c.conn for c in core.clients)
    try:
        # 600 steps: a busy step's stats update is ~620 bytes pickled, and b's pipe (a socket pair with
        # Linux's default 208 KiB buffer) holds ~170 of them unread, so a core that sent b one per step would
        # block by the second request
        for i in range(4):
            a.send([AddRequest(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=150, ignore_eos=True), handle=2 * i)])
            seen = _updates(a, lambda u: u.outputs is not None and u.outputs.finished, timeout=60)
            assert sum(len(u.outputs.tokens) for u in seen if u.outputs is not None) == 150
        b.send([AbortRequests([])])        # b asks for stats: it is answered
        assert _updates(b, lambda u: u.stats is not None)[-1].stats["num_running"] == 0
        a.send([Shutdown()])
        b.send([Shutdown()])
        core.join(10)
    finally:
        for conn in (a, b):
            conn.close()


# ----- the processes -------------------------------------------------------------------------------------
PROMPTS = ["The quick brown fox", "PagedAttention keeps", "def main():", "Continuous batching lets"]
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


class Servers(ServerProcess):
    """`tokenmill serve --api-server-count 2` with 20 ms steps; `api_pids` are its API server processes."""

    def __init__(self, model_dir: str, tmp_path, *args: str, factory: str = "slow_engine:make"):
        mp = pytest.MonkeyPatch()
        mp.setenv("PYTHONPATH", TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))
        try:
            super().__init__(model_dir, tmp_path, "--api-server-count", "2", "--engine-factory", factory,
                             "--max-model-len", "512", "--num-kv-blocks", "512", "--block-size", "4", *args)
        finally:
            mp.undo()
        m = re.search(r"2 API server processes \(pids (\d+), (\d+)\)", self.log_path.read_text())
        self.api_pids = [int(m.group(1)), int(m.group(2))]
        self.port = int(self.url.rsplit(":", 1)[1])


def connections_by_pid(pids: list[int], port: int) -> dict[int, int]:
    """How many established connections to `port` each process holds (/proc: socket inodes of its
    descriptors, matched against the kernel's TCP table)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":    # ESTABLISHED
                    inodes.add(fields[9])
    counts = {}
    for pid in pids:
        held = 0
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            held += target.startswith("socket:[") and target[8:-1] in inodes
        counts[pid] = held
    return counts


@pytest.fixture(scope="module")
def servers(qwen3_dir, tmp_path_factory):
    s = Servers(qwen3_dir, tmp_path_factory.mktemp("api-servers"), "--enable-tokenizer-info-endpoint",
                factory="beside_api_servers:make")
    yield s
    s.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def want(qwen3_dir):
    from tokenmill import LLM, SamplingParams
    llm = LLM(qwen3_dir, device="cpu", max_model_len=512, num_kv_blocks=256, block_size=4)
    return [out.outputs[0].text for out in llm.generate(PROMPTS, SamplingParams(**GREEDY))]


async def _complete(c: httpx.AsyncClient, prompt: str, stream: bool) -> str:
    return await completion_text(c, {"prompt": prompt, **GREEDY}, stream)


def test_the_api_servers_start_while_the_core_loads(servers):
    """The API server processes are spawned with the core, not once it is ready: the core's engine factory
    saw both (the pids that then serve) before it returned, and, once they had finished their start, /health
    got no answer from them: none accepts a connection before its core client is usable."""
    log = servers.log_path.read_text()
    assert (f"engine core loading beside API server processes {sorted(servers.api_pids)}; /health: no answer "
            "(TimeoutError)") in log, log[-3000:]


def test_a_core_that_fails_to_start_takes_the_api_servers_down(qwen3_dir):
    """The core fails while the API servers start (they had been running: its factory names them): the error
    is the core's, the status 1, and no API server is left."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(TESTS), "src"), TESTS]),
               OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", qwen3_dir, "--device", "cpu", "--port", "0",
                        "--api-server-count", "2", "--engine-factory", "beside_api_servers:fail"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 1, p.stderr[-2000:]
    m = re.search(r"tokenmill: engine core failed to start:\ncannot load the model \(API server processes "
                  r"\[(\d+), (\d+)\] were starting\)", p.stderr)
    assert m, p.stderr[-2000:]
    assert "Traceback" not in p.stderr and "serving" not in p.stdout
    for pid in map(int, m.groups()):
        assert not alive(pid), pid


def test_concurrent_requests_complete_through_both_api_servers(servers, want):
    """48 requests at once, streaming and not, each on its own connection: every text is the offline
    engine's, both API server processes accepted connections, and /metrics (one process answers) counts
    the requests of both."""
    before = servers.metrics().get("tokenmill:request_success_total", 0.0)
    held: dict[int, int] = {}
    rounds = 0
    while rounds < 5:           # the kernel gives each connection to the first process to accept it
        rounds += 1
        async def main():
            async with httpx.AsyncClient(base_url=servers.url, timeout=60,
                                         limits=httpx.Limits(max_connections=64)) as c:
                texts = await asyncio.gather(*(_complete(c, PROMPTS[i % 4], stream=i % 2 == 1) for i in range(48)))
                return texts, connections_by_pid(servers.api_pids, servers.port)
        texts, by_pid = asyncio.run(main())
        assert texts == [want[i % 4] for i in range(48)]
        held = {pid: held.get(pid, 0) + n for pid, n in by_pid.items()}
        if all(held.values()):
            break
    assert all(held.values()), held
    m = servers.metrics()
    assert m["tokenmill:request_success_total"] - before == 48 * rounds
    assert m["tokenmill:e2e_request_latency_seconds_count"] >= 48 * rounds


def test_a_client_gone_mid_stream_frees_its_blocks(servers):
    """Eight streams, each on a connection of its own, abandoned mid-generation: the core aborts them."""
    body = {"prompt": "abandoned", "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def main():
        clients = [httpx.AsyncClient(base_url=servers.url, timeout=60) for _ in range(8)]
        streams = []
        for c in clients:
            ctx = c.stream("POST", "/v1/completions", json=body)
            r = await ctx.__aenter__()
            lines = r.aiter_lines()
            while not (await lines.__anext__()).startswith("data: {"):
                pass
            streams.append((ctx, lines))      # keep `lines`: collecting it would close the stream
        assert servers.metrics()["tokenmill:num_requests_running"] == 8
        for (ctx, _), c in zip(streams, clients):
            await ctx.__aexit__(None, None, None)
            await c.aclose()
    asyncio.run(main())
    m = servers.wait_engine_idle(timeout=10)
    assert m["tokenmill:kv_cache_usage_perc"] == 0


def test_several_api_servers_store_no_responses(servers):
    """Each API server process would keep only the Responses it made, and a later request may reach
    another: none stores, and continuing or fetching one is a 400 that says why."""
    r = httpx.post(servers.url + "/v1/responses", timeout=60, json={"input": "x", "max_output_tokens": 2})
    assert r.status_code == 200 and r.json()["store"] is False, r.text
    for response in (httpx.post(servers.url + "/v1/responses", timeout=60,
                                json={"input": "x", "previous_response_id": r.json()["id"]}),
                     httpx.get(servers.url + f"/v1/responses/{r.json()['id']}", timeout=60)):
        assert response.status_code == 400 and "--api-server-count" in response.json()["error"]["message"]


def test_every_api_server_serves_tokenizer_info(servers):
    """--enable-tokenizer-info-endpoint reaches each API server process: 16 requests at once, each on a
    connection of its own, are answered 200 whichever process accepted them (both did)."""
    held: dict[int, int] = {}
    for _ in range(5):          # the kernel gives each connection to the first process to accept it
        async def main():
            async with httpx.AsyncClient(base_url=servers.url, timeout=60,
                                         limits=httpx.Limits(max_connections=16)) as c:
                answers = await asyncio.gather(*(c.get("/tokenizer_info") for _ in range(16)))
                return answers, connections_by_pid(servers.api_pids, servers.port)
        answers, by_pid = asyncio.run(main())
        assert all(r.status_code == 200 and r.json()["eos_token"] == "<|im_end|>" for r in answers), answers[0].text
        held = {pid: held.get(pid, 0) + n for pid, n in by_pid.items()}
        if all(held.values()):
            break
    assert all(held.values()), held


def test_sigterm_drains_every_api_server_and_exits_0(servers, want):
    """Runs last on `servers`: the streams in flight finish whole, new requests get 503 from either process,
    and every API server exits (the parent's wait would time out if one had not been told to drain)."""
    async def main():
        async with httpx.AsyncClient(base_url=servers.url, timeout=60, limits=httpx.Limits(max_connections=64)) as c:
            body = {"prompt": PROMPTS[0], **GREEDY, "max_tokens": 60, "stream": True}
            async def stream():
                lines = []
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line:
                            lines.append(line)
                return lines
            streams = [asyncio.ensure_future(stream()) for _ in range(16)]
            while servers.metrics()["tokenmill:num_requests_running"] < 16:
                await asyncio.sleep(0.05)
            servers.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            refused = [await c.post("/v1/completions", json={"prompt": "late", "max_tokens": 1},
                                    headers={"Connection": "close"}) for _ in range(4)]
            return await asyncio.gather(*streams), refused
    streams, refused = asyncio.run(main())
    for lines in streams:
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert "".join(ch["choices"][0]["text"] for ch in chunks).startswith(want[0])
    # a new connection may reach either process: both are draining
    assert {r.status_code for r in refused} == {503}, [r.text for r in refused]
    assert servers.proc.wait(30) == 0, servers.log_path.read_text()[-3000:]
    for pid in [*servers.api_pids, servers.engine_pid]:
        assert not alive(pid), pid


def test_an_api_server_that_dies_takes_the_server_down_with_status_1(qwen3_dir, tmp_path):
    s = Servers(qwen3_dir, tmp_path)
    try:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200
        os.kill(s.api_pids[0], signal.SIGKILL)
        assert s.proc.wait(30) == 1
        assert "exited with status -9 unasked" in s.log_path.read_text()
        deadline = time.monotonic() + 10
        while any(alive(p) for p in [s.api_pids[1], s.engine_pid]):
            assert time.monotonic() < deadline, "the other API server or the engine core outlived the parent"
            time.sleep(0.1)
    finally:
        s.stop(signal.SIGKILL)


def test_no_core_is_started_where_the_start_fails_before_it_could_be_ended(monkeypatch):
    """The parent's own set-up (the metrics directory) comes before the engine core's start: a core ignores SIGTERM,
    so one started ahead of a step that then failed would be left for the exit to wait on."""
    import socket as socket_module
    import tempfile
    from tokenmill.server import api_servers
    from tokenmill.server.http_server import ServeOptions
    started = []
    monkeypatch.setattr(api_servers, "EngineCore", lambda *a, **kw: started.append(a))

    def full(*a, **kw):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(tempfile, "mkdtemp", full)
    with socket_module.socket() as sock, pytest.raises(OSError, match="No space left"):
        sock.bind(("127.0.0.1", 0))
        api_servers.run_api_servers(None, sock, "127.0.0.1", ServeOptions(), 2, None)
    assert started == []


def _pipe_end():
    """One end of a pipe, for a core client whose other end no one reads."""
    import multiprocessing as mp
    return mp.Pipe(duplex=True)[0]
