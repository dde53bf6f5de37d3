"""`tokenmill serve --data-parallel-size N`: N engine cores behind one API server.

The routing rule is tested on `PrefixRouter` alone; that it holds for real cores on two tiny engines
driven in this process by a `DataParallelLLM` (each core's own stats: which served which prompts, and
whose prefix cache was hit); the whole on a real `tokenmill serve --data-parallel-size 2` whose steps
take at least 20 ms (tests/slow_engine.py), so that streams outlast a SIGTERM."""
from __future__ import annotations

import asyncio
import os
import re
import signal

import httpx
import pytest

from test_server import ServerProcess, alive, cmdline, completion_text
from tokenmill.engine.dp_router import PrefixRouter, block_hashes

TESTS = os.path.dirname(os.path.abspath(__file__))
BS = 4


# ----- the rule ------------------------------------------------------------------------------------------
def test_block_hashes_chain_the_full_blocks_only():
    a, b = block_hashes(list(range(10)), BS), block_hashes(list(range(8)) + [0, 0, 0], BS)
    assert len(a) == 2 and a == b                         # the partial third block is not hashed
    assert block_hashes([9, 1, 2, 3, 4, 5, 6, 7], BS)[1] != a[1]    # a block's hash covers its parent's
    assert block_hashes([1, 2, 3], BS) == []
    # a salted prompt's chain starts from its salt, as the cores' prefix caches do
    salted = block_hashes(list(range(10)), BS, "s")
    assert salted == block_hashes(list(range(10)), BS, "s") and not set(salted) & set(a)


def test_a_shared_prefix_stays_on_its_core_until_it_is_too_loaded():
    router = PrefixRouter(2, BS, min_imbalance=2, imbalance_ratio=0.5)
    prefix = list(range(100, 112))                       # three full blocks
    loads = [0, 0]
    first = router.choose(prefix + [1], loads)
    loads[first] += 1
    for tail in range(2, 4):                             # in flight, the other core idle: still affinity
        assert router.choose(prefix + [tail], loads) == first
        loads[first] += 1
    assert loads[first] - loads[1 - first] == 3          # now beyond max(2, 0.5 x 0): the other core
    assert router.choose(prefix + [9], loads) == 1 - first
    # that core last received the prefix: it takes the next one too
    assert router.choose(prefix + [10], [0, 0]) == 1 - first
    # one shared block is enough; a prompt shorter than a block has no affinity (least loaded)
    assert router.choose(prefix[:BS] + [7, 7], [5, 4]) == 1 - first
    assert router.choose(prefix[:3], [5, 4]) == 1


def test_a_prefix_of_half_the_prompt_or_less_draws_no_request_to_its_core():
    """Chat prompts all share their template's first block (SmolLM2's default system prompt is 24 tokens):
    counted as affinity, it put every one of 8 concurrent chats on one core, the other idle."""
    router = PrefixRouter(2, BS)
    header = [1, 2, 3, 4, 5]                             # one full block in every prompt
    loads = [0, 0]
    for i in range(8):
        loads[router.choose(header + [10 + i] * 7, loads)] += 1
    assert loads == [4, 4]
    # more than half of the prompt (a conversation's history) keeps it on its core; exactly half does not
    first = router.choose([7] * 8, [0, 0])
    busy = [2, 0] if first == 0 else [0, 2]
    assert router.choose([7] * 8 + [9], busy) == first
    assert router.choose([7] * 4 + [8] * 4, busy) == 1 - first


def test_distinct_prefixes_spread_by_load_and_ties_take_turns():
    router = PrefixRouter(3, BS)
    assert [router.choose([i] * 8, [0, 0, 0]) for i in range(6)] == [0, 1, 2, 0, 1, 2]
    assert router.choose([42] * 8, [3, 1, 2]) == 1


