"""Job messages in, result records out: the OpenAI Batch formats of docs/formats.md.

One module per concept: ``jobs`` parses and validates a raw message (``parse_job``),
``records`` builds the output lines (``success_record`` / ``error_record`` /
``conflict_record``) and reads them back (``error_of``), ``keys``
the object key of a result (``result_key``). The names are re-exported here so callers
import them from ``qworker.schema``.
"""

from qworker.schema.fingerprint import request_fingerprint
from qworker.schema.jobs import (
    CHAT_URL,
    COMPLETIONS_URL,
    MAX_METADATA_DEPTH,
    MAX_N,
    RESPONSES_URL,
    Job,
    JobKind,
    ParsedJob,
    parse_job,
)
from qworker.schema.keys import (
    CANCEL_NAME,
    COLLECTED_NAME,
    CONFLICTS_DIR,
    DEAD_LETTERS_DIR,
    DEFAULT_BATCH,
    MANIFEST_NAME,
    MAX_SAFE_BYTES,
    batch_folder,
    cancel_key,
    collected_key,
    conflict_key,
    dead_letter_key,
    failed_key,
    manifest_key,
    result_key,
    safe_segment,
)
from qworker.schema.records import (
    conflict_record,
    dumps,
    error_of,
    error_record,
    error_record_for,
    is_error_record,
    new_id,
    new_request_id,
    param_of,
    success_record,
)

__all__ = [
    "CANCEL_NAME",
    "CHAT_URL",
    "COLLECTED_NAME",
    "COMPLETIONS_URL",
    "CONFLICTS_DIR",
    "DEAD_LETTERS_DIR",
    "DEFAULT_BATCH",
    "MANIFEST_NAME",
    "MAX_METADATA_DEPTH",
    "MAX_N",
    "MAX_SAFE_BYTES",
    "RESPONSES_URL",
    "Job",
    "JobKind",
    "ParsedJob",
    "batch_folder",
    "cancel_key",
    "collected_key",
    "conflict_key",
    "conflict_record",
    "dead_letter_key",
    "dumps",
    "error_of",
    "error_record",
    "error_record_for",
    "failed_key",
    "is_error_record",
    "manifest_key",
    "new_id",
    "new_request_id",
    "param_of",
    "parse_job",
    "request_fingerprint",
    "result_key",
    "safe_segment",
    "success_record",
]
