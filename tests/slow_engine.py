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
