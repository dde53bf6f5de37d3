"""The model's sampling defaults (its generation_config.json), as vLLM applies them: requests that leave
temperature, top_p, top_k, min_p or repetition_penalty unset take the model's values, through the server
(`--generation-config`, `--override-generation-config`) and the offline API's default SamplingParams."""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from tokenmill import LLM
from tokenmill.generation_config import sampling_defaults
from test_server import ServerProcess

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Qwen3-4B's own recommendation, with keys the defaults do not read beside it
QWEN3_LIKE = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": [2, 1],
              "max_new_tokens": 32768, "transformers_version": "4.51.0"}


def with_generation_config(src: str, dst: str, config: dict) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "generation_config.json")) as f:
        merged = {**json.load(f), **config}
    with open(os.path.join(dst, "generation_config.json"), "w") as f:
        json.dump(merged, f)
    return dst


def test_defaults_are_read_from_the_model_a_directory_or_overrides(tmp_path, qwen3_dir):
    model = with_generation_config(qwen3_dir, str(tmp_path / "m"), QWEN3_LIKE)
    assert sampling_defaults("auto", model) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert sampling_defaults("vllm", model) == {}
    assert sampling_defaults("auto", qwen3_dir) == {}                  # a file without sampling keys
    assert sampling_defaults("auto", "preset:qwen3-4b") == {}           # no directory at all
    assert sampling_defaults(model, qwen3_dir) == sampling_defaults("auto", model)
    assert sampling_defaults("auto", model, {"temperature": 0, "min_p": 0.1}) == {
        "temperature": 0, "top_p": 0.95, "top_k": 20, "min_p": 0.1}
    with pytest.raises(ValueError, match="no generation_config.json there"):
        sampling_defaults(str(tmp_path), model)
    with pytest.raises(ValueError, match="unknown key 'temprature'"):
        sampling_defaults("auto", model, {"temprature": 0.5})
    with pytest.raises(ValueError, match="top_p"):
        sampling_defaults("auto", model, {"top_p": 1.5})
    # a value of another type was SamplingParams' TypeError ("'>=' not supported between instances of
    # 'str' and 'int'"), naming no key; true was taken as temperature 1
    for bad, shown in (("hot", '"hot"'), (True, "true"), ([0.5], "[0.5]")):
        with pytest.raises(ValueError, match=re.escape(f"the generation config's temperature must be a number, "
                                                       f"got {shown}")):
            sampling_defaults("auto", model, {"temperature": bad})
    # null, as vLLM reads it: no default for that key, not even the model's
    assert sampling_defaults("auto", model, {"top_k": None}) == {"temperature": 0.6, "top_p": 0.95}
    # vLLM's server caps max_tokens by it; this one does not, and says so rather than "unknown key"
    with pytest.raises(ValueError, match="max_new_tokens is not taken by the server"):
        sampling_defaults("auto", model, {"max_new_tokens": 256})
    with open(os.path.join(model, "generation_config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="generation_config.json: Expecting property name"):
        sampling_defaults("auto", model)


def test_the_offline_api_samples_with_the_models_defaults(tmp_path, qwen3_dir):
    model = with_generation_config(qwen3_dir, str(tmp_path / "m"), {"temperature": 0.0})
    llm = LLM(model, device="cpu", dtype="float32")
    assert llm.get_default_sampling_params().temperature == 0.0
    from tokenmill import SamplingParams
    prompts = ["hello there", "the quick brown fox"]
    greedy = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))]
    assert [o.outputs[0].text for o in llm.generate(prompts)] == greedy
    assert LLM(qwen3_dir, device="cpu", dtype="float32").get_default_sampling_params().temperature == 1.0


