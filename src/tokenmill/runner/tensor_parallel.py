"""Tensor parallelism across processes of one host (`EngineConfig.tensor_parallel_size` N > 1).

Rank 0 is the engine's own `ModelRunner`: it alone schedules and samples. Ranks 1..N-1 are worker
processes (`tp_worker.py`) that hold the other slices of the same model and of the KV cache
(`layers/parallel.py`) and replay every model call that rank 0 makes:

- rank 0 calls the model only through `ShardedModel`, which first broadcasts the call (a fixed-size
  int64 header, then one payload: a forward pass's input ids, positions and attention metadata, or a
  head product's hidden rows) and then runs it; a worker receives the same call and runs it too, so
  every rank runs the same sequence of calls and their all-reduces and all-gathers pair up;
- a worker's logits are dropped: the all-gather gives rank 0 the whole vocabulary.

Workers are started with `subprocess` rather than `multiprocessing` because the engine core may itself
be a daemonic process, which multiprocessing forbids to have children. A worker reads its arguments
from its stdin and exits as soon as that pipe closes: when rank 0 closes it (`close`, or the finalizer
once the runner is collected) or when rank 0's process dies, so no worker outlives the engine.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import weakref

import torch
import torch.distributed as dist

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.layers.attention_metadata import AttentionMetadata
from tokenmill.layers.parallel import TensorParallel

HEADER_LEN = 8
START, FORWARD, LOGITS = 1, 2, 3
# a worker waits for rank 0's next call for as long as the engine sits idle, so collectives never time
# out; a rank that dies closes its connections, which fails its peers' collectives at once
_COLLECTIVE_TIMEOUT = datetime.timedelta(days=3650)
_READY_TIMEOUT_S = 600.0


def make_group(store: dist.Store, rank: int, size: int):
    """The gloo process group of the ranks, over the loopback interface."""
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._timeout = _COLLECTIVE_TIMEOUT
    return dist.ProcessGroupGloo(store, rank, size, options)


def ready_key(rank: int) -> str:
    """Where a worker reports its slice of the model loaded (or its error)."""
    return f"tokenmill_tp_ready_{rank}"


def started_key(rank: int) -> str:
    """Where a worker reports its slice of the KV cache allocated (or its error)."""
    return f"tokenmill_tp_started_{rank}"


def header(*values: int) -> torch.Tensor:
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[:len(values)] = torch.tensor(values, dtype=torch.int64)
    return h


def forward_payload(input_ids: torch.Tensor, positions: torch.Tensor,
                    meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The header and the one int64 payload of a forward pass's inputs (`unpack_forward` inverts it)."""
    tiles = meta.prefill_tiles
    seqs, width = meta.block_tables.shape
    parts = [input_ids, positions, meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables.flatten()]
    if tiles is not None:
        parts.append(tiles.flatten())
    payload = torch.cat([p.to(torch.int64) for p in parts])
    return (header(FORWARD, input_ids.shape[0], seqs, width, meta.max_query_len, meta.max_seq_len,
                   -1 if tiles is None else tiles.shape[1]), payload)


def _forward_sizes(h: list[int]) -> list[int]:
    _, tokens, seqs, width, _, _, num_tiles, _ = h
    return [tokens, tokens, tokens, seqs + 1, seqs, seqs * width, max(num_tiles, 0) * 2]


def forward_payload_len(h: list[int]) -> int:
    """The int64 elements of the payload that follows forward header `h`."""
    return sum(_forward_sizes(h))


def unpack_forward(h: list[int], payload: torch.Tensor):
    """(input_ids, positions, meta) from `forward_payload`'s header values and payload."""
    _, _, seqs, width, max_q, max_seq_len, num_tiles, _ = h
    ids, positions, slots, qsl, seq_lens, tables, tiles = payload.split(_forward_sizes(h))
    i32 = torch.int32
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=qsl.to(i32), seq_lens=seq_lens.to(i32),
                             block_tables=tables.to(i32).view(seqs, width), max_query_len=max_q,
                             max_seq_len=max_seq_len,
                             prefill_tiles=None if num_tiles < 0 else tiles.to(i32).view(2, num_tiles))
    return ids, positions, meta


