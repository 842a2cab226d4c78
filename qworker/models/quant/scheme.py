"""Which FP8 scheme a checkpoint's ``quantization_config`` (or the ``quantization`` knob)
asks for, or a one-line ``ModelLoadError`` naming what is not supported.

Supported (docs/quantization.md):

- ``quant_method: compressed-tensors`` with 8-bit float weights (``format``
  ``float-quantized`` or ``naive-quantized``): per-tensor, per-channel or block weight
  scales (``weight_scale``); activations dynamic per token, dynamic per group, static per
  tensor (``input_scale``), or none (weight-only).
- ``quant_method: fp8`` (transformers' fine-grained FP8, as Qwen's and DeepSeek's
  "-FP8" checkpoints ship): block scales ``weight_scale_inv`` over ``weight_block_size``
  (``[128, 128]``), activations dynamic per 1 x block-width group.
- ``quantization="fp8"`` on an unquantized checkpoint: per-channel weight scales made on
  load, activations dynamic per token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from qworker.errors import ModelLoadError

#: The ``quantization`` knob's values.
QUANTIZATION_MODES = ("auto", "fp8", "none")

_KNOWN_OTHER = ("awq", "gptq", "bitsandbytes", "bitsandbytes_4bit", "bitsandbytes_8bit",
                "mxfp4", "aqlm", "quanto", "eetq", "hqq", "torchao", "fbgemm_fp8", "bitnet",
                "higgs", "vptq", "spqr", "fp_quant", "auto-round", "quark", "nvfp4")


class WeightScales(enum.Enum):
    """How an FP8 weight's dequantization scales are laid out."""

    TENSOR = "tensor"  # one scale
    CHANNEL = "channel"  # one per output row
    BLOCK = "block"  # one per (block rows x block cols) tile


class ActQuant(enum.Enum):
    """How a quantized layer's input activations are quantized to FP8."""

    NONE = "none"  # weight-only (W8A16)
    DYNAMIC_TOKEN = "token"  # a scale per token, from the token's amax
    DYNAMIC_GROUP = "group"  # a scale per token and group of input columns
    STATIC_TENSOR = "tensor"  # the checkpoint's calibrated ``input_scale``


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """One FP8 scheme for every quantized layer of a model.

    ``source``: ``"compressed-tensors"``, ``"fp8"`` (fine-grained) or ``"online"``
    (quantized on load). ``block``: ``(rows, cols)`` of a weight scale tile (BLOCK
    only). ``group_size``: input columns per activation scale (DYNAMIC_GROUP only).
    ``scale_name``: the checkpoint tensor beside each weight that holds its scales.
    """

    source: str
    weights: WeightScales
    activations: ActQuant
    block: tuple[int, int] | None = None
    group_size: int | None = None
    scale_name: str = "weight_scale"

    @property
    def online(self) -> bool:
        """Whether weights are quantized by qworker on load (not by the checkpoint)."""
        return self.source == "online"


ONLINE_FP8 = Fp8Scheme("online", WeightScales.CHANNEL, ActQuant.DYNAMIC_TOKEN)


def resolve_scheme(quantization_config: Any, mode: str) -> Fp8Scheme | None:
    """The scheme for a checkpoint whose config.json holds ``quantization_config`` (None
    when absent) under the knob's ``mode``; None means an unquantized model.

    ``auto``: the checkpoint's scheme. ``fp8``: the checkpoint's FP8 scheme, or online
    FP8 for an unquantized checkpoint. ``none``: None for an unquantized or FP8
    checkpoint (FP8 weights are then dequantized on load and activations stay unquantized).
    Any method other than FP8 is a ``ModelLoadError`` naming it, whatever the mode.
    """
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be 'auto', 'fp8' or 'none', got {mode!r}")
    scheme = None if quantization_config in (None, {}) else _parse(quantization_config)
    if mode == "none":
        return None
    if mode == "fp8" and scheme is None:
        return ONLINE_FP8
    return scheme


def _parse(qc: Any) -> Fp8Scheme:
    if not isinstance(qc, dict):
        raise ModelLoadError(f"config.json: quantization_config must be an object, got {qc!r}")
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fp8":
        return _fine_grained(qc)
    known = " (a known method qworker does not load)" if method in _KNOWN_OTHER else ""
    raise ModelLoadError(
        f"config.json: quantization_config.quant_method {method or None!r} is not supported"
        f"{known}; qworker loads FP8 checkpoints (compressed-tensors float8, fine-grained "
        "fp8) and unquantized ones"
    )


