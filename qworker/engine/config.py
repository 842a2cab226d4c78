"""Engine configuration: every engine knob declared once, here.

``EngineConfig`` is a plain record built at the edge and passed inward. Each knob's
field carries its help text, its allowed values and its unit (``Knob`` metadata), and
``check_knob`` holds its rule. The worker's settings (``qworker.config``), the CLI
flags and ``docs/configuration.md`` are generated from these declarations, so the
Python API (``LLM(**knobs)``), ``QWORKER_<NAME>`` and ``--name`` cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

#: Allowed values of the knobs that take one of a few strings.
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
PREEMPTION_MODES = ("recompute", "swap")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "cuda")
KERNEL_SELFTEST_MODES = ("on", "strict", "off")
BLOCK_SIZES = (8, 16, 32)
LOAD_FORMATS = ("auto", "dummy")
QUANTIZATIONS = ("auto", "fp8", "none")
TASKS = ("auto", "generate", "embed")


@dataclass(frozen=True, slots=True)
class Knob:
    """How one engine knob is presented: help text, allowed values, unit.

    ``unit`` is ``"bytes"`` for sizes (which also accept ``"4GiB"``-style strings),
    ``"tokens"``, ``"blocks"``, ``"sequences"`` or ``""``.
    """

    help: str
    choices: tuple[Any, ...] | None = None
    unit: str = ""


def knob(default: Any, help: str, *, choices: tuple[Any, ...] | None = None,
         unit: str = "") -> Any:
    """A dataclass field whose metadata is a ``Knob`` (used only in ``EngineConfig``)."""
    return field(default=default, metadata={"knob": Knob(help, choices, unit)})


@dataclass(slots=True)
class EngineConfig:
    """Every knob of the engine, with the documented names and defaults.

    ``num_kv_blocks`` fixes the pool size exactly; otherwise it is derived from
    ``kv_cache_memory`` (bytes; CPU default 1 GiB) or, on GPU, from
    ``gpu_memory_utilization`` after a profiling forward. ``max_model_len`` None means
    the model's ``max_position_embeddings``. Reference: ``docs/configuration.md``.
    """

    model: str
    dtype: str = knob("auto", "weights/activations dtype; auto = bfloat16 on GPU, float32 on CPU",
                      choices=DTYPES)
    device: str = knob("auto", "device; auto = cuda when available", choices=DEVICES)
    block_size: int = knob(16, "tokens per KV block", choices=BLOCK_SIZES, unit="tokens")
    num_kv_blocks: int | None = knob(
        None, "exact KV pool size (overrides kv_cache_memory and gpu_memory_utilization)",
        unit="blocks")
    kv_cache_memory: int | None = knob(
        None, "memory for the KV pool (CPU default 1 GiB); accepts 4GiB, 512MiB, ...",
        unit="bytes")
    gpu_memory_utilization: float = knob(
        0.90, "GPU: share of device memory for weights, activations and the KV pool")
    max_num_seqs: int = knob(256, "most sequences in one step", unit="sequences")
    max_num_batched_tokens: int = knob(
        8192, "token budget of one step (longer prompts are prefilled in chunks)", unit="tokens")
    max_model_len: int | None = knob(
        None, "context length; default: the model's max_position_embeddings", unit="tokens")
    enable_prefix_caching: bool = knob(True, "share KV blocks of common prompt prefixes")
    preemption_mode: str = knob("recompute", "how a sequence gives up its KV blocks when the "
                                "pool runs out", choices=PREEMPTION_MODES)
    swap_space: int = knob(4 << 30, "host memory for swapped-out KV blocks (swap mode)",
                           unit="bytes")
    attention_backend: str = knob(
        "auto", "attention implementation; auto = cuda kernels on GPU, batched cpu backend "
        "elsewhere; torch = the per-sequence reference",
        choices=ATTENTION_BACKENDS)
    kernel_selftest: str = knob(
        "on", "check the selected CUDA kernels against the torch reference at engine start "
        "(model dtype, head size, GQA group, block size, KV dtype; decode, prefill, cache "
        "write, fused ops, one CUDA graph replay); on = log an error and run a failing "
        "component on a path that passed, strict = refuse to start, off = no check",
        choices=KERNEL_SELFTEST_MODES)
    kv_cache_dtype: str = knob(
        "auto", "KV cache element type; auto = dtype, fp8_e4m3 = per-tensor scaled FP8 "
        "(half the bytes of bf16)", choices=KV_CACHE_DTYPES)
    enforce_eager: bool = knob(False, "never use CUDA graphs (debugging); graphs are the GPU "
                               "default for decode steps")
    async_scheduling: bool = knob(True, "overlap each step's scheduling and output "
                                  "processing with the device's forward (GPU only; outputs "
                                  "are identical either way)")
    cpu_threads: int | None = knob(
        None, "CPU: threads for the model's ops; default: every core this process may use "
        "for the packed matmuls (their threads share work, so one the OS parks delays "
        "nothing) and one fewer for torch's other ops, a core left to the worker's event "
        "loop (at least 1)", unit="threads")
    tensor_parallel_size: int = knob(
        1, "ranks the model is split over, one process each (torch.distributed: NCCL over "
        "cuda:0..N-1, gloo on the CPU); heads, KV heads and the MLP width must divide evenly "
        "(KV heads may instead be fewer, and are then replicated)", unit="ranks")
    tensor_parallel_timeout: float = knob(
        600.0, "tensor parallelism: a collective waiting longer than this for another rank "
        "fails the engine (a hung rank; exit 70 under the worker)", unit="seconds")
    served_model_name: str | None = knob(
        None, "the model name results report; default: the model dir's or hub id's last part")
    load_format: str = knob("auto", "how weights are read; dummy = only config.json, random "
                            "weights made on the device (benchmarks)", choices=LOAD_FORMATS)
    quantization: str = knob(
        "auto", "weight quantization; auto = the checkpoint's quantization_config (FP8: "
        "compressed-tensors float8 or fine-grained fp8), fp8 = quantize a bf16/fp16 "
        "checkpoint to FP8 on load (per-channel weight scales, dynamic per-token "
        "activations), none = run unquantized (FP8 weights dequantized on load)",
        choices=QUANTIZATIONS)
    task: str = knob(
        "auto", "what the engine serves; auto = embed when the model folder is a "
        "sentence-transformers model with a Pooling module or its architecture has no LM head "
        "(BertModel, Qwen3Model, ...), else generate (docs/embeddings.md)", choices=TASKS)
    seed: int = knob(0, "engine seed (unseeded sampling draws from it)")
    tokenizer: str | None = knob(None, "tokenizer dir or hub id; default: the model's")
    model_cache: str | None = knob(
        None, "where s3:// models are copied; default $XDG_CACHE_HOME, $HF_HOME or ~/.cache "
        "(/qworker/models), the temp dir when that is read-only")


def served_model_name(config: EngineConfig) -> str:
    """The name results report as ``model``: ``served_model_name``, else the last part of
    the model dir, ``s3://`` prefix or hub id (never a whole local path)."""
    if config.served_model_name:
        return config.served_model_name
    return config.model.rstrip("/").rsplit("/", 1)[-1] or config.model


