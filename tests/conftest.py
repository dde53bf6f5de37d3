"""Tiny random-weight models of each architecture, saved with `save_pretrained` and loaded back
through tokenmill's own loader. No network, no GPU."""
from __future__ import annotations

import gc
import os
import signal

import pytest
import torch

# The files that take longest on the 2-core CI machine, longest first, collected before the rest: `-n 2
# --dist loadfile` hands whole files to the two workers in the order of its queue, and a long file handed
# out last leaves one worker running it alone while the other has finished. xdist orders that queue by
# each file's number of tests unless told not to (`pytest_configure` below), which put the longest file,
# of three tests, near the end. Every file of 6 s or more is listed (measured 2026-12), so that the files
# handed out last are short: test_tensor_parallel.py (12 s), unlisted, ran while the other worker had finished.
LONGEST_FIRST = ("test_real_quantized.py", "test_fp8_gemm.py", "test_hardening.py", "test_ui.py",
                 "test_tiny_model.py", "test_server.py", "test_real_model.py", "test_api_server_count.py",
                 "test_openai_api.py", "test_bench_serve.py", "test_agent_api.py", "test_sampling_kernel.py",
                 "test_tensor_parallel.py", "test_bench.py", "test_deploy.py", "test_data_parallel.py",
                 "test_decode_attention.py", "test_model_paths.py", "test_cli.py", "test_gemv_whole.py",
                 "test_gguf.py", "test_generation_config.py", "test_engine_api.py")


def pytest_configure(config):
    # the Ctrl-C tests send SIGINT to this process and to the processes it starts, which inherit its
    # disposition; a shell without job control starts a command run in the background with SIGINT ignored
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    # an xdist worker's share of the cores for torch's intra-op threads: two workers of two threads each on
    # two cores wait on each other's threads (see `one_torch_thread`)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_collectreport(report):
    # what collection imports and builds (torch, transformers, the test modules) lives until the session
    # ends: frozen as each collector finishes, the garbage collector's full passes no longer scan it (they
    # were half of a worker's collection time: 6.0 of 12.2 s, 23 passes)
    gc.freeze()


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))      # stable: the rest keep their order


# Files that share a session fixture too costly to build once per worker, and the fixture: `--dist loadfile`
# hands each group to one worker as one unit of work (its files in the queue's order), where the fixture is
# built once. The default model's server (`default_server`, ~13 s of a worker's time) was started by both.
SHARED_SESSION_FIXTURE = {"test_ui.py": "default_server", "test_tiny_model.py": "default_server"}


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LoadFileSharingFixtures(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return SHARED_SESSION_FIXTURE.get(os.path.basename(path), path)
    return LoadFileSharingFixtures(config, log)


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_TEXT = (
    "The quick brown fox jumps over the lazy dog. PagedAttention keeps the KV cache in blocks. "
    "def main():\n    return 42\n"
    "你好，世界！这是一个测试。模型服务很快。 😀🚀 café naïve façade "
    "Continuous batching lets requests join and leave the batch at every step. "
) * 4


def make_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_TEXT], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.add_tokens(["<think>", "</think>"])      # one token each, as in Qwen3's vocabulary (not special)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def make_model(path: str, arch: str, vocab_size: int = 512, **overrides) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    from transformers import Qwen3Config, Qwen3ForCausalLM
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, eos_token_id=2, bos_token_id=None, pad_token_id=0)
    if arch == "llama":
        # Nanbeige-like: GQA group 5 (not a power of two), untied head, no q/k norm
        common.update(num_attention_heads=10, num_key_value_heads=2, hidden_size=80, head_dim=8,
                      tie_word_embeddings=False, rope_theta=70000.0)
        cfg_cls, model_cls = LlamaConfig, LlamaForCausalLM
    elif arch == "qwen2":
        common.update(tie_word_embeddings=False, rope_theta=10000.0)
        cfg_cls, model_cls = Qwen2Config, Qwen2ForCausalLM
    else:
        common.update(head_dim=16, tie_word_embeddings=True, rope_theta=1e6)
        cfg_cls, model_cls = Qwen3Config, Qwen3ForCausalLM
    common.update(overrides)
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**common))
    with torch.no_grad():   # larger weights than the default init, so greedy paths are not flat
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            elif "bias" in name:
                p.normal_(0, 0.1)
    model.save_pretrained(path)


@pytest.fixture(scope="session")
def save_tiny_model():
    """`make_model`, for tests that save variants of their own (test files cannot import this conftest by
    name: tests/kernels has one too)."""
    return make_model


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tokenizer"))
    make_tokenizer(path)
    return path


@pytest.fixture(scope="session", params=["llama", "qwen2", "qwen3"])
def model_dir(request, tmp_path_factory, tokenizer_dir):
    path = str(tmp_path_factory.mktemp(f"tiny-{request.param}"))
    make_model(path, request.param)
    for f in os.listdir(tokenizer_dir):
        with open(os.path.join(tokenizer_dir, f), "rb") as src, open(os.path.join(path, f), "wb") as dst:
            dst.write(src.read())
    return path


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory, tokenizer_dir):
    path = str(tmp_path_factory.mktemp("tiny-qwen3-chat"))
    make_model(path, "qwen3")
    for f in os.listdir(tokenizer_dir):
        with open(os.path.join(tokenizer_dir, f), "rb") as src, open(os.path.join(path, f), "wb") as dst:
            dst.write(src.read())
    return path


@pytest.fixture(scope="session")
def default_server(tmp_path_factory):
    """One `tokenmill serve` with no model argument (the default model) for the whole session; the tests
    that talk to it (test_tiny_model, test_ui) only read from it."""
    from test_tiny_model import DefaultServer
    server = DefaultServer(tmp_path_factory.mktemp("default-server"), "--num-kv-blocks", "128",
                           "--max-model-len", "512")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def qwen3_long_dir(tmp_path_factory, tokenizer_dir):
    """The chat Qwen3 with a 2,048-token context (tool schemas take many of the 400-token vocabulary's tokens)."""
    path = str(tmp_path_factory.mktemp("tiny-qwen3-long"))
    make_model(path, "qwen3", max_position_embeddings=2048)
    for f in os.listdir(tokenizer_dir):
        with open(os.path.join(tokenizer_dir, f), "rb") as src, open(os.path.join(path, f), "wb") as dst:
            dst.write(src.read())
    return path


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of small models: on a shared 2-core runner a second intra-op thread made the engine
    7x slower (waiting, not computing)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
