"""One step of the model runner, on the host side: its inputs as flat arrays (`prepare_inputs`), their
packed layout in the CUDA graphs' static buffers (`PackedInputs`), and the handle of a launched step
whose sampled tokens are on their way to the host (`StepResult`)."""
from __future__ import annotations

import numpy as np
import torch

from tokenmill.engine.request import Request
from tokenmill.layers.kernels import staging
from tokenmill.runner.host_copies import HostCopies
from tokenmill.runner.sampler import SamplerOutput


class StepInputs:
    """One step's inputs on the host: per token `input_ids` (a placeholder as -(row + 1) of the step in
    flight), `positions`, `slots`; per sequence `qsl` (query start offsets), `seq_lens`, `tables`
    (block table rows); the rows that sample (`sample_rows`) and their last tokens (`sample_tokens`);
    the longest query and context; whether any input is a placeholder."""

    __slots__ = ("input_ids", "positions", "slots", "qsl", "seq_lens", "tables", "sample_rows",
                 "sample_tokens", "max_q", "max_seq_len", "placeholders")

    def __init__(self, *values):
        for name, value in zip(self.__slots__, values):
            setattr(self, name, value)


def prepare_inputs(requests: list[Request], num_new_tokens: list[int], block_size: int,
                   copies: HostCopies | None = None) -> StepInputs:
    """The flat arrays of one step: `num_new_tokens[i]` tokens of `requests[i]`, from its
    `num_computed_tokens` on (NumPy, vectorised over tokens); the block-table rows from `copies` (the
    runner's, kept across steps)."""
    bs = block_size
    starts = np.fromiter((r.num_computed_tokens for r in requests), np.int64, len(requests))
    counts = np.asarray(num_new_tokens, dtype=np.int64)
    ends = starts + counts
    if counts.max() == 1:
        input_ids = np.fromiter((r.all_token_ids[r.num_computed_tokens] for r in requests),
                                np.int64, len(requests))
        positions = starts
    else:
        input_ids = np.fromiter((t for r, s, e in zip(requests, starts.tolist(), ends.tolist())
                                 for t in r.all_token_ids[s:e]), np.int64, int(counts.sum()))
        positions = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts - starts, counts)
    seq_of_token = np.repeat(np.arange(len(requests)), counts)
    held = np.nonzero(input_ids < 0)[0]
    if len(held):    # placeholders, as -(row + 1): the token of that row of the step in flight
        input_ids[held] = -1 - np.fromiter((requests[i].pending_row for i in seq_of_token[held].tolist()),
                                           np.int64, len(held))
    block_tables = (copies or HostCopies()).block_table(requests)
    slot_mapping = block_tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
    query_start_loc = np.concatenate(([0], np.cumsum(counts))).astype(np.int32)
    sample_rows = np.nonzero(ends == np.fromiter((r.num_tokens for r in requests), np.int64,
                                                 len(requests)))[0]
    sample_tokens = query_start_loc[1:][sample_rows].astype(np.int64) - 1   # their last token rows
    return StepInputs(input_ids, positions, slot_mapping, query_start_loc, ends.astype(np.int32), block_tables,
                      sample_rows, sample_tokens, int(counts.max()), int(ends.max()), len(held) > 0)


