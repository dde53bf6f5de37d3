"""tokenmill: a PagedAttention, continuously batched inference engine for small LLMs."""
from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import SamplingParamError, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "SamplingParamError", "RequestOutput",
           "CompletionOutput", "Logprob", "EngineConfig", "ModelConfig"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # `LLM` brings the engine, the model runner and Triton; an API server process, which never builds an
    # engine, imports this package without them
    if name == "LLM":
        from tokenmill.llm import LLM
        return LLM
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
