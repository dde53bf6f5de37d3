"""Turns a scheduled batch into flat tensors, runs the model and samples on the device.

Host-side preparation is vectorised with NumPy into pinned staging buffers and copied without
blocking; on CUDA, batches replay CUDA graphs captured for bucketed sizes (pure decode by batch size,
steps with prefill tokens by tokens and sequences, up to `cuda_graph_max_tokens`), each ending in the
greedy argmax. Where the GPU addresses pinned host memory, a graph's inputs and its sampled tokens
move by kernels (`kernels/staging.py`), not by the copy engines. The only host synchronisation per
step is reading back the sampled token ids.
"""
from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.engine.request import Request
from tokenmill.layers.attention import PREFILL_BLOCK_M, AttentionMetadata, prefill_tiles
from tokenmill.layers.kernels import argmax, staging
from tokenmill.runner.loader import load_model
from tokenmill.runner.sampler import SamplingTensors, sample
from tokenmill.runner.step import PackedInputs, StepInputs, StepResult, prepare_inputs

logger = logging.getLogger("tokenmill")

_CPU_KV_BUDGET_BYTES = 1 << 30
# TOKENMILL_MAPPED_STAGING=0 keeps a graph's inputs and tokens on the copy engines (for A/B benchmarks)
MAPPED_STAGING = os.environ.get("TOKENMILL_MAPPED_STAGING", "1") != "0"


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (first of equals): one kernel on CUDA, torch's elsewhere."""
    return argmax.greedy(logits) if logits.is_cuda else logits.argmax(-1)