def warm_up_inputs(tokens: int, max_model_len: int, block_size: int) -> StepInputs | None:
    """An invented step of `tokens` tokens with prefill (`ModelRunner._warm_eager`): a decode row beside a
    chunk of 5 and the rest in chunks of at most `max_model_len`, the first two after a context of 8 and
    16, a block table at least 3 wide. It writes no KV slot (all slots -1) and reads block 0 only; None
    where `max_model_len` holds too little of it."""
    if max_model_len < 21:      # positions past the model's length are not valid input
        return None
    full, part = divmod(tokens - 6, max_model_len)
    q_lens = np.array([1, 5, *[max_model_len] * full, *([part] if part else [])])
    ctx = q_lens + np.array([8, 16] + [0] * (len(q_lens) - 2))
    width = max(3, -(-int(ctx.max()) // block_size))
    qsl = np.concatenate(([0], np.cumsum(q_lens))).astype(np.int32)
    positions = np.concatenate([np.arange(c - q, c) for q, c in zip(q_lens, ctx)])
    return StepInputs(np.zeros(tokens, np.int64), positions, np.full(tokens, -1, np.int64), qsl, ctx.astype(np.int32),
                      np.zeros((len(q_lens), width), np.int32), np.arange(len(q_lens)), qsl[1:].astype(np.int64) - 1,
                      int(q_lens.max()), int(ctx.max()), False)


class PackedInputs:
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
        self.item_bytes = self._nbytes(dtype, ())

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

    def span(self, rows: int, width: int | None = None) -> int:
        """Bytes from the start to the end of the last array's first `rows` rows, of which the last one
        only up to its first `width` entries (the whole row by default)."""
        end = self.offsets[self.spec[-1][0]] + rows * self.row_bytes
        if width is not None and rows:
            end -= self.row_bytes - width * self.item_bytes
        return end

    def upload(self, host: dict, rows: int, width: int | None = None) -> None:
        end = self.span(rows, width)
        self.buffer[:end].copy_(host["_buffer"][:end], non_blocking=True)


class StepResult:
    """A launched step. `positions[j]` is where row j's sampled token goes in
    `requests[sample_rows[j]].all_token_ids`; `fetch()` waits for the copy to the host."""

    def __init__(self, requests, sample_rows, positions):
        self.requests = requests
        self.sample_rows = sample_rows
        self.positions = positions
        self.token_ids: torch.Tensor | None = None
        self._host: dict[str, torch.Tensor] = {}
        self._event = None
        self._shared = False    # _host views a graph's published table, which a later replay overwrites
        self._values: dict[str, list] | None = None    # published tokens, once read
        self.prompt_logprobs: list = []      # prompt_logprobs.PromptLogprobs of the requests that asked

    def start_copy(self, out: SamplerOutput, mapped: bool = False, published: torch.Tensor | None = None,
                   done=None) -> None:
        """Starts the copy of the sampled tokens (and logprobs) to the host; with `mapped`, tokens
        alone go by a kernel writing pinned memory (`staging.publish`) instead of a copy engine.
        `published`: the tokens alone, which the step's graph writes into this pinned view itself;
        `done`: an event recorded after that graph (else one is recorded here)."""
        if published is not None:
            self._host, self._shared = {"token_ids": published}, True
            self._event = done
            if done is None and published.is_pinned():
                self._event = torch.cuda.Event()
                self._event.record()
            return
        tensors = {"token_ids": out.token_ids}
        if out.logprobs is not None:
            tensors.update(logprobs=out.logprobs, logprob_token_ids=out.logprob_token_ids, ranks=out.ranks)
        if not out.token_ids.is_cuda:     # a copy: the tokens may be a graph's output, which its next replay overwrites
            self._host = {k: v.clone() for k, v in tensors.items()}
            return
        if mapped and len(tensors) == 1:
            host = torch.empty(out.token_ids.shape, dtype=torch.int64, pin_memory=True)
            staging.publish(out.token_ids.contiguous(), host)
            self._host = {"token_ids": host}
        else:
            self._host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True).copy_(v, non_blocking=True)
                          for k, v in tensors.items()}
        self._event = torch.cuda.Event()
        self._event.record()

    def fetch(self) -> dict[str, list]:
        if self._values is not None:
            return self._values
        if self._event is not None:
            self._event.synchronize()
        values = {k: v.tolist() for k, v in self._host.items()}
        if self._shared:    # these lists are the private copy
            self._values, self._host, self._shared = values, {}, False
        return values

    def settle(self) -> None:
        """Takes a private copy of tokens that a graph published, before a later replay overwrites them
        (a no-op once fetched)."""
        if self._shared:
            self.fetch()
