"""Offline API behaviour: bad input, chat, detokenization, loader and config errors."""
from __future__ import annotations

import asyncio
import json
import os
import shutil

import pytest

from tokenmill import LLM, ModelConfig, SamplingParams
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.tokenizer import Tokenizer
from tokenmill.sampling_params import StructuredOutputsParams


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(qwen3_dir, device="cpu", dtype="float32", block_size=4, max_model_len=64, num_kv_blocks=40)


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    (dict(temperature=-0.1), "temperature must be >= 0, got -0.1"),
    (dict(max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
    (dict(n=0), "n must be an integer >= 1, got 0"),
    (dict(n=2.0), "n must be an integer >= 1, got 2.0"),
    (dict(min_p=2.0), "min_p must be in [0, 1], got 2.0"),
    (dict(logprobs=50), "logprobs must be an integer in [0, 20], got 50"),
    # a float count of alternatives failed inside the step (topk, a slice), which killed an engine core; a
    # NaN temperature sampled token 0 every time
    (dict(logprobs=1.5), "logprobs must be an integer in [0, 20], got 1.5"),
    (dict(prompt_logprobs=2.0), "prompt_logprobs must be an integer in [0, 20], got 2.0"),
    (dict(temperature=float("nan")), "temperature must be >= 0, got nan"),
    (dict(stop_token_ids=[-1]), "stop_token_ids must be a list of token ids (integers >= 0), got [-1]"),
    (dict(stop=[1]), "stop must be non-empty strings (a string or a list of them), got [1]"),
    (dict(top_k=1.5), "top_k must be an integer: 0 or -1 (disabled) or >= 1, got 1.5"),
    (dict(thinking_token_budget=-1), "thinking_token_budget must be an integer >= 0 (or None: no budget), got -1"),
    (dict(thinking_token_budget=2.5), "thinking_token_budget must be an integer >= 0 (or None: no budget), got 2.5"),
])
def test_bad_sampling_values_name_value_and_limit(kwargs, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert message in str(e.value)


def test_sampling_params_from_optional_and_clone_as_vllm():
    """vLLM's SamplingParams.from_optional (None takes the default, but max_tokens=None is unlimited) and
    clone (a deep copy): both were AttributeErrors."""
    params = SamplingParams.from_optional(n=None, temperature=None, top_p=0.5, stop=["x"], seed=None)
    assert (params.n, params.temperature, params.top_p, params.stop, params.max_tokens) == (1, 1.0, 0.5, ["x"], 16)
    assert SamplingParams.from_optional(max_tokens=None).max_tokens is None
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams.from_optional(top_p=0)
    copy = params.clone()
    copy.stop.append("y")
    assert copy == SamplingParams(top_p=0.5, stop=["x", "y"]) and params.stop == ["x"]


def test_vllms_other_sampling_fields_are_taken_at_their_no_op_values_and_refused_by_name():
    """vLLM's best_of, detokenize, spaces_between_special_tokens, logits_processors and extra_args were
    TypeErrors (unexpected keyword); at the values that change nothing here they are taken, any other is a
    SamplingParamError naming the field. spaces_between_special_tokens changes nothing either way: special
    tokens are joined as the fast tokenizer joins them, with no space (False was refused beside
    skip_special_tokens=False, where it is what the output shows)."""
    taken = SamplingParams(n=2, best_of=2, detokenize=True, spaces_between_special_tokens=False,
                           logits_processors=[], extra_args={"plugin": 1})
    assert taken.extra_args == {"plugin": 1}
    assert not SamplingParams(spaces_between_special_tokens=False, skip_special_tokens=False).skip_special_tokens
    for kwargs, param in ((dict(n=1, best_of=2), "best_of"), (dict(detokenize=False), "detokenize"),
                          (dict(logits_processors=[lambda ids, logits: logits]), "logits_processors"),
                          (dict(extra_args=[1]), "extra_args")):
        with pytest.raises(ValueError, match=f"^{param} must be") as e:
            SamplingParams(**kwargs)
        assert e.value.param == param


def test_bad_prompts_are_rejected_and_others_keep_running(llm):
    engine = llm.engine
    engine.add_request("ok", [5, 6, 7], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    with pytest.raises(ValueError, match=r"empty \(0 tokens\)"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(ValueError, match=r"has 70 tokens but the maximum context length is 64"):
        engine.add_request("long", [5] * 70, SamplingParams())
    with pytest.raises(ValueError, match=r"token id 999999 is out of range \[0, 512\)"):
        engine.add_request("oov", [5, 999999], SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", [5], SamplingParams())
    # ids the sampler indexes the logits with (min_tokens holds stop_token_ids back): an id past the
    # vocabulary killed the step, and every later one
    # the grammar's think tags too (its bitmask is indexed with them; a negative one let a refused token through)
    from tokenmill.sampling_params import StructuredOutputsParams
    for params in (SamplingParams(stop_token_ids=[100000], min_tokens=1), SamplingParams(logit_bias={600: 1.0}),
                   SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a"], think_tags=(600, 3)))):
        with pytest.raises(ValueError, match=r"token id (100000|600) is out of range: token ids must be in \[0, 512\)"):
            engine.add_request("bad-ids", [5], params)
    with pytest.raises(ValueError, match=r"think_tags must be the token ids of <think> and </think> \(two integers "
                                         r">= 0\), got \(-1, 3\)"):
        StructuredOutputsParams(choice=["a"], think_tags=(-1, 3))
    # a priority the scheduler's rank cannot order ("1") failed every step after it
    for priority in ("1", 1.5, True, 2**63):
        with pytest.raises(ValueError, match=r"priority must be an integer in \[-2\*\*63, 2\*\*63\), got"):
            engine.add_request("bad-priority", [5], SamplingParams(), priority=priority)
    tokens, finished = [], []
    while engine.has_unfinished_requests():
        report = engine.step()
        tokens += report.tokens.tolist()
        finished += report.finished
    assert len(tokens) == 6 and [f[2] for f in finished] == ["length"]     # the core reports token ids only
    with pytest.raises(ValueError):
        llm.generate([[1, 2], []], SamplingParams(max_tokens=2))
    assert not engine.has_unfinished_requests()          # the valid prompt was withdrawn too
    assert engine.get_stats()["num_free_blocks"] == engine.get_stats()["num_total_blocks"]


def test_any_integer_seed_samples_reproducibly(llm):
    """A seed past int64 (vLLM's offline API takes 64-bit seeds), with n choices after it, samples as its
    value modulo 2**62 does, where it overflowed packing the sampling row and broke later steps."""
    sp = lambda seed: SamplingParams(temperature=1.0, max_tokens=6, seed=seed, n=2, ignore_eos=True)  # noqa: E731
    big = llm.generate([[5, 6, 7]], sp(2 ** 64 + 5))[0]
    small = llm.generate([[5, 6, 7]], sp((2 ** 64 + 5) % 2 ** 62))[0]
    assert [o.token_ids for o in big.outputs] == [o.token_ids for o in small.outputs]
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_max_model_len_bounded_by_kv_cache(qwen3_dir, monkeypatch):
    small = LLM(qwen3_dir, device="cpu", dtype="float32", block_size=4, num_kv_blocks=5)
    assert small.engine.max_model_len == 20
    with pytest.raises(ValueError, match="maximum context length is 20"):
        small.generate([[3] * 25])
    out = small.generate([[3] * 10], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 10 and out.outputs[0].finish_reason == "length"
    # a cache sized by hand below a context length asked for serves what it holds, with a warning; a cache
    # sized by the memory is refused, as vLLM refuses it (the CPU's default: 1 GiB of blocks)
    assert LLM(qwen3_dir, device="cpu", dtype="float32", block_size=4, num_kv_blocks=5,
               max_model_len=64).engine.max_model_len == 20
    from tokenmill.runner import model_runner
    block = LLM(qwen3_dir, device="cpu", dtype="float32", block_size=4, num_kv_blocks=1).engine.runner.block_bytes
    monkeypatch.setattr(model_runner, "_CPU_KV_BUDGET_BYTES", 10 * block)
    with pytest.raises(ValueError, match="max_model_len 64 needs 64 tokens of KV cache for one request, but the "
                                         "cache holds 40 .* lower --max-model-len to at most 40"):
        LLM(qwen3_dir, device="cpu", dtype="float32", block_size=4, max_model_len=64)


def test_abort_frees_blocks(llm):
    engine = llm.engine
    for i in range(3):
        engine.add_request(f"a{i}", [4 + i] * 9, SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    assert engine.get_stats()["num_free_blocks"] < engine.get_stats()["num_total_blocks"]
    engine.abort_request(["a0", "a1", "a2", "unknown"])
    assert engine.get_stats()["num_free_blocks"] == engine.get_stats()["num_total_blocks"]
    engine.step()                     # reads the step in flight: nothing is left
    assert not engine.has_unfinished_requests()


def test_vllm_dict_prompts_equal_their_plain_forms(llm):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    plain = llm.generate(["def main():", [5, 6, 7]], params)
    dicts = llm.generate([{"prompt": "def main():"}, {"prompt_token_ids": [5, 6, 7]}], params)
    assert [o.prompt_token_ids for o in dicts] == [o.prompt_token_ids for o in plain]
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    one = llm.generate({"prompt_token_ids": [5, 6, 7]}, params)       # a single dict is one prompt
    assert len(one) == 1 and one[0].outputs[0].token_ids == plain[1].outputs[0].token_ids
    with pytest.raises(ValueError, match=r"exactly one of the keys \['prompt', 'prompt_token_ids'\] \(and "
                                         r"optionally 'cache_salt'\), got \['prompt', 'prompt_token_ids'\]"):
        llm.generate({"prompt": "x", "prompt_token_ids": [5]}, params)
    with pytest.raises(ValueError, match="'multi_modal_data' is not supported: tokenmill runs text-only models"):
        llm.generate({"prompt": "x", "multi_modal_data": {}}, params)
    with pytest.raises(ValueError, match="'prompt' must be a string, got list"):
        llm.generate({"prompt": [5, 6]}, params)
    assert llm.engine.get_stats()["num_free_blocks"] == llm.engine.get_stats()["num_total_blocks"]


def test_min_tokens_holds_back_stop_tokens_and_stop_strings(llm):
    greedy = dict(temperature=0, max_tokens=8)
    free = llm.generate([[5, 6, 7]], SamplingParams(**greedy, ignore_eos=True))[0].outputs[0]
    first = free.token_ids[0]
    # the first token as a stop token id ends the output at once, unless min_tokens holds it back: it is
    # then never sampled among the first min_tokens tokens, and stops the output after them
    stopped = llm.generate([[5, 6, 7]], SamplingParams(**greedy, stop_token_ids=[first]))[0].outputs[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    held = llm.generate([[5, 6, 7]], SamplingParams(**greedy, stop_token_ids=[first], min_tokens=4))[0].outputs[0]
    assert len(held.token_ids) >= 4 and first not in held.token_ids[:4]
    # a stop string in the first tokens' text counts only once a token after the first min_tokens ends it
    # (vLLM's rule: where a stop token could end the output)
    word = llm.get_tokenizer().decode(free.token_ids[:1])
    text_stop = llm.generate([[5, 6, 7]], SamplingParams(**greedy, ignore_eos=True, stop=[word]))[0].outputs[0]
    assert text_stop.finish_reason == "stop" and len(text_stop.token_ids) == 1
    one = llm.generate([[5, 6, 7]], SamplingParams(**greedy, ignore_eos=True, stop=[word], min_tokens=1))[0]
    assert len(one.outputs[0].token_ids) > 1
    late = llm.generate([[5, 6, 7]], SamplingParams(**greedy, ignore_eos=True, stop=[word], min_tokens=8))[0]
    assert late.outputs[0].token_ids == free.token_ids and late.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(8\), got 9"):
        SamplingParams(**greedy, min_tokens=9)
    with pytest.raises(ValueError, match=r"min_tokens must be an integer >= 0, got -1"):
        SamplingParams(min_tokens=-1)
    with pytest.raises(ValueError, match=r"min_tokens must be 0 with structured outputs"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    assert llm.engine.get_stats()["num_free_blocks"] == llm.engine.get_stats()["num_total_blocks"]


def test_text_prompts_and_chat(llm):
    tok = llm.get_tokenizer()
    out = llm.generate("def main():", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert out.prompt_token_ids == tok.encode("def main():")
    full, text = tok.decode(out.outputs[0].token_ids), out.outputs[0].text
    # an unfinished multi-byte character at the very end is withheld, never emitted as U+FFFD
    assert full.startswith(text) and set(full[len(text):]) <= {"\ufffd"}
    msgs = [{"role": "user", "content": "你好"}]
    chat = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    rendered = tok.apply_chat_template(msgs)
    assert rendered.startswith("<|im_start|>user\n你好<|im_end|>") and rendered.endswith("assistant\n")
    ids = chat.prompt_token_ids
    assert ids == tok.encode(rendered, add_special_tokens=False)
    assert ids.count(tok.hf.convert_tokens_to_ids("<|im_start|>")) == 2    # not added twice
    # vLLM's LLM.chat: OpenAI's text parts read as the server reads them (joined by newlines as vLLM joins
    # them, never a Python repr), an assistant turn continued, a template of the caller's; vLLM's engine name
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    parts = [{"role": "user", "content": [{"type": "text", "text": "你"}, {"type": "text", "text": "好"}]}]
    assert llm.chat(parts, sp)[0].prompt == tok.apply_chat_template([{"role": "user", "content": "你\n好"}])
    turn = msgs + [{"role": "assistant", "content": "Hel"}]
    cont = llm.chat(turn, sp, add_generation_prompt=False, continue_final_message=True)[0]
    assert cont.prompt == tok.apply_chat_template(turn, False, continue_final_message=True)
    assert cont.prompt.endswith("Hel")
    mine = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    assert llm.chat(msgs, sp, chat_template=mine)[0].prompt == "[你好]"
    assert llm.llm_engine is llm.engine
    with pytest.raises(ValueError, match="image_url"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], sp)
    # vLLM's chat_template_content_format: "string" is what the template gets here (a TypeError before)
    assert llm.chat(parts, sp, chat_template_content_format="string")[0].prompt == llm.chat(parts, sp)[0].prompt
    with pytest.raises(ValueError, match=r"chat_template_content_format='openai' is not supported"):
        llm.chat(parts, sp, chat_template_content_format="openai")
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        llm.generate(["a", "b"], sp, priority=[1])



def test_chat_takes_vllms_argument_order_and_chat_template_kwargs(llm):
    """vLLM's LLM.chat(messages, sampling_params, use_tqdm, lora_request, chat_template, ...): a template
    passed fifth was read as continue_final_message (and None as add_generation_prompt), rendering another
    prompt silently; chat_template_kwargs' add_generation_prompt (which vLLM's LLM.chat lets win) was a
    TypeError; mm_processor_kwargs=None a TypeError."""
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    mine = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    kwargs = {"add_generation_prompt": False, "continue_final_message": True}
    out = llm.chat(msgs, sp, False, None, mine, chat_template_kwargs=kwargs, mm_processor_kwargs=None)[0]
    assert out.prompt == "[hi][Hel"
    with pytest.raises(ValueError, match="chat_template_kwargs may not set 'tokenize'"):
        llm.chat(msgs, sp, chat_template_kwargs={"tokenize": True})
    with pytest.raises(ValueError, match="mm_processor_kwargs is not supported"):
        llm.chat(msgs, sp, mm_processor_kwargs={"num_crops": 4})


def test_vllms_other_offline_names_are_taken_or_refused_by_name(llm):
    """A ported script's SamplingParams(output_kind=...) was a TypeError (vLLM's LLM returns final outputs
    whatever it says, as here); sampling_params of another type an AttributeError on a str; LLM.embed,
    beam_search, ... AttributeErrors."""
    from tokenmill.sampling_params import RequestOutputKind
    delta = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    assert len(llm.generate([[5, 6]], delta)[0].outputs[0].token_ids) == 3
    with pytest.raises(TypeError, match=r"sampling_params must be a SamplingParams or a list of them \(one per "
                                        r"prompt\), got dict \{'max_tokens': 3\}"):
        llm.generate([[5, 6]], {"max_tokens": 3})
    with pytest.raises(TypeError, match="got a list holding dict"):
        llm.generate([[5, 6], [7]], [delta, {"max_tokens": 3}])
    for name in ("embed", "encode", "classify", "score", "reward", "beam_search"):
        with pytest.raises(ValueError, match=rf"^LLM\.{name}\(\) is not supported: "):
            getattr(llm, name)(["a"])
    assert not llm.engine.has_unfinished_requests()

def test_text_prompts_to_a_model_without_a_tokenizer_are_refused_by_name(tmp_path, save_tiny_model):
    """A checkpoint without tokenizer files (or a GGUF without tokenizer metadata) takes token ids; a text
    prompt was an AttributeError on None."""
    save_tiny_model(str(tmp_path), "qwen3")
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=8)
    assert llm.get_tokenizer() is None
    with pytest.raises(ValueError, match=r"has no tokenizer; pass prompts as lists of token ids, or tokenizer=DIR"):
        llm.generate(["hello", [5, 6]], SamplingParams(max_tokens=1))
    out = llm.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 2


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_a_damaged_tokenizer_file_is_named(tmp_path, qwen3_dir, name):
    """A tokenizer file that is not JSON failed the engine's start with a bare JSONDecodeError, or the
    `tokenizers` library's bare Exception, naming neither the file's folder nor a way out."""
    d = shutil.copytree(qwen3_dir, tmp_path / "model")
    (d / name).write_text("{x")
    with pytest.raises(ValueError, match=r"cannot load the tokenizer in .*model' \(JSONDecodeError: .*\); pass "
                                         r"--tokenizer DIR"):
        LLM(str(d), device="cpu", dtype="float32", num_kv_blocks=8)


def test_use_tqdm_takes_a_callable_that_makes_the_bar(llm):
    """vLLM's use_tqdm=functools.partial(tqdm, ...): the callable makes the progress bar (it was ignored,
    and tqdm's default bar shown)."""
    from tqdm import tqdm
    made = []

    def bar(**kwargs):
        made.append(kwargs["total"])
        return tqdm(disable=True, **kwargs)
    llm.generate([[5, 6], [7]], SamplingParams(max_tokens=1), use_tqdm=bar)
    assert made == [2]


def test_include_stop_str_in_output_shows_a_stop_token(llm):
    """As vLLM: the text of the stop token that ended the output shows only with include_stop_str_in_output."""
    base = dict(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = llm.generate([[5, 6, 7]], SamplingParams(**base))[0].outputs[0].token_ids
    stop = tokens[2]
    cut = tokens.index(stop) + 1
    tok = llm.get_tokenizer()
    for include, upto in ((False, cut - 1), (True, cut)):
        out = llm.generate([[5, 6, 7]], SamplingParams(**base, stop_token_ids=[stop],
                                                       include_stop_str_in_output=include))[0].outputs[0]
        assert out.stop_reason == stop and out.text == tok.decode(tokens[:upto])


def test_incremental_detokenizer_never_emits_broken_utf8(tokenizer_dir):
    tok = Tokenizer(tokenizer_dir)
    text = "你好，世界！😀🚀 café naïve PagedAttention"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=[])
    seen = []
    for t in ids:
        detok.add(t)
        current = detok.output_text(False)
        assert "\ufffd" not in current
        assert text.startswith(current)
        seen.append(current)
    assert detok.output_text(True) == text
    assert len(set(seen)) > 3      # text grew step by step


def test_a_stop_string_in_text_held_back_at_the_end_ends_the_output():
    """A token that completes one character and begins the next holds both back (the text would end in
    U+FFFD); where the output then ended by length, that text was released unchecked, stop string and all,
    with finish_reason "length"."""
    pieces = {1: b"x", 2: "世".encode()[:2], 3: "世".encode()[2:] + "界".encode()[:1]}

    class Bytes:                 # a byte-level tokenizer without an incremental decoder
        def decode_stream(self, context, skip_special_tokens):
            return None

        def decode(self, ids, skip_special_tokens=True):
            return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    detok = IncrementalDetokenizer(Bytes(), [], stop=["世"])
    assert [detok.add(t) for t in (1, 2, 3)] == [None, None, None]      # "世" still held back
    assert detok.finish() == "世" and detok.output_text(True) == "x"
    clean = IncrementalDetokenizer(Bytes(), [], stop=["z"])
    [clean.add(t) for t in (1, 2, 3)]
    assert clean.finish() is None and clean.output_text(True) == "x世\ufffd"


def test_stop_string_is_held_back_and_not_leaked(tokenizer_dir):
    tok = Tokenizer(tokenizer_dir)
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["fox jumps"])
    hit = None
    for t in ids:
        assert "fox j" not in detok.output_text(False)
        hit = detok.add(t)
        if hit:
            break
    assert hit == "fox jumps" and detok.output_text(True) == "The quick brown "


def test_the_stop_string_that_begins_first_ends_the_text(tokenizer_dir):
    """Of stop strings found in one token's text, the earliest ends it (the one listed first left the other
    in the text), the longest where two begin together."""
    tok = Tokenizer(tokenizer_dir)
    for stop, reason, kept in ((["e", "t"], "t", ""), (["he", "the"], "the", "")):
        detok = IncrementalDetokenizer(tok, [], stop=stop)
        hit = None
        for t in tok.encode("the end", add_special_tokens=False):
            hit = hit or detok.add(t)
        assert (hit, detok.output_text(True)) == (reason, kept)
    detok = IncrementalDetokenizer(tok, [], stop=["he", "the"], include_stop_str_in_output=True)
    for t in tok.encode("the end", add_special_tokens=False):
        if detok.add(t):
            break
    assert detok.output_text(True) == "the"


def test_a_stop_string_in_the_first_min_tokens_text_never_counts(tokenizer_dir):
    """A stop string counts only where it ends in the text of a token after the first min_tokens: "a",
    shorter than "zz", lay wholly in the character held back after the first token and was found with the
    second, ending the output inside the text min_tokens protects."""
    tok = Tokenizer(tokenizer_dir)
    (a,), (b,) = tok.encode("a", add_special_tokens=False), tok.encode("b", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["a", "zz"], min_tokens=1)
    assert [detok.add(t) for t in (a, b)] == [None, None] and detok.output_text(False) == "a"
    assert detok.add(a) == "a" and detok.output_text(True) == "ab"


def test_text_with_stop_strings_is_released_up_to_the_hold_at_every_token(tokenizer_dir):
    # the released text grows incrementally: it must be, after every token, exactly the decoded text but
    # its last max(len(stop)) - 1 characters, until a stop string ends it
    tok = Tokenizer(tokenizer_dir)
    text = "Streaming text through the frontend, token by token, while a stop string may still begin. " * 3
    ids = tok.encode(text, add_special_tokens=False)
    for stop in (["zzzz"], ["q", "never here"]):
        hold = max(len(s) for s in stop) - 1
        detok = IncrementalDetokenizer(tok, [], stop=stop)
        for k, t in enumerate(ids, 1):
            assert detok.add(t) is None
            decoded = tok.decode(ids[:k])
            assert detok.output_text(False) == decoded[:max(0, len(decoded) - hold)]
        assert detok.output_text(True) == text


def test_config_normalisation():
    base = dict(architectures=["Qwen3ForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    c = ModelConfig.from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 5e6},
                             "eos_token_id": [1, 2], "dtype": "bfloat16"})
    # Qwen3 without head_dim: transformers' default 128, not hidden_size / heads
    assert c.rope_theta == 5e6 and c.eos_token_ids == (1, 2) and c.head_dim == 128 and c.qk_norm
    assert c.rope_scaling is None and str(c.dtype) == "torch.bfloat16"
    c = ModelConfig.from_hf({**base, "architectures": ["LlamaForCausalLM"], "rope_theta": 7e7,
                             "rope_scaling": {"type": "linear", "factor": 2.0}, "eos_token_id": 3,
                             "torch_dtype": "float16", "head_dim": 16})
    assert c.rope_theta == 7e7 and c.rope_scaling["rope_type"] == "linear" and c.eos_token_ids == (3,)
    assert c.head_dim == 16 and not c.qk_norm and not c.attention_bias
    assert ModelConfig.from_hf({**base, "architectures": ["Qwen2ForCausalLM"]}).attention_bias
    # Qwen2's q/k/v carry a bias whatever an exported attention_bias key says (transformers reads none)
    assert ModelConfig.from_hf({**base, "architectures": ["Qwen2ForCausalLM"], "attention_bias": False}).attention_bias
    assert ModelConfig.from_hf({**base, "hidden_act": "swish"}).hidden_act == "silu"      # the same function
    # a sliding window: Qwen3 reads it with use_sliding_window alone, by layer_types or from max_window_layers
    # on (tests/test_sliding_window.py)
    for window in ({"layer_types": ["sliding_attention"], "sliding_window": 16, "use_sliding_window": True},
                   {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}):
        assert ModelConfig.from_hf({**base, **window}).window(0) == 16
    for window in ({"layer_types": ["full_attention"], "sliding_window": 16},
                   {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 0},
                   {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}):
        assert ModelConfig.from_hf({**base, **window}).window(0) is None


def test_unknown_architecture_and_missing_weights(qwen3_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(qwen3_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'MambaForCausalLM'; supported: "
                                         "Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3ForConditionalGeneration, "
                                         "GraniteForCausalLM, LlamaForCausalLM, MistralForCausalLM, Phi3ForCausalLM, "
                                         "Qwen2ForCausalLM, "
                                         "Qwen3ForCausalLM"):
        LLM(str(bad), device="cpu")
    empty = tmp_path / "noweights"
    shutil.copytree(qwen3_dir, empty)
    for f in os.listdir(empty):
        if f.endswith(".safetensors"):
            os.remove(empty / f)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors weights"):
        LLM(str(empty), device="cpu")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"), device="cpu")


def test_missing_and_leftover_checkpoint_keys(qwen3_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    for mutate, message in [(lambda sd: sd.pop("model.layers.0.self_attn.k_proj.weight"),
                             "parameters missing .*qkv_proj"),
                            (lambda sd: sd.__setitem__("model.layers.0.extra.weight", sd["model.norm.weight"].clone()),
                             "checkpoint keys not used .*extra")]:
        d = tmp_path / f"ck{len(message)}"
        shutil.copytree(qwen3_dir, d)
        sd = load_file(str(d / "model.safetensors"))
        mutate(sd)
        save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ValueError, match=message):
            LLM(str(d), device="cpu")


def test_sharded_checkpoint_loads(qwen3_dir, tmp_path):
    from transformers import AutoModelForCausalLM
    d = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(qwen3_dir).save_pretrained(str(d), max_shard_size="100KB")
    assert os.path.exists(d / "model.safetensors.index.json")
    for f in os.listdir(qwen3_dir):
        if f.startswith("tokenizer") or f.endswith(".jinja"):
            shutil.copy(os.path.join(qwen3_dir, f), d / f)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    a = LLM(qwen3_dir, device="cpu", dtype="float32").generate([[5, 6, 7]], params)[0].outputs[0].token_ids
    b = LLM(str(d), device="cpu", dtype="float32").generate([[5, 6, 7]], params)[0].outputs[0].token_ids
    assert a == b


def test_an_unreadable_shard_or_index_is_named(qwen3_dir, tmp_path):
    """A shard cut short (an interrupted download), an index without its weight_map or listing a shard
    that is not there: each error names the file, not a bare SafetensorError or KeyError."""
    from transformers import AutoModelForCausalLM
    d = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(qwen3_dir).save_pretrained(str(d), max_shard_size="100KB")
    index = d / "model.safetensors.index.json"
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    data = (d / shards[-1]).read_bytes()
    (d / shards[-1]).write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match=rf"cannot read checkpoint file .*{shards[-1]}'"):
        LLM(str(d), device="cpu")
    (d / shards[-1]).unlink()
    with pytest.raises(FileNotFoundError, match=rf"lists the shard '{shards[-1]}', which is not in"):
        LLM(str(d), device="cpu")
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json' has no weight_map"):
        LLM(str(d), device="cpu")
    # a list, no JSON, a shard named by no string or outside the directory (tracebacks, or a file read elsewhere)
    for body, message in (("[]", "has no weight_map"), ("{", "is not JSON"),
                          (json.dumps({"weight_map": {"w": 3}}), "names the shard 3"),
                          (json.dumps({"weight_map": {"w": "/etc/passwd"}}), "names the shard '/etc/passwd'"),
                          (json.dumps({"weight_map": {"w": "../x.safetensors"}}), "names the shard '../x")):
        index.write_text(body)
        with pytest.raises(ValueError, match=message):
            LLM(str(d), device="cpu")


def test_a_stop_string_found_by_the_frontend_frees_the_core_at_once(llm):
    """The core reports token ids only; the frontend's OutputProcessor finds the stop string, and the
    sequence it names is stopped in the core (its blocks free) before another step runs, while the
    other sequence of the request goes on; tokens of the stopped one still in flight are dropped."""
    import time as _time

    from tokenmill.engine.output_processor import OutputProcessor

    prompt = [7, 8, 9, 10]
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    text = llm.generate([prompt], free)[0].outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    engine = llm.engine
    total = engine.get_stats()["num_total_blocks"]
    processor = OutputProcessor(engine.tokenizer)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop], n=2, seed=1)
    params_other = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=1)
    h = engine.add_request("s", prompt, params, handle=100)
    processor.add(h, "s", prompt, params)
    h2 = engine.add_request("other", prompt, params_other, handle=101)
    processor.add(h2, "other", prompt, params_other)
    stopped = []
    while not stopped:
        outputs, stopped, _ = processor.process(engine.step(), _time.time())
    assert stopped == [("s", 0), ("s", 1)]          # greedy: both sequences hit the stop string together
    held = engine.get_stats()["num_free_blocks"]
    engine.stop_sequences(stopped)
    assert "s" not in engine.groups and "other" in engine.groups
    assert engine.get_stats()["num_free_blocks"] > held              # freed now, not at the next step
    [s_out] = [o for o in outputs if o.request_id == "s"]
    assert s_out.finished and all(c.finish_reason == "stop" and c.stop_reason == stop for c in s_out.outputs)
    assert all(c.text == text[:3] for c in s_out.outputs)
    before = {len(c.token_ids) for c in s_out.outputs}
    last = None
    while engine.has_unfinished_requests():
        outs, _, _ = processor.process(engine.step(), _time.time())
        last = next((o for o in outs if o.request_id == "other"), last)
    assert {len(c.token_ids) for c in s_out.outputs} == before     # in-flight tokens of "s" were dropped
    assert last.finished and last.outputs[0].text == text and len(processor) == 0
    assert engine.get_stats()["num_free_blocks"] == total


def test_the_frontend_keeps_logprobs_flat_and_reads_them_as_vllms_dicts(llm):
    """A request's logprobs stay the core's numbers, in a few objects however many tokens it has: as dicts of
    `Logprob` they were built on the API server's event loop (~0.1 s a 1,000 prompt tokens with 20
    alternatives) and walked by every full garbage collection (~220 ms each for n = 128 x 200 tokens x 21).
    Read, a position is vLLM's dict: its own token at its rank, then the top ones (ranks 1, 2, ...)."""
    import gc
    import types

    import numpy as np

    from tokenmill.engine.output_processor import OutputProcessor
    from tokenmill.engine.step_outputs import StepOutputs
    from tokenmill.outputs import Logprob

    processor = OutputProcessor(llm.engine.tokenizer)
    text = processor.token_text
    processor.add(1, "r", [7, 8, 9], SamplingParams(n=2, max_tokens=200, logprobs=1, prompt_logprobs=1,
                                                    ignore_eos=True))
    processor.process(StepOutputs(prompt_logprobs=[(1, [None, (-0.5, 2, [9], [-0.25]), (-0.75, 1, [9], [-0.75])])]),
                      0.0)
    for _ in range(200):
        # the batch asked for 2 alternatives, this request for 1
        rows = {j: ([-1.5, -0.5, -1.0], [5 + j, 4, 6], 2 + j) for j in range(2)}
        [out], _, _ = processor.process(StepOutputs(np.array([1, 1]), np.array([0, 1], np.int32), np.array([5, 6]),
                                                 logprobs=rows), 0.0)
    held, seen, todo = 0, set(), [out]
    while todo:                     # what the output holds, short of classes and its token texts' lookup
        obj = todo.pop()
        if id(obj) in seen or not gc.is_tracked(obj) or isinstance(obj, (type, types.MethodType)):
            continue
        seen.add(id(obj))
        held += 1
        todo += gc.get_referents(obj)
    assert held < 40, held
    first, second = out.outputs
    assert len(first.logprobs) == len(second.logprobs) == 200 and first.cumulative_logprob == -300.0
    assert list(first.logprobs[-1].items()) == [(5, Logprob(-1.5, 2, text(5))), (4, Logprob(-0.5, 1, text(4)))]
    assert list(second.logprobs[0].items()) == [(6, Logprob(-1.5, 3, text(6))), (4, Logprob(-0.5, 1, text(4)))]
    assert list(out.prompt_logprobs) == [None, {8: Logprob(-0.5, 2, text(8)), 9: Logprob(-0.25, 1, text(9))},
                                         {9: Logprob(-0.75, 1, text(9))}]


def _async_engine(model_dir: str):
    """A fresh in-process AsyncLLM of the tiny model; the test shuts it down."""
    from tokenmill.config import EngineConfig
    from tokenmill.engine.async_engine import AsyncLLM
    return AsyncLLM(EngineConfig(model=model_dir, device="cpu", dtype="float32"), in_process=True)


async def _reading(engine, request_id: str, max_tokens: int) -> asyncio.Task:
    """A task reading request `request_id`'s stream to its end, returned once its first output has come."""
    started = asyncio.Event()

    async def read():
        async for _ in engine.generate(request_id, [5, 6, 7], SamplingParams(max_tokens=max_tokens, ignore_eos=True)):
            started.set()
    task = asyncio.create_task(read())
    await started.wait()
    return task


def test_a_reader_is_woken_every_stream_interval_tokens(qwen3_dir):
    """`AsyncLLM.generate(stream_interval=k)` yields the first output, then one each time the longest
    sequence has k more tokens, and the last; 0 yields the first and the last alone (what the server's
    requests answered whole wait for). The outputs stay cumulative: the last is the whole answer."""
    engine = _async_engine(qwen3_dir)
    assert engine.scheduling_policy == "fcfs"       # as its core announced it (CoreReady), for the server's checks
    params = SamplingParams(temperature=0, max_tokens=11, ignore_eos=True, n=2)

    async def seen(rid: str, interval: int):
        counts = []
        async for out in engine.generate(rid, [5, 6, 7], params, stream_interval=interval):
            counts.append(len(out.outputs[0].token_ids))
        return counts, [c.text for c in out.outputs]

    async def main():
        engine.attach()
        return await asyncio.gather(seen("each", 1), seen("fours", 4), seen("ends", 0))
    try:
        (each, text1), (fours, text4), (ends, text0) = asyncio.run(main())
        with pytest.raises(ValueError, match="stream_interval must be 0 or more, got -1"):
            asyncio.run(anext(engine.generate("bad", [5], params, stream_interval=-1)))
    finally:
        engine.shutdown()
    # a reader reads the newest output when it runs, so it may see a later token count than the one that
    # woke it, never more outputs than wakes: 2 for 0 (the first, the last), 4 for 4 (at 1, 5, 9 and 11)
    assert text1 == text4 == text0
    assert len(ends) == 2 and ends[-1] == 11
    assert 2 <= len(fours) <= 4 and fours[-1] == 11
    assert each[-1] == 11


def test_an_aborted_id_used_again_at_once_serves_the_new_request(qwen3_dir):
    """abort(id), then generate(id) again before the aborted reader has ended: the aborted reader's cleanup
    removed the new request's stream and output state by id, and the new generate never yielded (its
    request ran to the end in the core unseen)."""
    from tokenmill.engine.async_engine import RequestAbortedError

    engine = _async_engine(qwen3_dir)

    async def main():
        engine.attach()
        task = await _reading(engine, "x", 200)
        engine.abort("x")
        async with asyncio.timeout(30):
            outs = [o async for o in engine.generate("x", [5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True))]
        with pytest.raises(RequestAbortedError):
            await task
        return outs[-1], len(engine.processor)
    try:
        last, left = asyncio.run(main())
    finally:
        engine.shutdown()
    assert last.finished and len(last.outputs[0].token_ids) == 5 and left == 0


def test_an_aborted_request_whose_reader_is_cancelled_leaves_the_new_request_of_its_id_alone(qwen3_dir):
    """The reader cancelled (its client gone), the request aborted and its id used again in the same tick:
    the cancelled reader's cleanup, which runs after the new request was sent, aborted the id in the core,
    where it named the new request, whose stream then never ended."""
    engine = _async_engine(qwen3_dir)

    async def main():
        engine.attach()
        task = await _reading(engine, "x", 200)
        task.cancel()
        engine.abort("x")
        async with asyncio.timeout(5):
            outs = [o async for o in engine.generate("x", [5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True))]
        await asyncio.gather(task, return_exceptions=True)
        return outs[-1], len(engine.processor)
    try:
        last, left = asyncio.run(main())
    finally:
        engine.shutdown()
    assert last.finished and len(last.outputs[0].token_ids) == 5 and left == 0


def test_a_request_whose_output_cannot_be_made_fails_alone(qwen3_dir):
    """An error while one request's tokens are turned into its output (its detokenizer here) escaped the
    output processor: the rest of the step's tokens, every other request's, were dropped, and the failing
    request's reader waited for ever. Now that request alone fails, its reader raises, the core aborts it,
    and the others run on whole."""
    engine = _async_engine(qwen3_dir)

    class Exploding:
        def add(self, token):
            raise ValueError("boom")

    async def main():
        engine.attach()
        bad = await _reading(engine, "bad", 200)
        engine.processor._requests[engine.processor._handles["bad"]].seqs[0].detok = Exploding()
        async with asyncio.timeout(30):
            outs = [o async for o in engine.generate("good", [5, 6, 7],
                                                     SamplingParams(max_tokens=20, ignore_eos=True))]
            with pytest.raises(RuntimeError, match=r"request bad: its output could not be made \(ValueError: boom\)"):
                await bad
            while (stats := await engine.get_stats())["num_running"]:
                await asyncio.sleep(0.05)
        return outs[-1], stats, len(engine.processor)
    try:
        last, stats, left = asyncio.run(main())
    finally:
        engine.shutdown()
    assert last.finished and len(last.outputs[0].token_ids) == 20 and left == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    # aborted as it failed: the core did not generate the failed request's 200 tokens for nobody
    assert stats["generation_tokens"] < 100, stats["generation_tokens"]


def test_a_prompt_the_detokenizer_refuses_leaves_its_id_free(qwen3_dir):
    """A negative token id fails in the frontend's detokenizer, before the request reaches the core: its
    stream was left registered, so the id stayed "already in use" for good and `num_unfinished` counted it."""
    engine = _async_engine(qwen3_dir)

    async def main():
        engine.attach()
        with pytest.raises(TypeError):
            await anext(engine.generate("x", [5, -1], SamplingParams(max_tokens=3)))
        left = engine.num_unfinished
        async with asyncio.timeout(5):
            outs = [o async for o in engine.generate("x", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))]
        return left, outs[-1]
    try:
        left, last = asyncio.run(main())
    finally:
        engine.shutdown()
    assert left == 0 and last.finished and len(last.outputs[0].token_ids) == 3


def test_a_reader_in_flight_at_shutdown_ends_with_engine_dead(qwen3_dir):
    """`shutdown()` inside the event loop while a stream was read: the reader waited for ever (nothing woke
    it once the pipe closed). It now raises EngineDeadError, as a request after the shutdown does, and the
    on_dead callbacks, which report a crash, are not called."""
    from tokenmill.engine.async_engine import EngineDeadError

    engine = _async_engine(qwen3_dir)
    deaths = []
    engine.on_dead(deaths.append)

    async def main():
        engine.attach()
        task = await _reading(engine, "x", 300)
        engine.shutdown()
        async with asyncio.timeout(5):
            with pytest.raises(EngineDeadError, match="shut down"):
                await task
        with pytest.raises(EngineDeadError):
            await anext(engine.generate("y", [5], SamplingParams()))
    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    assert deaths == [] and engine.num_unfinished == 0


def test_a_step_in_flight_when_the_last_request_ends_is_read_at_once(qwen3_dir):
    """Aborting the last requests while a step is in flight left that step unread until a request next
    arrived, and its time then counted the idle gap: the latency target's step model took seconds for a
    step, admitted nothing more while anything ran, and new requests waited hundreds of steps."""
    import time
    llm = LLM(qwen3_dir, device="cpu", dtype="float32", max_num_seqs=8, target_itl_ms=250.0)
    engine = llm.engine
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"a{i}", [5 + i] * 8, params)
    for _ in range(5):
        engine.step()
    engine.abort_request([f"a{i}" for i in range(4)])
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert steps == 1 and engine._in_flight is None
    time.sleep(0.5)
    engine.add_request("b", [9] * 8, params)
    engine.step(), engine.step()
    assert engine.scheduler.last_step_seconds < 0.4


def test_a_sequence_that_stopped_early_holds_back_no_other_ones_tokens():
    """Two sequences of one request: the first stops at 10 tokens, the second goes on from 5; at interval 1
    each of the second's tokens wakes the reader, at interval 3 every third (each sequence counts its own,
    not the longest's)."""
    from types import SimpleNamespace

    from tokenmill.engine.request_stream import RequestStream

    def out(*lengths):
        return SimpleNamespace(finished=False, outputs=[SimpleNamespace(token_ids=[0] * n) for n in lengths])
    for interval, expected in ((1, [True] * 6), (3, [False, False, True, False, False, True])):
        stream = RequestStream(interval=interval)
        assert stream.due(out(10, 5))
        assert [stream.due(out(10, n)) for n in range(6, 12)] == expected


def _tokenizer_with_clean_up(model_dir, tmp_path) -> Tokenizer:
    """The model's tokenizer, copied to tmp_path with `clean_up_tokenization_spaces` set."""
    for name in os.listdir(model_dir):
        if name.startswith("tokenizer") or name.endswith(".txt") or name == "vocab.json":
            shutil.copy(os.path.join(model_dir, name), tmp_path / name)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["clean_up_tokenization_spaces"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return Tokenizer(str(tmp_path))


def test_tokenizer_decode_equals_transformers_decode(qwen3_dir, tmp_path):
    """Tokenizer.decode calls the Rust tokenizer directly: it must give transformers' text for any ids,
    special tokens skipped or kept, and leave tokenizers that ask for space clean-up to transformers."""
    import random

    tok = Tokenizer(qwen3_dir)
    assert tok._rust_decode
    rng = random.Random(0)
    specials = sorted(tok.all_special_ids)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 6))]
        if specials and rng.random() < 0.3:
            ids.insert(rng.randint(0, len(ids)), rng.choice(specials))
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == tok.hf.decode(ids, skip_special_tokens=skip)
    # a tokenizer that asks for transformers' clean-up keeps transformers' decode
    assert not _tokenizer_with_clean_up(qwen3_dir, tmp_path)._rust_decode


