"""The batch subcommands of ``qworker``: produce, status, collect, cancel (docs/formats.md).

``add_parsers`` adds them to the CLI's parser; each handler takes the parsed arguments
and the ``WorkerSettings`` and returns the exit code. Errors are raised as
``ValueError`` / ``FileNotFoundError``: the CLI prints one line and exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

#: Settings every batch command takes from flags or QWORKER_* (storage and AWS).
STORAGE_FIELDS = ("s3_endpoint_url", "aws_region")
#: Settings ``produce`` adds: where to send and how (Kafka security, SQS endpoint).
PRODUCE_FIELDS = (
    "sqs_endpoint_url", "kafka_security_protocol", "kafka_sasl_mechanism",
    "kafka_sasl_username", "kafka_sasl_password", "kafka_ssl_cafile", "kafka_compression",
    "max_job_bytes",
)
_SHOWN_MISSING = 20
#: Statuses after which nothing changes by itself (``status --wait`` stops there).
_FINAL = frozenset({"completed", "cancelled", "expired", "failed"})


def add_parsers(
    sub: Any, add_settings_flags: Callable[[argparse.ArgumentParser, Sequence[str]], None]
) -> None:
    """Add ``produce``, ``status``, ``collect`` and ``cancel`` to the subparsers ``sub``."""
    prod = sub.add_parser(
        "produce", help="push an OpenAI batch file as jobs to a source URI",
        description="Send every line of an OpenAI batch input file as one job. Refuses a "
        "file with duplicate custom_ids; assigns batch_<uuid> when no --batch-id is given "
        "(and prints it); writes <results>/<batch_id>/_manifest.json so that `status` and "
        "`collect` know the batch's total and order.",
    )
    prod.add_argument("-i", "--input", required=True, help="requests.jsonl (path or s3://)")
    prod.add_argument("--to", required=True, help="kafka://..., sqs://... or file://...")
    prod.add_argument("--batch-id", help="batch_id for every job (default: the file's own, "
                      "else a new batch_<uuid>)")
    prod.add_argument("--results", help="results location for the manifest "
                      "(s3://bucket/prefix or file:///dir; default QWORKER_SINK; required "
                      "for a kafka:// or sqs:// target unless QWORKER_SINK is set)")
    prod.add_argument("--no-manifest", action="store_true", help="do not write a manifest")
    prod.add_argument("--completion-window", default="24h", metavar="DURATION",
                      help="stamp each job's deadline (unless it has an earlier one) this "
                      "long from now, and the manifest's expires_at: 24h (default), 90m, "
                      "30s, 2d (OpenAI accepts only 24h; qworker any duration), or none "
                      "(lines sent as they are; the batch never expires)")
    prod.add_argument("--allow-mixed", action="store_true",
                      help="send a file whose lines name different urls as one batch "
                      "(its endpoint is then 'mixed'); refused by default, as OpenAI does")
    add_settings_flags(prod, (*STORAGE_FIELDS, *PRODUCE_FIELDS, "sink"))

    stat = sub.add_parser(
        "status", help="how far a batch is: an OpenAI-batch-like JSON object",
        description="Print the batch as an OpenAI Batch object: status (validating, "
        "in_progress, cancelling, cancelled, expired, completed, failed), request_counts "
        "{total, completed, failed}, usage, the custom_ids still missing.",
    )
    stat.add_argument("--from", dest="from_uri", required=True, help="s3://... or file://...")
    stat.add_argument("--batch-id", required=True, help="the batch ('default' if none)")
    stat.add_argument("--wait", type=float, metavar="SECONDS",
                      help="poll every SECONDS until the batch is completed, cancelled, "
                      "expired or failed")
    stat.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                      help="with --wait: give up (exit 1) after this long")
    stat.add_argument("--no-cache", action="store_true",
                      help="read every result again (no local cache of outcomes)")
    add_settings_flags(stat, STORAGE_FIELDS)

    col = sub.add_parser(
        "collect", help="merge a batch's stored results into JSONL files",
        description="Write the batch's results (input order when a manifest exists) to "
        "--output and failed lines plus conflict records to --errors; list missing ids.",
    )
    col.add_argument("--from", dest="from_uri", required=True, help="s3://... or file://...")
    col.add_argument("--batch-id", required=True, help="the batch to collect ('default' if none)")
    col.add_argument("-o", "--output", required=True, help="results.jsonl (path or s3://)")
    col.add_argument("--errors", help="errors.jsonl (default: errors go to --output too)")
    col.add_argument("--missing", help="write every missing custom_id here, one per line")
    col.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_settings_flags(col, STORAGE_FIELDS)

    can = sub.add_parser(
        "cancel", help="cancel a batch: workers answer its unstarted jobs batch_cancelled",
        description="Write <results>/<batch>/_cancel.json once. Workers holding the batch's "
        "jobs see it within QWORKER_CANCEL_CHECK_SECONDS: jobs not yet in the engine get a "
        "batch_cancelled record, jobs already generating finish. A second cancel changes "
        "nothing. `status` shows cancelling, then cancelled once every job has a record. "
        "A batch that already ended (completed, expired) is refused.",
    )
    can.add_argument("--from", dest="from_uri", required=True, help="s3://... or file://...")
    can.add_argument("--batch-id", required=True, help="the batch to cancel")
    add_settings_flags(can, STORAGE_FIELDS)


def produce_command(args: argparse.Namespace, settings: Any) -> int:
    """``qworker produce``."""
    from qworker.batch.files import open_input
    from qworker.batch.lifecycle import parse_window, write_failed
    from qworker.batch.manifest import ManifestState, job_items, scan_input, write_manifest
    from qworker.batch.store import open_store
    from qworker.schema import manifest_key
    from qworker.worker.sources import produce

    window = parse_window(args.completion_window)
    deadline = int(time.time()) + window if window is not None else None
    with open_input(args.input, settings) as f:
        manifest = scan_input(f, args.batch_id, args.input, settings.max_job_bytes,
                              allow_mixed=args.allow_mixed, deadline=deadline)
        manifest.to = args.to
        manifest.completion_window = args.completion_window.strip().lower()
        manifest.expires_at = deadline
        store = None
        if not args.no_manifest:
            results = _manifest_location(args, settings)
            store = open_store(results, settings)
            manifest.state = ManifestState.SENDING
            key = write_manifest(store, manifest).removeprefix(store.prefix).lstrip("/")
            print(f"produce: manifest at {results.rstrip('/')}/{key}", file=sys.stderr)
        f.seek(0)
        try:
            sent = produce(args.to, job_items(f, manifest.batch_id, deadline), settings)
        except BaseException as exc:
            if store is not None:  # `status` says failed instead of validating forever
                write_failed(store, manifest.batch_id, f"{exc!r}"[:500])
            raise
        if store is not None:
            manifest.state, manifest.sent_at = ManifestState.SENT, int(time.time())
            store.put(manifest_key(store.prefix, manifest.batch_id), manifest.to_json())
    skipped = (f" ({manifest.skipped_lines} lines without a custom_id go to the dead-letter "
               "target)") if manifest.skipped_lines else ""
    print(f"produce: sent {sent} jobs of batch {manifest.batch_id} to {args.to}{skipped}",
          file=sys.stderr)
    print(manifest.batch_id)
    return 0


def _manifest_location(args: argparse.Namespace, settings: Any) -> str:
    """Where ``produce`` writes the manifest: ``--results``, else a sink that was set
    (``QWORKER_SINK`` / ``--sink``). A queue target needs one of them (docs/formats.md):
    the default ``file://./results`` is this machine's folder, where ``status`` and
    ``collect`` against the workers' bucket would never find the manifest."""
    from qworker.worker.sources import source_scheme

    if args.results:
        return str(args.results)
    if "sink" in settings.model_fields_set or source_scheme(args.to) == "file":
        return str(settings.sink)
    raise ValueError(f"--to {args.to} is a queue: give --results URI (or QWORKER_SINK), "
                     "the location the workers write results to, so that `status` and "
                     "`collect` find the batch's manifest there (or --no-manifest)")


