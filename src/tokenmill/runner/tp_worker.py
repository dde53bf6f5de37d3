"""A tensor-parallel worker process, rank r > 0 (`python -m tokenmill.runner.tp_worker`, started by
`tensor_parallel.TensorParallelWorkers`): it loads rank r's slice of the model, allocates its slice of
the KV cache, then replays every model call that rank 0 broadcasts (see `tensor_parallel.py`) until
its stdin closes."""
from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import traceback

import torch
import torch.distributed as dist

from tokenmill.layers.backend import make_backend
from tokenmill.layers.parallel import TensorParallel
from tokenmill.runner import tensor_parallel as wire
from tokenmill.runner.loader import load_model
from tokenmill.runner.model_runner import kv_cache_tensors


# the status an EOF on stdin exits with: 1 once a failure is being reported (rank 0, told of it, closes our
# stdin, and that must not turn the failure into a clean exit)
_stdin_exit_status = 0


def _exit_when_stdin_closes() -> None:
    """Rank 0 holds the other end of stdin: EOF means it stopped us or died. Read unbuffered: a thread
    blocked inside the buffered reader holds its lock, which the interpreter's exit then waits on (an
    abort, status -6, where a failed worker should exit 1)."""
    while os.read(0, 4096):
        pass
    os._exit(_stdin_exit_status)


class Worker:
    def __init__(self, engine_config, model_config, model_dir: str, rank: int):
        self.config, self.model_config = engine_config, model_config
        self.device = engine_config.resolve_device()
        self.dtype = engine_config.resolve_dtype(model_config, self.device)
        self.tp = TensorParallel(rank, engine_config.tensor_parallel_size)
        self.model = load_model(model_dir, model_config, self.device, self.dtype, engine_config.quantization,
                                self.tp)
        self.model.use_backend(make_backend(self.device, engine_config.kernels))

    @torch.inference_mode()
    def allocate(self) -> None:
        """Allocates the KV cache rank 0 sized (its START call)."""
        h = self.tp.broadcast(wire.header()).tolist()
        if h[0] != wire.START:
            raise RuntimeError(f"tensor-parallel worker rank {self.tp.rank}: expected START, got {h}")
        kv_cache, kv_scales = kv_cache_tensors(
            self.model_config, h[1], self.config.block_size,
            self.config.resolve_kv_cache_dtype(self.dtype), self.device, self.tp.size)
        self.model.bind_kv_cache(kv_cache, kv_scales)

    @torch.inference_mode()
    def serve(self) -> None:
        """Runs each call rank 0 broadcasts."""
        while True:
            h = self.tp.broadcast(wire.header()).tolist()
            if h[0] == wire.FORWARD:
                payload = torch.empty(wire.forward_payload_len(h), dtype=torch.int64, device=self.device)
                self.tp.broadcast(payload)
                self.model(*wire.unpack_forward(h, payload))
            elif h[0] == wire.LOGITS:
                hidden = torch.empty(h[1], h[2], dtype=self.dtype, device=self.device)
                self.model.compute_logits(self.tp.broadcast(hidden))
            else:
                raise RuntimeError(f"tensor-parallel worker rank {self.tp.rank}: unknown call {h}")


def _report(store, key: str, step) -> None:
    """Runs `step`, then tells rank 0 through `key` that it succeeded, or its traceback (and exits 1)."""
    global _stdin_exit_status
    try:
        step()
    except BaseException:
        _stdin_exit_status = 1
        traceback.print_exc()
        store.set(key, traceback.format_exc())
        _exit(1)
    store.set(key, "ok")


def _exit(status: int) -> None:
    """Exits at once: the interpreter's own exit would run the destructors of the store's and the process
    group's threads, which abort the process (status -6) where it should report `status`."""
    sys.stderr.flush()
    os._exit(status)


def main() -> None:
    # rank 0's engine decides when we stop (it closes our stdin): a terminal's Ctrl-C or a SIGTERM to the
    # process group must not cut its drain short
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    engine_config, model_config, model_dir, rank, port, threads = pickle.load(sys.stdin.buffer)
    threading.Thread(target=_exit_when_stdin_closes, name="tokenmill-tp-parent", daemon=True).start()
    size = engine_config.tensor_parallel_size
    torch.set_num_threads(threads)          # rank 0's share of its threads
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False)
    workers = []
    _report(store, wire.ready_key(rank), lambda: workers.append(Worker(engine_config, model_config, model_dir, rank)))
    worker = workers[0]
    worker.tp.group = wire.make_group(store, rank, size)
    _report(store, wire.started_key(rank), worker.allocate)
    try:
        worker.serve()
    except RuntimeError as e:       # a collective failed: rank 0 (or another rank) is gone
        print(f"tokenmill tensor-parallel worker rank {rank} stops: {e}", file=sys.stderr)
        _exit(1)


if __name__ == "__main__":
    main()