def engine_knobs() -> dict[str, tuple[dataclasses.Field[Any], Knob]]:
    """Every knob of ``EngineConfig`` (all fields but ``model``) with its metadata, in order."""
    return {f.name: (f, f.metadata["knob"]) for f in dataclasses.fields(EngineConfig)
            if "knob" in f.metadata}


_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_BYTE_UNITS = {"": 1, "B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
               "KI": 1 << 10, "MI": 1 << 20, "GI": 1 << 30, "TI": 1 << 40}


def parse_bytes(value: int | str) -> int:
    """``4294967296``, ``"4GiB"``, ``"512MiB"``, ``"1.5GB"`` -> bytes (ValueError otherwise).

    ``KiB``/``MiB``/``GiB``/``TiB`` are powers of 1024, ``KB``/``MB``/``GB``/``TB`` (and
    ``K``/``M``/``G``/``T``) powers of 1000.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a byte size, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    match = _BYTES_RE.match(str(value))
    if match is None:
        raise ValueError(f"expected a byte size such as 4GiB, 512MiB or 1073741824, "
                         f"got {value!r}")
    number, unit = match.groups()
    key = (unit or "").upper().removesuffix("B")
    return int(float(number) * _BYTE_UNITS[key])


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_knob(name: str, value: Any) -> Any:
    """Validate (and normalise: byte sizes) one knob's value; ValueError naming the knob."""
    fields = engine_knobs()
    if name not in fields:
        raise ValueError(f"{name} is not an engine setting")
    spec = fields[name][1]
    if spec.unit == "bytes" and value is not None:
        value = parse_bytes(value)
    if spec.choices is not None and value not in spec.choices:
        *head, last = map(repr, spec.choices)
        raise ValueError(f"{name} must be {', '.join(head)} or {last}, got {value!r}")
    if name in ("max_num_seqs", "max_num_batched_tokens", "swap_space", "num_kv_blocks",
                "kv_cache_memory", "cpu_threads") and value is not None and (
                    not _is_int(value) or value < 1):
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if name == "max_model_len" and value is not None and (not _is_int(value) or value < 2):
        raise ValueError(f"max_model_len must be an integer >= 2, got {value!r}")
    if name == "gpu_memory_utilization" and not (
        isinstance(value, int | float) and not isinstance(value, bool) and 0.0 < value <= 1.0
    ):
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {value!r}")
    if name in ("enable_prefix_caching", "enforce_eager", "async_scheduling") and not isinstance(
        value, bool
    ):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    if name == "tensor_parallel_size" and (not _is_int(value) or value < 1):
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {value!r}")
    if name == "tensor_parallel_timeout" and not (
        isinstance(value, int | float) and not isinstance(value, bool) and value > 0
    ):
        raise ValueError(f"tensor_parallel_timeout must be a number of seconds > 0, "
                         f"got {value!r}")
    if name == "seed" and not _is_int(value):
        raise ValueError(f"seed must be an integer, got {value!r}")
    if name in ("served_model_name", "tokenizer", "model_cache") and value is not None and (
        not isinstance(value, str) or not value
    ):
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    return value


def check_config(config: EngineConfig) -> None:
    """Reject engine settings that cannot work, naming the field; normalises byte sizes."""
    for name in engine_knobs():
        setattr(config, name, check_knob(name, getattr(config, name)))
