"""Sampling: seeded draws reproducible and independent of batch composition; filters; penalties;
logprobs; n > 1; stop conditions."""
from __future__ import annotations

import re

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.runner.sampler import sample, seeded_exponential
from tokenmill.runner.sampling_tensors import SamplingTensors


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(qwen3_dir, device="cpu", dtype="float32", block_size=4)


PROMPTS = [[5, 6, 7, 8, 9], [11, 12], list(range(20, 45)), [300, 301, 302]]


def test_seeded_sampling_reproducible_and_batch_independent(llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], params)[0].outputs[0].token_ids
    again = llm.generate([PROMPTS[0]], params)[0].outputs[0].token_ids
    unseeded = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    batched = llm.generate(PROMPTS + [PROMPTS[0]], [unseeded, unseeded, params, unseeded, unseeded])
    assert alone == again
    assert batched[2].outputs[0].token_ids != alone or True  # other prompt, other tokens
    mixed = llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1]], [unseeded, params, unseeded])
    assert mixed[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, seed=99, max_tokens=10, ignore_eos=True)
    assert llm.generate([PROMPTS[0]], other_seed)[0].outputs[0].token_ids != alone


def test_seeded_noise_is_a_function_of_seed_and_position():
    seeds = torch.tensor([1, 2, 1], dtype=torch.int64)
    pos = torch.tensor([0, 0, 0], dtype=torch.int64)
    e = seeded_exponential(seeds, pos, 1000)
    assert torch.equal(e[0], e[2]) and not torch.equal(e[0], e[1])
    assert abs(e.mean().item() - 1.0) < 0.1 and (e > 0).all()
    e2 = seeded_exponential(seeds, pos + 1, 1000)
    assert not torch.equal(e[0], e2[0])


@pytest.mark.parametrize("seeded", ["all", "none", "half"])
def test_sampled_distribution_matches_probabilities(seeded):
    """Each row's draw by the exponential race, its noise from the row's seed or from torch's generator."""
    rows = 4000
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 1e-9]])).repeat(rows, 1)
    seeded_rows = {"all": torch.ones(rows), "none": torch.zeros(rows), "half": torch.arange(rows) % 2}[seeded].bool()
    t = _tensors(rows, seeds=None if seeded == "none" else torch.arange(rows, dtype=torch.int64),
                 seeded_rows=None if seeded == "none" else seeded_rows,
                 output_positions=None if seeded == "none" else torch.zeros(rows, dtype=torch.int64))
    ids = sample(logits, t).token_ids
    for part in (seeded_rows, ~seeded_rows):
        if part.any():
            freq = torch.bincount(ids[part], minlength=4).float() / part.sum()
            assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2, 0.0]), atol=0.04), (seeded, freq)


def _tensors(rows, **kw):
    base = dict(temperature=torch.ones(rows), all_greedy=False, top_k=None, top_p=None, min_p=None,
                seeds=None, seeded_rows=None, output_positions=None, presence_penalty=None,
                frequency_penalty=None, repetition_penalty=None, output_counts=None, seen_mask=None,
                max_logprobs=None)
    base.update(kw)
    return SamplingTensors(**base)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_rows_take_the_float32_argmax(dtype):
    # all-greedy batches take the argmax in the logits' dtype; ties (frequent in bf16) go to the first
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 3000, generator=gen) * 3).round().to(dtype)
    logits[:, 7] = logits.max()                     # a tie in every row, against later equal values
    got = sample(logits, _tensors(64, temperature=None, all_greedy=True)).token_ids
    assert torch.equal(got, logits.float().argmax(-1))
    assert (got <= 7).all()


def test_top_k_top_p_min_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]])).repeat(2000, 1)
    ids = sample(logits, _tensors(2000, top_k=torch.full((2000,), 2))).token_ids
    assert set(ids.tolist()) == {0, 1}
    ids = sample(logits, _tensors(2000, top_p=torch.full((2000,), 0.65))).token_ids
    assert set(ids.tolist()) == {0, 1}
    ids = sample(logits, _tensors(2000, min_p=torch.full((2000,), 0.6))).token_ids
    assert set(ids.tolist()) == {0, 1}
    ids = sample(logits, _tensors(2000, temperature=torch.zeros(2000))).token_ids
    assert set(ids.tolist()) == {0}


