"""docs/configuration.md is generated from the settings model and cannot drift from it."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("pydantic_settings")

from qworker.cli import build_parser
from qworker.config import WorkerSettings
from qworker.settings_doc import GROUPS, group_of, render_configuration, unit_of

ROOT = Path(__file__).resolve().parents[1]


def test_committed_configuration_doc_is_what_the_model_generates() -> None:
    committed = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert committed == render_configuration(), (
        "docs/configuration.md is stale: run "
        "`python -m qworker docs configuration -o docs/configuration.md`"
    )


def test_every_setting_is_documented_with_its_variable_and_flag() -> None:
    text = render_configuration()
    for name in WorkerSettings.model_fields:
        assert f"| `{name}` | `QWORKER_{name.upper()}`<br>`--{name.replace('_', '-')}` |" in text


def test_engine_knobs_with_a_few_allowed_values_list_them() -> None:
    text = render_configuration()
    block_size = next(line for line in text.splitlines() if line.startswith("| `block_size`"))
    assert "| `8` \\| `16` \\| `32` |" in block_size
    assert "| `auto` \\| `float32` \\| `bfloat16` \\| `float16` |" in text


def test_units_and_groups() -> None:
    assert (unit_of("drain_seconds"), unit_of("kafka_session_timeout_ms")) == (
        "seconds", "milliseconds")
    assert (unit_of("kv_cache_memory"), unit_of("max_num_batched_tokens")) == ("bytes", "tokens")
    assert group_of("kafka_sasl_password") == "kafka security"
    assert group_of("kafka_dlq_topic") == "source and sink"
    assert group_of("swap_space") == "engine" and group_of("log_level") == "observability"
    assert {group_of(n) for n in WorkerSettings.model_fields} <= set(GROUPS)


def test_run_help_is_grouped_with_units() -> None:
    parser = build_parser()
    run = parser._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    titles = [g.title for g in run._action_groups]
    assert titles[2:] == [f"{g} settings" for g in GROUPS]
    text = run.format_help()
    assert "--kv-cache-memory BYTES" in text and "[bytes]" in text
    assert "--drain-seconds SECONDS" in text
    assert "kafka security settings:" in text


def test_memory_flags_take_human_sizes() -> None:
    args = build_parser().parse_args(["run", "--kv-cache-memory", "4GiB", "--swap-space",
                                      "512MiB"])
    settings = WorkerSettings(**{k: v for k, v in vars(args).items()
                                 if k in WorkerSettings.model_fields})
    assert (settings.kv_cache_memory, settings.swap_space) == (4 << 30, 512 << 20)
