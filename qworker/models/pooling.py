"""Pooling: one vector per input from its tokens' final hidden states.

The rule comes from a sentence-transformers folder when there is one: ``modules.json``
names a ``Pooling`` module (its ``config.json`` says which modes) and optionally a
``Normalize`` module; ``sentence_bert_config.json``'s ``max_seq_length`` caps the
context. Several modes at once are concatenated in sentence-transformers' order
(cls, max, mean, mean_sqrt_len, lasttoken). Without ``modules.json`` the defaults are
vLLM's: an encoder pools its CLS token, a decoder its last token, both normalized
(docs/embeddings.md, "Pooling").

Pooling works on the step's packed tokens (``PackedBatch``): tensor ops over segment
ids, no loop over inputs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from qworker.errors import ModelLoadError
from qworker.models.packed_attention import PackedBatch

#: Pooling modes in the order sentence-transformers concatenates them.
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len", "lasttoken")

_ST_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_lasttoken": "lasttoken",
}
_ST_MODULE = "sentence_transformers.models."
#: sentence-transformers modules that change nothing here (the backbone itself).
_ST_PASSTHROUGH = ("Transformer",)


@dataclass(frozen=True, slots=True)
class PoolingRule:
    """How a model's token states become its embedding.

    ``modes``: one or more of ``POOLING_MODES`` (concatenated in that order);
    ``normalize``: L2-normalize the pooled vector; ``max_seq_length``: the
    sentence-transformers cap on input tokens (None: none given); ``source``: where the
    rule came from, for logs and docs ("sentence-transformers" or "default").
    """

    modes: tuple[str, ...]
    normalize: bool
    max_seq_length: int | None = None
    source: str = "default"

    def output_dim(self, hidden_size: int) -> int:
        """The embedding's width for a model of ``hidden_size``."""
        return hidden_size * len(self.modes)


def has_sentence_transformers_pooling(folder: Path) -> bool:
    """Whether ``folder`` is a sentence-transformers model with a Pooling module."""
    return any(m.get("type", "").endswith(".Pooling") for m in _read_modules(folder) or [])


def read_pooling_rule(folder: Path, is_encoder: bool) -> PoolingRule:
    """The pooling rule of the model in ``folder``: its sentence-transformers modules, or
    the default for an encoder (CLS) or a decoder (last token), normalized.

    ``ModelLoadError`` for a sentence-transformers module qworker does not run (Dense,
    a second Transformer, ...), rather than returning vectors that differ silently.
    """
    modules = _read_modules(folder)
    max_len = _read_max_seq_length(folder)
    if modules is None:
        return PoolingRule(("cls",) if is_encoder else ("lasttoken",), True, max_len)
    modes: tuple[str, ...] | None = None
    normalize = False
    for module in sorted(modules, key=lambda m: int(m.get("idx", 0))):
        kind = str(module.get("type", ""))
        short = kind.removeprefix(_ST_MODULE)
        if short == "Pooling":
            modes = _read_pooling_modes(folder / str(module.get("path", "")))
        elif short == "Normalize":
            normalize = True
        elif short in _ST_PASSTHROUGH and not module.get("path"):
            continue
        else:
            raise ModelLoadError(
                f"{folder / 'modules.json'} uses the sentence-transformers module {kind!r}, "
                "which qworker does not run (it runs Transformer, Pooling and Normalize)")
    if modes is None:
        modes = ("cls",) if is_encoder else ("lasttoken",)
        normalize = True
    return PoolingRule(modes, normalize, max_len, "sentence-transformers")


def pool(hidden: torch.Tensor, batch: PackedBatch, rule: PoolingRule) -> torch.Tensor:
    """Pool the packed final states ``hidden`` ``[T, H]`` into ``[num_inputs, dim]``
    (fp32), normalized when ``rule`` says so."""
    parts = [_pool_one(hidden, batch, mode) for mode in rule.modes]
    pooled = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    pooled = pooled.float()
    return F.normalize(pooled, p=2, dim=-1) if rule.normalize else pooled


def _pool_one(hidden: torch.Tensor, batch: PackedBatch, mode: str) -> torch.Tensor:
    if mode == "cls":
        return hidden.index_select(0, batch.cu_seqlens[:-1])
    if mode == "lasttoken":
        return hidden.index_select(0, batch.cu_seqlens[1:] - 1)
    num, dim = batch.num_seqs, hidden.shape[-1]
    if mode == "max":
        out = hidden.new_full((num, dim), float("-inf"))
        index = batch.seq_ids.unsqueeze(1).expand(-1, dim)
        return out.scatter_reduce(0, index, hidden, reduce="amax", include_self=True)
    # mean and mean_sqrt_len sum in fp32 (sentence-transformers sums in the model dtype;
    # in fp32 the two agree to rounding)
    sums = torch.zeros((num, dim), dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, batch.seq_ids, hidden.float())
    lengths = batch.lengths.to(torch.float32).unsqueeze(1)
    return sums / (lengths if mode == "mean" else lengths.sqrt())


def _read_modules(folder: Path) -> list[dict[str, Any]] | None:
    path = folder / "modules.json"
    if not path.exists():
        return None
    try:
        modules = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ModelLoadError(f"{path} is not a list of modules")
    return modules


def _read_pooling_modes(path: Path) -> tuple[str, ...]:
    config_path = path / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read the pooling config {config_path}: {exc}") from exc
    if config.get("pooling_mode_weightedmean_tokens"):
        raise ModelLoadError(f"{config_path}: weighted-mean pooling is not supported")
    # newer sentence-transformers write one "pooling_mode" string instead of the flags
    named = config.get("pooling_mode")
    if isinstance(named, str):
        alias = {"mean_tokens": "mean", "max_tokens": "max", "cls_token": "cls",
                 "mean_sqrt_len_tokens": "mean_sqrt_len"}
        flags = {alias.get(m, m) for m in named.split("-")}
    else:
        flags = {mode for key, mode in _ST_KEYS.items() if config.get(key)}
    unknown = flags - set(POOLING_MODES)
    if unknown:
        raise ModelLoadError(f"{config_path}: unsupported pooling mode(s) {sorted(unknown)}")
    if not flags:
        raise ModelLoadError(f"{config_path} enables no pooling mode")
    return tuple(m for m in POOLING_MODES if m in flags)


def _read_max_seq_length(folder: Path) -> int | None:
    path = folder / "sentence_bert_config.json"
    if not path.exists():
        return None
    try:
        value = json.loads(path.read_text()).get("max_seq_length")
    except (OSError, json.JSONDecodeError, AttributeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    return int(value) if isinstance(value, int) and value > 0 else None
