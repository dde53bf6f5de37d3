"""An engine factory for server tests whose outcome depends on requests still running: every step
takes at least `STEP_S`, so a few hundred tokens outlast the test's actions on any machine."""
from __future__ import annotations

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
