"""Swap space: KV blocks of swapped-out requests in host memory, and the copies between it and the KV
cache. The block manager decides which blocks move where (`SchedulerOutput.swap_out` / `swap_in`); this
file only moves bytes.

Host blocks are laid out block-major, (num_blocks, layers, 2, block_size, kv_heads, head_dim), so that one
block is one contiguous run of host memory and a run of consecutive blocks is one DMA copy. On CUDA the
memory is pinned and the copies run on a side stream, in step order:

- a copy reads or writes a GPU block only after every forward launched before it: the side stream waits
  on the compute stream first (a swapped-out block holds K/V that the step in flight is still writing);
- the compute stream waits for a step's copies before a forward that may write a block they read or
  fill. The swap-outs of GPU blocks that this step's requests took (`swap_out_reused`: usually the one
  or two blocks the preempting request needed) are copied first, and this step's forward waits for
  those only; the rest is waited for before the next step's forward, by when it has had the length of
  a step to finish. A swapped-in request first runs in the next step, so a swap-in never holds up the
  step that issues it;
- copies run in issue order on the one side stream, so a host block freed by a swap-in (or a finish) and
  reused by a later swap-out is read before it is overwritten.

On the CPU every copy is immediate, and the order of calls is the order of effects.
"""
from __future__ import annotations

import threading

import torch

# blocks gathered per device-side copy: bounds the transient device memory of a swap to this many blocks
_CHUNK_BLOCKS = 32


class SwapSpace:
    def __init__(self, kv_cache: torch.Tensor, num_blocks: int):
        layers, two, _, block_size, heads, head_dim = kv_cache.shape
        # copies move bytes: a one-byte (FP8) cache as uint8, which every indexing op takes on every device
        self.kv_cache = kv_cache = kv_cache.view(torch.uint8) if kv_cache.element_size() == 1 else kv_cache
        self.num_blocks = num_blocks
        self.cuda = kv_cache.is_cuda
        shape = (num_blocks, layers, two, block_size, heads, head_dim)
        self.stream = torch.cuda.Stream(kv_cache.device) if self.cuda else None
        self._pending: torch.cuda.Event | None = None     # the copies of an earlier step, not yet waited on
        self._blocks: torch.Tensor | None = None
        self._pinning: threading.Thread | None = None
        if self.cuda:
            # pinning GiBs of host memory takes time in proportion to their size: it runs beside the
            # engine instead of delaying its start, and the first swap waits for it. Not during CUDA-graph
            # capture, which forbids allocations from other threads: the runner builds this after capture.
            def pin():
                self._blocks = torch.empty(shape, dtype=kv_cache.dtype, pin_memory=True)
            self._pinning = threading.Thread(target=pin, name="tokenmill-swap-pin", daemon=True)
            self._pinning.start()
        else:
            # on the CPU, torch.empty maps pages lazily: an unused swap space costs no memory
            self._blocks = torch.empty(shape, dtype=kv_cache.dtype)

    @property
    def blocks(self) -> torch.Tensor:
        """The host blocks, once their memory is allocated."""
        if self._pinning is not None:
            self._pinning.join()
            self._pinning = None
            if self._blocks is None:
                raise RuntimeError(f"could not allocate the swap space: {self.num_blocks} pinned KV blocks")
        return self._blocks

    @staticmethod
    def _runs(pairs: list[tuple[int, int]], host_side: int):
        """Splits (src, dst) pairs into chunks, and each chunk's host blocks into consecutive runs:
        yields (device block ids, [(first row in chunk, first host block, count)])."""
        for start in range(0, len(pairs), _CHUNK_BLOCKS):
            chunk = pairs[start:start + _CHUNK_BLOCKS]
            device_ids = [p[1 - host_side] for p in chunk]
            runs, host = [], [p[host_side] for p in chunk]
            j = 0
            while j < len(host):
                k = j + 1
                while k < len(host) and host[k] == host[k - 1] + 1:
                    k += 1
                runs.append((j, host[j], k - j))
                j = k
            yield device_ids, runs

    def _index(self, ids: list[int]) -> torch.Tensor:
        index = torch.tensor(ids, dtype=torch.int64)
        if self.cuda:   # from pinned memory: a pageable upload would wait for the streams
            index = index.pin_memory().to(self.kv_cache.device, non_blocking=True)
        return index

    @torch.inference_mode()
    def copy(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]], reused: list[int]) -> None:
        """Makes one step's copies, (GPU, host) pairs out and (host, GPU) pairs in, `reused` the GPU blocks
        of `swap_out` that this step's forward may write; called once per step before the step's forward
        is launched (also for a step that runs no request)."""
        if not self.cuda:
            self._copy(swap_out, swap_in)
            return
        compute = torch.cuda.current_stream(self.kv_cache.device)
        if self._pending is not None:
            compute.wait_event(self._pending)
            self._pending = None
        if not swap_out and not swap_in:
            return
        taken = set(reused)
        first = [p for p in swap_out if p[0] in taken]
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            if first:
                self._copy(first, [])
                urgent = torch.cuda.Event()
                urgent.record(self.stream)
                compute.wait_event(urgent)
            self._copy([p for p in swap_out if p[0] not in taken], swap_in)
            done = torch.cuda.Event()
            done.record(self.stream)
        self._pending = done

    def _copy(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        kv, nb, host = self.kv_cache, self.cuda, self.blocks
        for device_ids, runs in self._runs(swap_out, host_side=1):
            gathered = kv.index_select(2, self._index(device_ids)).permute(2, 0, 1, 3, 4, 5).contiguous()
            for row, first, count in runs:
                host[first:first + count].copy_(gathered[row:row + count], non_blocking=nb)
        for device_ids, runs in self._runs(swap_in, host_side=0):
            staged = torch.empty((len(device_ids),) + host.shape[1:], dtype=kv.dtype, device=kv.device)
            for row, first, count in runs:
                staged[row:row + count].copy_(host[first:first + count], non_blocking=nb)
            kv.index_copy_(2, self._index(device_ids), staged.permute(1, 2, 0, 3, 4, 5))
