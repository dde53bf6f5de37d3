"""tensor_parallel_size=2 on the CPU: two processes (rank 0 in the engine, one spawned worker) joined by a
gloo process group give the greedy tokens of one process and its logits within float32 rounding, on
the three architectures (llama with 10 query heads over 2 KV heads, qwen2 with biases, qwen3 with q/k
norms and a tied head); refusals name the value and the limit; no worker outlives its engine."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.cli import build_parser, engine_config
from tokenmill.config import EngineConfig, ModelConfig

from test_server import alive, cmdline

# a shared prefix, lengths 3 to 40 (several prefill chunks under max_num_batched_tokens=24), one token
PROMPTS = [[7, 3, 11], [5, 9, 13, 2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51],
           [5, 9, 13, 2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 60, 61, 62, 63],
           list(range(100, 140)), [300]]
ENGINE = dict(device="cpu", max_num_batched_tokens=24, num_kv_blocks=64, block_size=4)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def pair(request, tmp_path_factory, save_tiny_model):
    """One model directory of the architecture, with a one-process LLM and a tensor_parallel_size=2 one."""
    path = str(tmp_path_factory.mktemp(f"tp-{request.param}"))
    save_tiny_model(path, request.param)
    single = LLM(path, **ENGINE)
    split = LLM(path, tensor_parallel_size=2, **ENGINE)
    yield path, single, split
    split.engine.shutdown()


def _greedy(llm: LLM, max_tokens: int = 12) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def test_greedy_tokens_equal_one_process(pair):
    _, single, split = pair
    assert single.engine.runner.workers is None and len(split.engine.runner.workers.procs) == 1
    assert split.engine.runner.kv_cache.shape[4] == single.engine.runner.kv_cache.shape[4] // 2
    assert _greedy(split) == _greedy(single)


def _teacher_forced_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] at every position of `ids`, from the engine's own forward passes."""
    runner, rows = llm.engine.runner, {}

    def hook(requests, num_new, qsl, hidden):
        starts = qsl.tolist()
        for i, (req, n) in enumerate(zip(requests, num_new)):
            logits = runner.model.compute_logits(hidden[starts[i]:starts[i] + n])
            for j in range(n):
                rows[req.num_computed_tokens + j] = logits[j].clone()
    runner.hidden_hook = hook
    try:
        llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))
    finally:
        runner.hidden_hook = None
    return torch.stack([rows[i] for i in range(len(ids))])


def test_teacher_forced_logits_match_one_process(pair):
    _, single, split = pair
    ids = list(range(200, 250))
    ref, got = _teacher_forced_logits(single, ids), _teacher_forced_logits(split, ids)
    assert got.shape == (len(ids), 512)
    # only the order of the partial sums differs (o_proj, down_proj, the head's slices)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())


def test_refusals_name_the_value_and_the_limit(qwen3_dir):
    path = qwen3_dir
    cfg = ModelConfig.from_hf(path)
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"tensor_parallel_size must be >= 1, got {bad}"):
            EngineConfig(model=path, tensor_parallel_size=bad)
    assert cfg.num_key_value_heads == 2
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the model's num_key_value_heads=2"):
        EngineConfig(model=path, tensor_parallel_size=3).check_tensor_parallel(cfg, torch.device("cpu"))
    with pytest.raises(ValueError, match="tensor_parallel_size=2 runs on the CPU only.*not implemented"):
        EngineConfig(model=path, tensor_parallel_size=2).check_tensor_parallel(cfg, torch.device("cuda"))
    with pytest.raises(ValueError, match="preemption_mode 'swap' is not supported with tensor_parallel_size=2"):
        EngineConfig(model=path, tensor_parallel_size=2, preemption_mode="swap")
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide"):     # before any process starts
        LLM(path, device="cpu", tensor_parallel_size=3)
    # a plain checkpoint quantized at load: said 'is quantized' of a checkpoint that is not
    from tokenmill.runner.loader import load_model
    from tokenmill.runner.tensor_parallel import TensorParallel
    with pytest.raises(ValueError, match=r"would be quantized at load \(--quantization fp8\)"):
        load_model(path, cfg, torch.device("cpu"), torch.float32, "fp8", TensorParallel(0, 2))


