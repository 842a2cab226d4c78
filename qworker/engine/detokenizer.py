"""Incremental detokenization and stop-string matching for one sequence.

Decoding each step only the last few tokens (vLLM's prefix/read offsets) keeps the
cost per step constant while producing the same text as decoding everything at
once; a piece ending in an incomplete UTF-8 character (``\\ufffd``) is held back
until the next token completes it.
"""

from __future__ import annotations

from typing import Any

from qworker.engine.sequence import Sequence

_CONTEXT_TOKENS = 5


def start_offsets(num_prompt_tokens: int) -> tuple[int, int]:
    """``(prefix_offset, read_offset)`` for a sequence that has generated nothing yet."""
    return max(num_prompt_tokens - _CONTEXT_TOKENS, 0), num_prompt_tokens


def append_new_text(tokenizer: Any, seq: Sequence) -> str:
    """Decode what the sequence's last token(s) added, append it to ``seq.text``, return it."""
    ids = seq.token_ids
    prefix = tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=True)
    full = tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=True)
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        new = full[len(prefix) :]
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        seq.text += new
        return new
    return ""


def full_output_text(tokenizer: Any, seq: Sequence, exclude_last: bool = False) -> str:
    """The sequence's whole output text, decoded at once with the same prompt context
    (without its last token when ``exclude_last``)."""
    ids = seq.token_ids[:-1] if exclude_last else seq.token_ids
    start, read = start_offsets(seq.num_prompt_tokens)
    prefix = tokenizer.decode(ids[start:read], skip_special_tokens=True)
    full = tokenizer.decode(ids[start:], skip_special_tokens=True)
    return full[len(prefix) :] if full.startswith(prefix) else tokenizer.decode(
        ids[read:], skip_special_tokens=True
    )


def find_stop(text: str, num_new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends within the last ``num_new_chars`` characters.

    Returns ``(index where it starts, the stop string)`` or None.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best