def test_penalties_change_greedy_choice():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    counts = torch.tensor([[3.0, 0.0, 0.0]])
    seen = counts > 0
    t = _tensors(1, temperature=torch.zeros(1), frequency_penalty=torch.tensor([0.1]),
                 presence_penalty=torch.tensor([0.0]), repetition_penalty=None, output_counts=counts,
                 seen_mask=None)
    assert sample(logits, t).token_ids.item() == 1
    t = _tensors(1, temperature=torch.zeros(1), repetition_penalty=torch.tensor([1.2]), seen_mask=seen)
    assert sample(logits, t).token_ids.item() == 1


def test_temperature_zero_is_greedy_and_penalties_apply_end_to_end(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    again = llm.generate(PROMPTS, SamplingParams(temperature=0.0, top_p=0.5, max_tokens=8, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in again]
    penalised = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                     frequency_penalty=2.0, repetition_penalty=2.0))
    for o in penalised:
        ids = o.outputs[0].token_ids
        assert len(set(ids)) >= len(ids) - 2   # strongly discouraged from repeating


def test_logprobs_and_n(llm):
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=5, logprobs=3,
                                                    ignore_eos=True))[0]
    comp = out.outputs[0]
    assert type(comp.logprobs) is list and len(comp.logprobs) == 5       # vLLM's list of dicts
    for tok, entry in zip(comp.token_ids, comp.logprobs):
        assert entry[tok].rank == 1                  # greedy picks the most likely token
        assert len(entry) == 3
        assert all(lp.logprob <= 0 for lp in entry.values())
    assert comp.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(comp.token_ids, comp.logprobs)))
    many = llm.generate([PROMPTS[1]], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6,
                                                     ignore_eos=True))[0]
    assert [c.index for c in many.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in many.outputs}) > 1
    assert llm.engine.get_stats()["num_free_blocks"] == llm.engine.get_stats()["num_total_blocks"]


