"""kiln: build Llama-family LLM engines for one target and run them fast.

from kiln import LLM, SamplingParams
llm = LLM()  # the embedded SmolLM2-135M-Instruct
print(llm.chat([{"role": "user", "content": "Hi"}])[0].outputs[0].text)
"""

__version__ = "0.1.0"

from kiln.config import BuildConfig, KvCacheConfig, ModelConfig
from kiln.errors import CheckpointError, ConfigError, EngineLoadError, KilnError
from kiln.llm import LLM
from kiln.outputs import CompletionOutput, RequestOutput
from kiln.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "BuildConfig",
    "CheckpointError",
    "CompletionOutput",
    "ConfigError",
    "EngineLoadError",
    "KilnError",
    "KvCacheConfig",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
]