def test_tokenizer_encode_batch_equals_encode(qwen3_dir, tmp_path):
    """Tokenizer.encode_batch (one call of the Rust tokenizer for many texts, what the API server encodes a
    burst of prompts with) gives each text transformers' `encode` ids, with and without special tokens,
    for the test tokenizer and the bundled model's; one whose tokenizer.json truncates goes through
    transformers (which turns the truncation off), not the Rust call."""
    from tokenmill.tiny import bundled_model_path
    texts = ["Hello world!", "", "  spaces\n\n\ttabs  ", "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
             "从前有一座山，山上有一座庙。 😀", "It's 2024: don't I'LL we've " * 20]
    for path in (qwen3_dir, bundled_model_path()):
        tok = Tokenizer(path)
        for flag in (True, False):
            assert tok.encode_batch(texts, flag) == [tok.hf.encode(t, add_special_tokens=flag) for t in texts]
    for name in os.listdir(qwen3_dir):
        if name.startswith("tokenizer"):
            shutil.copy(os.path.join(qwen3_dir, name), tmp_path / name)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    truncating = Tokenizer(str(tmp_path))
    assert truncating.hf._tokenizer.truncation is not None
    assert truncating.encode_batch(texts[-1:], False) == [Tokenizer(qwen3_dir).encode(texts[-1], False)]
    assert len(truncating.encode_batch(texts[-1:], False)[0]) > 4


