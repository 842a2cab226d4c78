"""Reference outputs from ``transformers`` for parity tests (fp32, CPU), memoised per model."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import torch


@functools.lru_cache(maxsize=8)
def hf_model(path: str, gguf_file: str | None = None) -> torch.nn.Module:
    """The transformers model at ``path`` in fp32, eval mode (cached)."""
    from tests.fixtures.models import load_hf_reference

    model = load_hf_reference(Path(path), gguf_file)
    # No EOS at all: the engine's ignore_eos keeps a sampled EOS and goes on, whereas
    # min_new_tokens would forbid sampling it.
    model.generation_config.eos_token_id = None
    return model


_greedy_cache: dict[tuple[str, tuple[int, ...], int], list[int]] = {}


def hf_greedy(path: Path | str, prompt: list[int], max_new_tokens: int,
              gguf_file: str | None = None) -> list[int]:
    """``generate(do_sample=False)`` continuation of one prompt, EOS disabled."""
    key = (str(path), tuple(prompt), max_new_tokens)
    if key not in _greedy_cache:
        model = hf_model(str(path), gguf_file)
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=max_new_tokens, pad_token_id=0,
            )
        _greedy_cache[key] = out[0, len(prompt):].tolist()
    return _greedy_cache[key]


def hf_logits(path: Path | str, tokens: list[int]) -> torch.Tensor:
    """fp32 logits ``[len(tokens), vocab]`` of one forward over ``tokens``."""
    model = hf_model(str(path))
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float()


def random_prompts(count: int, min_len: int, max_len: int, vocab: int = 512,
                   seed: int = 0) -> list[list[int]]:
    """Seeded prompts of mixed lengths, avoiding ids 0-2 (pad, bos, eos)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))]
            for _ in range(count)]
