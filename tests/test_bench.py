import json
import os

import numpy as np
import pytest

from tokenmill.bench.datasets import (load_requests, parse_range, random_requests, sampleable_token_ids,
                                      save_requests, sharegpt_requests)
from tokenmill.bench.roofline import Hardware, ModelCost, roofline_floor
from tokenmill.config import ModelConfig
from tokenmill.models.presets import PRESETS


def test_random_requests_deterministic_and_in_range():
    a = random_requests(50, (3, 9), (2, 5), vocab_size=1000, specials={0, 998, 999}, seed=7)
    b = random_requests(50, (3, 9), (2, 5), vocab_size=1000, specials={0, 998, 999}, seed=7)
    c = random_requests(50, (3, 9), (2, 5), vocab_size=1000, specials={0, 998, 999}, seed=8)
    assert a == b and a != c
    assert all(3 <= r.prompt_len <= 9 and 2 <= r.output_len <= 5 for r in a)
    ids = np.concatenate([r.prompt_token_ids for r in a])
    assert ids.min() >= 1 and ids.max() < 998
    assert {r.prompt_len for r in a} == set(range(3, 10))     # the upper bound is inclusive


def test_sampleable_ids_skip_specials():
    ids = sampleable_token_ids(100, {3, 90, 95})
    assert 3 not in ids and ids.max() == 89 and len(ids) == 89


def test_parse_range():
    assert parse_range("100,1024") == (100, 1024) and parse_range("32") == (32, 32)
    with pytest.raises(ValueError):
        parse_range("9,3")


def test_requests_roundtrip_and_sharegpt(tmp_path):
    reqs = random_requests(3, (2, 4), (1, 2), 50, seed=0)
    save_requests(reqs, tmp_path / "r.json")
    assert load_requests(tmp_path / "r.json") == reqs

    class WordTokenizer:
        def encode(self, text, add_special_tokens=False):
            return [len(w) for w in text.split()]

    data = [{"conversations": [{"from": "human", "value": "a b c d e"}, {"from": "gpt", "value": "x y z w"}]},
            {"conversations": [{"from": "human", "value": "too short"}, {"from": "gpt", "value": "p q r s"}]},
            {"conversations": [{"from": "gpt", "value": "no human turn at all"}]}]
    (tmp_path / "sg.json").write_text(json.dumps(data))
    out = sharegpt_requests(str(tmp_path / "sg.json"), WordTokenizer(), num_prompts=10)
    assert [(r.prompt_len, r.output_len) for r in out] == [(5, 4)]


def test_roofline_hand_computed():
    cost = ModelCost(weight_bytes=1000.0, matmul_params=100, lm_head_params=10, kv_bytes_per_token=4,
                     attn_flops_per_pair=8)
    hw = Hardware(memory_bandwidth=1000.0, matmul_flops=1000.0)
    # Step 1: prefill 3 tokens -> bytes 1000 + 4*3 = 1012, flops 600 + 20 + 8*6 = 668 -> 1.012 s.
    # Step 2: decode at context 3 -> bytes 1000 + 4*4 = 1016, flops 200 + 20 + 8*4 = 252 -> 1.016 s.
    floor = roofline_floor([3], [2], cost, max_num_seqs=4, max_num_batched_tokens=100, hw=hw)
    assert floor.num_steps == 2 and floor.seconds == pytest.approx(2.028)
    assert floor.total_flops == pytest.approx(668 + 252)

    # Compute-bound prefill chunked by the token budget (5 = 2 + 2 + 1), then one decode.
    big = ModelCost(weight_bytes=0.0, matmul_params=1000, lm_head_params=0, kv_bytes_per_token=0,
                    attn_flops_per_pair=0)
    floor = roofline_floor([5], [2], big, max_num_seqs=1, max_num_batched_tokens=2, hw=hw)
    assert floor.num_steps == 4 and floor.seconds == pytest.approx(2 * (2 + 2 + 1 + 1))

    # max_num_seqs=1 serialises two one-token requests: two steps of pure weight reads.
    floor = roofline_floor([1, 1], [1, 1], cost, max_num_seqs=1, hw=hw)
    assert floor.num_steps == 2
    floor = roofline_floor([1, 1], [1, 1], cost, max_num_seqs=2, hw=hw)
    assert floor.num_steps == 1


def test_roofline_real_model_figures():
    mc = ModelConfig.from_hf(PRESETS["qwen3-4b"])
    cost = ModelCost.from_model_config(mc)
    assert ModelCost.num_params(mc) == 4_022_468_096
    assert cost.kv_bytes_per_token == 144 * 1024
    assert 1e3 * cost.weight_bytes / 4.3e12 == pytest.approx(1.87, abs=0.01)


