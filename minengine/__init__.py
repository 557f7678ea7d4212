"""minengine: a small LLM serving engine driving hand-written paged-attention kernels."""

from minengine.config import EngineConfig
from minengine.llm import LLM, CompletionOutput, RequestOutput
from minengine.logprobs import Logprob
from minengine.sampling_params import SamplingParams
from minengine.structured import StructuredOutputs

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "EngineConfig", "Logprob", "RequestOutput", "SamplingParams", "StructuredOutputs"]
