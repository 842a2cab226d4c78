"""Worker settings: env, .env, flags, validation messages (qworker/config.py, cli flags)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("pydantic_settings")

from pydantic import ValidationError

from qworker.cli import build_parser, load_settings
from qworker.config import WorkerSettings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL_SQS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # no stray .env


def test_defaults_match_the_worker_contract() -> None:
    s = WorkerSettings()
    assert (s.source, s.sink, s.model) == ("file://./examples/requests.jsonl", "file://./results",
                                           "smollm2")
    assert (s.metrics_port, s.drain_seconds, s.spot_poll_seconds) == (9400, 90, 5)
    assert (s.max_job_bytes, s.sqs_visibility_timeout, s.aws_region) == (1 << 20, 300,
                                                                        "us-east-1")
    assert s.spot_metadata_url == "http://169.254.169.254"


def test_env_and_dotenv_are_read_and_env_wins(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    (tmp_path / ".env").write_text("QWORKER_DRAIN_SECONDS=12\nQWORKER_BLOCK_SIZE=32\n")
    monkeypatch.setenv("QWORKER_BLOCK_SIZE", "8")
    monkeypatch.setenv("QWORKER_SINK", "s3://bucket/pre")
    s = WorkerSettings()
    assert (s.drain_seconds, s.block_size, s.sink) == (12, 8, "s3://bucket/pre")


def test_flags_override_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QWORKER_MAX_NUM_SEQS", "4")
    monkeypatch.setenv("QWORKER_ENABLE_PREFIX_CACHING", "true")
    args = build_parser().parse_args(
        ["run", "--max-num-seqs", "9", "--no-enable-prefix-caching", "--until-idle", "2.5"])
    s = load_settings(args)
    assert (s.max_num_seqs, s.enable_prefix_caching, s.until_idle) == (9, False, 2.5)


def test_aws_endpoint_variables_are_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:2")
    s = WorkerSettings()
    assert (s.s3_endpoint_url, s.sqs_endpoint_url) == ("http://127.0.0.1:2", "http://127.0.0.1:1")
    assert WorkerSettings(sqs_endpoint_url="http://x:3").sqs_endpoint_url == "http://x:3"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("source", "http://host/q", "source 'http://host/q' must be kafka://"),
        ("source", "kafka://host:9092", "a kafka URI needs a topic"),
        ("sink", "gs://bucket", "sink 'gs://bucket' must be s3://bucket/prefix"),
        ("block_size", 12, "block_size must be 8, 16 or 32, got 12"),
        ("metrics_port", 70000, "metrics_port must be in 0..65535"),
        ("drain_seconds", -1, "must be >= 0"),
        ("sink_outage_seconds", -5, "must be >= 0"),
        ("max_num_seqs", 0, "max_num_seqs must be an integer >= 1"),
        ("kv_cache_memory", "lots", "expected a byte size"),
        ("kv_cache_dtype", "int4", "Input should be 'auto' or 'fp8_e4m3'"),
        ("gpu_memory_utilization", 1.5, "must be in (0, 1]"),
        ("log_format", "xml", "Input should be 'text' or 'json'"),
        ("log_level", "LOUD", "log_level 'LOUD' must be DEBUG"),
        ("dtype", "int8", "Input should be 'auto', 'float32', 'bfloat16' or 'float16'"),
    ],
)
def test_bad_values_fail_with_a_message_naming_the_setting(field: str, value: object,
                                                           message: str) -> None:
    with pytest.raises(ValidationError) as info:
        WorkerSettings(**{field: value})
    err = info.value.errors()[0]
    assert err["loc"] == (field,)
    assert message in err["msg"]


def test_engine_config_carries_engine_fields() -> None:
    s = WorkerSettings(model="/models/x", block_size=8, num_kv_blocks=64, dtype="float32",
                       max_model_len=512, enable_prefix_caching=False)
    cfg = s.engine_config()
    assert (cfg.model, cfg.block_size, cfg.num_kv_blocks, cfg.dtype, cfg.max_model_len,
            cfg.enable_prefix_caching) == ("/models/x", 8, 64, "float32", 512, False)


def test_every_setting_has_a_run_flag() -> None:
    help_text = build_parser()._subparsers._group_actions[0].choices["run"].format_help()
    for name in WorkerSettings.model_fields:
        assert "--" + name.replace("_", "-") in help_text


def test_sink_outage_seconds_defaults_to_five_minutes_and_reads_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert WorkerSettings().sink_outage_seconds == 300
    monkeypatch.setenv("QWORKER_SINK_OUTAGE_SECONDS", "42.5")
    assert WorkerSettings().sink_outage_seconds == 42.5


def test_engine_settings_are_generated_from_the_engine_config() -> None:
    from qworker.config import ENGINE_FIELDS
    from qworker.engine.config import engine_knobs

    knobs = engine_knobs()
    assert set(ENGINE_FIELDS) == set(knobs) - {"tokenizer"}
    for name in ENGINE_FIELDS:
        info = WorkerSettings.model_fields[name]
        assert info.default == knobs[name][0].default, name
        assert knobs[name][1].help in (info.description or ""), name


def test_memory_settings_accept_units(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QWORKER_KV_CACHE_MEMORY", "4GiB")
    s = WorkerSettings(swap_space="512MiB")
    assert (s.kv_cache_memory, s.swap_space) == (4 << 30, 512 << 20)
    assert s.engine_config().kv_cache_memory == 4 << 30


def test_bundled_model_is_served_under_its_own_name() -> None:
    assert WorkerSettings(model="/models/x").engine_config().served_model_name is None
    assert WorkerSettings(served_model_name="mine").engine_config().served_model_name == "mine"
