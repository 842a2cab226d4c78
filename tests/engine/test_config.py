"""Engine knobs: declared once in EngineConfig, validated by check_knob."""

from __future__ import annotations

import pytest

from qworker.engine.config import (
    EngineConfig,
    check_config,
    check_knob,
    engine_knobs,
    parse_bytes,
    served_model_name,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [(1024, 1024), ("1024", 1024), ("4GiB", 4 << 30), ("512MiB", 512 << 20),
     ("1.5GB", 1_500_000_000), ("2K", 2000), ("3 KiB", 3 << 10), ("7B", 7)],
)
def test_byte_sizes_accept_iec_and_si_suffixes(text: int | str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["4 gigs", "", "-1GiB", "GiB", True])
def test_bad_byte_sizes_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="byte size"):
        parse_bytes(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("block_size", 12, "block_size must be 8, 16 or 32, got 12"),
        ("dtype", "int8", "dtype must be 'auto', 'float32', 'bfloat16' or 'float16'"),
        ("kv_cache_dtype", "int4", "kv_cache_dtype must be 'auto' or 'fp8_e4m3'"),
        ("max_num_seqs", 0, "max_num_seqs must be an integer >= 1"),
        ("gpu_memory_utilization", 0.0, "gpu_memory_utilization must be in (0, 1]"),
        ("max_model_len", 1, "max_model_len must be an integer >= 2"),
        ("enforce_eager", "yes", "enforce_eager must be true or false"),
        ("served_model_name", "", "served_model_name must be a non-empty string"),
        ("kv_cache_memory", "lots", "byte size"),
        ("cpu_threads", 0, "cpu_threads must be an integer >= 1"),
    ],
)
def test_bad_knobs_name_themselves(name: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_knob(name, value)


def test_every_knob_has_help_and_config_normalises_sizes() -> None:
    knobs = engine_knobs()
    assert "model" not in knobs
    assert {"kv_cache_dtype", "enforce_eager", "served_model_name"} <= set(knobs)
    assert all(spec.help for _, spec in knobs.values())
    config = EngineConfig(model="m", kv_cache_memory="2GiB", swap_space="1GiB")  # type: ignore[arg-type]
    check_config(config)
    assert (config.kv_cache_memory, config.swap_space) == (2 << 30, 1 << 30)


@pytest.mark.parametrize(
    ("model", "served", "expected"),
    [("/models/llama-3-8b/", None, "llama-3-8b"), ("s3://bucket/prefix/qwen", None, "qwen"),
     ("HuggingFaceTB/SmolLM2-135M", None, "SmolLM2-135M"), ("/x/y", "mine", "mine")],
)
def test_served_model_name_is_never_a_local_path(model: str, served: str | None,
                                                 expected: str) -> None:
    assert served_model_name(EngineConfig(model=model, served_model_name=served)) == expected
