"""Fixtures for the grammar tests: SmolLM2's tokenizer and a backend over it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir: Path) -> Any:
    """SmolLM2's Hugging Face tokenizer (vocab 49152, EOS 2)."""
    from transformers import AutoTokenizer

    from tests.fixtures.models import _smollm2_tokenizer_dir

    return AutoTokenizer.from_pretrained(str(_smollm2_tokenizer_dir(smollm2_dir)))


@pytest.fixture()
def backend(smollm2_tokenizer: Any) -> Any:
    """A fresh llguidance backend for SmolLM2 (skips where llguidance is not installed)."""
    pytest.importorskip("llguidance")
    from qworker.engine.structured.backend import GrammarBackend

    return GrammarBackend(smollm2_tokenizer, 49152, [2])
