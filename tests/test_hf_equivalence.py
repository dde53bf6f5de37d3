"""Greedy outputs must equal Hugging Face transformers `generate()` token for token."""
from __future__ import annotations

import random

import pytest
import torch

from tokenmill import LLM, SamplingParams


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        # each step's argmax over the whole sequence so far: the end-of-sequence token may win, as it may
        # under ignore_eos (generate's min_new_tokens would forbid it instead)
        ids, out = torch.tensor([p]), []
        with torch.no_grad():
            for _ in range(max_new_tokens):
                out.append(int(model(ids).logits[0, -1].argmax()))
                ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
        outs.append(out)
    return outs


def make_prompts(n: int = 6, seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 500) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(model_dir):
    prompts = make_prompts(6) + make_prompts(4, seed=1, shared_prefix=37)
    return prompts, hf_greedy(model_dir, prompts, GREEDY.max_tokens)


@pytest.mark.parametrize("engine_kwargs", [
    dict(block_size=16),
    dict(block_size=1),
    dict(block_size=4, max_num_batched_tokens=7),                 # chunked prefill
    dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=64),  # preemption
    dict(block_size=8, max_num_seqs=3, enable_prefix_caching=False),
], ids=["bs16", "bs1", "chunked", "preempt", "no-prefix-cache"])
def test_greedy_matches_hf(model_dir, reference, engine_kwargs):
    prompts, expected = reference
    llm = LLM(model_dir, device="cpu", dtype="float32", **engine_kwargs)
    outputs = llm.generate(prompts, GREEDY)
    got = [o.outputs[0].token_ids for o in outputs]
    assert got == expected
    stats = llm.engine.get_stats()
    if "num_kv_blocks" in engine_kwargs:
        assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_prefix_cache_hits_do_not_change_outputs(model_dir, reference):
    prompts, expected = reference
    llm = LLM(model_dir, device="cpu", dtype="float32", block_size=4)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    hits_before = llm.engine.get_stats()["prefix_cache_hits"]
    second = llm.generate(prompts, GREEDY)   # every prompt's full blocks are cached now
    assert [o.outputs[0].token_ids for o in second] == expected == first
    assert llm.engine.get_stats()["prefix_cache_hits"] > hits_before
    assert all(o.num_cached_tokens > 0 for o, p in zip(second, prompts) if len(p) > 4)
