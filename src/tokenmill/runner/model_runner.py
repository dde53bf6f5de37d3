"""Turns a scheduled batch into flat tensors, runs the model and samples on the device.

Host-side preparation is vectorised with NumPy (`step.py`) into pinned staging buffers and copied
without blocking; on CUDA, batches replay CUDA graphs captured for bucketed sizes (`cuda_graphs.py`:
pure decode by batch size, steps with prefill tokens by tokens and sequences, up to
`cuda_graph_max_tokens`). Where the GPU addresses pinned host memory, a graph's inputs and its sampled
tokens move by kernels (`kernels/staging.py`), not by the copy engines. The only host synchronisation
per step is reading back the sampled token ids. This file holds the model, its KV cache (sized from a
measured memory profile) and the step itself. With tensor_parallel_size > 1 it is rank 0: it holds
rank 0's slice of the model and of the KV cache, and its model calls run on every rank
(`tensor_parallel.py`); nothing of that exists at size 1.
"""
from __future__ import annotations

import logging
import math
import mmap
import time

import numpy as np
import torch

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.engine.request import Request
from tokenmill.layers.attention import FP8_KV_DTYPE
from tokenmill.layers.attention_metadata import AttentionMetadata, prefill_tiles
from tokenmill.layers.backend import make_backend
from tokenmill.layers.kernels import staging
from tokenmill.layers.kernels.fp8_gemm import PATH_ROWS
from tokenmill.quant import fp8
from tokenmill.runner import prompt_logprobs
from tokenmill.runner.cuda_graphs import CudaGraphRunner
from tokenmill.runner.host_copies import HostCopies
from tokenmill.runner.loader import load_model
from tokenmill.runner.sampler import sample, warm_up as warm_up_sampler
from tokenmill.runner.sampling_tensors import SamplingTensors
from tokenmill.runner.step import StepInputs, StepResult, prepare_inputs, warm_up_inputs
from tokenmill.runner.swap import SwapSpace
from tokenmill.runner.tensor_parallel import ShardedModel, TensorParallelWorkers

logger = logging.getLogger("tokenmill")

_CPU_KV_BUDGET_BYTES = 1 << 30