def status_command(args: argparse.Namespace, settings: Any) -> int:
    """``qworker status``: print the status object (once, or when completed with --wait)."""
    from qworker.batch.status import batch_status
    from qworker.batch.store import open_store

    store = open_store(args.from_uri, settings)
    started = time.monotonic()
    while True:
        status = batch_status(store, args.batch_id, args.from_uri, not args.no_cache)
        if status["request_counts"]["total"] == 0 and not status["manifest"]:
            raise ValueError(f"no batch {args.batch_id!r} under {args.from_uri} "
                             "(no manifest and no results)")
        if not status["manifest"]:
            # Its total is unknown, so it never reads as completed (docs/formats.md).
            print(json.dumps(status, indent=2))
            wait = (", so it never reads as completed: --wait needs a batch sent by "
                    "`qworker produce`") if args.wait is not None else ""
            raise ValueError(
                f"batch {args.batch_id} has no manifest under {args.from_uri}{wait} "
                f"({status['request_counts']['total']} results stored, total unknown; was it "
                "produced with --results pointing here? `qworker collect` still gathers them)")
        if args.wait is None or status["status"] in _FINAL:
            break
        counts = status["request_counts"]
        print(f"status: {status['status']}: {counts['completed'] + counts['failed']}/"
              f"{counts['total']} done ({counts['failed']} failed)", file=sys.stderr)
        if args.timeout is not None and time.monotonic() - started >= args.timeout:
            print(json.dumps(status, indent=2))
            raise ValueError(f"batch {args.batch_id} not finished after {args.timeout:.0f}s "
                             f"(still {status['status']})")
        time.sleep(args.wait)
    print(json.dumps(status, indent=2))
    return 0


