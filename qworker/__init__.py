"""qworker: a GPU batch-inference worker with a paged-KV continuously batched engine.

The public Python API mirrors vLLM's names::

    from qworker import LLM, SamplingParams, StructuredOutputsParams

Only the engine is imported here, so ``import qworker`` works on machines
without the worker's dependencies (pydantic, aiokafka, boto3, orjson).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qworker.engine.outputs import CompletionOutput, EmbeddingOutput, RequestOutput
from qworker.engine.sampling_params import SamplingParams
from qworker.engine.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    from qworker.engine.llm import LLM

__all__ = ["LLM", "CompletionOutput", "EmbeddingOutput", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # LLM pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from qworker.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'qworker' has no attribute {name!r}")
