"""tokenmill: a PagedAttention, continuously batched inference engine for small LLMs."""
from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.llm import LLM
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "EngineConfig",
           "ModelConfig"]
__version__ = "0.1.0"