def test_streamed_detokenization_equals_the_window_decode(qwen3_dir, tmp_path):
    """The detokenizer steps the Rust tokenizer's DecodeStream, one call a token: its released text, token
    by token, and its final text (pending bytes flushed as U+FFFD) must equal the two-window decode that a
    tokenizer needing transformers' clean-up still takes, on random ids with special tokens, prompt context
    (dropped by both where it ends inside a character: the window decode joined its bytes to the first
    output token's, emitting no text for that token) and stop strings."""
    import random

    tok = Tokenizer(qwen3_dir)
    window = _tokenizer_with_clean_up(qwen3_dir, tmp_path)
    window.hf.clean_up_tokenization_spaces = False       # the same text, through the window decode
    assert tok.decode_stream([], True) is not None and window.decode_stream([], True) is None
    rng = random.Random(3)
    specials = sorted(tok.all_special_ids)
    for _ in range(300):
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 6))]
        out = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))]
        if rng.random() < 0.3:
            out.insert(rng.randint(0, len(out)), rng.choice(specials))
        skip = rng.random() < 0.7
        stop = rng.choice([[], ["e"], ["the", "\n"]])
        a = IncrementalDetokenizer(tok, prompt, stop, skip)
        b = IncrementalDetokenizer(window, prompt, stop, skip)
        assert a.stream is not None and b.stream is None
        for t in out:
            hit = a.add(t)
            assert hit == b.add(t) and a.output_text(False) == b.output_text(False)
            if hit:
                break
        assert a.output_text(True) == b.output_text(True)