def _fine_grained(qc: dict[str, Any]) -> Fp8Scheme:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelLoadError(f"config.json: fp8 quantization_config.fmt {fmt!r} is not "
                             "supported (only e4m3)")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ModelLoadError(f"config.json: fp8 quantization_config.activation_scheme "
                             f"{scheme!r} is not supported (only 'dynamic')")
    block = qc.get("weight_block_size")
    if block is None:
        return Fp8Scheme("fp8", WeightScales.TENSOR, ActQuant.DYNAMIC_TOKEN,
                         scale_name="weight_scale_inv")
    if (not isinstance(block, list | tuple) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelLoadError(f"config.json: fp8 quantization_config.weight_block_size must be "
                             f"two positive integers, got {block!r}")
    return Fp8Scheme("fp8", WeightScales.BLOCK, ActQuant.DYNAMIC_GROUP, block=(block[0],
                     block[1]), group_size=block[1], scale_name="weight_scale_inv")


def _compressed_tensors(qc: dict[str, Any]) -> Fp8Scheme:
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ModelLoadError("config.json: compressed-tensors quantization_config has no "
                             "config_groups")
    schemes = {_ct_group(name, group) for name, group in groups.items()}
    if len(schemes) > 1:
        raise ModelLoadError("config.json: compressed-tensors config_groups with different "
                             f"schemes ({', '.join(sorted(groups))}) are not supported")
    if qc.get("kv_cache_scheme"):
        raise ModelLoadError("config.json: compressed-tensors kv_cache_scheme (calibrated KV "
                             "scales) is not supported; use kv_cache_dtype=fp8_e4m3")
    return schemes.pop()


def _ct_group(name: str, group: dict[str, Any]) -> Fp8Scheme:
    where = f"config.json: compressed-tensors config_groups.{name}"
    fmt = group.get("format")
    weights = group.get("weights") or {}
    kind = f"{weights.get('num_bits')}-bit {weights.get('type')} weights"
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise ModelLoadError(f"{where}: {kind} (format {fmt!r}) are not supported; only "
                             "8-bit float (FP8) weights load")
    if fmt not in (None, "float-quantized", "naive-quantized"):
        raise ModelLoadError(f"{where}: format {fmt!r} is not supported (float-quantized)")
    if weights.get("symmetric") is False:
        raise ModelLoadError(f"{where}: asymmetric FP8 weights are not supported")
    if weights.get("dynamic"):
        raise ModelLoadError(f"{where}: dynamic weight scales are not supported")
    strategy = weights.get("strategy")
    block = None
    if strategy == "tensor":
        wscales = WeightScales.TENSOR
    elif strategy == "channel":
        wscales = WeightScales.CHANNEL
    elif strategy == "block":
        shape = weights.get("block_structure")
        if not isinstance(shape, list) or len(shape) != 2:
            raise ModelLoadError(f"{where}: block weights need a block_structure [rows, cols]")
        wscales, block = WeightScales.BLOCK, (int(shape[0]), int(shape[1]))
    else:
        raise ModelLoadError(f"{where}: weight strategy {strategy!r} is not supported "
                             "(tensor, channel or block)")
    if group.get("output_activations"):
        raise ModelLoadError(f"{where}: output activation quantization is not supported")
    acts = group.get("input_activations")
    if not acts:
        return Fp8Scheme("compressed-tensors", wscales, ActQuant.NONE, block=block)
    if acts.get("type") != "float" or acts.get("num_bits") != 8 or acts.get("symmetric") is False:
        raise ModelLoadError(f"{where}: input activations other than symmetric 8-bit float "
                             "are not supported")
    act_strategy, dynamic = acts.get("strategy"), bool(acts.get("dynamic"))
    if dynamic and act_strategy == "token":
        return Fp8Scheme("compressed-tensors", wscales, ActQuant.DYNAMIC_TOKEN, block=block)
    if dynamic and act_strategy == "group" and isinstance(acts.get("group_size"), int):
        return Fp8Scheme("compressed-tensors", wscales, ActQuant.DYNAMIC_GROUP, block=block,
                         group_size=acts["group_size"])
    if not dynamic and act_strategy == "tensor":
        return Fp8Scheme("compressed-tensors", wscales, ActQuant.STATIC_TENSOR, block=block)
    raise ModelLoadError(f"{where}: {'dynamic' if dynamic else 'static'} per-{act_strategy} "
                         "input activation scales are not supported (dynamic per token or "
                         "group, static per tensor)")