def test_prompt_logprobs_of_a_one_token_prompt_are_one_none(llm):
    """vLLM's: the first prompt token has no logprob, so a one-token prompt's list is [None] (it was None,
    as if prompt_logprobs had not been asked for)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    one, two = llm.generate([[5], [5, 6]], params)
    assert one.prompt_logprobs == [None]
    assert two.prompt_logprobs[0] is None and 6 in two.prompt_logprobs[1]


def test_stop_conditions(llm):
    base = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    toks = base.outputs[0].token_ids
    assert base.outputs[0].finish_reason == "length" and len(toks) == 12
    out = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                    stop_token_ids=[toks[3]]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == toks[3]
    assert out.token_ids == toks[:toks.index(toks[3]) + 1]
    text = base.outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    if stop.strip():
        out = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                        stop=[stop]))[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert stop not in out.text and text.startswith(out.text)
    saved = llm.engine.eos_token_ids
    llm.engine.eos_token_ids = {toks[5]}     # make the model's 6th greedy token the eos token
    try:
        out = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
        ignored = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=12,
                                                            ignore_eos=True))[0].outputs[0]
    finally:
        llm.engine.eos_token_ids = saved
    first = toks.index(toks[5])
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids == toks[:first + 1]
    assert ignored.token_ids == toks and ignored.finish_reason == "length"


def test_penalty_tensors_follow_each_requests_tokens_as_they_grow():
    # counts of generated tokens and the mask of prompt and generated ones, built from each request's int32
    # copy of its tokens that only the new (and a resolved placeholder's) entries are copied into
    from tokenmill.engine.request import PLACEHOLDER, Request
    from tokenmill.runner.host_copies import HostCopies
    from tokenmill.runner.sampling_tensors import _penalty_tensors

    vocab = 50
    a = Request("a", [3, 4, 4], SamplingParams(frequency_penalty=1.0), 100, 0)
    b = Request("b", [7], SamplingParams(repetition_penalty=1.2), 100, 0)

    def expected(requests):
        counts = torch.zeros(len(requests), vocab)
        seen = torch.zeros(len(requests), vocab, dtype=torch.bool)
        for i, r in enumerate(requests):
            for t in r.all_token_ids[r.num_prompt_tokens:]:
                counts[i, t] += 1
            seen[i, r.all_token_ids] = True
        return counts, seen

    rng = torch.Generator().manual_seed(0)
    copies = HostCopies()
    for step in range(150):                       # past the copies' first capacity (64)
        for r in (a, b):
            r.append_placeholder(0)
            if step % 5 == 0:
                copies.tokens([r])                # copied while its last token is a placeholder
            r.resolve(r.num_tokens - 1, int(torch.randint(vocab, (1,), generator=rng)))
        if step % 7 == 0:
            counts, seen = _penalty_tensors([b, a], vocab, torch.device("cpu"), copies=copies)
            want_counts, want_seen = expected([b, a])
            assert torch.equal(counts, want_counts) and torch.equal(seen, want_seen)
    assert PLACEHOLDER not in a.all_token_ids


def test_penalised_steps_overlap_and_give_the_tokens_of_steps_processed_one_by_one(llm):
    # a penalised batch is launched before the step in flight is read: the counts take that step's tokens
    # on the device (placeholders), so the tokens equal those of an engine that reads each step first
    # prompts whose greedy continuation repeats its last token (26, 26; 54, 54, 54): there a penalty on the
    # token in flight decides the next one
    repeating = [[261, 74, 147, 74, 389], [172, 244, 289, 54, 184, 225, 164, 315, 330, 470, 107, 497]]
    params, prompts = [], []
    for penalty in (0.2, 0.5, 1.0, 2.0):
        for prompt in repeating:
            params.append(SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=penalty))
            prompts.append(prompt)
    params += [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, presence_penalty=1.0,
                              repetition_penalty=1.3),
               SamplingParams(temperature=0.9, seed=3, max_tokens=12, ignore_eos=True, frequency_penalty=2.0),
               SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    prompts += [repeating[0], repeating[1], PROMPTS[0]]
    engine = llm.engine
    assert engine.overlap
    overlapped = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    engine.overlap = False
    try:
        one_by_one = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        engine.overlap = True
    assert overlapped == one_by_one
    plain = llm.generate(repeating, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in plain] != overlapped[:2]     # the penalties changed the tokens
    # and a penalised step returns with its tokens still in flight, as any other
    engine.add_request("penalised", repeating[0], params[0])
    engine.step()
    engine.step()
    assert engine._in_flight is not None
    engine.abort_request("penalised")
    while engine.has_unfinished_requests() or engine._in_flight is not None:
        engine.step()


def test_vllm_sampling_rules_at_the_edges(llm):
    """vLLM's rules where they are easy to miss: a request's logprobs hold its own k alternatives in a batch
    that asks more (it got the batch's largest k); seed -1 is no seed (it was one fixed seed: every such
    request drew the same tokens); min_tokens holds end-of-sequence back with ignore_eos too (it did not);
    a positive temperature below 0.01 samples at 0.01 (not greedily)."""
    few, many = llm.generate([PROMPTS[0], PROMPTS[1]], [SamplingParams(max_tokens=3, logprobs=1, ignore_eos=True),
                                                        SamplingParams(max_tokens=3, logprobs=6, ignore_eos=True)])
    assert all(len(e) <= 2 for e in few.outputs[0].logprobs) and all(len(e) >= 6 for e in many.outputs[0].logprobs)
    draws = llm.generate([PROMPTS[3]] * 4, SamplingParams(seed=-1, max_tokens=8, ignore_eos=True))
    assert len({tuple(o.outputs[0].token_ids) for o in draws}) > 1
    eos = next(iter(llm.engine.eos_token_ids))
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, min_tokens=4,
                                                    logit_bias={eos: 100}))[0].outputs[0]
    assert eos not in out.token_ids[:4] and out.token_ids[4:] == [eos] * 4
    assert SamplingParams(temperature=1e-6).temperature == 0.01 and not SamplingParams(temperature=1e-6).greedy
    assert SamplingParams(temperature=0).greedy


def test_allowed_token_ids_limit_what_a_request_samples(llm):
    """vLLM's allowed_token_ids: greedy and sampled rows take only those ids, beside a row without them in
    the same batch; the logprobs stay the model's whole distribution; bad lists are refused by name."""
    allowed = [40, 41, 300]
    free = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    greedy, sampled, unlimited = llm.generate(
        [PROMPTS[0], PROMPTS[0], PROMPTS[0]],
        [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, allowed_token_ids=allowed),
         SamplingParams(temperature=1.5, max_tokens=30, ignore_eos=True, seed=3, allowed_token_ids=allowed), free])
    assert set(greedy.outputs[0].token_ids) <= set(allowed) and set(sampled.outputs[0].token_ids) <= set(allowed)
    assert len(set(sampled.outputs[0].token_ids)) > 1
    assert not set(unlimited.outputs[0].token_ids) <= set(allowed)
    # the first token's top alternatives are the unlimited row's (raw logprobs)
    assert set(greedy.outputs[0].logprobs[0]) - set(allowed) == set(unlimited.outputs[0].logprobs[0]) - set(allowed)
    for bad in ([], [-1], [1.5]):
        with pytest.raises(ValueError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)
    with pytest.raises(ValueError, match="allowed_token_ids token id 100000 is out of range"):
        llm.generate([PROMPTS[0]], SamplingParams(allowed_token_ids=[5, 100000]))