def test_served_requests_take_the_defaults_they_leave_unset(tmp_path, qwen3_dir):
    """top_k 1 (greedy) from the model's file and a repetition penalty from --override-generation-config:
    a request that sets no sampling field decodes greedily under that penalty, one that sets its own
    fields samples with them. And --return-tokens-as-token-ids: the logprobs' tokens as "token_id:{id}"
    where a request leaves its own field unset, on chat, completions and Responses (which has no such
    field); a request's false wins."""
    model = with_generation_config(qwen3_dir, str(tmp_path / "m"), {"temperature": 0.7, "top_k": 1,
                                                                     "repetition_penalty": 1.0})
    server = ServerProcess(model, tmp_path, "--override-generation-config", '{"repetition_penalty": 1.5}',
                           "--return-tokens-as-token-ids")
    try:
        client = server.client()

        def text(**kw) -> str:
            return client.completions.create(model="tiny", prompt="hello", max_tokens=24, **kw).choices[0].text
        greedy = text(temperature=0, extra_body={"repetition_penalty": 1.5})
        assert text() == greedy and text(seed=3) == greedy
        assert text(temperature=0, extra_body={"repetition_penalty": 1.0}) != greedy
        sampled = {text(temperature=1.0, top_p=1.0, seed=s, extra_body={"top_k": 0}) for s in range(4)}
        assert sampled != {greedy} and len(sampled) > 1
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=24)
        again = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=24, temperature=0, extra_body={"repetition_penalty": 1.5})
        assert chat.choices[0].message.content == again.choices[0].message.content
        user = [{"role": "user", "content": "hi"}]
        chat = client.chat.completions.create(model="tiny", messages=user, max_tokens=4, logprobs=True, top_logprobs=1)
        assert all(e.token.startswith("token_id:") for e in chat.choices[0].logprobs.content)
        lps = client.completions.create(model="tiny", prompt="hello", max_tokens=4, logprobs=1).choices[0].logprobs
        assert all(t.startswith("token_id:") for t in lps.tokens)
        resp = client.responses.create(model="tiny", input=user, max_output_tokens=4, top_logprobs=1)
        entries = resp.output[-1].content[0].logprobs
        assert entries and all(e.token.startswith("token_id:") and e.top_logprobs[0].token.startswith("token_id:")
                               for e in entries)
        plain = client.completions.create(model="tiny", prompt="hello", max_tokens=4, logprobs=1,
                                          extra_body={"return_tokens_as_token_ids": False})
        assert not any(t.startswith("token_id:") for t in plain.choices[0].logprobs.tokens)
    finally:
        assert server.stop() == 0, server.log_path.read_text()[-3000:]


@pytest.mark.parametrize("args,message", [
    (["--generation-config", "/nonexistent"], "--generation-config '/nonexistent': no generation_config.json"),
    (["--override-generation-config", '{"temprature": 1}'], "unknown key 'temprature'"),
    (["--override-generation-config", "[1]"], "takes a JSON object"),
])
def test_bad_generation_configs_are_refused_before_the_model_loads(args, message, qwen3_dir, monkeypatch, capsys):
    """`tokenmill serve` in this process (a subprocess spent ~4 s importing torch for each case): the usage
    error comes before `run_server`, which loads the model, is reached."""
    import tokenmill.server.launch as launch
    from tokenmill import cli

    def no_server(*a, **kw):
        raise AssertionError("the server was started")
    monkeypatch.setattr(launch, "run_server", no_server)
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", qwen3_dir, "--device", "cpu", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err, err


@pytest.mark.parametrize("text,message", [
    ("{not json", r"generation_config\.json: Expecting property name"),
    ("[1, 2]", r"generation_config\.json: not a JSON object"),
    (json.dumps({"eos_token_id": ["<|im_end|>"]}), r"generation_config\.json's eos_token_id must be a token id or "
                                                    r"a list of them \(integers >= 0\), got \[\"<\|im_end\|>\"\]"),
    (json.dumps({"eos_token_id": -1}), r"eos_token_id must be .*, got -1"),
])
def test_a_generation_config_the_engine_cannot_read_is_named(tmp_path, qwen3_dir, text, message):
    """Its EOS ids are read when the engine starts: a file that is not JSON was a bare JSONDecodeError, a list
    an AttributeError, and an EOS given as a token's text joined the stop ids where no sampled id matches it."""
    d = shutil.copytree(qwen3_dir, tmp_path / "model")
    (d / "generation_config.json").write_text(text)
    with pytest.raises(ValueError, match=message):
        LLM(str(d), device="cpu", dtype="float32", num_kv_blocks=8)