class ModelRunner:
    def __init__(self, engine_config: EngineConfig, model_config: ModelConfig, model_dir: str,
                 max_model_len: int):
        self.config = engine_config
        self.model_config = model_config
        self.device = engine_config.resolve_device()
        self.dtype = engine_config.resolve_dtype(model_config, self.device)
        self.block_size = engine_config.block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = engine_config.max_num_seqs
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.vocab_size = model_config.vocab_size
        t0 = time.perf_counter()
        self.model = load_model(model_dir, model_config, self.device, self.dtype)
        self.load_seconds = time.perf_counter() - t0
        self.num_blocks = self._determine_num_blocks()
        self._allocate_kv_cache()
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._mapped = False
        # called as hook(requests, num_new_tokens, query_start_loc, hidden) after each forward pass;
        # used by correctness checks that compare every position's logits with a reference
        self.hidden_hook = None
        if self.device.type == "cuda" and not engine_config.enforce_eager:
            self._capture_graphs()

    # ---- KV cache ---------------------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        c = self.model_config
        return 2 * c.num_hidden_layers * self.block_size * c.num_key_value_heads * c.head_dim * self.dtype.itemsize

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
            context_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
            block_tables=tables, max_query_len=seq_len, max_context_len=seq_len)
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
        c = self.model_config
        n = self.num_blocks if num_blocks is None else num_blocks
        shape = (c.num_hidden_layers, 2, n, self.block_size, c.num_key_value_heads, c.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.model.model.layers):
            layer.self_attn.attn.k_cache = self.kv_cache[i, 0]
            layer.self_attn.attn.v_cache = self.kv_cache[i, 1]
        if num_blocks is None:
            gib = self.kv_cache_bytes / 2**30
            logger.info("KV cache: %d blocks of %d tokens, %.2f GiB, %d tokens", n, self.block_size,
                        gib, n * self.block_size)

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    def _free_kv_cache(self) -> None:
        for layer in self.model.model.layers:
            layer.self_attn.attn.k_cache = layer.self_attn.attn.v_cache = torch.empty(0)
        del self.kv_cache

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
                prev: StepResult | None = None) -> StepResult:
        """Launches one step and returns at once; `StepResult.fetch()` waits for its sampled tokens.

        Each request that samples this step gets a placeholder token appended; a placeholder among this
        step's inputs is read on the device from `prev`, the step still in flight."""
        inp = prepare_inputs(requests, num_new_tokens, self.block_size)
        sampled = [requests[i] for i in inp.sample_rows.tolist()]
        tensors = SamplingTensors.from_requests(sampled, self.vocab_size, self.device) if sampled else None
        prev_tokens = None
        if inp.placeholders:
            if prev is None or prev.token_ids is None:
                raise RuntimeError("a step's inputs hold placeholders but no step in flight samples them")
            prev_tokens = prev.token_ids
        key = self._graph_key(inp)
        greedy = None
        if key is not None:
            hidden, logits, greedy = self._replay(key, inp, prev_tokens)
        else:
            hidden, logits = self._eager_forward(inp, prev_tokens)
        if self.hidden_hook is not None:
            self.hidden_hook(requests, num_new_tokens, inp.qsl, hidden)
        result = StepResult(requests, inp.sample_rows, [])
        if sampled:
            out = sample(logits, tensors, greedy)
            result.token_ids = out.token_ids
            result.start_copy(out, self._mapped)
            for j, req in enumerate(sampled):
                result.positions.append(req.num_tokens)
                req.append_placeholder(j)
        return result

    def _eager_forward(self, inp: StepInputs, prev_tokens: torch.Tensor | None):
        ids = self._to_device(inp.input_ids)
        if prev_tokens is not None:
            staging.fill_placeholders(ids, prev_tokens)
        meta = AttentionMetadata(
            slot_mapping=self._to_device(inp.slots), query_start_loc=self._to_device(inp.qsl),
            context_lens=self._to_device(inp.context_lens), block_tables=self._to_device(inp.tables),
            max_query_len=inp.max_q, max_context_len=inp.max_ctx, prefill_tiles=self._eager_tiles(inp))
        hidden = self.model(ids, self._to_device(inp.positions), meta)
        logits = None
        if len(inp.sample_rows):
            logits = self.model.compute_logits(hidden[self._to_device(inp.sample_tokens)])
        return hidden, logits

    @torch.inference_mode()
    def _warm_eager(self) -> None:
        """One eager step with prefill tokens, of sizes no graph has (17 tokens in 3 sequences, a decode
        row beside two chunks, a block table at least 3 wide), so that whatever the eager path compiles beyond
        the graphs' kernels compiles now rather than inside the first large batch. It writes no KV
        slot (all slots -1) and reads block 0 only; its results are dropped."""
        q_lens = np.array([1, 5, 11])
        ctx = q_lens + np.array([8, 16, 0])
        if ctx.max() > self.max_model_len:      # positions past the model's length are not valid input
            return
        width = max(3, -(-int(ctx.max()) // self.block_size))
        qsl = np.concatenate(([0], np.cumsum(q_lens))).astype(np.int32)
        positions = np.concatenate([np.arange(c - q, c) for q, c in zip(q_lens, ctx)])
        inp = StepInputs(np.zeros(int(qsl[-1]), np.int64), positions, np.full(int(qsl[-1]), -1, np.int64), qsl,
                         ctx.astype(np.int32), np.zeros((len(q_lens), width), np.int32), np.arange(len(q_lens)),
                         qsl[1:].astype(np.int64) - 1, int(q_lens.max()), int(ctx.max()), False)
        self._eager_forward(inp, None)
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    # ---- CUDA graphs -----------------------------------------------------------------------------------
    # Two families, each with its own static inputs (one packed buffer, `PackedInputs`), share one memory pool:
    #   ("decode", B):    B sequences of one token each, the split-K decode kernel;
    #   ("mixed", T, S):  up to T tokens of up to S sequences (prefill chunks, with or without decode rows),
    #                     the prefill kernel over a tile map; padding tokens have slot -1 and belong to no
    #                     sequence, padding sequences are empty.
    def _graph_keys(self) -> list[tuple]:
        n = self.max_num_seqs
        decode = sorted({b for b in [1, 2, 4, 8, *range(16, n + 1, 16)] if b <= n} | {n})
        keys = [("decode", b) for b in decode]
        limit = min(self.config.cuda_graph_max_tokens, self.config.max_num_batched_tokens)
        if limit > 0:
            tokens = sorted({t for t in (64, 128, 256, 512, 1024, 2048, 4096, 8192) if t < limit} | {limit})
            seqs = sorted({s for s in (1, 2, 4, 8, 16, 32, 64) if s < n} | {min(n, 64)})
            keys += [("mixed", t, s) for t in tokens for s in seqs if s <= t]
        return keys

    def _init_static_buffers(self, keys: list[tuple]) -> None:
        """Static inputs per family, each family's arrays packed into one buffer (`PackedInputs`) in the
        order a step fills them, the block table last, so a step's inputs go over in one copy."""
        i64, i32 = torch.int64, torch.int32
        width = self.max_blocks_per_seq
        decode = max((k[1] for k in keys if k[0] == "decode"), default=0)
        mixed = [k for k in keys if k[0] == "mixed"]
        pin = self.device.type == "cuda"
        self.static, self.staging = {}, {}
        specs = {"decode": [("input_ids", i64, (decode,)), ("positions", i64, (decode,)), ("slots", i64, (decode,)),
                            ("context_lens", i32, (decode,)), ("qsl", i32, (decode + 1,)),
                            ("block_tables", i32, (decode, width))]}
        if mixed:
            tokens, seqs = max(k[1] for k in mixed), max(k[2] for k in mixed)
            specs["mixed"] = [("input_ids", i64, (tokens,)), ("positions", i64, (tokens,)), ("slots", i64, (tokens,)),
                              ("sample_idx", i64, (seqs,)), ("context_lens", i32, (seqs,)), ("qsl", i32, (seqs + 1,)),
                              ("tiles", i32, (2, tokens // PREFILL_BLOCK_M + seqs)),
                              ("block_tables", i32, (seqs, width))]
        for family, spec in specs.items():
            packed = PackedInputs(spec, self.device)
            packed.views["slots"].fill_(-1)          # capture runs on these: it must write no KV slot
            self.static[family] = packed
            if family == "mixed":
                packed.views["tiles"].copy_(torch.from_numpy(prefill_tiles([], packed.views["tiles"].shape[1])))
            # two host copies, used in turn: while step N's copy may still be queued, step N+1 fills
            # the other; a copy is refilled only once the step before last has read it (an event after
            # each read, by (family, turn): `fetch` does not ensure it for steps that sample nothing)
            self.staging[family] = [packed.host_copy(pin) for _ in range(2)]
        self._staging_turn = 0
        self._staging_read: dict[tuple, torch.cuda.Event] = {}
        self._mapped = pin and MAPPED_STAGING and staging.mapped_host_ok(self.device.index or 0)

    def _static_forward(self, key: tuple):
        """The forward pass of one graph key over views of the static buffers -> (hidden, logits,
        greedy ids of the logits' rows)."""
        s = self.static[key[0]].views
        if key[0] == "decode":
            tokens = seqs = key[1]
            max_query_len, tiles = 1, None
        else:
            _, tokens, seqs = key
            max_query_len, tiles = tokens, s["tiles"][:, :tokens // PREFILL_BLOCK_M + seqs]
        meta = AttentionMetadata(slot_mapping=s["slots"][:tokens], query_start_loc=s["qsl"][:seqs + 1],
                                 context_lens=s["context_lens"][:seqs], block_tables=s["block_tables"][:seqs],
                                 max_query_len=max_query_len, max_context_len=self.max_model_len,
                                 prefill_tiles=tiles)

        def forward():
            hidden = self.model(s["input_ids"][:tokens], s["positions"][:tokens], meta)
            rows = hidden if key[0] == "decode" else hidden[s["sample_idx"][:seqs]]
            logits = self.model.compute_logits(rows)
            return hidden, logits, greedy_ids(logits)
        return forward

    def _capture_graphs(self, emulate: bool = False) -> None:
        """Captures every graph key, largest first so that the smaller ones reuse the pool. With
        `emulate` (no CUDA), each "graph" re-runs the forward on the static buffers instead, which
        lets the padded-batch path be tested on the CPU."""
        t0 = time.perf_counter()
        keys = self._graph_keys()
        self._init_static_buffers(keys)
        self.graph_outputs: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        pool = None
        for key in sorted(keys, key=lambda k: (k[0] != "mixed", -k[1], -k[-1])):
            forward = self._static_forward(key)
            outputs = forward()                       # warms up the kernels (and their compilation)
            if emulate:
                self.graphs[key] = _EagerGraph(forward, outputs)
            else:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    outputs = forward()
                pool = graph.pool()
                self.graphs[key] = graph
            self.graph_outputs[key] = outputs
        self._decode_buckets = sorted(k[1] for k in keys if k[0] == "decode")
        self._token_buckets = sorted({k[1] for k in keys if k[0] == "mixed"})
        self._seq_buckets = sorted({k[2] for k in keys if k[0] == "mixed"})
        self._warm_eager()
        self.graph_seconds = time.perf_counter() - t0
        logger.info("captured %d CUDA graphs (%d decode, %d with prefill up to %d tokens) in %.1f s",
                    len(keys), len(self._decode_buckets), len(keys) - len(self._decode_buckets),
                    max(self._token_buckets, default=0), self.graph_seconds)

    def _graph_key(self, inp: StepInputs) -> tuple | None:
        """The smallest captured graph that holds this batch, or None (run eagerly)."""
        if not self.graphs:
            return None
        seqs, tokens = len(inp.context_lens), len(inp.input_ids)
        if inp.max_q == 1:
            bs = next((b for b in self._decode_buckets if b >= seqs), None)
            return None if bs is None else ("decode", bs)
        t = next((b for b in self._token_buckets if b >= tokens), None)
        sb = next((b for b in self._seq_buckets if b >= seqs), None)
        return None if t is None or sb is None else ("mixed", t, sb)

    def _replay(self, key: tuple, inp: StepInputs, prev_tokens: torch.Tensor | None):
        """Stages the batch into the static buffers (zero-padded to the key's sizes) and replays the
        graph; returns (hidden of the batch's tokens, logits of its sampled rows)."""
        tokens, seqs = len(inp.input_ids), len(inp.context_lens)
        t_pad, s_pad = (key[1], key[1]) if key[0] == "decode" else key[1:]
        packed = self.static[key[0]]
        turn = (key[0], self._staging_turn)
        self._staging_turn ^= 1
        if turn in self._staging_read:
            self._staging_read.pop(turn).synchronize()
        host = self.staging[key[0]][turn[1]]
        width = inp.tables.shape[1]
        # padding rows too: stale placeholders must not reach the embedding, stale slots not the cache
        host["input_ids"][:tokens], host["input_ids"][tokens:t_pad] = inp.input_ids, 0
        host["positions"][:tokens], host["positions"][tokens:t_pad] = inp.positions, 0
        host["slots"][:tokens], host["slots"][tokens:t_pad] = inp.slots, -1
        host["context_lens"][:seqs] = inp.context_lens
        host["qsl"][:seqs + 1] = inp.qsl
        if key[0] == "decode":
            host["context_lens"][seqs:s_pad] = 1
            host["qsl"][seqs + 1:s_pad + 1] = np.arange(seqs + 1, s_pad + 1)
        else:
            host["context_lens"][seqs:s_pad] = 0
            host["qsl"][seqs + 1:s_pad + 1] = tokens           # empty padding sequences
            host["tiles"][:] = prefill_tiles(np.diff(inp.qsl), host["tiles"].shape[1])
            rows = len(inp.sample_tokens)
            host["sample_idx"][:rows], host["sample_idx"][rows:s_pad] = inp.sample_tokens, 0
        # a row's columns past `width` keep older block ids, which its context never reaches
        host["block_tables"][:seqs, :width] = inp.tables
        if self._mapped:     # the staging kernel also fills the placeholders from the step before
            staging.stage(packed.buffer, host["_buffer"], packed.span(seqs), packed.offsets["positions"], t_pad,
                          prev_tokens)
        else:
            packed.upload(host, rows=seqs)
            if prev_tokens is not None:
                staging.fill_placeholders(packed.views["input_ids"][:tokens], prev_tokens)
        if packed.buffer.is_cuda:
            self._staging_read[turn] = torch.cuda.Event()
            self._staging_read[turn].record()
        self.graphs[key].replay()
        hidden, logits, greedy = self.graph_outputs[key]
        if key[0] == "decode" and len(inp.sample_rows) != seqs:   # a one-token prefill chunk samples nothing
            rows = self._to_device(inp.sample_rows)
            return hidden[:tokens], logits[rows], greedy[rows]
        return hidden[:tokens], logits[:len(inp.sample_rows)], greedy[:len(inp.sample_rows)]


class _Packed:
    """Named arrays laid out one after another (16-byte aligned) in one device buffer, with pinned host
    copies of the same layout. `upload` copies the span from the first array to the end of the last
    one's first `rows` rows: the last array (the block table) is the only one whose size on the wire
    grows with the batch, so a small step is one small copy instead of one copy per array."""

    def __init__(self, spec: list[tuple[str, torch.dtype, tuple]], device: torch.device):
        self.spec, self.offsets, size = spec, {}, 0
        for name, dtype, shape in spec:
            self.offsets[name] = size
            size += -(-self._nbytes(dtype, shape) // 16) * 16
        self.nbytes = size
        self.buffer = torch.zeros(size, dtype=torch.uint8, device=device)
        self.views = self._views(self.buffer)
        _, dtype, shape = spec[-1]
        self.row_bytes = self._nbytes(dtype, shape[1:])

    @staticmethod
    def _nbytes(dtype: torch.dtype, shape: tuple) -> int:
        return int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()

    def _views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: buffer[self.offsets[name]:self.offsets[name] + self._nbytes(dtype, shape)].view(dtype).view(shape)
                for name, dtype, shape in self.spec}

    def host_copy(self, pin: bool) -> dict[str, np.ndarray]:
        """A host staging copy: NumPy views by name, and the buffer itself under "_buffer"."""
        buffer = torch.zeros(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        return {**{name: view.numpy() for name, view in self._views(buffer).items()}, "_buffer": buffer}

    def span(self, rows: int) -> int:
        """Bytes from the start to the end of the last array's first `rows` rows."""
        return self.offsets[self.spec[-1][0]] + rows * self.row_bytes

    def upload(self, host: dict, rows: int) -> None:
        end = self.span(rows)
        self.buffer[:end].copy_(host["_buffer"][:end], non_blocking=True)


class _EagerGraph:
    """Stands in for a CUDA graph where there is none: `replay` re-runs the forward on the same static
    buffers and writes the results into the outputs of the first run, as a graph replay would."""

    def __init__(self, forward, outputs):
        self.forward, self.outputs = forward, outputs

    def replay(self) -> None:
        for dst, src in zip(self.outputs, self.forward()):
            dst.copy_(src)