def test_allowed_token_ids_that_min_tokens_bans_are_refused(llm):
    """allowed_token_ids that are all stop or end-of-sequence tokens (or bad words), which min_tokens bans,
    leave the first tokens none to sample: the sampler drew token 0 until min_tokens were out. Refused by name,
    stop tokens when the params are made, the model's end-of-sequence ones when the engine takes the request;
    one token besides is enough."""
    held = ("stop or end-of-sequence tokens, which min_tokens=3 bans for the first 3 tokens: no token is left to "
            "generate")
    with pytest.raises(ValueError, match=re.escape(f"allowed_token_ids [7] are all {held}")) as e:
        SamplingParams(min_tokens=3, allowed_token_ids=[7], stop_token_ids=[7])
    assert e.value.param == "min_tokens"
    with pytest.raises(ValueError, match=re.escape(f"of allowed_token_ids [5, 7], bad_words ban [5] and the rest are "
                                                   f"{held}")):
        SamplingParams(min_tokens=3, allowed_token_ids=[5, 7], stop_token_ids=[7], bad_words_token_ids=[[5]])
    eos = next(iter(llm.engine.eos_token_ids))
    with pytest.raises(ValueError, match=re.escape(f"allowed_token_ids [{eos}] are all {held}")) as e:
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, min_tokens=3, allowed_token_ids=[eos]))
    assert e.value.param == "min_tokens" and not llm.engine.groups
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, min_tokens=3,
                                                    allowed_token_ids=[eos, 40]))[0].outputs[0]
    assert out.token_ids[:3] == [40] * 3


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens only (-1: the context length), the output
    as that prompt's alone; bad values refused by name."""
    prompt = list(range(20, 45))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    cut, alone = llm.generate([prompt, prompt[-6:]], [SamplingParams(**{**vars(params), "truncate_prompt_tokens": 6}),
                                                       params])
    assert cut.prompt_token_ids == prompt[-6:] and cut.outputs[0].token_ids == alone.outputs[0].token_ids
    whole = llm.generate([prompt], SamplingParams(**{**vars(params), "truncate_prompt_tokens": -1}))[0]
    assert whole.prompt_token_ids == prompt
    # -1 on a prompt longer than the context: as much of it as the engine admits, which leaves room for one
    # generated token (cut to the whole context, every such prompt was refused as too long)
    limit = llm.engine.max_model_len
    longer = [20 + i % 300 for i in range(limit + 50)]
    cut = llm.generate([longer], SamplingParams(**{**vars(params), "truncate_prompt_tokens": -1}))[0]
    assert cut.prompt_token_ids == longer[-(limit - 1):]
    assert len(cut.outputs[0].token_ids) == 1 and cut.outputs[0].finish_reason == "length"
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be an integer >= 1, or -1"):
            SamplingParams(truncate_prompt_tokens=bad)
    with pytest.raises(ValueError, match=f"truncate_prompt_tokens {limit + 1} is greater than the maximum context"):
        llm.generate([prompt], SamplingParams(truncate_prompt_tokens=limit + 1))


