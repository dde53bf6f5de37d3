"""An engine factory for server tests whose outcome depends on requests still running: every step
takes at least `STEP_S`, so a few hundred tokens outlast the test's actions on any machine."""
from __future__ import annotations

import threading
import time

from tokenmill.engine.engine import LLMEngine

STEP_S = 0.02


class SlowEngine(LLMEngine):
    def step(self):
        time.sleep(STEP_S)
        return super().step()


def make(config):
    return SlowEngine(config)


def never_ready(config):
    """A core whose engine never finishes loading (an interrupted start-up)."""
    time.sleep(3600)


LOADING = threading.Event()      # set to let `core_0_loads` return


def core_0_loads(config):
    """For cores in threads of the test (`EngineCore(in_process=True)`) whose configs carry their index in
    `extra["core"]`: core 0 loads until `LOADING` is set (and then fails too); the others fail at once."""
    if config.extra["core"] == 0:
        LOADING.wait(60)
    raise ValueError(f"core {config.extra['core']} cannot load its model")


STARTING = threading.Event()     # set by the frontend's `while_starting`


def loads_once_started(config):
    """A core (in a thread of the test) that finishes loading only once its frontend's `AsyncLLM`
    `while_starting` has run, and fails if that has not come within 5 s."""
    if not STARTING.wait(5):
        raise RuntimeError("while_starting did not run while the core loaded")
    return LLMEngine(config)
