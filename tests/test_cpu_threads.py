"""The served engine core's CPU threads: one core left to each API server process, borrowed back (with
OpenMP threads that sleep while they wait) for steps of `BIG_STEP_TOKENS` or more when that leaves the core
a single thread."""
from __future__ import annotations

import os

import pytest
import torch

from tokenmill.engine import core_proc
from tokenmill.engine.core_client import EngineCore, EngineStartError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def no_omp_env(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    return monkeypatch


def test_a_core_left_one_thread_borrows_the_cores_only_with_sleeping_openmp_threads(no_omp_env):
    assert core_proc.borrows_cores(2, 1) and core_proc.borrows_cores(4, 3) and core_proc.borrows_cores(2, 2)
    assert not core_proc.borrows_cores(8, 1) and not core_proc.borrows_cores(1, 1)
    assert core_proc.cpu_threads(2, 1) == (1, 1)               # spinning threads: no borrowing
    no_omp_env.setenv("OMP_WAIT_POLICY", "passive")
    assert core_proc.cpu_threads(2, 1) == (1, 2) and core_proc.cpu_threads(4, 3) == (1, 4)
    assert core_proc.cpu_threads(8, 1) == (7, 7) and core_proc.cpu_threads(1, 1) == (1, 1)
    assert not core_proc.borrows_cores(2, 1)                   # the user's own OpenMP settings stand
    no_omp_env.delenv("OMP_WAIT_POLICY")
    no_omp_env.setenv("OMP_NUM_THREADS", "2")
    assert not core_proc.borrows_cores(2, 1)


def report_threads(config):
    """An engine factory that fails at once, naming the threads the core gave itself."""
    raise RuntimeError(f"threads={torch.get_num_threads()} big={config.extra.get('big_step_threads')} "
                       f"wait={os.environ.get('OMP_WAIT_POLICY')}")


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores to borrow")
def test_a_spawned_core_left_one_thread_runs_big_steps_on_every_core(no_omp_env, qwen3_dir):
    from tokenmill.config import EngineConfig
    cores = os.cpu_count()
    # as many API servers as cores: the core keeps one thread and borrows all the cores for big steps
    with pytest.raises(EngineStartError, match=f"threads=1 big={cores} wait=PASSIVE"):
        EngineCore(EngineConfig(model=qwen3_dir, device="cpu"), num_clients=cores,
                   engine_factory="test_cpu_threads:report_threads", startup_timeout=120)
    assert "OMP_WAIT_POLICY" not in os.environ                 # only the core's environment had it
    # data-parallel cores are given their share and borrow nothing
    with pytest.raises(EngineStartError, match="threads=1 big=None wait=None"):
        EngineCore(EngineConfig(model=qwen3_dir, device="cpu", extra={"cpu_threads": 1}), num_clients=cores,
                   engine_factory="test_cpu_threads:report_threads", startup_timeout=120)


def test_steps_of_big_step_tokens_or_more_run_on_the_borrowed_threads(qwen3_dir):
    from tokenmill import LLM, SamplingParams
    from tokenmill.runner.model_runner import BIG_STEP_TOKENS
    llm = LLM(qwen3_dir, device="cpu", max_num_batched_tokens=512, extra={"big_step_threads": 2})
    runner = llm.engine.runner
    assert runner.step_threads == (1, 2)
    seen = []
    runner.hidden_hook = lambda requests, num_new, qsl, hidden: seen.append((sum(num_new), torch.get_num_threads()))
    prompts = [list(range(5, 5 + BIG_STEP_TOKENS)), list(range(9, 9 + BIG_STEP_TOKENS - 1))]
    llm.generate(prompts[:1], SamplingParams(max_tokens=3, ignore_eos=True))
    llm.generate(prompts[1:], SamplingParams(max_tokens=3, ignore_eos=True))
    assert seen == [(BIG_STEP_TOKENS, 2), (1, 1), (1, 1), (BIG_STEP_TOKENS - 1, 1), (1, 1), (1, 1)]
    assert torch.get_num_threads() == 1
