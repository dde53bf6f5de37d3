"""The model runner's CUDA graphs (`CudaGraphRunner`): which graphs exist, their static inputs, capture,
and the replay of a step through the smallest graph that holds it.

Two families, each with its own static inputs (one packed buffer, `PackedInputs`), share one memory pool:
  ("decode", B):    B sequences of one token each, the split-K decode kernel;
  ("mixed", T, S):  up to T tokens of up to S sequences (prefill chunks, with or without decode rows),
                    the prefill kernel over a tile map; padding tokens have slot -1 and belong to no
                    sequence, padding sequences are empty.
Each graph ends in the greedy argmax of its logits. Where the GPU addresses pinned host memory, a
graph's inputs go over by the staging kernel (`kernels/staging.py`), not by a copy engine, and the
argmax also writes its tokens into a pinned table of the graph's own (`published`), so a greedy step
needs nothing after its replay to hand its tokens to the host. The table has a row per turn (the step's
`publish_turn` input), so the tokens of the step before stay readable while the next one runs.
"""
from __future__ import annotations

import gc
import logging
import time

import numpy as np
import torch
from tqdm import tqdm

from tokenmill.layers.attention_metadata import PREFILL_BLOCK_M, AttentionMetadata, prefill_tiles
from tokenmill.layers.kernels import staging
from tokenmill.runner.compile_ahead import compile_ahead
from tokenmill.runner.step import PackedInputs, StepInputs, StepResult

logger = logging.getLogger("tokenmill")