def test_bytes_that_break_a_byte_fallback_run_leave_the_released_text(tmp_path):
    """SentencePiece's byte-fallback decoder decodes a run of byte tokens whole, or as one U+FFFD per byte
    where it is not UTF-8: ">" (a byte token), then a lone lead byte and a word turn the released ">" into
    U+FFFD. The Rust DecodeStream raised on that (the frontend's whole report was lost), in the prompt's
    context too; the window decode and the final flush gave text that repeated or dropped characters.
    The released text stands and the tokens after it decode on their own, as they end the text."""
    from tokenizers import Tokenizer as RustTokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "\u2581": 257, "a": 258, "\u2581a": 259}
    rust = RustTokenizer(models.BPE(vocab=vocab, merges=[("\u2581", "a")], unk_token="<unk>", byte_fallback=True))
    rust.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    rust.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    PreTrainedTokenizerFast(tokenizer_object=rust, unk_token="<unk>").save_pretrained(tmp_path / "sp")
    stream = Tokenizer(str(tmp_path / "sp"))
    window = _tokenizer_with_clean_up(tmp_path / "sp", tmp_path)
    window.hf.clean_up_tokenization_spaces = False       # the same text, through the window decode
    gt, lead, word = 1 + ord(">"), 1 + 0xE4, 259
    assert stream.decode([gt, lead, word]) == "\ufffd\ufffd a"
    for tok in (stream, window):
        for prompt in ([], [gt, lead, word]):
            detok = IncrementalDetokenizer(tok, prompt, [])
            seen = []
            for t in (gt, lead, word):
                detok.add(t)
                seen.append(detok.output_text(False))
            assert seen == [">", ">", ">\ufffd a"] and detok.output_text(True) == ">\ufffd a"
        detok = IncrementalDetokenizer(tok, [], [])
        detok.add(gt), detok.add(lead)
        assert detok.output_text(True) == ">\ufffd"