def test_the_map_is_bounded_least_recently_used_first():
    router = PrefixRouter(2, BS, max_entries=4)
    router.choose([1] * 8, [0, 0])                       # 2 hashes -> core 0
    router.choose([2] * 8, [0, 0])                       # 2 hashes -> core 1
    assert len(router) == 4
    router.choose([1] * 8, [9, 0])                       # refreshed (and moved: core 0 is far too loaded)
    router.choose([3] * 8, [0, 0])                       # evicts [2]'s blocks, the least recent
    assert len(router) == 4
    assert router.affinity(block_hashes([2] * 8, BS)) == (None, 0)
    assert router.affinity(block_hashes([1] * 8, BS)) == (1, 2)


# ----- the frontend over fake cores ----------------------------------------------------------------
class FakeCore:
    """What `DataParallelLLM` uses of an `AsyncLLM`: each request yields one output, then waits for `gate`."""

    def __init__(self, stats: dict):
        self.config = None
        self.model_name, self.max_model_len, self.vocab_size, self.tokenizer, self.processor = "m", 96, 512, None, None
        self.scheduling_policy = "fcfs"
        self.on_output = None
        self.stats, self.requests, self.aborted, self.dead_callbacks = stats, [], [], []
        self.gate: asyncio.Event | None = None
        self.pid = self.dead = None
        self.failed: list[BaseException] = []

    def on_dead(self, callback):
        self.dead_callbacks.append(callback)

    async def generate(self, request_id, prompt, params, *args):
        self.requests.append(request_id)
        yield "first"
        await self.gate.wait()
        yield "last"

    def abort(self, ids):
        self.aborted += ids

    def fail_all(self, error):
        self.failed.append(error)
        return 0

    async def get_stats(self, max_age=0.0, timeout=2.0):
        return dict(self.stats)


def test_the_frontend_routes_follows_and_sums_its_cores():
    from tokenmill.engine.data_parallel import DataParallelLLM
    cores = [FakeCore({"num_running": 2, "num_total_blocks": 100, "num_free_blocks": 50, "kv_cache_usage": 0.5,
                       "prompt_tokens": 10, "iteration_tokens": [3, 0, 1]}),
             FakeCore({"num_running": 1, "num_total_blocks": 300, "num_free_blocks": 300, "kv_cache_usage": 0.0,
                       "prompt_tokens": 5, "iteration_tokens": [1, 2, 0]})]
    cores[1].max_model_len = 64              # its device had less memory for the KV cache
    dp = DataParallelLLM(cores, BS)
    assert dp.max_model_len == 64            # the length every core takes, whichever the router picks
    shared = list(range(100, 112))
    deaths = []
    dp.on_dead(deaths.append)

    async def main():
        for core in cores:
            core.gate = asyncio.Event()
        gens = [dp.generate(f"s{i}", shared + [i], None) for i in range(4)]
        gens += [dp.generate(f"d{i}", [50 + i] * 8, None) for i in range(4)]
        for g in gens:                       # every request in flight at once
            assert await g.__anext__() == "first"
        held = list(dp.loads)
        dp.abort(["s1", "d2", "unknown"])
        stats = await dp.get_stats()
        for core in cores:
            core.gate.set()
        for g in gens:
            assert [out async for out in g] == ["last"]
        return held, stats
    held, stats = asyncio.run(main())
    shared_core = 0 if "s0" in cores[0].requests else 1
    assert sorted(cores[shared_core].requests) == ["s0", "s1", "s2", "s3"]       # affinity, load 4 < 8 apart
    assert sorted(cores[1 - shared_core].requests) == ["d0", "d1", "d2", "d3"]   # the least-loaded core
    assert held == [4, 4] and dp.loads == [0, 0] and not dp._owner
    assert cores[shared_core].aborted == ["s1"] and cores[1 - shared_core].aborted == ["d2"]
    assert stats["num_running"] == 3 and stats["prompt_tokens"] == 15 and stats["num_total_blocks"] == 400
    assert stats["kv_cache_usage"] == 50 / 400 and stats["iteration_tokens"] == [4, 2, 1]
    cores[1].dead = "engine core exited (EOFError)"
    cores[1].dead_callbacks[0](cores[1].dead)
    cores[0].dead_callbacks[0]("later")
    assert deaths == [dp.dead] and dp.dead.startswith("engine core 1 of 2: engine core exited")
    assert [str(e) for e in cores[0].failed] == [dp.dead] and not cores[1].failed   # the live core's requests end