class CudaGraphRunner:
    """Owns the graphs, their static input buffers, host staging copies and published-token tables. The
    runner asks it for the graph of a step (`key`), replays through it (`replay`), and hands back the
    steps whose tokens a graph published (`read_later`)."""

    def __init__(self, model, backend, config, device: torch.device, max_num_seqs: int, max_model_len: int,
                 max_blocks_per_seq: int):
        self.model, self.backend, self.config, self.device = model, backend, config, device
        self.max_num_seqs, self.max_model_len, self.max_blocks_per_seq = max_num_seqs, max_model_len, max_blocks_per_seq
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._decode_buckets, self._token_buckets, self._seq_buckets = [], [], []   # of the captured keys
        self.mapped = False      # inputs and tokens move by kernels through pinned memory (staging.py)
        self.summary = ""

    def _keys(self) -> list[tuple]:
        n = self.max_num_seqs
        decode = sorted({b for b in [1, 2, 4, 8, *range(16, n + 1, 16)] if b <= n} | {n})
        keys = [("decode", b) for b in decode]
        limit = min(self.config.cuda_graph_max_tokens, self.config.max_num_batched_tokens)
        if limit > 0:
            # a step's tokens are padded to its bucket, and from a few hundred tokens on the products are
            # compute-bound, so padding costs in proportion: buckets 64 apart up to 512, 128 up to 2048
            steps = (*range(64, 512, 64), *range(512, 2048, 128), 2048, 4096, 8192)
            tokens = sorted({t for t in steps if t < limit} | {limit})
            # up to every running sequence: at high concurrency nearly every step carries a prefill
            # chunk beside its decode rows, and a step no graph holds pays the eager launches. Padding
            # sequences cost only logits rows and programs that exit, so their buckets are 4x apart
            seqs = sorted({s for s in (1, 4, 16, 64, 256, 1024) if s < n} | {n})
            keys += [("mixed", t, s) for t in tokens for s in seqs if s <= t]
        return keys

    def _init_buffers(self, keys: list[tuple]) -> None:
        """Static inputs per family, each family's arrays packed into one buffer (`PackedInputs`) in the
        order a step fills them, the block table last, so a step's inputs go over in one copy."""
        i64, i32 = torch.int64, torch.int32
        width = self.max_blocks_per_seq
        decode = max((k[1] for k in keys if k[0] == "decode"), default=0)
        mixed = [k for k in keys if k[0] == "mixed"]
        pin = self.device.type == "cuda"
        self.static, self.staging = {}, {}
        specs = {"decode": [("input_ids", i64, (decode,)), ("positions", i64, (decode,)), ("slots", i64, (decode,)),
                            ("seq_lens", i32, (decode,)), ("qsl", i32, (decode + 1,)),
                            ("publish_turn", i32, (1,)), ("block_tables", i32, (decode, width))]}
        if mixed:
            tokens, seqs = max(k[1] for k in mixed), max(k[2] for k in mixed)
            specs["mixed"] = [("input_ids", i64, (tokens,)), ("positions", i64, (tokens,)), ("slots", i64, (tokens,)),
                              ("sample_idx", i64, (seqs,)), ("seq_lens", i32, (seqs,)), ("qsl", i32, (seqs + 1,)),
                              ("tiles", i32, (2, tokens // PREFILL_BLOCK_M + seqs)),
                              ("publish_turn", i32, (1,)), ("block_tables", i32, (seqs, width))]
        for family, spec in specs.items():
            packed = PackedInputs(spec, self.device)
            packed.views["slots"].fill_(-1)          # capture runs on these: it must write no KV slot
            self.static[family] = packed
            if family == "mixed":
                packed.views["tiles"].copy_(torch.from_numpy(prefill_tiles([], packed.views["tiles"].shape[1])))
            # two host copies, used in turn: while step N's copy may still be queued, step N+1 fills
            # the other; a copy is refilled only once the step before last has read it (an event after
            # each replay, by (family, turn): `fetch` does not ensure it for steps that sample nothing)
            self.staging[family] = [packed.host_copy(pin) for _ in range(2)]
        self._staging_turn = 0
        self._staging_read: dict[tuple, torch.cuda.Event] = {}
        self.mapped = pin and staging.mapped_host_ok(self.device.index or 0)
        # per graph key, a table of its greedy tokens per turn (pinned), where the GPU can write it;
        # the step that last read each (key, turn), which must have its tokens before they are overwritten
        self.published = {}
        if self.mapped or not pin:
            self.published = {k: torch.zeros(2, k[1] if k[0] == "decode" else k[2], dtype=i64, pin_memory=pin)
                              for k in keys}
        self._publish_readers: dict[tuple, StepResult] = {}

    def static_forward(self, key: tuple):
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
                                 seq_lens=s["seq_lens"][:seqs], block_tables=s["block_tables"][:seqs],
                                 max_query_len=max_query_len, max_seq_len=self.max_model_len,
                                 prefill_tiles=tiles)

        publish = (self.published[key], s["publish_turn"]) if key in self.published else None

        def forward():
            hidden = self.model(s["input_ids"][:tokens], s["positions"][:tokens], meta)
            rows = hidden if key[0] == "decode" else hidden[s["sample_idx"][:seqs]]
            logits = self.model.compute_logits(rows)
            return hidden, logits, self.backend.greedy(logits, publish)
        return forward

    def capture(self, emulate: bool = False) -> None:
        """Captures every graph key, largest first so that the smaller ones reuse the pool. With
        `emulate` (no CUDA), each "graph" re-runs the forward on the static buffers instead, which
        lets the padded-batch path be tested on the CPU. On CUDA, one pass over every key first compiles
        the Triton specializations the capture will launch, side by side (`compile_ahead`)."""
        t0 = time.perf_counter()
        keys = self._keys()
        self._init_buffers(keys)
        compiled = ""
        if not emulate:
            with compile_ahead() as ahead:
                for key in keys:
                    self.static_forward(key)()
            compiled = (f"; {ahead.specializations} kernel specializations compiled first on {ahead.threads} "
                        f"threads in {time.perf_counter() - t0:.1f} s")
        self.graph_outputs: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        pool = None
        order = sorted(keys, key=lambda k: (k[0] != "mixed", -k[1], -k[-1]))
        # A CUDA graph destroyed while another is captured invalidates that capture: the dead engines of this
        # process (held in reference cycles) are collected first, and no collection runs until the end
        collecting = gc.isenabled()
        gc.collect()
        gc.disable()
        try:
            for key in tqdm(order, desc="Capturing CUDA graphs", unit="graph", disable=emulate):
                forward = self.static_forward(key)
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
        finally:
            if collecting:
                gc.enable()
        self._decode_buckets = sorted(k[1] for k in keys if k[0] == "decode")
        self._token_buckets = sorted({k[1] for k in keys if k[0] == "mixed"})
        self._seq_buckets = sorted({k[2] for k in keys if k[0] == "mixed"})
        seconds = time.perf_counter() - t0
        self.summary = (f"{len(keys)} ({len(self._decode_buckets)} decode, "
                        f"{len(keys) - len(self._decode_buckets)} with prefill up to "
                        f"{self.max_prefill_tokens} tokens) in {seconds:.1f} s{compiled}")

    @property
    def max_prefill_tokens(self) -> int:
        """The most tokens a step with prefill may have and run in a graph (0: none captured)."""
        return max(self._token_buckets, default=0)

    def key(self, inp: StepInputs) -> tuple | None:
        """The smallest captured graph that holds this batch, or None (run eagerly)."""
        if not self.graphs:
            return None
        seqs, tokens = len(inp.seq_lens), len(inp.input_ids)
        if inp.max_q == 1:
            bs = next((b for b in self._decode_buckets if b >= seqs), None)
            return None if bs is None else ("decode", bs)
        sb = next((b for b in self._seq_buckets if b >= seqs), None)
        if sb is None:
            return None
        # the mixed graphs hold at most as many sequences as tokens: a step of more sequences than the token
        # bucket of its tokens (a short prompt beside many decode rows) pads its tokens up to its sequences'
        t = next((b for b in self._token_buckets if b >= max(tokens, sb)), None)
        return None if t is None else ("mixed", t, sb)

    def read_later(self, turn: tuple, result: StepResult) -> None:
        """`result`'s tokens are in the published table of (key, turn): it must read them before a
        later replay of that key and turn overwrites them."""
        self._publish_readers[turn] = result

    def replay(self, key: tuple, inp: StepInputs, prev_tokens: torch.Tensor | None):
        """Stages the batch into the static buffers (zero-padded to the key's sizes) and replays the
        graph; returns (hidden of the batch's tokens, logits of its sampled rows, their greedy tokens,
        and where the graph publishes those on the host: (pinned view, its (key, turn), an event recorded
        after the replay or None), or None)."""
        tokens, seqs = len(inp.input_ids), len(inp.seq_lens)
        t_pad, s_pad = (key[1], key[1]) if key[0] == "decode" else key[1:]
        packed = self.static[key[0]]
        turn = (key[0], self._staging_turn)
        self._staging_turn ^= 1
        if turn in self._staging_read:
            self._staging_read.pop(turn).synchronize()
        host = self.staging[key[0]][turn[1]]
        reader = self._publish_readers.pop((key, turn[1]), None)
        if reader is not None:     # the step before last with this graph: its tokens are about to be overwritten
            reader.settle()
        host["publish_turn"][0] = turn[1]
        width = inp.tables.shape[1]
        # padding rows too: stale placeholders must not reach the embedding, stale slots not the cache
        host["input_ids"][:tokens], host["input_ids"][tokens:t_pad] = inp.input_ids, 0
        host["positions"][:tokens], host["positions"][tokens:t_pad] = inp.positions, 0
        host["slots"][:tokens], host["slots"][tokens:t_pad] = inp.slots, -1
        host["seq_lens"][:seqs] = inp.seq_lens
        host["qsl"][:seqs + 1] = inp.qsl
        if key[0] == "decode":
            host["seq_lens"][seqs:s_pad] = 1
            host["qsl"][seqs + 1:s_pad + 1] = np.arange(seqs + 1, s_pad + 1)
        else:
            host["seq_lens"][seqs:s_pad] = 0
            host["qsl"][seqs + 1:s_pad + 1] = tokens           # empty padding sequences
            host["tiles"][:] = prefill_tiles(np.diff(inp.qsl), host["tiles"].shape[1])
            rows = len(inp.sample_tokens)
            host["sample_idx"][:rows], host["sample_idx"][rows:s_pad] = inp.sample_tokens, 0
        # a row's columns past `width` keep older block ids, which its context never reaches; so the last
        # row goes over only up to `width` (a batch of one: a few entries instead of the whole row)
        host["block_tables"][:seqs, :width] = inp.tables
        if self.mapped:      # the staging kernel also fills the placeholders from the step before
            staging.stage(packed.buffer, host["_buffer"], packed.span(seqs, width), packed.offsets["positions"],
                          t_pad, prev_tokens)
        else:
            packed.upload(host, rows=seqs, width=width)
            if prev_tokens is not None:
                staging.fill_placeholders(packed.views["input_ids"][:tokens], prev_tokens)
        self.graphs[key].replay()
        done = None
        if packed.buffer.is_cuda:   # one event for both: the host copy was read, the graph's tokens are out
            done = self._staging_read[turn] = torch.cuda.Event()
            done.record()
        hidden, logits, greedy = self.graph_outputs[key]
        if key[0] == "decode" and len(inp.sample_rows) != seqs:   # a one-token prefill chunk samples nothing
            rows = torch.from_numpy(inp.sample_rows).to(self.device, non_blocking=True)
            return hidden[:tokens], logits[rows], greedy[rows], None
        n = len(inp.sample_rows)
        published = None
        if self.mapped and key in self.published:
            published = (self.published[key][turn[1], :n], (key, turn[1]), done)
        return hidden[:tokens], logits[:n], greedy[:n], published


class _EagerGraph:
    """Stands in for a CUDA graph where there is none: `replay` re-runs the forward on the same static
    buffers and writes the results into the outputs of the first run, as a graph replay would."""

    def __init__(self, forward, outputs):
        self.forward, self.outputs = forward, outputs

    def replay(self) -> None:
        for dst, src in zip(self.outputs, self.forward()):
            dst.copy_(src)
