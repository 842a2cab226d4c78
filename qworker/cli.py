"""The ``qworker`` command line: run, generate, produce, collect, cost.

Settings are read here, once, into a ``WorkerSettings`` (flags over ``QWORKER_*``
environment over ``.env`` over defaults) and passed down.
"""

from __future__ import annotations

import contextlib as _contextlib
import signal as _signal
import sys as _sys

#: SIGTERMs that reached ``qworker run`` while it was still importing (a pod stopped in
#: its first second): the worker drains for them as soon as it can (exit 75), instead of
#: dying of the signal. Only a ``run`` process captures them, and only until ``serve``
#: installs its own handlers. This runs before the imports below (hence their noqa).
EARLY_SIGNALS: list[int] = []


def _capture_early_signal(signum: int, frame: object) -> None:
    EARLY_SIGNALS.append(signum)


if (len(_sys.argv) > 1 and _sys.argv[1] == "run"
        and _sys.argv[0].endswith(("qworker", "__main__.py"))):
    with _contextlib.suppress(ValueError):  # not the main thread: nothing to capture
        _signal.signal(_signal.SIGTERM, _capture_early_signal)

import argparse  # noqa: E402
import asyncio  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import types  # noqa: E402
import typing  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any, TypeVar  # noqa: E402

from pydantic import ValidationError  # noqa: E402

from qworker import __version__  # noqa: E402
from qworker.batch.commands import (  # noqa: E402
    add_parsers as add_batch_parsers,
)
from qworker.batch.commands import (  # noqa: E402
    cancel_command,
    collect_command,
    produce_command,
    status_command,
)
from qworker.config import ENGINE_FIELDS, WorkerSettings  # noqa: E402
from qworker.worker.exit_codes import ExitCode  # noqa: E402

T = TypeVar("T")


def _flag_type(annotation: Any) -> tuple[Any, list[Any] | None, bool]:
    """(argparse type, choices, is_bool) for a settings field annotation."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _flag_type(args[0])
    if origin is typing.Literal:
        values = list(typing.get_args(annotation))
        return type(values[0]), values, False
    if annotation is bool:
        return None, None, True
    if annotation in (int, float):
        return annotation, None, False
    return str, None, False


def add_settings_flags(parser: argparse.ArgumentParser, names: Sequence[str] | None = None) -> None:
    """Add ``--name-with-dashes`` for each settings field (all when ``names`` is None).

    Flags are grouped (source and sink, kafka security, engine, worker, observability)
    and their help gives the unit, the environment variable and the default.
    """
    from qworker.settings_doc import GROUPS, group_of, unit_of

    groups: dict[str, Any] = {}
    wanted = [n for n in WorkerSettings.model_fields if names is None or n in names]
    for title in GROUPS:
        for name in wanted:
            if group_of(name) != title:
                continue
            if title not in groups:
                groups[title] = parser.add_argument_group(f"{title} settings")
            _add_flag(groups[title], name, unit_of(name))


def _add_flag(group: Any, name: str, unit: str) -> None:
    info = WorkerSettings.model_fields[name]
    flag = "--" + name.replace("_", "-")
    kind, choices, is_bool = _flag_type(info.annotation)
    description = info.description or ""
    if unit:
        description = description.removesuffix(f" [{unit}]") + f" [{unit}]"
    default = "unset" if info.default is None else repr(info.default)
    help_text = f"{description} (env QWORKER_{name.upper()}, default {default})"
    help_text = help_text.replace("%", "%%")
    if is_bool:
        group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                           default=argparse.SUPPRESS, help=help_text)
    else:
        group.add_argument(flag, dest=name, type=kind, choices=choices,
                           default=argparse.SUPPRESS, help=help_text,
                           metavar=None if choices else unit.upper() or None)


def load_settings(args: argparse.Namespace) -> WorkerSettings:
    """Settings from parsed flags (only those given) over env / ``.env`` / defaults."""
    overrides = {k: v for k, v in vars(args).items() if k in WorkerSettings.model_fields}
    return WorkerSettings(**overrides)


def _settings_error(exc: ValidationError) -> str:
    lines = ["invalid settings:"]
    for err in exc.errors():
        name = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if not name:  # a rule across settings (Kafka security): its message names them
            lines.append(f"  {msg}")
            continue
        lines.append(f"  {name} (--{name.replace('_', '-')} / QWORKER_{name.upper()}): {msg}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(
        prog="qworker", description="GPU batch-inference worker (OpenAI batch format). "
        "Formats: docs/formats.md; settings: docs/configuration.md."
    )
    parser.add_argument("--version", action="version", version=f"qworker {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run",
        help="serve jobs from a source into a sink until stopped",
        description="Serve jobs from --source into --sink. Every flag also "
        "reads from QWORKER_<NAME> and .env; flags win.",
    )
    add_settings_flags(run)

    gen = sub.add_parser(
        "generate",
        help="run an OpenAI batch file through the engine, offline",
        description="Offline, like `vllm run-batch`: streams the input with bounded memory "
        "(at most --window jobs in flight) and writes one output line per non-blank input "
        "line IN INPUT ORDER. Invalid lines become error lines in the same output. "
        "Progress goes to stderr.",
    )
    gen.add_argument("-i", "--input", required=True,
                     help="requests.jsonl (OpenAI batch input; path or s3://bucket/key)")
    gen.add_argument("-o", "--output", required=True,
                     help="results.jsonl to write (path or s3://bucket/key)")
    gen.add_argument("--window", type=int, default=256, help="jobs read ahead (default 256)")
    gen.add_argument("--resume", action="store_true",
                     help="keep --output and skip the custom_ids it already holds")
    add_settings_flags(gen, ("model", "model_aliases", "accept_any_model", "max_job_bytes",
                             "s3_endpoint_url", "aws_region", *ENGINE_FIELDS))

    add_batch_parsers(sub, add_settings_flags)

    docs = sub.add_parser("docs", help="write the generated settings reference",
                          description="Print (or write with -o) docs/configuration.md, "
                          "generated from the settings model.")
    docs.add_argument("what", choices=["configuration"], help="which document")
    docs.add_argument("-o", "--output", help="file to write (default: stdout)")

    sub.add_parser("cost", help="cost estimates (see `qworker cost --help`)", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``qworker`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "cost":
        return _cost(argv[1:])
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # a usage error is a configuration error: exit 1, not 2
        raise SystemExit(1 if exc.code == 2 else exc.code) from None
    try:
        settings = load_settings(args)
    except ValidationError as exc:
        print(_settings_error(exc), file=sys.stderr)
        return 1
    handler = {"run": _run, "generate": _generate, "produce": produce_command,
               "status": status_command, "collect": collect_command, "cancel": cancel_command,
               "docs": _docs}
    try:
        return handler[args.command](args, settings)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        # Usage or configuration error: one line, exit 1 (docs/formats.md, "Exit codes").
        print(f"qworker {args.command}: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        if not _is_aws_error(exc):
            raise
        # A missing bucket, denied access, no credentials, an unreachable endpoint.
        print(f"qworker {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def _is_aws_error(exc: BaseException) -> bool:
    """True for botocore's errors (S3/SQS refused or unreachable), which are not bugs."""
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:
        return False
    return isinstance(exc, BotoCoreError | ClientError)