def test_bad_words_ban_a_words_last_token_after_the_rest(llm, monkeypatch):
    """vLLM's bad_words, as token ids: a one-token word never comes; a longer word's last token is banned
    where the output ends with the rest of it (the match read on the device while that token is in flight,
    steps overlapping), so the output leaves the free one exactly where the word would complete."""
    import tokenmill.runner.sampling_tensors as sampling_tensors
    decided_on_device = []

    def counted(row, r, pending):
        banned = bad_words(row, r, pending)
        decided_on_device.extend(pending)
        return banned
    bad_words = sampling_tensors._bad_words
    monkeypatch.setattr(sampling_tensors, "_bad_words", counted)
    free = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    o = free.outputs[0].token_ids
    for word in ([o[0]], [o[2], o[3]], [o[5], o[6], o[7]]):
        at = next(j for j in range(len(word) - 1, len(o)) if o[j + 1 - len(word):j + 1] == word)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=["w"],
                                bad_words_token_ids=[word])
        got = llm.generate([PROMPTS[2]], params)[0].outputs[0].token_ids
        assert got[:at] == o[:at] and got[at] != o[at], (word, at)
    assert decided_on_device
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=[" "])


def test_bad_words_leave_the_callers_params_unchanged(llm):
    """The words' token ids are filled in the request's copy of the params: a params object used again
    with other words bans those (the first words' ids were kept in it, and banned instead), and one given to
    a model with another tokenizer gets that tokenizer's ids."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, bad_words=["zebra"])
    free = llm.generate([PROMPTS[0]], params)[0].outputs[0].token_ids
    assert params.bad_words_token_ids is None
    tok = llm.get_tokenizer()
    # a word of the output that is one token again where the words' rule tokenizes it
    params.bad_words = [next(w for w in map(tok.decode, ([t] for t in free)) if w.strip() and any(
        len(tok.encode(s + w.lstrip(), add_special_tokens=False)) == 1 for s in ("", " ")))]
    again = llm.generate([PROMPTS[0]], params)[0].outputs[0].token_ids
    fresh = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, bad_words=params.bad_words)
    assert again == llm.generate([PROMPTS[0]], fresh)[0].outputs[0].token_ids != free


def test_bad_words_token_ids_of_no_tokens_are_refused():
    """A word of no token ids has no last token to ban: refused by name when the params are made (the
    sampler's IndexError crashed the engine core, every request in it failing)."""
    for bad in ([[]], [[5], []], [5], [[-1]], [[1.5]]):
        with pytest.raises(ValueError, match="bad_words_token_ids must be a list of words"):
            SamplingParams(bad_words_token_ids=bad)
    assert SamplingParams(bad_words_token_ids=[[5], [6, 7]]).bad_words_token_ids == [[5], [6, 7]]


def test_bad_words_that_ban_every_allowed_token_are_refused(llm):
    """allowed_token_ids all banned by one-token bad words leave a row no token (the sampler drew token 0,
    again and again): refused by name, given as ids or as words; a word of several tokens bans its last only
    after the rest, so it leaves that token allowed."""
    with pytest.raises(ValueError, match=r"bad_words ban every token of allowed_token_ids \[5, 6\]") as e:
        SamplingParams(allowed_token_ids=[5, 6], bad_words_token_ids=[[6], [5], [9]])
    assert e.value.param == "bad_words"
    assert SamplingParams(allowed_token_ids=[5, 6], bad_words_token_ids=[[6], [7, 5]]).allowed_token_ids == [5, 6]
    tok = llm.get_tokenizer()
    word = next(w for w in ("the", "a", "is", "of") if len(tok.encode(w, add_special_tokens=False)) == 1)
    banned = tok.encode(word, add_special_tokens=False)
    with pytest.raises(ValueError, match="leaves no token to generate"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, allowed_token_ids=banned, bad_words=[word]))
