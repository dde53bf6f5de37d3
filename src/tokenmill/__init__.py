"""tokenmill: a PagedAttention, continuously batched inference engine for small LLMs."""
from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.llm import LLM
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import SamplingParamError, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "SamplingParamError", "RequestOutput",
           "CompletionOutput", "Logprob", "EngineConfig", "ModelConfig"]
__version__ = "0.1.0"
