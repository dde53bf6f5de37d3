"""Steps trimmed to the CUDA graph below them (`engine/step_fit.py`): which chunks are trimmed and by how
much, the scheduler's steps with the graphs' sizes (every request still finishes, no block is left held,
fewer rows computed), and an engine on the CPU through its graphs' padded path giving the tokens of an
untrimmed engine."""
from __future__ import annotations

import random

from tokenmill import LLM, SamplingParams
from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.request import Request
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.step_fit import MIN_FIT_TOKENS, fit_to_graph
from tokenmill.runner.cuda_graphs import MixedSizes

from test_scheduler_policies import _advance

# the default engine's mixed graphs at 256 seats
SIZES = MixedSizes((*range(64, 512, 64), *range(512, 2049, 128)), (1, 4, 16, 64, 256))


def _fit(chunks: list[int]) -> tuple[list[int], int]:
    chunks = list(chunks)
    return chunks, fit_to_graph(chunks, SIZES)


def test_a_step_just_past_a_graph_hands_its_excess_to_the_next_step():
    # 254 decode rows and a 282-token prompt: 536 tokens would compute 640 rows; 24 tokens wait instead
    chunks, cut = _fit([1] * 254 + [282])
    assert cut == 24 and chunks == [1] * 254 + [258] and sum(chunks) == 512
    # the last chunks first, each down to one token
    chunks, cut = _fit([1] * 250 + [260, 5, 3, 18])
    assert cut == 24 and chunks[-4:] == [259, 1, 1, 1] and sum(chunks) == 512


def test_steps_that_are_left_as_they_are():
    assert _fit([1] * 254 + [258]) == ([1] * 254 + [258], 0)         # fills its graph already
    assert _fit([1] * 254 + [370])[1] == 0      # 624: deferring 112 tokens to save 16 rows is not worth it
    assert _fit([1] * 240)[1] == 0               # no prefill chunk to trim
    assert _fit([1] * 250 + [2] * 143)[1] == 0   # 393 sequences: no graph below holds them
    assert _fit([1] * 100 + [2100])[1] == 0      # above every graph: eager
    assert _fit([1] * 64 + [130])[1] == 0        # 194 -> 192 is under MIN_FIT_TOKENS
    assert MIN_FIT_TOKENS == 256
    chunks, cut = _fit([1] * 64 + [200])         # 264 -> 256
    assert cut == 8 and chunks[-1] == 192


def _run(sizes, prompt_lens, seed: int) -> tuple[int, list, BlockManager]:
    bm = BlockManager(4096, 16)
    sched = Scheduler(bm, 64, 8192, 8192)
    sched.step_sizes = sizes
    rng = random.Random(seed)
    todo = [Request(str(i), [3 + (i * 31 + j) % 900 for j in range(n)], SamplingParams(max_tokens=m), m, seed=0)
            for i, (n, m) in enumerate((n, rng.randint(1, 40)) for n in prompt_lens)]
    rows, finished = 0, []
    while todo or sched.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if todo:
                sched.add(todo.pop(0))
        out = sched.schedule()
        total = out.total_tokens
        padded = SIZES.padded(total, len(out.requests)) if any(n > 1 for n in out.num_new_tokens) else None
        rows += total if padded is None else padded[0]
        _advance(sched, out, token=5)
        finished += [(r.request_id, r.all_token_ids) for r in out.requests if r.status.finished]
    return rows, sorted(finished), bm


def test_the_scheduler_with_graph_sizes_finishes_everything_in_fewer_rows():
    rng = random.Random(0)
    lens = [rng.choice([1, 7, 40, 150, 300, 700]) + rng.randint(0, 60) for _ in range(120)]
    rows, done, bm = _run(SIZES, lens, 1)
    rows0, done0, bm0 = _run(None, lens, 1)
    assert done == done0 and len(done) == 120
    assert bm.num_used_blocks == bm0.num_used_blocks == 0
    assert rows < rows0


def test_an_engine_trimming_to_its_graphs_gives_the_untrimmed_tokens(qwen3_dir):
    # graphs up to 1,024 tokens: prompts of 300 and 230 tokens start at 530 tokens, which the 640-token
    # graph would hold; the step runs 512 and the second prompt's last 18 tokens come a step later
    config = dict(device="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=1024)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (300, 230)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    untrimmed = LLM(qwen3_dir, **config)
    untrimmed.engine.runner.capture_graphs(emulate=True)
    expected = [o.outputs[0].token_ids for o in untrimmed.generate(prompts, params)]

    llm = LLM(qwen3_dir, **config)
    graphs = llm.engine.runner.graph_runner
    llm.engine.runner.capture_graphs(emulate=True)
    llm.engine.scheduler.step_sizes = graphs.mixed      # as the engine takes them after its start's capture
    replayed = []
    replay = graphs.replay
    graphs.replay = lambda key, inp, prev: replayed.append((key, len(inp.input_ids))) or replay(key, inp, prev)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert replayed[0] == (("mixed", 512, 4), 512)
    assert replayed[1] == (("mixed", 64, 4), 18 + 1)    # the rest of the second prompt beside a decode row