def _run(args: argparse.Namespace, settings: WorkerSettings) -> int:
    from qworker.worker.app import serve
    from qworker.worker.logs import configure_logging
    from qworker.worker.served_models import check_model_given

    check_model_given(settings)  # before anything loads (docs/formats.md, "Model names")
    configure_logging(settings.log_level, settings.log_format)
    code, summary = asyncio.run(serve(settings, pending_signals=EARLY_SIGNALS, hard_exit=True))
    if code == ExitCode.CONFIG:
        return code  # the one line saying why was logged; no summary of nothing
    if settings.log_format == "json":
        logging.getLogger("qworker.cli").info("qworker run summary", extra=summary.as_dict())
    else:
        print(
            f"qworker run summary (results in {settings.sink})\n{summary.text()}", file=sys.stderr
        )
    if code == ExitCode.ENGINE:
        # A hung engine step may never return: do not wait for its thread at exit.
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    return code


def _generate(args: argparse.Namespace, settings: WorkerSettings) -> int:
    from qworker.worker.app import build_engine
    from qworker.worker.generate import check_output, generate_file
    from qworker.worker.logs import configure_logging
    from qworker.worker.served_models import ServedModels

    configure_logging("WARNING", "text")
    if args.window < 1:
        raise ValueError("--window must be >= 1")
    from qworker.batch.files import done_ids, local_path, open_output

    check_output(args.output, settings)  # before the model loads: a typo costs seconds

    skip_ids, skip_lines = done_ids(args.output, settings) if args.resume else (set(), set())
    if skip_ids or skip_lines:
        print(f"generate: resuming: {len(skip_ids) + len(skip_lines)} lines already in "
              f"{args.output}", file=sys.stderr)
    print(f"generate: loading model {settings.model}", file=sys.stderr)
    engine = build_engine(settings)
    served = ServedModels.from_settings(settings, engine.model_name)
    # A failed final upload keeps the local results and names them (UploadFailed, exit 1).
    try:
        with local_path(args.input, settings) as path, \
                open_output(args.output, settings, append=args.resume,
                            keep_failed_upload=True) as out:
            stats = _off_main_thread(
                lambda: generate_file(engine, path, out, args.window, settings.max_job_bytes,
                                      skip_ids=skip_ids, skip_lines=skip_lines, served=served)
            )
    finally:
        engine.close()
    print(
        f"generate: wrote {stats.ok + stats.errors} lines to {args.output} "
        f"({stats.ok} ok, {stats.errors} errors) in {stats.elapsed:.1f}s",
        file=sys.stderr,
    )
    return 0


def _docs(args: argparse.Namespace, settings: WorkerSettings) -> int:
    from qworker.settings_doc import render_configuration

    text = render_configuration()
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


def _off_main_thread(fn: Callable[[], T]) -> T:
    """Run ``fn`` on a daemon thread and wait; Ctrl-C still ends the process.

    The engine steps off the main thread here as in ``qworker run``: on an
    oversubscribed CPU, torch's OpenMP ops in the main thread were measured ~40x slower.
    """
    result: list[T] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, name="qworker-generate", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
    if errors:
        raise errors[0]
    return result[0]


def _cost(argv: list[str]) -> int:
    if importlib.util.find_spec("qworker.cost") is None:
        print("qworker cost: not available in this build (qworker.cost missing)", file=sys.stderr)
        return 2
    module = importlib.import_module("qworker.cost")
    return int(module.main(argv) or 0)
