"""The settings reference, generated from ``WorkerSettings``: groups, units, Markdown.

``docs/configuration.md`` is ``render_configuration()``'s output, written by
``qworker docs configuration -o docs/configuration.md``; a test fails when the
committed file differs, so the reference cannot drift from the model. The CLI's
``--help`` uses the same groups and units (``group_of``, ``unit_of``).
"""

from __future__ import annotations

import typing
from typing import Any

from pydantic.fields import FieldInfo

from qworker.config import ENGINE_FIELDS, WorkerSettings
from qworker.engine.config import engine_knobs

#: Help groups in the order shown; every setting belongs to exactly one (``group_of``).
GROUPS = ("source and sink", "kafka security", "engine", "worker", "observability")

_KAFKA_SECURITY = ("kafka_security_protocol", "kafka_sasl_", "kafka_ssl_", "kafka_compression")
_UNIT_OVERRIDES = {"sqs_visibility_timeout": "seconds", "until_idle": "seconds",
                   "metrics_port": "port", "admission_buffer_blocks": "blocks",
                   "engine_step_timeout": "seconds"}
_SUFFIX_UNITS = (("_seconds", "seconds"), ("_ms", "milliseconds"), ("_bytes", "bytes"),
                 ("_blocks", "blocks"))


def group_of(name: str) -> str:
    """The help group of setting ``name``."""
    if name in ENGINE_FIELDS or name in ("model", "model_aliases", "accept_any_model"):
        return "engine"
    if name.startswith(_KAFKA_SECURITY):
        return "kafka security"
    if name in ("source", "sink") or name.startswith(("s3_", "sqs_", "kafka_", "aws_")):
        return "source and sink"
    if name.startswith(("metrics_", "log_")):
        return "observability"
    return "worker"


def unit_of(name: str) -> str:
    """The unit of setting ``name`` ("" when it has none): engine knobs declare theirs."""
    knobs = engine_knobs()
    if name in knobs:
        return knobs[name][1].unit
    if name in _UNIT_OVERRIDES:
        return _UNIT_OVERRIDES[name]
    for suffix, unit in _SUFFIX_UNITS:
        if name.endswith(suffix):
            return unit
    return ""


def _type_text(annotation: Any) -> str:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    optional = type(None) in typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{v}`" for v in typing.get_args(annotation))
    if args and origin is not typing.Literal:
        inner = " or ".join(_type_text(a) for a in args)
        return f"{inner} (optional)" if optional else inner
    if annotation is bool:
        return "`true` \\| `false`"
    name = getattr(annotation, "__name__", str(annotation))
    return {"SecretStr": "secret string", "str": "string", "int": "integer",
            "float": "number"}.get(name, name)


def _default_text(name: str, info: FieldInfo) -> str:
    value = info.default
    if value is None:
        return "—"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if unit_of(name) == "bytes" and isinstance(value, int) and value >= 1 << 20:
        return f"`{value}` ({value / (1 << 30):g} GiB)" if value >= 1 << 30 else (
            f"`{value}` ({value / (1 << 20):g} MiB)")
    if value == "":
        return '`""`'
    return f"`{value}`"


def _description(name: str, info: FieldInfo) -> str:
    text = (info.description or "").replace("|", "\\|")
    # engine knobs carry "[unit]" in their description; the table has a unit column
    unit = unit_of(name)
    return text.removesuffix(f" [{unit}]") if unit else text


def settings_by_group() -> dict[str, list[tuple[str, FieldInfo]]]:
    """Every ``WorkerSettings`` field, grouped (``GROUPS`` order), declaration order inside."""
    out: dict[str, list[tuple[str, FieldInfo]]] = {g: [] for g in GROUPS}
    for name, info in WorkerSettings.model_fields.items():
        out[group_of(name)].append((name, info))
    return out


_INTRO = """\
# Configuration

<!-- Generated from qworker/config.py by `qworker docs configuration -o docs/configuration.md`;
     do not edit by hand (tests/test_settings_doc.py fails when this file is stale). -->

Every setting of `qworker run` comes, in this order of precedence, from its command-line
flag (`--name-with-dashes`), the environment (`QWORKER_<NAME>`), a `.env` file in the
working directory, or the default below. Values are checked when the worker starts: a bad
one stops it with exit code 1 and a line naming the setting and its flag/variable.
`qworker generate`, `produce`, `status` and `collect` take the flags of the settings they
use (see each command's `--help`). Byte sizes accept `4GiB`, `512MiB`, `1.5GB` or a plain
number of bytes. Secrets (`QWORKER_KAFKA_SASL_PASSWORD`) are never printed or logged.

Formats, exit codes and guarantees: [docs/formats.md](formats.md).
"""

_GROUP_NOTES = {
    "source and sink": ("Where jobs come from and results go "
                        "(URIs in [formats.md](formats.md#uris))."),
    "kafka security": (
        "Used by the worker's consumer, its dead-letter producer and `qworker produce` alike. "
        "Amazon MSK: `SASL_SSL` + `SCRAM-SHA-512` (port 9096) or `SASL_SSL` + `OAUTHBEARER` "
        "(IAM, port 9098; the pod's or task's AWS role signs the tokens for `aws_region`). "
        "Messages compressed with gzip, snappy, lz4 or zstd are all read."),
    "engine": ("The engine's knobs, as in the Python API (`LLM(**knobs)`)."),
    "worker": "The worker loop: admission, draining, spot notices, limits.",
    "observability": "Metrics (`/metrics`, `/healthz`, `/readyz`) and logs.",
}


def render_configuration() -> str:
    """The whole of ``docs/configuration.md``."""
    parts = [_INTRO]
    knobs = engine_knobs()
    for group, fields in settings_by_group().items():
        if not fields:
            continue
        parts.append(f"\n## {group.capitalize()}\n\n{_GROUP_NOTES[group]}\n\n")
        parts.append("| setting | environment / flag | values | default | unit | what |\n")
        parts.append("| --- | --- | --- | --- | --- | --- |\n")
        for name, info in fields:
            values = _type_text(info.annotation)
            choices = knobs[name][1].choices if name in knobs else None
            if choices is not None:  # e.g. block_size: an int of a few allowed values
                values = " \\| ".join(f"`{c}`" for c in choices)
            if unit_of(name) == "bytes":
                values = values.replace("integer or string", "integer or a size (`4GiB`)")
            parts.append(
                f"| `{name}` | `QWORKER_{name.upper()}`<br>`--{name.replace('_', '-')}` "
                f"| {values} | {_default_text(name, info)} "
                f"| {unit_of(name)} | {_description(name, info)} |\n"
            )
    return "".join(parts)
