"""Model implementations over the paged KV cache, and how to load them.

``load_model`` / ``load_tokenizer`` (``qworker.models.loader``) are the entry points;
``supported_architectures`` lists what they accept.
"""

from qworker.models.loader import LoadedModel, find_smollm2_dir, load_model, load_tokenizer
from qworker.models.registry import supported_architectures

__all__ = [
    "LoadedModel",
    "find_smollm2_dir",
    "load_model",
    "load_tokenizer",
    "supported_architectures",
]
