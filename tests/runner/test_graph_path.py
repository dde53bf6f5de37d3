"""The padded static-buffer path that CUDA graphs replay, run on the CPU: every step is staged into the
graph buffers (padding tokens, padding sequences, the prefill tile map, the sampled-row index) and the
forward re-runs on them, so the padding logic is checked here and the capture itself on the GPU
(tests/test_gpu_engine.py)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tokenmill import LLM, SamplingParams


def _workload():
    rng = random.Random(3)
    shared = [rng.randrange(3, 500) for _ in range(37)]
    prompts = []
    for i in range(11):
        body = [rng.randrange(3, 500) for _ in range(rng.choice([1, 5, 30, 70, 140]))]
        prompts.append(shared + body if i % 3 == 0 else body)
    params = [SamplingParams(temperature=0, max_tokens=3 + (i * 5) % 13, ignore_eos=True) for i in range(11)]
    return prompts, params


@pytest.mark.parametrize("mapped", [False, True])
def test_padded_graph_buffers_give_the_eager_tokens(qwen3_dir, monkeypatch, mapped):
    # mapped: the inputs go over as the staging kernel takes them (placeholders as -(row + 1), filled
    # on the device from the step before), run here by its reference
    from tokenmill.layers.kernels import staging
    prompts, params = _workload()
    config = dict(device="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=100)
    expected = [o.outputs[0].token_ids for o in LLM(qwen3_dir, **config).generate(prompts, params)]

    llm = LLM(qwen3_dir, **config)
    runner = llm.engine.runner
    runner.capture_graphs(emulate=True)
    staged = []
    if mapped:
        runner.graph_runner.mapped = True
        monkeypatch.setattr(staging, "stage", lambda *a: staged.append(a[-1] is not None) or staging.stage_torch(*a))
        monkeypatch.setattr(staging, "fill_placeholders", None)      # not used on this path
    keys = set(runner.graphs)
    assert ("mixed", 100, 8) in keys and ("mixed", 64, 1) in keys and ("decode", 8) in keys
    used = []
    replay = runner.graph_runner.replay
    runner.graph_runner.replay = lambda key, inp, prev: used.append(key) or replay(key, inp, prev)
    for _ in range(2):                              # the second round hits the prefix cache
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert got == expected
    kinds = {k[0] for k in used}
    assert kinds == {"decode", "mixed"}
    assert (len(staged) == len(used) and any(staged)) if mapped else not staged
    assert any(k[0] == "mixed" and k[2] > 1 for k in used)  # several sequences in one padded step
    stats = llm.engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["prefix_cache_hits"] > 0


@pytest.mark.parametrize("block_size", [16, 4])
def test_eager_warm_up_leaves_the_kv_cache_alone(qwen3_dir, block_size):
    # the warm-up steps after graph capture run eagerly over invented sequences: they must write no slot,
    # and their block tables must cover their longest sequence whatever the block size. Without graphs
    # there is one step above each of fp8_gemm.PATH_ROWS within the step's 100 tokens (and 17 tokens)
    llm = LLM(qwen3_dir, device="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=100,
              block_size=block_size)
    prompts, params = _workload()
    llm.generate(prompts, params)                   # the cache now holds these prompts' K/V (prefix cache)
    runner = llm.engine.runner
    before = runner.kv_cache.clone()
    calls = []
    eager = runner._eager_forward
    runner._eager_forward = lambda inp, prev: calls.append(inp) or eager(inp, prev)
    runner._warm_eager()
    assert [len(c.input_ids) for c in calls] == [17, 33, 65]
    for c in calls:
        assert c.max_q > 1 and (c.slots == -1).all() and c.qsl[-1] == len(c.input_ids)
        assert c.tables.shape[1] * block_size >= c.max_seq_len
    assert torch.equal(runner.kv_cache, before)
    # graphs that hold steps of up to 100 tokens leave the 17-token step only
    calls.clear()
    runner.capture_graphs(emulate=True)
    assert max(k[1] for k in runner.graphs if k[0] == "mixed") == 100
    assert [len(c.input_ids) for c in calls] == [17]
    assert torch.equal(runner.kv_cache, before)


def test_warm_up_steps_stay_inside_a_cache_sized_by_hand(qwen3_dir):
    """--num-kv-blocks below the model's context: the RoPE tables hold the cache's tokens, but the runner
    was given the model's length, and the warm-up steps after capture invented positions past the tables
    (an IndexError here; on the GPU, kernels that read the tables unchecked)."""
    llm = LLM(qwen3_dir, device="cpu", dtype="float32", num_kv_blocks=8, block_size=16, max_num_seqs=4,
              max_num_batched_tokens=512, cuda_graph_max_tokens=64)
    runner = llm.engine.runner
    assert runner.max_model_len == llm.engine.max_model_len == 128
    calls = []
    eager = runner._eager_forward
    runner._eager_forward = lambda inp, prev: calls.append(inp) or eager(inp, prev)
    runner.capture_graphs(emulate=True)
    assert calls and all(c.positions.max() < 128 for c in calls)


def test_a_warm_up_step_longer_than_the_model_splits_into_sequences_it_holds():
    from tokenmill.runner.step import warm_up_inputs
    inp = warm_up_inputs(2049, 512, 16)
    lens = np.diff(inp.qsl)
    assert lens.tolist() == [1, 5, 512, 512, 512, 507] and inp.qsl[-1] == len(inp.input_ids) == len(inp.positions)
    assert inp.max_seq_len <= 512 and (inp.seq_lens <= 512).all() and (inp.slots == -1).all()
    assert inp.tables.shape == (6, 32) and not inp.tables.any()
    assert inp.positions.max() < 512 and inp.sample_tokens.tolist() == (inp.qsl[1:] - 1).tolist()
    assert warm_up_inputs(17, 20, 16) is None           # a model shorter than the first two sequences' context


def test_packed_step_inputs_go_over_as_one_span():
    # a graph family's inputs live in one buffer; a step copies them up to its last block-table row
    from tokenmill.runner.step import PackedInputs
    spec = [("ids", torch.int64, (5,)), ("lens", torch.int32, (3,)), ("tables", torch.int32, (4, 6))]
    packed = PackedInputs(spec, torch.device("cpu"))
    assert all(off % 16 == 0 for off in packed.offsets.values())
    host = packed.host_copy(pin=False)
    host["ids"][:] = np.arange(5) - 2
    host["lens"][:] = [7, 8, 9]
    host["tables"][:] = np.arange(24).reshape(4, 6)
    packed.upload(host, rows=2)
    assert packed.views["ids"].tolist() == [-2, -1, 0, 1, 2]
    assert packed.views["lens"].tolist() == [7, 8, 9]
    assert packed.views["tables"][:2].tolist() == host["tables"][:2].tolist()
    assert not packed.views["tables"][2:].any()          # rows past the step's sequences are not sent
    host["tables"][:] += 100
    packed.upload(host, rows=2, width=4)                  # the last row only up to the batch's width
    assert packed.views["tables"][:2].tolist() == [list(range(100, 106)), [106, 107, 108, 109, 10, 11]]
    assert packed.span(2, 4) == packed.span(2) - 2 * 4 and packed.span(0, 4) == packed.offsets["tables"]


def test_graph_capture_writes_no_kv_slot(qwen3_dir):
    # capture runs every graph's forward on the static inputs as they start: their slots must be -1
    llm = LLM(qwen3_dir, device="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=100)
    runner = llm.engine.runner
    runner.kv_cache.normal_()
    before = runner.kv_cache.clone()
    runner.capture_graphs(emulate=True)
    assert torch.equal(runner.kv_cache, before)


def test_published_tokens_survive_a_late_read(qwen3_dir, monkeypatch):
    # greedy graphs write their tokens into a pinned table with one row per turn; a step whose tokens the
    # host has not read when its row comes round again must keep them (StepResult.settle)
    from tokenmill.engine.request import Request
    from tokenmill.layers.kernels import staging
    from tokenmill.runner.step import StepResult
    monkeypatch.setattr(staging, "stage", staging.stage_torch)
    config = dict(device="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=100)
    prompt = [5, 17, 230, 41, 9]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = LLM(qwen3_dir, **config).generate([prompt], params)[0].outputs[0].token_ids

    runner = LLM(qwen3_dir, **config).engine.runner
    runner.capture_graphs(emulate=True)
    runner.graph_runner.mapped = True
    settled = []
    settle = StepResult.settle
    monkeypatch.setattr(StepResult, "settle", lambda self: settled.append((self, self._shared)) or settle(self))
    req = Request("r", list(prompt), params, max_tokens=5, seed=0)
    req.block_ids = [1]
    steps, prev, new = [], None, len(prompt)
    for _ in range(5):             # launch every step before reading any
        prev = runner.execute([req], [new], prev)
        steps.append(prev)
        req.append_placeholder(0)      # as the scheduler does for a request that samples
        req.num_computed_tokens += new
        new = 1
    # the prefill step has a graph of its own; decode steps 1 and 2 were settled as steps 3 and 4 took
    # their rows, and those two still read the table
    assert settled == [(steps[1], True), (steps[2], True)]
    assert all(s._shared for s in steps[3:])
    assert [s.fetch()["token_ids"][0] for s in steps] == expected


def test_no_collection_runs_while_graphs_are_captured(qwen3_dir, monkeypatch):
    """A CUDA graph destroyed while another is captured invalidates that capture (an engine made after
    another one died in a reference cycle failed its start when a collection found the dead one's graphs
    mid-capture): the dead are collected before the first capture, and none after until the last."""
    import gc
    llm = LLM(qwen3_dir, device="cpu", dtype="float32", max_num_seqs=2, max_num_batched_tokens=64)
    graph_runner = llm.engine.runner.graph_runner
    freed, seen = [], []

    class Dead:
        def __del__(self):
            freed.append(True)
    dead = Dead()
    dead.me = dead          # garbage in a cycle, as a dead engine is
    del dead
    static_forward = graph_runner.static_forward

    def watched(key):
        forward = static_forward(key)
        return lambda: seen.append((gc.isenabled(), bool(freed))) or forward()
    monkeypatch.setattr(graph_runner, "static_forward", watched)
    llm.engine.runner.capture_graphs(emulate=True)
    assert seen and set(seen) == {(False, True)} and gc.isenabled()


def test_a_step_of_more_sequences_than_its_token_bucket_finds_a_graph(qwen3_dir):
    # 200 seats: sequence buckets 1, 4, 16, 64, 200 (200 only with 256 tokens); token buckets 64 apart up to
    # 256. A step of 70 sequences and 71 tokens (a two-token prompt beside 69 one-token rows) has no
    # (128, 200) graph: it pads its tokens to 256, and no step asks for a graph that was not captured
    from types import SimpleNamespace
    llm = LLM(qwen3_dir, device="cpu", dtype="float32", max_num_seqs=200, max_num_batched_tokens=256)
    runner = llm.engine.runner
    runner.capture_graphs(emulate=True)
    graphs = runner.graph_runner
    for seqs in range(1, 201):
        for tokens in range(seqs, 257):
            key = graphs.key(SimpleNamespace(seq_lens=np.zeros(seqs), input_ids=np.zeros(tokens),
                                             max_q=1 if tokens == seqs else 2))
            assert key is None or key in graphs.graphs, (seqs, tokens, key)
            if key is not None and key[0] == "mixed":
                assert key[1] >= tokens and key[2] >= seqs
    replayed = []
    replay = graphs.replay
    graphs.replay = lambda key, inp, prev: replayed.append(key) or replay(key, inp, prev)
    prompts = [[5 + i] for i in range(69)] + [[7, 8]]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    out = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in out] == [2] * 70
    assert replayed[:2] == [("mixed", 256, 200), ("decode", 80)]