def test_roofline_quantized_costs():
    """FP8 projections are a byte a parameter at twice the FLOP rate, 4-bit ones half a byte plus a group's
    scale and zero; the head, embedding and norms stay 16-bit; an FP8 cache halves the bytes a token."""
    mc = ModelConfig.from_hf(PRESETS["qwen3-4b"])
    bf16 = ModelCost.from_model_config(mc)
    fp8 = ModelCost.from_model_config(mc, quantization="fp8", kv_cache_dtype="fp8")
    awq = ModelCost.from_model_config(mc, quantization="awq", group_size=64)
    rest = bf16.weight_bytes - 2 * bf16.matmul_params
    assert fp8.weight_bytes == pytest.approx(rest + bf16.matmul_params)
    assert awq.weight_bytes == pytest.approx(rest + bf16.matmul_params * (0.5 + 2.5 / 64))
    assert 2 * fp8.kv_bytes_per_token == bf16.kv_bytes_per_token == awq.kv_bytes_per_token
    assert (bf16.matmul_rate, fp8.matmul_rate, awq.matmul_rate) == (1.0, 2.0, 1.0)
    # batch-1 decode: the FP8 projections and the bf16 tied head, 4.4 GB
    assert 1e3 * fp8.weight_bytes / 4.3e12 == pytest.approx(1.03, abs=0.01)
    with pytest.raises(ValueError, match="int3"):
        ModelCost.from_model_config(mc, quantization="int3")


def test_roofline_matmul_rate_speeds_the_projections_only():
    hw = Hardware(memory_bandwidth=1000.0, matmul_flops=1000.0)
    # one compute-bound step: a 5-token prompt, its last chunk sampling the one output token;
    # projections 2 * 1000 * 5 = 10,000 flops, attention 8 * 15 pairs = 120
    plain = ModelCost(weight_bytes=0.0, matmul_params=1000, lm_head_params=0, kv_bytes_per_token=0,
                      attn_flops_per_pair=8)
    fast = ModelCost(**{**plain.__dict__, "matmul_rate": 2.0})
    assert roofline_floor([5], [1], plain, hw=hw).seconds == pytest.approx(10.12)
    floor = roofline_floor([5], [1], fast, hw=hw)
    assert floor.seconds == pytest.approx(5.12) and floor.total_flops == pytest.approx(10_120)


def test_bench_weight_format_follows_the_engine():
    from tokenmill.bench.throughput_run import _weight_format
    from tokenmill.quant.formats import Fp8Config, W4Config

    assert _weight_format(None, None) == (None, 128)
    assert _weight_format("fp8", None) == ("fp8", 128)
    assert _weight_format(None, Fp8Config((128, 128), "compressed-tensors"))[0] == "fp8"
    assert _weight_format(None, W4Config("gptq", 64)) == ("gptq", 64)
    assert _weight_format(None, W4Config("awq", 32)) == ("awq", 32)


def _args(tmp_path, backend, extra=()):
    return ["throughput", "--model", "preset:test-tiny", "--backend", backend, "--num-prompts", "5",
            "--input-len-range", "4,12", "--output-len-range", "2,6", "--dtype", "float32", "--device", "cpu",
            "--output-dir", str(tmp_path), "--name", "run", "--no-progress", "--hf-batch-size", "2", *extra]


@pytest.fixture(scope="module")
def preset_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("preset-cache"))


@pytest.fixture
def tiny_cache(preset_cache, monkeypatch):
    """A preset cache of the module's own: the first test builds preset:test-tiny, the next one reuses it."""
    monkeypatch.setenv("TOKENMILL_CACHE", preset_cache)


def _check(tmp_path, backends):
    with open(os.path.join(tmp_path, "run.json")) as f:
        summary = json.load(f)
    assert [r["backend"] for r in summary["results"]] == backends
    for r in summary["results"]:
        assert r["output_tok_s"] > 0 and r["time_to_ready_s"] > 0 and r["num_short_outputs"] == 0
        assert r["output_tokens"] == summary["workload"]["output_tokens"]
        assert r["measured_over_floor"] > 0
    assert os.path.isfile(os.path.join(tmp_path, "run.md"))
    return summary


def test_bench_hf_static_in_process(tmp_path, tiny_cache):
    from tokenmill.bench.cli import main

    assert main(_args(tmp_path, "hf-static", ["--in-process"])) == 0
    _check(tmp_path, ["hf-static"])


def test_bench_tokenmill_and_hf_static_subprocesses(tmp_path, tiny_cache):
    pytest.importorskip("tokenmill.llm")
    from tokenmill.bench.cli import main

    assert main(_args(tmp_path, "tokenmill,hf-static", ["--subset", "3"])) == 0
    summary = _check(tmp_path, ["tokenmill", "hf-static"])
    tm = summary["results"][0]
    assert tm["peak_blocks_used"] > 0 and summary["workload"]["num_requests"] == 3
    assert "hf-static" in tm["output_tok_s_vs"]


def test_bench_tokenmill_quantization_reaches_the_engine(tmp_path, tiny_cache):
    """`--quantization` as `serve` takes it: fp8 quantizes the preset at load and is recorded with the result;
    a format the checkpoint is not in is refused by the engine, naming it."""
    pytest.importorskip("tokenmill.llm")
    from tokenmill.bench.cli import main

    assert main(_args(tmp_path, "tokenmill", ["--in-process", "--quantization", "fp8",
                                               "--cuda-graph-max-tokens", "4096"])) == 0
    summary = _check(tmp_path, ["tokenmill"])
    assert summary["engine_args"]["cuda_graph_max_tokens"] == 4096
    assert summary["results"][0]["quantization"] == "fp8"
    # the floor is the FP8 weights' (a byte a projection parameter against float32's four)
    assert summary["roofline"]["weights"] == "fp8" and summary["roofline"]["matmul_rate"] == 2.0
    with pytest.raises(ValueError, match="awq"):
        main(_args(tmp_path, "tokenmill", ["--in-process", "--quantization", "awq"]))
