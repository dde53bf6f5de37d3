"""The part of AsyncLLM that `build_app` and `Serving` read, for tests that script an engine's outputs in
process: a subclass gives `generate`."""
from __future__ import annotations

from tokenmill.engine.output_processor import OutputProcessor


class StandInEngine:
    model_name, dead, on_output = "tiny", False, None

    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self.processor = OutputProcessor(tokenizer)

    def attach(self):
        pass