# One fresh process builds an engine core, then an `LLM` (a process importing torch costs ~4 s of the suite),
# and reports what it imported at each point: the two tests below each read their part.
FRESH_ENGINE_PROCESS = """
import json, sys
from tokenmill.config import EngineConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.sampling_params import SamplingParams
e = LLMEngine(EngineConfig(model=sys.argv[1], device='cpu', num_kv_blocks=8))
at_start = 'transformers' in sys.modules
e.add_request('r', [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True, bad_words=['hi'], bad_words_token_ids=[[9]]))
while e.has_unfinished_requests():
    e.step()
served = 'transformers' in sys.modules
server_side = sorted(m for m in ('prometheus_client', 'fastapi') if m in sys.modules)
eos = sorted(e.eos_token_ids)
loaded = list(e.tokenizer.eos_token_ids)
after = 'transformers' in sys.modules
from tokenmill import LLM
LLM(sys.argv[1], device='cpu', num_kv_blocks=8)
print(json.dumps([server_side, at_start, served, eos, loaded, after, sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules)]))
"""


@pytest.fixture(scope="module")
def fresh_engine_process(qwen3_dir) -> list:
    """`FRESH_ENGINE_PROCESS`'s report: [the server's packages imported by the engine core, transformers
    imported once the engine core is built, and once it has served a request (bad words resolved), the core's
    EOS ids, its tokenizer's once loaded, transformers imported then, torch._dynamo and sympy imported by
    the end]."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", FRESH_ENGINE_PROCESS, qwen3_dir], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_building_the_engine_imports_neither_dynamo_nor_sympy(fresh_engine_process):
    """Start-up cost: the model is built on the meta device, where nn.Embedding's random init and
    to_empty's empty_like ran torch's Python references, whose first calls import torch._dynamo and sympy
    (1.5 s of every engine process's start on the CPU machine); the loader allocates without them (an engine
    core and an `LLM` built in a fresh process, `fresh_engine_process`)."""
    assert fresh_engine_process[-1] == []


def test_an_engine_core_imports_no_server_package(fresh_engine_process):
    """A bare GPU machine has torch and Triton but not prometheus_client or FastAPI: the engine core and
    its stats (the step-size histogram's counts included) stand without them."""
    assert fresh_engine_process[0] == []


def test_an_api_server_process_imports_neither_triton_nor_the_engine():
    """`import tokenmill` leaves `LLM` (the engine, the model runner, Triton) until it is asked for, and
    the configs leave torch until a dtype or device is made: an API server process, which only talks to
    the engine core, starts without them."""
    import subprocess
    import sys
    code = ("import sys, tokenmill.server.app; "
            "print(sorted(m for m in ('torch', 'triton', 'tokenmill.engine.engine', 'tokenmill.runner.model_runner') "
            "if m in sys.modules)); from tokenmill import LLM; print(LLM.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]", "LLM"]


def test_an_engine_core_takes_the_tokenizers_eos_id_without_loading_it(fresh_engine_process, qwen3_dir, tmp_path):
    """The engine reads the tokenizer's EOS id from tokenizer_config.json and tokenizer.json (no
    transformers) and loads the tokenizer when first asked for: a served engine core, whose frontend
    tokenizes, starts and serves without it (its first request loaded it, for bad words the frontend had
    resolved). The id is the one transformers resolves; where the files leave it unclear the tokenizer is
    loaded at start, as before."""
    from tokenmill.engine.tokenizer import Tokenizer, plain_eos_ids
    _, at_start, served, engine_eos, loaded_eos, after, _ = fresh_engine_process
    eos = Tokenizer(qwen3_dir).eos_token_ids
    assert eos and plain_eos_ids(qwen3_dir) == eos and tuple(loaded_eos) == eos
    assert set(eos) <= set(engine_eos)
    assert (at_start, served, after) == (False, False, True)
    # a special_tokens_map.json naming another EOS, or none named: only the tokenizer can tell
    other = tmp_path / "other"
    shutil.copytree(qwen3_dir, other)
    (other / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    assert plain_eos_ids(str(other)) is None
    config = json.loads((other / "tokenizer_config.json").read_text())
    config.pop("eos_token", None)
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    (other / "special_tokens_map.json").unlink()
    assert plain_eos_ids(str(other)) is None


def test_a_cpu_kv_cache_is_resident_only_where_requests_wrote(qwen3_dir):
    """The CPU engine's KV cache (by default as many blocks as fit 1 GiB, here 1 GiB of blocks asked for)
    is mapped, not zeroed, at start: a fresh engine holds only the pages its steps wrote, a block never
    written reads as zeros, and the engine's output is the same as with a small cache."""

    def resident_mib() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    small = LLM(qwen3_dir, device="cpu", dtype="float32", block_size=16, max_model_len=64, num_kv_blocks=40)
    blocks = 2**30 // small.engine.runner.block_bytes
    before = resident_mib()
    big = LLM(qwen3_dir, device="cpu", dtype="float32", block_size=16, max_model_len=64, num_kv_blocks=blocks)
    cache = big.engine.runner.kv_cache
    assert cache.nbytes > 512 * 2**20
    prompt = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = big.generate([[5, 6, 7, 8, 9]], prompt)[0].outputs[0].token_ids
    assert resident_mib() - before < cache.nbytes / 2**20 / 4
    assert not cache[:, :, -1].any()
    assert small.generate([[5, 6, 7, 8, 9]], prompt)[0].outputs[0].token_ids == out


def test_the_sequences_of_n_share_the_prompts_blocks(llm):
    """n = 4: the later sequences wait for the first to compute the prompt and then take its blocks from
    the prefix cache (each computed and held its own copy); the cache's lookups are counted once a sequence
    is admitted."""
    engine = llm.engine
    prompt = list(range(40, 72))                     # 32 tokens: 7 full blocks before the last token
    before = engine.get_stats()
    engine.add_request("n4", prompt, SamplingParams(n=4, max_tokens=3, ignore_eos=True, seed=3))
    seqs = list(engine.groups["n4"])
    while engine.has_unfinished_requests():
        engine.step()
    assert [s.num_cached_tokens for s in seqs] == [0, 28, 28, 28]
    after = engine.get_stats()
    assert after["prefix_cache_queries"] - before["prefix_cache_queries"] == 4 * 32
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 3 * 28
    assert after["num_free_blocks"] == after["num_total_blocks"]


def test_requests_of_different_cache_salts_share_no_prefix_cache_block(llm):
    """vLLM's cache_salt: the salt is mixed into the first block's hash, which every later block's hash
    chains, so a prompt run under one salt is a miss under another (or none) and a hit under the same."""
    engine = llm.engine
    prompt = list(range(300, 332))                   # 32 tokens: 7 full blocks before the last token
    params = dict(temperature=0, max_tokens=2, ignore_eos=True)

    def hits(salt) -> int:
        before = engine.get_stats()["prefix_cache_hits"]
        llm.generate([prompt], SamplingParams(**params, cache_salt=salt))
        return engine.get_stats()["prefix_cache_hits"] - before
    assert hits("tenant-a") == 0
    assert hits("tenant-b") == 0 and hits(None) == 0
    assert hits("tenant-a") == 28 and hits("tenant-b") == 28 and hits(None) == 28
    with pytest.raises(ValueError, match="^cache_salt must be a non-empty string, got ''"):
        SamplingParams(cache_salt="")
    # where vLLM's offline API takes it: on the prompt dict (it was refused as an unknown key)
    before = engine.get_stats()["prefix_cache_hits"]
    llm.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-a"},
                  {"prompt_token_ids": prompt, "cache_salt": "tenant-c"}], SamplingParams(**params))
    assert engine.get_stats()["prefix_cache_hits"] - before == 28
    with pytest.raises(ValueError, match="^cache_salt must be a non-empty string, got ''"):
        llm.generate([[5, 6], {"prompt": "x", "cache_salt": ""}], SamplingParams(**params))
    assert not engine.has_unfinished_requests()


