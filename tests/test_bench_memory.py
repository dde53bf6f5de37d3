"""`tokenmill bench memory`: the paged cache's measured peak against the bytes the tokens need and against a
static per-request reservation, the maximum-concurrency formulas, and the files the command writes. A tiny
random Qwen3 and a Nanbeige-like Llama, saved with `save_pretrained` and run through the real engine."""
import json
import math
import os

import pytest

from tokenmill.bench.cli import main
from tokenmill.bench.memory import Workload, blocks_per_request, concurrency, gpu_kv_budget, make_workloads
from tokenmill.config import ModelConfig
from tokenmill.models.presets import PRESETS

GIB = 2**30
# small workloads of the three shapes; 4 output tokens each
TINY = ["--num-concurrent", "4", "--concurrent-len-range", "20,120", "--num-mixed", "6", "--mixed-len-range",
        "10,500", "--num-long", "3", "--long-len", "512", "--output-len", "4", "--max-model-len", "512",
        "--device", "cpu", "--dtype", "float32", "--block-size", "16"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A Nanbeige-shaped Llama: GQA group 5, untied head (conftest's `model_dir` would run all three)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = str(tmp_path_factory.mktemp("tiny-llama-memory"))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=80, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=10, num_key_value_heads=2, head_dim=8,
                                 max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=2,
                                 bos_token_id=None, pad_token_id=0)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def study(tmp_path_factory, qwen3_dir, llama_dir, one_torch_thread):
    out = tmp_path_factory.mktemp("memory")
    assert main(["memory", "--model", f"{qwen3_dir},{llama_dir}", *TINY, "--in-process", "--output-dir", str(out),
                 "--name", "run"]) == 0
    with open(out / "run.json") as f:
        return out, json.load(f)


def test_workloads_lengths_and_seed():
    ws = make_workloads((10, (500, 2000)), (32, (50, 8000)), (8, 8192), output_len=16, seed=0)
    assert [w.name for w in ws] == ["concurrent", "mixed", "long"]
    assert make_workloads((10, (500, 2000)), (32, (50, 8000)), (8, 8192), 16, seed=0) == ws
    assert len(ws[0].lengths) == 10 and all(500 <= n <= 2000 for n in ws[0].lengths)
    assert len(ws[1].lengths) == 32 and all(50 <= n <= 8000 for n in ws[1].lengths)
    # log-uniform: the median is near the geometric mean of the range (632), far below the midpoint
    assert 200 < sorted(ws[1].lengths)[16] < 2000
    assert ws[2].lengths == (8192,) * 8
    w = Workload("w", "", (17, 33), output_len=4)
    assert w.kv_tokens == 48 and w.prompt_tokens == 42 and w.paged_blocks(16) == 1 + 2
    assert [len(p) for p in w.prompts(100, {0, 99}, seed=0)] == [13, 29]
    with pytest.raises(ValueError):
        make_workloads((1, (10, 20)), (1, (4, 20)), (1, 64), output_len=4)


def test_measured_peak_holds_the_needed_bytes_within_a_block_per_request(study):
    _, summary = study
    assert [m["model"] for m in summary["models"]] == [summary["models"][0]["model"], summary["models"][1]["model"]]
    for m in summary["models"]:
        t = m["kv_bytes_per_token"]
        block = 16 * t
        assert m["device_budget"]["block_bytes"] == block
        for r, w in zip(m["workloads"], summary["workloads"]):
            assert r["source"] == "measured" and r["num_preemptions"] == 0
            assert r["needed_bytes"] == sum(n - 1 for n in w["lengths"]) * t
            assert r["needed_bytes"] <= r["paged_bytes"] <= r["needed_bytes"] + r["num_requests"] * block
            # the engine's peak is exactly the blocks each request's K/V fills
            assert r["paged_blocks"] == r["paged_blocks_formula"] == sum(
                blocks_per_request(n, 16) for n in w["lengths"])
            assert r["static_longest_bytes"] == len(w["lengths"]) * max(w["lengths"]) * t
            assert r["static_max_model_len_bytes"] == len(w["lengths"]) * 512 * t
            assert r["static_max_model_len_waste"] == pytest.approx(1 - r["needed_bytes"] / r["static_max_model_len_bytes"])
            assert r["paged_saving_vs_longest"] == pytest.approx(1 - r["paged_bytes"] / r["static_longest_bytes"])
        long = m["workloads"][2]
        assert long["paged_blocks"] == 3 * 32 and long["static_max_model_len_bytes"] == 3 * 512 * t


def test_cli_writes_json_and_markdown(study):
    out, summary = study
    assert summary["git_commit"] and summary["date"] and summary["command"].startswith("tokenmill bench memory")
    assert summary["hardware"].startswith("cpu") and summary["settings"]["max_model_len"] == 512
    text = (out / "run.md").read_text()
    assert "## KV memory: paged vs static" in text and "(measured)" in text and "24 GiB (computed)" in text
    assert text.count("| concurrent |") == 2
    again = out / "again"
    assert main(["memory", "--replot", str(out / "run.json"), "--output-dir", str(again), "--name", "re"]) == 0
    assert (again / "re.md").read_text() == text.replace("run.png", "re.png")


def test_device_concurrency_uses_the_engines_blocks(study):
    _, summary = study
    for m in summary["models"]:
        b, c = m["device_budget"], m["device_concurrency"]
        assert c["num_blocks"] == b["num_blocks"]
        assert c["paged_long"] == b["num_blocks"] // blocks_per_request(512, 16)
        assert c["static_max_model_len"] == b["kv_budget_bytes"] // (512 * m["kv_bytes_per_token"])
        rows = {r["workload"]: r for r in m["workloads"]}
        assert c["paged_mixed"] == b["num_blocks"] * 6 // rows["mixed"]["paged_blocks"]


def test_concurrency_formulas_by_hand():
    rows = [{"workload": "a", "num_requests": 2, "paged_blocks": 5, "paged_bytes": 5 * 16 * 10,
             "static_max_model_len_bytes": 2 * 64 * 10}]
    c = concurrency(1000 * 16 * 10 + 7, rows, block_size=16, kv_bytes_per_token=10, max_model_len=64,
                    model_context=256)
    assert c["num_blocks"] == 1000 and c["paged_a"] == 1000 * 2 // 5
    assert c["static_max_model_len"] == (1000 * 16 * 10 + 7) // (64 * 10) and c["static_model_context"] == 62
    assert c["fits_paged_a"] and c["fits_static_max_model_len_a"]


def test_24_gib_figures_of_the_presets(tmp_path):
    """Computed without an engine: qwen3-4b's 4,022,468,096 bf16 parameters and 144 KiB per token."""
    assert main(["memory", "--compute-only", "--output-dir", str(tmp_path), "--name", "c"]) == 0
    summary = json.loads((tmp_path / "c.json").read_text())
    q = summary["models"][0]
    assert q["model"] == "preset:qwen3-4b" and summary["models"][1]["model"] == "preset:nanbeige4.1-3b"
    g = q["gpu_computed"]
    budget = 24 * GIB * 0.9 - 4_022_468_096 * 2 - 2 * GIB
    assert g["kv_budget_bytes"] == pytest.approx(budget) == gpu_kv_budget(24, 0.9, 4_022_468_096 * 2, 2.0)
    t = ModelConfig.from_hf(PRESETS["qwen3-4b"]).kv_bytes_per_token
    assert t == 144 * 1024 and g["kv_bytes_per_token"] == t
    assert g["paged_long"] == int(budget // (16 * t)) // 512
    assert g["static_max_model_len"] == math.floor(budget / (8192 * t))
    assert g["static_model_context"] == math.floor(budget / (40960 * t))
    assert all(r["source"] == "computed" for r in q["workloads"])
    assert os.path.isfile(tmp_path / "c.md")