def test_a_request_of_n_choices_weighs_n_on_its_core():
    """n sequences take n of a core's seats and blocks: counted as one request, a best-of-8 request on
    one core and three plain ones split 2 / 2."""
    from types import SimpleNamespace
    from tokenmill.engine.data_parallel import DataParallelLLM
    cores = [FakeCore({}), FakeCore({})]
    dp = DataParallelLLM(cores, BS)

    async def main():
        for core in cores:
            core.gate = asyncio.Event()
        gens = [dp.generate("wide", [1] * 8, SimpleNamespace(n=8))]
        gens += [dp.generate(f"r{i}", [2 + i] * 8, None) for i in range(3)]
        for g in gens:
            await g.__anext__()
        held = list(dp.loads)
        for core in cores:
            core.gate.set()
        for g in gens:
            assert [out async for out in g] == ["last"]
        return held
    held = asyncio.run(main())
    wide = 0 if "wide" in cores[0].requests else 1
    assert held[wide] == 8 and held[1 - wide] == 3 and dp.loads == [0, 0]
    assert sorted(cores[1 - wide].requests) == ["r0", "r1", "r2"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")   # a core's SystemExit(1)
def test_a_core_that_fails_to_start_is_reported_at_once_by_its_index(qwen3_dir, monkeypatch):
    """Core 1 fails while core 0 still loads: the cores' announcements were awaited in order, so the
    failure waited for core 0's whole start-up (up to its 600 s timeout) and named no core. Cores in
    threads here, so that no process starts."""
    import dataclasses
    import functools
    import threading
    import time

    import slow_engine
    from tokenmill.config import EngineConfig
    from tokenmill.engine import data_parallel
    monkeypatch.setattr(data_parallel, "EngineCore", functools.partial(data_parallel.EngineCore, in_process=True))
    configs = data_parallel.core_configs
    monkeypatch.setattr(data_parallel, "core_configs", lambda config, size: [
        dataclasses.replace(c, extra={**c.extra, "core": i}) for i, c in enumerate(configs(config, size))])
    start = time.monotonic()
    try:
        with pytest.raises(data_parallel.EngineStartError,
                           match=r"^engine core 1 of 2 \(cpu\) failed to start:\ncore 1 cannot load its model$"):
            data_parallel.DataParallelLLM.start(EngineConfig(model=qwen3_dir, device="cpu"), 2,
                                                engine_factory="slow_engine:core_0_loads", startup_timeout=10)
        assert time.monotonic() - start < 5
    finally:
        slow_engine.LOADING.set()
        for thread in threading.enumerate():
            if thread.name == "engine-core":
                thread.join(10)


# ----- the server ----------------------------------------------------------------------------------------
PROMPTS = ["The quick brown fox", "PagedAttention keeps", "def main():", "Continuous batching lets"]
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


class DPServer(ServerProcess):
    def __init__(self, model_dir: str, tmp_path, *args: str):
        mp = pytest.MonkeyPatch()
        mp.setenv("PYTHONPATH", TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))
        try:
            super().__init__(model_dir, tmp_path, "-dp", "2", "--engine-factory", "slow_engine:make",
                             "--max-model-len", "96", "--num-kv-blocks", "256", "--block-size", str(BS), *args)
        finally:
            mp.undo()
        m = re.search(r"2 engine cores \(pids (\d+), (\d+)\)", self.log_path.read_text())
        self.core_pids = [int(m.group(1)), int(m.group(2))]


@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    s = DPServer(qwen3_dir, tmp_path_factory.mktemp("dp-server"))
    yield s
    s.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def want(qwen3_dir):
    from tokenmill import LLM, SamplingParams
    llm = LLM(qwen3_dir, device="cpu", max_model_len=96, num_kv_blocks=128, block_size=BS)
    outs = llm.generate(PROMPTS, SamplingParams(**GREEDY))
    return [o.outputs[0].text for o in outs], [len(o.prompt_token_ids) for o in outs]


