"""vLLM's thinking_token_budget through `LLM.generate` on the tiny random Qwen3, whose tokenizer has <think> and
</think> as one token each. A random model neither opens nor closes a thinking block by itself: a prompt that
ends with <think> opens it (the engine reads the prompt's last think tag), a logit bias of -100 on </think>
keeps the model from closing it, and one of +100 on a tag makes the model write it."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

import tokenmill
from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import SamplingParamError, StructuredOutputsParams


@pytest.fixture(scope="module")
def llm(qwen3_dir, one_torch_thread):
    return LLM(qwen3_dir, device="cpu", dtype="float32", block_size=4, max_model_len=64, num_kv_blocks=512)


@pytest.fixture(scope="module")
def tags(llm) -> tuple[int, int]:
    tok = llm.get_tokenizer()
    return tok.encode("<think>", add_special_tokens=False)[0], tok.encode("</think>", add_special_tokens=False)[0]


def _tokens(llm, prompt, **kw) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **kw)
    return llm.generate(prompt, params)[0].outputs[0].token_ids


def test_the_block_is_cut_at_exactly_the_budget(llm, tags):
    """The budget counts the tokens after the <think> that opens the block (the prompt's, or the output's
    first token, itself not counted); the count reached, </think> is the next token, and the answer goes on
    after it within max_tokens. The forced token has the logprob the model gives it, beside the model's own
    top tokens there."""
    open_tag, close_tag = tags
    think = "The quick brown fox<think>"
    free = llm.generate(think, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2,
                                              logit_bias={close_tag: -100}))[0].outputs[0]
    assert close_tag not in free.token_ids
    for budget in (0, 1, 5):
        cut = llm.generate(think, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2,
                                                 logit_bias={close_tag: -100}, thinking_token_budget=budget)
                           )[0].outputs[0]
        assert cut.token_ids[:budget] == free.token_ids[:budget] and cut.token_ids[budget] == close_tag, budget
        assert len(cut.token_ids) == 12 and close_tag not in cut.token_ids[budget + 1:]
        forced, model = cut.logprobs[budget], free.logprobs[budget]
        assert forced[close_tag].rank > 2 and forced.keys() - {close_tag} == model.keys()
        assert all(forced[t].rank == lp.rank and forced[t].logprob == pytest.approx(lp.logprob, abs=1e-4)
                   for t, lp in model.items())
    # a budget the block never reaches changes nothing
    assert _tokens(llm, think, logit_bias={close_tag: -100}, thinking_token_budget=12) == free.token_ids
    # the output opens the block itself: <think> is not counted, nor are those after the block closed
    opened = _tokens(llm, "The quick brown fox", logit_bias={open_tag: 100, close_tag: -100}, thinking_token_budget=3)
    assert opened == [open_tag] * 4 + [close_tag] + [open_tag] * 7
    assert _tokens(llm, "The quick brown fox", logit_bias={open_tag: 100, close_tag: -100},
                   thinking_token_budget=0) == [open_tag, close_tag] + [open_tag] * 10
    # no block (the prompt opens none, the output's first token is not <think>): nothing is counted
    assert _tokens(llm, "The quick brown fox", logit_bias={close_tag: -100}, thinking_token_budget=0) == \
        _tokens(llm, "The quick brown fox", logit_bias={close_tag: -100})


def test_the_models_own_close_ends_the_count(llm, tags):
    """A block the model closes within its budget is left as it is, and so is every later </think>."""
    open_tag, close_tag = tags
    think = "The quick brown fox<think>"
    own = _tokens(llm, think, logit_bias={close_tag: 100})
    assert own[0] == close_tag
    for budget in (1, 4):
        assert _tokens(llm, think, logit_bias={close_tag: 100}, thinking_token_budget=budget) == own
    # a prompt whose block is closed opens none: nothing is counted
    closed = "The quick brown fox<think></think>"
    assert _tokens(llm, closed, logit_bias={close_tag: -100}, thinking_token_budget=0) == \
        _tokens(llm, closed, logit_bias={close_tag: -100})


def test_a_json_schema_holds_the_answer_after_the_forced_close(llm, tags):
    """A budgeted request's grammar starts after the block the budget counts (offline, where no reasoning parser
    names its tags): free thinking, </think> at the budget, then the schema's JSON, which ends the output."""
    open_tag, close_tag = tags
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}}, "required": ["city"]}
    out = llm.generate("The quick brown fox<think>", SamplingParams(
        temperature=0, max_tokens=40, logit_bias={close_tag: -100}, thinking_token_budget=3,
        structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True)))[0].outputs[0]
    assert out.token_ids[3] == close_tag and close_tag not in out.token_ids[:3] and out.finish_reason == "stop"
    assert json.loads(out.text.split("</think>", 1)[1])["city"] in ("Paris", "Tokyo"), out.text