def test_cli_flag_and_alias():
    _, subs = build_parser()
    for flag in ("--tensor-parallel-size", "-tp"):
        args = subs["serve"].parse_args(["m", flag, "2"])
        assert engine_config(args).tensor_parallel_size == 2
    assert engine_config(subs["serve"].parse_args(["m"])).tensor_parallel_size == 1


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_no_worker_outlives_its_engine(qwen3_dir):
    path = qwen3_dir
    # collected without a shutdown
    llm = LLM(path, tensor_parallel_size=2, **ENGINE)
    procs = list(llm.engine.runner.workers.procs)
    assert _greedy(llm, 2)
    del llm
    gc.collect()
    assert all(p.poll() is not None for p in procs)
    # rank 0's process killed
    script = textwrap.dedent(f"""
        import os, signal
        from tokenmill import LLM
        llm = LLM({path!r}, tensor_parallel_size=2, **{ENGINE!r})
        print(*(p.pid for p in llm.engine.runner.workers.procs), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    pids = [int(p) for p in out.stdout.split()]
    assert pids, out.stderr
    assert all(_gone(pid) for pid in pids)


def test_a_worker_that_cannot_allocate_its_kv_cache_fails_the_start(qwen3_dir, tmp_path, monkeypatch):
    """The worker's error reaches the engine's start (it was ready, and the first request died on a
    closed connection), and the worker exits 1 (a thread blocked in buffered stdin made it abort)."""
    from tokenmill.runner import tensor_parallel
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent("""
        import sys
        if "tokenmill.runner.tp_worker" in sys.orig_argv:
            import tokenmill.runner.model_runner as model_runner
            def kv_cache_tensors(*args, **kwargs):
                raise RuntimeError("cannot allocate memory (test)")
            model_runner.kv_cache_tensors = kv_cache_tensors
    """))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    procs = []
    start = tensor_parallel.TensorParallelWorkers.start
    monkeypatch.setattr(tensor_parallel.TensorParallelWorkers, "start",
                        lambda self, n: (procs.extend(self.procs), start(self, n)))
    with pytest.raises(RuntimeError, match=r"rank 1 failed to allocate its KV cache:(.|\n)*cannot allocate memory"):
        LLM(qwen3_dir, tensor_parallel_size=2, **ENGINE)
    gc.collect()
    assert procs and [p.wait(timeout=30) for p in procs] == [1]


def test_a_ctrl_c_inside_a_sharded_call_leaves_the_ranks_in_step(pair):
    """A Ctrl-C landing after rank 0 broadcast a call but before its collectives ended left the worker
    inside one: the next generate's broadcast never paired with it and hung for good. The interrupt now
    waits for the call's end; generate aborts its requests, and the next call runs."""
    import signal
    import threading
    path, single, split = pair
    if "llama" not in path:
        pytest.skip("one architecture is enough")
    layer = split.engine.runner.model.module.model.layers[0]
    sent = []

    def interrupt(module, args):
        if not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)
    hook = layer.register_forward_pre_hook(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            split.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    finally:
        hook.remove()
    result = []
    thread = threading.Thread(target=lambda: result.append(_greedy(split)), daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert result and result[0] == _greedy(single), "the next generate hung"


def test_a_worker_that_dies_while_the_server_idles_ends_it(qwen3_dir, tmp_path):
    """The idle engine core waited on its clients alone: /health answered 200 for as long as no request came
    to find the worker gone. The core now watches the workers and ends at once, naming the rank."""
    import signal

    from test_server import ServerProcess
    s = ServerProcess(qwen3_dir, tmp_path, "-tp", "2", "--max-model-len", "128", "--num-kv-blocks", "64")
    try:
        workers = [int(pid) for pid in os.listdir("/proc") if pid.isdigit()
                   and _parent(int(pid)) == s.engine_pid and b"tp_worker" in cmdline(int(pid))]
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        assert s.proc.wait(timeout=60) != 0
        assert "tensor-parallel worker rank 1 exited with status -9" in s.log_path.read_text()
    finally:
        if s.proc.poll() is None:
            s.proc.kill()


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def test_a_worker_that_dies_before_joining_the_group_fails_the_start(qwen3_dir, tmp_path, monkeypatch):
    """A worker that reported its slice loaded and then died before joining the gloo group left rank 0
    waiting in the group's constructor for good (its timeout is years)."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent("""
        import os, sys
        if "tokenmill.runner.tp_worker" in sys.orig_argv:
            import tokenmill.runner.tensor_parallel as wire
            wire.make_group = lambda store, rank, size: os._exit(3)
    """))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="worker rank 1 exited with status 3 before it joined the process group"):
        LLM(qwen3_dir, tensor_parallel_size=2, **ENGINE)