async def _complete(c: httpx.AsyncClient, prompt: str, stream: bool, max_tokens: int = 12) -> str:
    return await completion_text(c, {"prompt": prompt, **GREEDY, "max_tokens": max_tokens}, stream)


def test_served_text_is_the_offline_engines_and_metrics_sum_both_cores(server, want):
    """32 requests at once, streaming and not: the offline engine's greedy text; once idle, /metrics shows
    both cores' blocks, and the token counters grew by all requests' tokens."""
    texts, lengths = want
    before = server.metrics()

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=httpx.Limits(max_connections=64)) as c:
            return await asyncio.gather(*(_complete(c, PROMPTS[i % 4], stream=i % 2 == 1) for i in range(32)))
    assert asyncio.run(main()) == [texts[i % 4] for i in range(32)]
    m = server.wait_engine_idle()
    assert m["tokenmill:num_total_blocks"] == m["tokenmill:num_free_blocks"] == 2 * 256
    assert m["tokenmill:generation_tokens_total"] - before["tokenmill:generation_tokens_total"] == 32 * 12
    assert m["tokenmill:prompt_tokens_total"] - before["tokenmill:prompt_tokens_total"] == 8 * sum(lengths)
    assert m["tokenmill:request_success_total"] - before.get("tokenmill:request_success_total", 0) == 32


def test_prompts_sharing_a_prefix_hit_one_cores_prefix_cache(server):
    """Eight prompts, one after another, sharing five full blocks: every one after the first finds all
    five in the prefix cache, which only happens if they all reached the same core."""
    before = server.metrics()
    shared = list(range(10, 30))
    for i in range(8):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": shared + [40 + i, 41], **GREEDY,
                                                             "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
    hits = server.metrics()["tokenmill:prefix_cache_hits_total"] - before["tokenmill:prefix_cache_hits_total"]
    assert hits == 7 * 20


def test_sigterm_drains_both_cores_and_exits_0(server, want):
    """Runs last on `server`: 16 streams in flight finish whole, a new request gets 503, the server exits
    0 and neither core is left."""
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=httpx.Limits(max_connections=64)) as c:
            streams = [asyncio.ensure_future(_complete(c, PROMPTS[i % 4], True, max_tokens=40)) for i in range(16)]
            while server.metrics()["tokenmill:num_requests_running"] < 16:
                await asyncio.sleep(0.05)
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            late = await c.post("/v1/completions", json={"prompt": "late", "max_tokens": 1},
                                headers={"Connection": "close"})
            return await asyncio.gather(*streams), late
    texts, late = asyncio.run(main())
    assert all(t.startswith(want[0][i % 4]) for i, t in enumerate(texts)), texts
    assert late.status_code == 503
    assert server.proc.wait(30) == 0, server.log_path.read_text()[-3000:]
    for pid in server.core_pids:
        assert not alive(pid), pid


def test_ctrl_c_while_the_cores_start_leaves_no_core_running(qwen3_dir):
    """An interrupted start-up kills the cores: they ignore SIGTERM (their server drains first), so
    multiprocessing's exit handler, which terminates and then joins them, waited forever."""
    import subprocess
    import sys
    import time
    script = f"""
import sys
sys.path.insert(0, {TESTS!r})
from tokenmill.config import EngineConfig
from tokenmill.engine.data_parallel import DataParallelLLM
DataParallelLLM.start(EngineConfig(model={qwen3_dir!r}, device="cpu"), 2, engine_factory="slow_engine:never_ready")
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    cores = []
    deadline = time.monotonic() + 60
    while len(cores) < 2 and time.monotonic() < deadline:     # both cores started (their loads "running")
        time.sleep(0.2)
        try:
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                children = [int(c) for c in f.read().split()]
            # the cores are multiprocessing's spawned children; its resource tracker is a child too
            cores = [pid for pid in children if b"spawn_main" in cmdline(pid)]
        except OSError:
            break
    assert len(cores) >= 2, cores
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the process did not exit after SIGINT")
    assert "KeyboardInterrupt" in proc.stderr.read()
    time.sleep(0.5)
    assert not any(alive(pid) for pid in cores)