@contextlib.contextmanager
def _whole_call():
    """Holds a Ctrl-C back until a sharded call ends. Once rank 0 has broadcast a call, every rank must
    run its collectives to the end: cut between (an offline generate interrupted), the workers would wait
    inside a collective that the next call's broadcast never pairs, and it would hang for good. Only the
    main thread receives signals; where SIGINT is ignored there is nothing to hold."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None):
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            if previous is signal.default_int_handler or not callable(previous):
                raise KeyboardInterrupt
            previous(signal.SIGINT, caught[0])


class ShardedModel:
    """Rank 0's tensor-parallel model: called as the model is (`model(input_ids, positions, meta)`,
    `compute_logits`), it has every worker make the same call first; anything else is the model's own
    rank-0 slice (`bind_kv_cache` binds rank 0's cache only: each worker binds its own)."""

    def __init__(self, module: torch.nn.Module, tp: TensorParallel):
        self.module, self.tp = module, tp

    def __call__(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        with _whole_call():
            h, payload = forward_payload(input_ids, positions, meta)
            self.tp.broadcast(h)
            self.tp.broadcast(payload)
            return self.module(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with _whole_call():
            hidden = hidden.contiguous()
            self.tp.broadcast(header(LOGITS, *hidden.shape))
            self.tp.broadcast(hidden)
            return self.module.compute_logits(hidden)

    def __getattr__(self, name):
        if name == "module":        # not set yet (copy, unpickling): no recursion through self.module
            raise AttributeError(name)
        return getattr(self.module, name)


class TensorParallelWorkers:
    """Ranks 1..N-1, seen from rank 0. Built before rank 0 loads its slice, so that the workers load
    theirs at the same time; then `connect` (once rank 0's slice is loaded: waits for the workers' and
    joins the process group) and `start` (the KV cache's size, after which workers serve calls)."""

    def __init__(self, engine_config: EngineConfig, model_config: ModelConfig, model_dir: str):
        size = engine_config.tensor_parallel_size
        self.tp = TensorParallel(0, size)
        self.store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=_READY_TIMEOUT_S))
        env = dict(os.environ)
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
        # a worker's OpenMP threads sleep while it waits on rank 0 instead of spinning on the cores rank 0
        # computes on (at two ranks on two cores, spinning made a step ten times slower)
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        self.procs: list[subprocess.Popen] = []
        # the ranks share this process's threads (the host's cores, or the share the engine core was
        # given): each computes on 1/N of them; restored at `close`
        threads = torch.get_num_threads()
        per_rank = max(1, threads // size)
        torch.set_num_threads(per_rank)
        self._finalizer = weakref.finalize(self, _stop, self.procs, threads)
        for rank in range(1, size):
            proc = subprocess.Popen([sys.executable, "-m", "tokenmill.runner.tp_worker"], stdin=subprocess.PIPE,
                                    env=env)
            self.procs.append(proc)
            proc.stdin.write(pickle.dumps((engine_config, model_config, model_dir, rank, self.store.port, per_rank)))
            proc.stdin.flush()

    def connect(self) -> None:
        """Waits until every worker has loaded its slice (raising what a failed one reported), then joins
        the process group."""
        self._await(ready_key, "load the model")
        # joined on a thread while this one watches the workers: one that dies before it joins would leave
        # the join waiting for good
        joined: dict = {}

        def join():
            try:
                joined["group"] = make_group(self.store, 0, self.tp.size)
            except BaseException as e:
                joined["error"] = e
        thread = threading.Thread(target=join, name="tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.05)
            for rank, proc in enumerate(self.procs, start=1):
                if thread.is_alive() and proc.poll() is not None:
                    raise self.exited(rank, " before it joined the process group")
        if "error" in joined:
            raise joined["error"]
        self.tp.group = joined["group"]

    def start(self, num_blocks: int) -> None:
        """Tells the workers the KV cache's size in blocks and waits until each has allocated its slice
        (raising what a failed one reported); they then serve calls."""
        self.tp.broadcast(header(START, num_blocks))
        self._await(started_key, "allocate its KV cache")

    def _await(self, key_of, what: str) -> None:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        for rank, proc in enumerate(self.procs, start=1):
            key = key_of(rank)
            while not self.store.check([key]):
                if proc.poll() is not None:
                    raise self.exited(rank, f" before it could {what} (its error is in the log above)")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel worker rank {rank} did not {what} in "
                                       f"{_READY_TIMEOUT_S:.0f} s")
                time.sleep(0.02)
            status = self.store.get(key).decode()
            if status != "ok":
                raise RuntimeError(f"tensor-parallel worker rank {rank} failed to {what}:\n{status}")

    def exit_watch(self) -> dict[int, int]:
        """A file descriptor per worker that becomes readable when the worker exits (a pidfd), to its rank:
        an idle engine core waits on them beside its clients, so that a worker's death is noticed at once,
        not at the next request's collective. Empty where the system has no pidfds."""
        if not hasattr(os, "pidfd_open"):
            return {}
        if not hasattr(self, "_pidfds"):
            self._pidfds = {}
            for rank, proc in enumerate(self.procs, start=1):
                try:
                    self._pidfds[os.pidfd_open(proc.pid)] = rank
                except OSError:
                    pass
            weakref.finalize(self, _close_fds, list(self._pidfds))
        return self._pidfds

    def exited(self, rank: int, when: str = "") -> RuntimeError:
        """The error of worker `rank`, which has exited (or is exiting: its status is waited for)."""
        proc = self.procs[rank - 1]
        proc.wait(timeout=5)
        return RuntimeError(f"tensor-parallel worker rank {rank} exited with status {proc.returncode}{when}")

    def close(self) -> None:
        """Stops the workers (closes their stdin) and waits for them; idempotent."""
        self._finalizer()


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _stop(procs: list[subprocess.Popen], threads: int) -> None:
    torch.set_num_threads(threads)
    for proc in procs:
        try:
            proc.stdin.close()
        except OSError:
            pass
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