def test_reset_prefix_cache(llm):
    """vLLM's LLM.reset_prefix_cache: a prompt run before is computed from its first token again; refused
    (False, the cache kept) while a request is unfinished."""
    engine = llm.engine
    prompt = list(range(100, 140))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    first = llm.generate([prompt], params)[0].outputs[0].token_ids
    hits = engine.get_stats()["prefix_cache_hits"]
    engine.add_request("held", prompt, params)
    assert llm.reset_prefix_cache() is False
    while engine.has_unfinished_requests():
        engine.step()
    served = engine.get_stats()["prefix_cache_hits"] - hits
    assert served >= 32                                                  # the kept cache served it
    assert llm.reset_prefix_cache() is True
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == first
    assert engine.get_stats()["prefix_cache_hits"] - hits == served
    # a request ended by a stop token (as by end of sequence) leaves the step launched after its last token
    # in flight: that step, whose requests have all ended, was taken for an unfinished request (False)
    stopped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, stop_token_ids=[first[0]]))[0]
    assert stopped.outputs[0].finish_reason == "stop" and engine.has_unfinished_requests()
    assert llm.reset_prefix_cache() is True and not engine.has_unfinished_requests()


def test_a_preempted_request_is_looked_up_in_the_prefix_cache_once(qwen3_dir):
    """Each re-admission of a request preempted by recompute counted its whole length as a cache query
    again, and its own just-freed blocks as hits: distinct prompts showed a hit rate (22% here)."""
    import random
    llm = LLM(qwen3_dir, device="cpu", dtype="float32", block_size=4, max_model_len=64, num_kv_blocks=16,
              max_num_seqs=8, swap_space=0)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(10)] for _ in range(6)]      # no prefix shared
    llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    stats = llm.engine.get_stats()
    assert stats["num_preemptions"] > 0
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (60, 0)


