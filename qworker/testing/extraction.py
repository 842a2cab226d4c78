"""Schema-constrained extraction workload shared by the benchmarks and the GPU check.

Each entry is a JSON schema of the kind overnight extraction jobs send (nested objects,
enums, bounded arrays, required fields, numbers and integers), one valid instance of it
(to walk a grammar matcher through a realistic token sequence) and a prompt asking a
model for it. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ExtractionCase:
    """One schema, an instance that validates against it, and a prompt asking for it."""

    name: str
    schema: dict[str, Any]
    instance: Any
    prompt: str


PERSON = ExtractionCase(
    name="person",
    schema={
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string"},
            "address": {
                "type": "object",
                "properties": {
                    "street": {"type": "string"},
                    "city": {"type": "string"},
                    "country": {"type": "string", "enum": ["US", "UK", "FR", "DE", "other"]},
                },
                "required": ["city", "country"],
                "additionalProperties": False,
            },
            "skills": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                       "maxItems": 4},
        },
        "required": ["name", "age", "address", "skills"],
        "additionalProperties": False,
    },
    instance={"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
              "address": {"street": "12 St James's Square", "city": "London", "country": "UK"},
              "skills": ["mathematics", "poetry"]},
    prompt="Extract the person as JSON: Ada Lovelace, 36, lives at 12 St James's Square, "
           "London. She is skilled in mathematics and poetry. Email ada@example.org.",
)

INVOICE = ExtractionCase(
    name="invoice",
    schema={
        "type": "object",
        "properties": {
            "invoice_number": {"type": "string"},
            "currency": {"enum": ["USD", "EUR", "GBP"]},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 5,
                "items": {
                    "type": "object",
                    "properties": {
                        "description": {"type": "string"},
                        "quantity": {"type": "integer", "minimum": 1},
                        "unit_price": {"type": "number", "minimum": 0},
                    },
                    "required": ["description", "quantity", "unit_price"],
                    "additionalProperties": False,
                },
            },
            "total": {"type": "number"},
            "paid": {"type": "boolean"},
        },
        "required": ["invoice_number", "currency", "items", "total"],
        "additionalProperties": False,
    },
    instance={"invoice_number": "INV-2041", "currency": "EUR",
              "items": [{"description": "Widget", "quantity": 3, "unit_price": 4.5},
                        {"description": "Gadget, large", "quantity": 1, "unit_price": 19.99}],
              "total": 33.49, "paid": False},
    prompt="Extract the invoice as JSON: Invoice INV-2041, in euros: 3 widgets at 4.50 each "
           "and one large gadget at 19.99; total 33.49; not paid yet.",
)

REVIEW = ExtractionCase(
    name="review",
    schema={
        "type": "object",
        "properties": {
            "sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            "topics": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
            "summary": {"type": "string"},
        },
        "required": ["sentiment", "rating", "topics", "summary"],
        "additionalProperties": False,
    },
    instance={"sentiment": "negative", "rating": 2, "confidence": 0.8,
              "topics": ["battery", "screen"],
              "summary": "The battery dies fast and the screen scratches easily."},
    prompt="Classify this review as JSON: 'The battery dies within hours and the screen "
           "scratched on day one. Two stars.'",
)

CASES: tuple[ExtractionCase, ...] = (PERSON, INVOICE, REVIEW)


def cap_strings(schema: Any, max_length: int) -> Any:
    """``schema`` with every free-form string (no ``enum``) limited to ``max_length``
    characters: a random model's answers then end within a small ``max_tokens``."""
    if isinstance(schema, dict):
        out = {k: cap_strings(v, max_length) for k, v in schema.items()}
        if out.get("type") == "string" and "enum" not in out:
            out["maxLength"] = max_length
        return out
    if isinstance(schema, list):
        return [cap_strings(v, max_length) for v in schema]
    return schema