def test_rows_whose_token_is_in_flight_are_decided_on_the_device():
    """`forced_rows`: a row whose tokens are all known must close at its budget; one whose last token is still
    in flight must close after it unless that token is </think> (or, as its first token, must close at once
    after <think> under a budget of 0), which the device reads from the step in flight's tokens."""
    from types import SimpleNamespace

    from tokenmill.engine.thinking_budget import ThinkingBudget, forced_rows

    def seq(budget: int, in_think: bool, accepted: list[int], in_flight: int | None = None):
        b = ThinkingBudget((400, 401), budget, in_think)
        for token in accepted:
            b.accept(token)
        return SimpleNamespace(thinking=b, num_pending=int(in_flight is not None),
                               pending_row=-1 if in_flight is None else in_flight)
    requests = [seq(2, True, [5], in_flight=0),      # </think> in flight: the block closes, nothing to force
                seq(1, True, [5]),                   # at its budget
                SimpleNamespace(thinking=None, num_pending=1, pending_row=1),
                seq(2, True, [5], in_flight=1),      # another token in flight: at its budget after it
                seq(0, False, [], in_flight=2),      # <think> in flight as its first token
                seq(3, True, [5], in_flight=3)]      # short of its budget whatever comes: not listed
    rows, ids, must = forced_rows(requests, torch.device("cpu"), torch.tensor([401, 7, 400, 9]))
    assert dict(zip(rows.tolist(), must.tolist())) == {0: False, 1: True, 3: True, 4: True}
    assert ids.tolist() == [401] * 4
    assert forced_rows(requests[5:], torch.device("cpu"), torch.tensor([401, 7, 400, 9])) is None


@pytest.mark.parametrize("swap_space", [4.0, 0.0], ids=["swap", "recompute"])
def test_n_seeded_sequences_keep_their_count_through_preemption(llm, tags, qwen3_dir, swap_space):
    """n seeded sequences each cut at their budget; preempted (swapped, or recomputed from their tokens) they
    give the tokens of a run with room for all, where none was preempted (a seed's draws depend on the
    position alone)."""
    open_tag, close_tag = tags
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 399) for _ in range(6)] + [open_tag] for _ in range(4)]
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=30, ignore_eos=True,
                            logit_bias={close_tag: -100}, thinking_token_budget=9)
    roomy = [[c.token_ids for c in out.outputs] for out in llm.generate(prompts, params)]
    assert all(t[9] == close_tag and close_tag not in t[:9] for seqs in roomy for t in seqs)
    assert len({tuple(t) for seqs in roomy for t in seqs}) == 8
    small = LLM(qwen3_dir, device="cpu", dtype="float32", block_size=4, max_model_len=64, num_kv_blocks=24,
                swap_space=swap_space)
    tight = [[c.token_ids for c in out.outputs] for out in small.generate(prompts, params)]
    stats = small.engine.get_stats()
    assert stats["num_preemptions"] > 0 and (stats["swapped_out_blocks"] > 0) == (swap_space > 0), stats
    assert tight == roomy


def test_a_tokenizer_without_one_token_tags_is_refused():
    """Offline, the tags come from the tokenizer, as a server's reasoning parser reads them: one that spells
    </think> in pieces is refused, naming the field and the tag."""
    bundled = LLM(os.path.join(os.path.dirname(tokenmill.__file__), "assets", "tiny"), device="cpu",
                  num_kv_blocks=8)
    with pytest.raises(SamplingParamError, match=r"thinking_token_budget needs <think> as one token") as e:
        bundled.generate("Hi", SamplingParams(max_tokens=2, thinking_token_budget=4))
    assert e.value.param == "thinking_token_budget"
    assert bundled.generate("Hi", SamplingParams(max_tokens=2))[0].outputs[0].token_ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_budget_on_the_gpu_under_graphs_and_overlap(qwen3_dir):
    """On the GPU's sampling kernel, CUDA graphs and overlapped steps on (each row's last token still in
    flight when the next step's sampling is built, so whether it must close is decided on the device): the
    block cut at exactly the budget, greedy and sampled, beside rows without a budget that keep their tokens."""
    llm = LLM(qwen3_dir, device="cuda", max_num_seqs=16, gpu_memory_utilization=0.3)
    tok = llm.get_tokenizer()
    open_tag, close_tag = (tok.encode(t, add_special_tokens=False)[0] for t in ("<think>", "</think>"))
    assert llm.engine.runner.graphs
    prompts = [f"The quick brown fox {i}<think>" for i in range(6)]
    base = dict(max_tokens=16, ignore_eos=True, logit_bias={close_tag: -100})
    for sampled in (dict(temperature=0), dict(temperature=1.0, top_p=0.9, seed=3)):
        free = llm.generate(prompts, SamplingParams(**sampled, **base))
        budgets = [0, 1, 3, 7, None, 5]
        cut = llm.generate(prompts, [SamplingParams(**sampled, **base, thinking_token_budget=b) for b in budgets])
        for f, c, b in zip(free, cut, budgets):
            f, c = f.outputs[0].token_ids, c.outputs[0].token_ids
            if b is None:
                assert c == f
            else:
                assert c[:b] == f[:b] and c[b] == close_tag and close_tag not in c[b + 1:], (b, c)
    stats = llm.engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
