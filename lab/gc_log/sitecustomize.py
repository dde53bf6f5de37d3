"""Logs the garbage collector's pauses of every Python process started with this folder on PYTHONPATH
(Python imports `sitecustomize` at start-up): one line per collection of generation 2, or of any
generation that took over 2 ms, appended to $GC_LOG_DIR/<pid>.txt as "unix-time gen ms collected".

    GC_LOG_DIR=/tmp/gc PYTHONPATH=lab/gc_log:src tokenmill serve ...
    python lab/gc_log/summary.py /tmp/gc START END      # pauses per process between two unix times
"""
import gc
import os
import time

_DIR = os.environ.get("GC_LOG_DIR")
_start = [0.0]


def _log(phase, info):
    if phase == "start":
        _start[0] = time.perf_counter()
        return
    ms = (time.perf_counter() - _start[0]) * 1e3
    if ms > 2.0 or info["generation"] == 2:
        with open(os.path.join(_DIR, f"{os.getpid()}.txt"), "a") as f:
            f.write(f"{time.time():.3f} {info['generation']} {ms:.2f} {info['collected']}\n")


if _DIR:
    os.makedirs(_DIR, exist_ok=True)
    gc.callbacks.append(_log)