def test_a_template_given_for_a_model_without_one(qwen3_dir, monkeypatch):
    """--chat-template (and LLM.chat's chat_template) is what a model without a template of its own needs:
    it was refused for having none. `tokenmill generate --chat` passes the rendered prompt as token ids (the
    text holds the template's BOS, which encoding it as a prompt added again)."""
    from tokenmill import cli
    from tokenmill.llm import LLM as OfflineLLM

    tok = Tokenizer(qwen3_dir)
    tok.hf.chat_template = None
    mine = "{{ bos_token or '' }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=mine).endswith("[hi]")
    with pytest.raises(ValueError, match="no chat template; pass one"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    seen = []
    monkeypatch.setattr(OfflineLLM, "generate", lambda self, prompts, params: seen.extend(prompts) or [])
    assert cli.main(["generate", qwen3_dir, "--chat", "--prompt", "hi", "--device", "cpu", "--num-kv-blocks", "8"]) == 0
    rendered = Tokenizer(qwen3_dir).apply_chat_template([{"role": "user", "content": "hi"}])
    assert seen == [Tokenizer(qwen3_dir).encode(rendered, add_special_tokens=False)]


def _metric_sample(metrics, name: str, labels: dict | None = None) -> float | None:
    """The value of the sample `name` (with these labels) on a ServerMetrics' rendered page."""
    from prometheus_client.parser import text_string_to_metric_families
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                return s.value
    return None


def test_request_metrics_per_choice_and_for_requests_ended_unfinished():
    """Each choice's latency when it finishes (not the whole request's); a request that ends unfinished
    (client gone, engine dead) counts as an abort with its latency; the buckets reach two hours."""
    from tokenmill.engine.metrics import ServerMetrics
    from tokenmill.engine.request_stream import RequestStream
    from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput

    metrics = ServerMetrics("m", lambda: {})
    stream = RequestStream(n=2, metrics=RequestMetrics(100.0))

    def out(reasons, finished, finished_time=None):
        return RequestOutput("r", None, [1], [CompletionOutput(i, "x", [5], None, None, r) for i, r in enumerate(reasons)],
                             finished, metrics=RequestMetrics(100.0, 100.0, 100.5, finished_time=finished_time))
    metrics.observe_output(stream, out(["stop", None], False), 101.0)
    metrics.observe_output(stream, out(["stop", "length"], True, 105.0), 105.5)
    metrics.observe_output(RequestStream(n=1, metrics=RequestMetrics(100.0)), None, 102.0)

    def sample(name, labels=None):
        return _metric_sample(metrics, name, labels)
    assert sample("tokenmill:e2e_request_latency_seconds_count") == 3
    assert sample("tokenmill:e2e_request_latency_seconds_sum") == 1.0 + 5.0 + 2.0
    assert [sample("tokenmill:request_success_total", {"finished_reason": r}) for r in ("stop", "length", "abort")] \
        == [1, 1, 1]
    assert sample("tokenmill:e2e_request_latency_seconds_bucket", {"le": "7680.0"}) == 3


def test_a_long_gap_between_tokens_reads_as_itself_in_the_inter_token_latency():
    """A sequence preempted for 30 s between two tokens: its gap lands in the 40 s bucket (the buckets
    reach 80 s, as vLLM's), not past the last bound, where every quantile would read that bound."""
    from tokenmill.engine.metrics import ServerMetrics
    from tokenmill.engine.request_stream import RequestStream
    from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput

    metrics = ServerMetrics("m", lambda: {})
    stream = RequestStream(n=1, metrics=RequestMetrics(100.0))

    def out(tokens):
        return RequestOutput("r", None, [1], [CompletionOutput(0, "x", tokens, None, None, None)], False,
                             metrics=RequestMetrics(100.0, 100.0, 100.5))
    metrics.observe_output(stream, out([5]), 100.5)
    metrics.observe_output(stream, out([5, 6]), 130.5)
    page = metrics.render().decode()
    assert 'tokenmill:inter_token_latency_seconds_bucket{le="20.0",model_name="m"} 0.0' in page
    assert 'tokenmill:inter_token_latency_seconds_bucket{le="40.0",model_name="m"} 1.0' in page


def test_request_length_and_phase_metrics_that_vllms_dashboard_reads():
    """vLLM's Grafana dashboard reads the prompt and generation lengths, prefill and decode times, the
    longest sequence and the n and max_tokens parameters: per finished sequence (an aborted one too),
    and n and the longest sequence once per request."""
    from tokenmill.engine.metrics import ServerMetrics, build_1_2_5_buckets
    from tokenmill.engine.request_stream import RequestStream
    from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput

    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    metrics = ServerMetrics("m", lambda: {}, max_model_len=64)
    stream = RequestStream(n=2, metrics=RequestMetrics(100.0), num_prompt_tokens=3, max_tokens=8)

    def out(tokens, reasons, finished):
        return RequestOutput("r", None, [1, 2, 3], [CompletionOutput(i, "x", t, None, None, r)
                                                    for i, (t, r) in enumerate(zip(tokens, reasons))],
                             finished, metrics=RequestMetrics(100.0, 100.5, 101.0, finished_time=104.0 if finished else None))
    metrics.observe_output(stream, out([[5], [5]], [None, None], False), 101.0)
    metrics.observe_output(stream, out([[5, 6], [5]], ["stop", None], False), 102.0)
    metrics.observe_output(stream, out([[5, 6], [5, 6, 7, 8]], ["stop", "length"], True), 104.0)
    cut = RequestStream(n=1, metrics=RequestMetrics(100.0), num_prompt_tokens=7)      # aborted while queued
    metrics.observe_output(cut, None, 103.0)

    def sample(name, labels=None):
        return _metric_sample(metrics, name, labels)
    assert sample("tokenmill:request_prompt_tokens_count") == 3
    assert sample("tokenmill:request_prompt_tokens_sum") == 3 + 3 + 7
    assert [sample("tokenmill:request_prompt_tokens_bucket", {"le": le}) for le in ("5.0", "50.0")] == [2, 3]
    assert sample("tokenmill:request_generation_tokens_sum") == 2 + 4 + 0
    assert sample("tokenmill:request_params_max_tokens_count") == 2      # the abort set none
    assert sample("tokenmill:request_params_max_tokens_sum") == 16
    # prefill: scheduled 100.5 to each choice's first token at 101; decode: to each one's last, 102 and 104
    assert sample("tokenmill:request_prefill_time_seconds_sum") == 0.5 + 0.5
    assert sample("tokenmill:request_prefill_time_seconds_count") == 2
    assert sample("tokenmill:request_decode_time_seconds_sum") == 1.0 + 3.0
    assert sample("tokenmill:request_inference_time_seconds_sum") == 1.5 + 3.5
    assert sample("tokenmill:request_params_n_count") == 2 and sample("tokenmill:request_params_n_sum") == 2 + 1
    assert sample("tokenmill:request_max_num_generation_tokens_sum") == 4 + 0


def test_queue_time_and_finish_reason_of_sequences_that_end_unfinished():
    """The queue time is observed when a sequence finishes, as vLLM's: one aborted after its first scheduling
    but before its first token had none (it was observed with a first token only); one aborted while
    queued has none. A request that ran and then failed (its grammar too slow, the engine dead) counted as
    an abort, vLLM's reason for a client that went away: it is an "error", a series there from the start."""
    from tokenmill.engine.async_engine import RequestAbortedError
    from tokenmill.engine.metrics import ServerMetrics
    from tokenmill.engine.request_stream import RequestStream
    from tokenmill.outputs import RequestMetrics
    from tokenmill.sampling_params import SamplingParamError

    metrics = ServerMetrics("m", lambda: {})
    assert _metric_sample(metrics, "tokenmill:request_success_total", {"finished_reason": "error"}) == 0
    metrics.observe_output(RequestStream(metrics=RequestMetrics(100.0, first_scheduled_time=100.25)), None, 101.0)
    metrics.observe_output(RequestStream(metrics=RequestMetrics(100.0, first_scheduled_time=100.5),
                                   error=RequestAbortedError("aborted")), None, 101.0)
    metrics.observe_output(RequestStream(metrics=RequestMetrics(100.0, first_scheduled_time=100.5),
                                   error=SamplingParamError("structured_outputs.regex", "too slow")), None, 102.0)
    metrics.observe_output(RequestStream(metrics=RequestMetrics(100.0)), None, 103.0)

    def sample(name, labels=None):
        return _metric_sample(metrics, name, labels)
    assert sample("tokenmill:request_queue_time_seconds_count") == 3
    assert sample("tokenmill:request_queue_time_seconds_sum") == 0.25 + 0.5 + 0.5
    assert sample("tokenmill:request_prefill_time_seconds_count") == 0
    assert [sample("tokenmill:request_success_total", {"finished_reason": r}) for r in ("abort", "error")] == [3, 1]
    assert sample("tokenmill:e2e_request_latency_seconds_sum") == 1.0 + 1.0 + 2.0 + 3.0


def test_a_request_the_core_refuses_is_no_request_in_the_metrics(qwen3_dir):
    """A request the engine core refuses (priority under fcfs: the client's 400) counted as
    request_success{finished_reason="abort"} with an e2e latency, as if it had run and been cut; one
    aborted after it started still counts as an abort."""
    from tokenmill.engine.async_engine import RequestAbortedError
    from tokenmill.engine.metrics import ServerMetrics
    from tokenmill.sampling_params import SamplingParamError

    engine = _async_engine(qwen3_dir)
    metrics = ServerMetrics("m", lambda: {})
    engine.on_output = metrics.observe_output

    async def main():
        engine.attach()
        with pytest.raises(SamplingParamError, match="priority"):
            await anext(engine.generate("refused", [5, 6, 7], SamplingParams(max_tokens=5), priority=3))
        with pytest.raises(RequestAbortedError):
            async for _ in engine.generate("cut", [5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True)):
                engine.abort("cut")
    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    assert [metrics.finished.labels("m", r)._value.get() for r in ("stop", "length", "abort")] == [0, 0, 1]
    assert metrics.e2e._sum.get() > 0 and sum(b.get() for b in metrics.e2e._buckets) == 1


def test_a_prompt_counts_once_it_is_prefilled(qwen3_dir):
    llm = LLM(qwen3_dir, device="cpu", dtype="float32", block_size=4, max_num_seqs=1, num_kv_blocks=40)
    engine = llm.engine
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request("b", list(range(10, 30)), SamplingParams(max_tokens=3, ignore_eos=True))
    assert engine.get_stats()["prompt_tokens"] == 0
    engine.step()
    engine.abort_request("b")                  # never scheduled: its 20 tokens were never prefilled
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats()["prompt_tokens"] == 3


def test_the_offline_api_as_vllm_users_call_it(qwen3_dir, tmp_path):
    """vLLM's LLM as its users call it: the tokenizer's apply_chat_template(..., tokenize=False) and HF's
    attributes (a TypeError and AttributeErrors), seed=None and the arguments that change nothing here
    (TypeErrors about EngineConfig), lora_request=None, the model's max_new_tokens as the default budget;
    and a generate interrupted (Ctrl-C) left its requests in the engine, which the next call ran first; a
    request added through llm_engine beside generate was numbered as generate numbered its own (both from 0),
    and the step reports name requests by that number: generate's output took the other's tokens too."""
    import json
    import shutil
    model = tmp_path / "m"
    shutil.copytree(qwen3_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3, "temperature": 0.5}))
    llm = LLM(str(model), device="cpu", dtype="float32", seed=None, trust_remote_code=True,
              disable_log_stats=True, revision=None, data_parallel_size=1, max_model_len=64, num_kv_blocks=64,
              block_size=4)
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    llm.llm_engine.add_request("side", [9, 9, 9, 9], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    beside = llm.generate([[5, 6, 7]], greedy)[0].outputs[0].token_ids
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    assert beside == llm.generate([[5, 6, 7]], greedy)[0].outputs[0].token_ids
    tok = llm.get_tokenizer()
    chat = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str) and tok.apply_chat_template(chat, tokenize=True) == tok.encode(
        text, add_special_tokens=False)
    assert tok.eos_token_id is not None and len(tok) == tok.vocab_size and tok("hi")["input_ids"]
    defaults = llm.get_default_sampling_params()
    assert (defaults.max_tokens, defaults.temperature) == (3, 0.5)
    assert len(llm.generate([[5, 6, 7]], lora_request=None)[0].outputs[0].token_ids) <= 3
    with pytest.raises(TypeError, match=r"LLM\(\) got unknown engine arguments \['bogus'\]"):
        LLM(str(model), device="cpu", bogus=1)
    with pytest.raises(ValueError, match=r"LLM\(enable_lora=True\) is not supported"):
        LLM(str(model), device="cpu", enable_lora=True)
    with pytest.raises(ValueError, match=r"LLM\(data_parallel_size=2\) is not supported: .*--data-parallel-size N"):
        LLM(str(model), device="cpu", data_parallel_size=2)

    calls = {"n": 0}
    process = llm.processor.process

    def interrupted(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return process(*args)
    llm.processor.process = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[5, 6, 7]] * 6, SamplingParams(max_tokens=40, ignore_eos=True))
    llm.processor.process = process
    assert not llm.engine.groups and len(llm.processor) == 0
    out = llm.generate([[8, 9]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 2 and not llm.engine.groups


def test_while_starting_runs_while_the_core_loads(qwen3_dir):
    """`AsyncLLM`'s `while_starting` (a server's app imports) runs while its core loads the model, not once the
    core is ready: a core that finishes loading only after it has run still starts."""
    import slow_engine
    from tokenmill.config import EngineConfig
    from tokenmill.engine.async_engine import AsyncLLM
    slow_engine.STARTING.clear()
    engine = AsyncLLM(EngineConfig(model=qwen3_dir, device="cpu", dtype="float32"), in_process=True,
                      engine_factory="slow_engine:loads_once_started", startup_timeout=30,
                      while_starting=slow_engine.STARTING.set)
    engine.shutdown()


def test_an_engine_is_freed_when_its_last_reference_goes(qwen3_dir):
    """No reference cycle holds a dead LLM's engine, runner and model (its weights and KV cache; on a GPU
    0.3-0.9 of it) until a collection: the parts the engine holds refer back to it by proxy."""
    import gc
    import weakref
    llm = LLM(qwen3_dir, device="cpu", dtype="float32", block_size=4, max_model_len=64, num_kv_blocks=40)
    llm.generate(["Hello"], SamplingParams(max_tokens=3))
    parts = [weakref.ref(o) for o in (llm.engine, llm.engine.runner, llm.engine.runner.model)]
    collecting = gc.isenabled()
    gc.disable()
    try:
        del llm
        assert [p() for p in parts] == [None, None, None]
    finally:
        if collecting:
            gc.enable()


def test_a_large_command_and_a_large_update_crossing_in_the_pipe_do_not_deadlock():
    """The event loop sent each tick's commands with a blocking write: a batch of prompts larger than the
    pipe's buffer, sent while the core was sending a step's large update (prompt logprobs), blocked both
    sides for good (the core reads no commands while it sends, the loop read no updates while it sent):
    every request hung. A sender thread writes now; the loop goes on reading."""
    import multiprocessing as mp
    import socket
    import threading
    import time
    from types import SimpleNamespace
    from tokenmill.engine.async_engine import AsyncLLM
    from tokenmill.engine.core_messages import AbortRequests, CoreReady, CoreUpdate

    ours, core = mp.Pipe(duplex=True)
    ready = CoreReady(model_name="m", max_model_len=64, tokenizer_path=None, pid=os.getpid())
    engine = AsyncLLM(None, client=SimpleNamespace(conn=ours, index=0, count=1, ready=ready))
    heard: list = []

    def the_core():         # as core_proc's loop does: a step (no reading), its whole update, then commands
        time.sleep(0.5)
        core.send(CoreUpdate(stats={"pad": "u" * 8_000_000}))
        heard.extend(core.recv())
    peer = threading.Thread(target=the_core, daemon=True)
    # a deadlock ends in the pipe shut (both blocked writes fail), not in a hung test
    watchdog = threading.Timer(30, lambda: socket.socket(fileno=os.dup(core.fileno())).shutdown(socket.SHUT_RDWR))
    watchdog.start()

    async def main():
        engine.attach()
        engine._send(AbortRequests(["c" * 8_000_000]))     # sent while the core steps
        async with asyncio.timeout(30):
            while engine._stats.get("pad") is None and not engine.dead:
                await asyncio.sleep(0.05)
        return engine._stats.get("pad")
    try:
        peer.start()
        pad = asyncio.run(main())
        peer.join(30)
    finally:
        watchdog.cancel()
        engine.shutdown(timeout=1)
    assert engine.dead == "the engine was shut down"
    assert pad is not None and len(pad) == 8_000_000
    assert [len(cmd.request_ids[0]) for cmd in heard] == [8_000_000]


def test_the_pipe_sender_never_blocks_its_writer_and_keeps_the_order():
    """Messages to a side that reads nothing (an API server whose loop stalled, for the engine core) wait
    in order for the writer thread, their bytes counted: the writer goes on (the core's steps for the
    other API servers); once read, all arrive in order. A pipe that closes fails the sender once."""
    import multiprocessing as mp
    import socket
    import time
    from tokenmill.engine.pipe_sender import PipeSender

    ours, theirs = mp.Pipe(duplex=True)
    errors = []
    sender = PipeSender(ours, errors.append, "test-sender")
    t0 = time.monotonic()
    for i in range(40):
        sender.send((i, "x" * 100_000))     # 4 MB, twenty times the pipe's buffer
    sender.send((40, "small"))
    assert time.monotonic() - t0 < 2 and sender.backlog > 3_000_000
    assert [theirs.recv()[0] for _ in range(41)] == list(range(41))
    deadline = time.monotonic() + 5
    while sender.backlog and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sender.backlog == 0 and not errors
    sender.send("direct")                   # an empty queue and room in the pipe: written at once
    assert theirs.poll(0) and theirs.recv() == "direct"
    socket.socket(fileno=os.dup(theirs.fileno())).shutdown(socket.SHUT_RDWR)
    theirs.close()
    for _ in range(3):
        sender.send("lost")
    sender.close(5)
    assert sender.failed and len(errors) == 1 and isinstance(errors[0], OSError)