def kv_cache_tensors(c: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                     device: torch.device, tp_size: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A KV cache [layers, 2, num_blocks, block_size, kv_heads / tp_size, head_dim] of one rank and, in
    FP8, its per-layer K and V scales (see `ModelRunner._allocate_kv_cache`)."""
    shape = (c.num_hidden_layers, 2, num_blocks, block_size, c.num_key_value_heads // tp_size, c.head_dim)
    if device.type == "cpu":
        # private anonymous memory: the kernel maps a zeroed page where the cache first writes, so the
        # cache costs neither a pass of zeroing at start (0.4 s a GiB) nor resident memory for blocks no
        # request has used; the tensor keeps the mapping alive
        pages = mmap.mmap(-1, math.prod(shape) * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        kv_cache = torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)
    else:
        kv_cache = torch.zeros(shape, dtype=dtype, device=device)
    kv_scales = (torch.ones(c.num_hidden_layers, 2, dtype=torch.float32, device=device)
                 if dtype == FP8_KV_DTYPE else None)
    return kv_cache, kv_scales


# On the CPU, a step of this many tokens or more (a prefill chunk, a wide batch) runs on the engine core's
# borrowed cores where it has some (`core_proc.cpu_threads`): splitting it pays for waking the other
# thread, while a smaller step would mostly wait for a thread whose core a busy API server holds.
BIG_STEP_TOKENS = 128


class ModelRunner:
    def __init__(self, engine_config: EngineConfig, model_config: ModelConfig, model_dir: str,
                 max_model_len: int):
        self.config = engine_config
        self.model_config = model_config
        self.device = engine_config.resolve_device()
        if self.device.type == "cuda" and self.device.index is not None:
            # Triton launches, CUDA graph capture and torch.cuda's memory queries act on the current device,
            # not on their tensors': a core on cuda:1 (a data-parallel core after the first) makes it current
            torch.cuda.set_device(self.device)
        self.dtype = engine_config.resolve_dtype(model_config, self.device)
        self.kv_cache_dtype = engine_config.resolve_kv_cache_dtype(self.dtype)
        if self.kv_cache_dtype == FP8_KV_DTYPE:
            fp8.check_device(self.device, "FP8 KV caches (--kv-cache-dtype fp8)")
        self.block_size = engine_config.block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = engine_config.max_num_seqs
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.vocab_size = model_config.vocab_size
        self.host_copies = HostCopies()      # what steps read of the requests, kept across steps
        self.tp_size = engine_config.tensor_parallel_size
        engine_config.check_tensor_parallel(model_config, self.device)
        t0 = time.perf_counter()
        # ranks 1..N-1 load their slices while this process loads rank 0's
        self.workers = (TensorParallelWorkers(engine_config, model_config, model_dir)
                        if self.tp_size > 1 else None)
        try:
            self.model = load_model(model_dir, model_config, self.device, self.dtype, engine_config.quantization,
                                    self.workers.tp if self.workers else None)
            self.backend = make_backend(self.device, engine_config.kernels)
            self.model.use_backend(self.backend)
            if self.workers is not None:
                self.workers.connect()
                self.model = ShardedModel(self.model, self.workers.tp)
            self.load_seconds = time.perf_counter() - t0
            self.num_blocks = self._determine_num_blocks()
            if self.workers is not None:
                self.workers.start(self.num_blocks)
        except BaseException:
            self.shutdown()
            raise
        self._allocate_kv_cache()
        if self.device.type == "cuda":
            warm_up_sampler(self.vocab_size, self.dtype, self.device)
        self.graph_runner = CudaGraphRunner(self.model, self.backend, engine_config, self.device,
                                            self.max_num_seqs, max_model_len, self.max_blocks_per_seq)
        # called as hook(requests, num_new_tokens, query_start_loc, hidden) after each forward pass;
        # used by correctness checks that compare every position's logits with a reference
        self.hidden_hook = None
        # on the CPU, (threads of a step, threads of a big step), where the two differ (see BIG_STEP_TOKENS)
        big = engine_config.extra.get("big_step_threads")
        self.step_threads = ((torch.get_num_threads(), big) if big and self.device.type == "cpu" and self.tp_size == 1
                             else None)
        if self.device.type == "cuda" and not engine_config.enforce_eager:
            self.capture_graphs()
        # swap space for preempted requests' blocks (none when preemption recomputes); built after the
        # graphs are captured, since on CUDA it pins its memory in a background thread
        # (none with tensor parallelism: preempted requests recompute, EngineConfig refuses "swap")
        self.num_cpu_blocks = 0 if engine_config.preemption_mode == "recompute" or self.tp_size > 1 else \
            int(engine_config.swap_space * 2**30) // self.block_bytes
        self.swap_space = SwapSpace(self.kv_cache, self.num_cpu_blocks) if self.num_cpu_blocks else None

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers, if any (also done when the runner is collected)."""
        if getattr(self, "workers", None) is not None:
            self.workers.close()

    def capture_graphs(self, emulate: bool = False) -> None:
        """Captures the CUDA graphs (with `emulate`, stand-ins that re-run the forward, so the padded
        path runs on the CPU), then warms the eager path for the steps no graph holds."""
        self.graph_runner.capture(emulate)
        self._warm_eager()

    @property
    def graphs(self) -> dict:
        return self.graph_runner.graphs

    @property
    def graph_summary(self) -> str:
        return self.graph_runner.summary

    # ---- KV cache ---------------------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        c = self.model_config
        return (2 * c.num_hidden_layers * self.block_size * (c.num_key_value_heads // self.tp_size) * c.head_dim
                * self.kv_cache_dtype.itemsize)

    def _determine_num_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type != "cuda":
            want = self.max_num_seqs * self.max_blocks_per_seq
            return max(1, min(want, _CPU_KV_BUDGET_BYTES // self.block_bytes))
        return self._profile_num_blocks()

    def _profile_num_blocks(self) -> int:
        """Runs the largest batch once to measure activation memory, then gives the rest of
        `gpu_memory_utilization` of the device to the KV cache."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        tokens = min(self.config.max_num_batched_tokens, self.max_model_len * self.max_num_seqs)
        num_blocks = -(-tokens // self.block_size)
        self._allocate_kv_cache(num_blocks)
        seq_len = min(tokens, self.max_model_len)
        num_seqs = -(-tokens // seq_len)
        lens = [seq_len] * (num_seqs - 1) + [tokens - seq_len * (num_seqs - 1)]
        starts = np.concatenate(([0], np.cumsum(lens)))
        tables = torch.zeros(num_seqs, -(-seq_len // self.block_size), dtype=torch.int32, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=self.device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
            block_tables=tables, max_query_len=seq_len, max_seq_len=seq_len)
        ids = torch.zeros(tokens, dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            hidden = self.model(ids, ids.clone(), meta)
            rows = min(self.max_num_seqs, tokens)
            logits = self.model.compute_logits(hidden[:rows])
            sample(logits, SamplingTensors.dummy(rows, self.device, greedy=False))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - self.kv_cache_bytes
        del hidden, logits
        self._free_kv_cache()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        used_by_others = total - free - torch.cuda.memory_allocated()
        budget = total * self.config.gpu_memory_utilization - used_by_others - peak
        blocks = int(budget // self.block_bytes)
        if blocks < 1:
            raise RuntimeError(f"no memory left for the KV cache: gpu_memory_utilization="
                               f"{self.config.gpu_memory_utilization} of {total / 2**30:.1f} GiB, "
                               f"peak activations {peak / 2**30:.2f} GiB")
        return blocks

    def _allocate_kv_cache(self, num_blocks: int | None = None) -> None:
        """The cache in `kv_cache_dtype`. An FP8 cache has per-layer K and V scales (`kv_scales`, float32
        [layers, 2]) of 1.0, vLLM's default for checkpoints that carry none: E4M3's relative precision
        (3 mantissa bits) is the same from 2^-6 to 448, so a scale only moves that window, and the K/V of
        the models served here lie inside it (SmolLM2-135M's |K| peaks near 20); a fixed scale also
        keeps what a block holds independent of which request came first. Values outside saturate."""
        n = self.num_blocks if num_blocks is None else num_blocks
        self.kv_cache, self.kv_scales = kv_cache_tensors(self.model_config, n, self.block_size, self.kv_cache_dtype,
                                                         self.device, self.tp_size)
        self.model.bind_kv_cache(self.kv_cache, self.kv_scales)

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    def _free_kv_cache(self) -> None:
        self.model.bind_kv_cache(None)
        del self.kv_cache

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]], reused: list[int]) -> None:
        """Copies blocks between the KV cache and the swap space (`swap.SwapSpace.copy`): called once per
        step, before `execute`, with the step's (GPU, CPU) swap-outs, (CPU, GPU) swap-ins and the
        swapped-out GPU blocks that the step's requests took."""
        if self.swap_space is not None:
            self.swap_space.copy(swap_out, swap_in, reused)

    # ---- inputs -------------------------------------------------------------------------------------
    def _eager_tiles(self, inp: StepInputs) -> torch.Tensor | None:
        """The tile map of an eager step with prefill tokens, as the graphs have it: one attention
        program per block of a sequence's queries, where the plain grid launches the longest query's
        blocks for every sequence (a prefill chunk beside 200 decode rows: 16 x 201 programs a head
        instead of 216), and the same kernel variant the graphs compiled. None for decode steps."""
        return None if inp.max_q == 1 else self._to_device(prefill_tiles(np.diff(inp.qsl)))

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    # ---- the step ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, requests: list[Request], num_new_tokens: list[int],
                prev: StepResult | None = None, before_sample=None) -> StepResult:
        """Launches one step and returns at once; `StepResult.fetch()` waits for its sampled tokens.

        Reads the requests, never changes them: the scheduler appends a placeholder to each request that
        samples (`Scheduler.update_after_step`), and a placeholder among this step's inputs is read on
        the device from `prev`, the step still in flight. `StepResult.positions[j]` is where sample row
        j's token goes: the request's length before that placeholder."""
        if self.step_threads is not None:
            threads = self.step_threads[sum(num_new_tokens) >= BIG_STEP_TOKENS]
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
        inp = prepare_inputs(requests, num_new_tokens, self.block_size, self.host_copies)
        sampled = [requests[i] for i in inp.sample_rows.tolist()]
        tensors = SamplingTensors.from_requests(sampled, self.vocab_size, self.device,
                                                prev.token_ids if prev is not None else None,
                                                self.host_copies) if sampled else None
        prev_tokens = None
        if inp.placeholders:
            if prev is None or prev.token_ids is None:
                raise RuntimeError("a step's inputs hold placeholders but no step in flight samples them")
            prev_tokens = prev.token_ids
        scores_prompt = prompt_logprobs.wanted(requests, num_new_tokens)
        key = None if scores_prompt else self.graph_runner.key(inp)
        greedy = published = None
        if key is not None:
            hidden, logits, greedy, published = self.graph_runner.replay(key, inp, prev_tokens)
        else:
            hidden, logits = self._eager_forward(inp, prev_tokens)
        if self.hidden_hook is not None:
            self.hidden_hook(requests, num_new_tokens, inp.qsl, hidden)
        result = StepResult(requests, inp.sample_rows, [])
        if scores_prompt:
            result.prompt_logprobs = prompt_logprobs.compute(self.model, requests, num_new_tokens, inp.qsl, hidden)
        positions = [req.num_tokens for req in sampled]
        if before_sample is not None:
            before_sample(result)       # host work while the forward runs (a grammar's mask may wait on it)
        if sampled:
            out = sample(logits, tensors, greedy)
            result.token_ids = out.token_ids
            if published is not None and out.token_ids is greedy:
                view, turn, done = published       # the graph wrote these tokens to the host itself
                result.start_copy(out, self.graph_runner.mapped, published=view, done=done)
                self.graph_runner.read_later(turn, result)
            else:
                result.start_copy(out, self.graph_runner.mapped)
            result.positions.extend(positions)
        return result

    def _eager_forward(self, inp: StepInputs, prev_tokens: torch.Tensor | None):
        ids = self._to_device(inp.input_ids)
        if prev_tokens is not None:
            staging.fill_placeholders(ids, prev_tokens)
        meta = AttentionMetadata(
            slot_mapping=self._to_device(inp.slots), query_start_loc=self._to_device(inp.qsl),
            seq_lens=self._to_device(inp.seq_lens), block_tables=self._to_device(inp.tables),
            max_query_len=inp.max_q, max_seq_len=inp.max_seq_len, prefill_tiles=self._eager_tiles(inp))
        hidden = self.model(ids, self._to_device(inp.positions), meta)
        logits = None
        if len(inp.sample_rows):
            logits = self.model.compute_logits(hidden[self._to_device(inp.sample_tokens)])
        return hidden, logits

    @torch.inference_mode()
    def _warm_eager(self) -> None:
        """Eager steps with prefill tokens (`step.warm_up_inputs`), so that whatever the eager path compiles
        beyond the graphs' kernels compiles now rather than inside a served step: one of 17 tokens, and one
        just above each row count where an FP8 product changes its path or tile (`fp8_gemm.PATH_ROWS`) that
        no graph holds and a step may have. Their results are dropped."""
        held = self.graph_runner.max_prefill_tokens
        sizes = {17} | {b + 1 for b in PATH_ROWS if held < b + 1 <= self.config.max_num_batched_tokens}
        for n in sorted(sizes):
            inp = warm_up_inputs(n, self.max_model_len, self.block_size)
            if inp is not None:
                self._eager_forward(inp, None)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