def collect_command(args: argparse.Namespace, settings: Any) -> int:
    """``qworker collect``; records where it wrote in ``_collected.json`` (status)."""
    import contextlib

    from qworker.batch.collect import collect_batch
    from qworker.batch.files import open_output
    from qworker.batch.lifecycle import Collected, file_id, write_collected
    from qworker.batch.listing import scan_batch
    from qworker.batch.store import open_store

    store = open_store(args.from_uri, settings)
    listing = scan_batch(store, args.batch_id)
    if listing.manifest is None and not (listing.present or listing.unexpected
                                         or listing.conflicts):
        # before any output is opened: a mistyped batch id leaves earlier files alone
        raise ValueError(f"no batch {args.batch_id!r} under {args.from_uri} "
                         "(no manifest and no results)")
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open_output(args.output, settings))
        errors = stack.enter_context(open_output(args.errors, settings)) if args.errors else out
        stats = collect_batch(store, args.batch_id, out, errors, not args.no_progress,
                              listing=listing)
        if args.missing:
            missing = stack.enter_context(open_output(args.missing, settings))
            missing.write("".join(f"{cid}\n" for cid in stats.missing).encode())
    error_id = file_id(args.errors) if args.errors else (
        file_id(args.output) if stats.errors or stats.conflicts else None)
    write_collected(store, args.batch_id,
                    Collected(file_id(args.output), error_id, int(time.time())))
    total = f" of {stats.total}" if stats.total is not None else ""
    print(f"collect: {stats.results} results, {stats.errors} errors, {stats.conflicts} "
          f"conflicts{total} for batch {args.batch_id}", file=sys.stderr)
    if stats.missing:
        shown = ", ".join(stats.missing[:_SHOWN_MISSING])
        more = len(stats.missing) - _SHOWN_MISSING
        print(f"collect: {len(stats.missing)} missing: {shown}"
              + (f" (and {more} more{'; see ' + args.missing if args.missing else ''})"
                 if more > 0 else ""), file=sys.stderr)
    if stats.total is None:
        print(f"collect: warning: batch {args.batch_id} has no manifest under "
              f"{args.from_uri} (produced without --results pointing here?): lines are in "
              "key order and missing ids are unknown", file=sys.stderr)
    return 0


def cancel_command(args: argparse.Namespace, settings: Any) -> int:
    """``qworker cancel``: write the batch's cancel marker once (qworker/batch/lifecycle.py)."""
    from qworker.batch.lifecycle import cancel_batch
    from qworker.batch.store import open_store

    store = open_store(args.from_uri, settings)
    marker, written = cancel_batch(store, args.batch_id)
    if written:
        print(f"cancel: batch {args.batch_id} is cancelling: workers answer its jobs that "
              "have not started batch_cancelled", file=sys.stderr)
    else:
        print(f"cancel: batch {args.batch_id} was already cancelled: nothing changed",
              file=sys.stderr)
    print(json.dumps({"id": args.batch_id,
                      "cancelling_at": marker.cancelling_at if written else None,
                      "already_cancelled": not written}))
    return 0
