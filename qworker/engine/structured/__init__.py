"""Structured outputs: generation constrained to a JSON schema, a regex or a choice.

``params`` holds ``StructuredOutputsParams`` (no grammar library needed); ``backend``
wraps the grammar engine (llguidance, imported lazily: the engine runs without it);
``manager`` keeps each sequence's matcher and fills a step's token masks; ``bitmask``
applies them to the logits on the device. User docs: ``docs/structured_outputs.md``.
"""

from qworker.engine.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
