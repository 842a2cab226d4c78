"""The end-of-campaign check: every job has exactly one valid result object, and no other.

It reads the sink bucket directly from moto (never through the fault proxy) and
compares it with the job set: missing jobs, custom_ids with more than one object,
objects that do not parse or do not answer their job, and objects nobody asked for.
Conflict records (``_conflicts/``) are checked too: each second request under a used
custom_id has exactly one, for the request whose answer is *not* stored (none missing:
nothing silently replaced; none for a plain redelivery: fingerprints are stable).
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .jobs import JobSet

log = logging.getLogger(__name__)


@dataclass(slots=True)
class CheckResult:
    """What the sink holds compared with what was produced."""

    expected: int = 0
    objects: int = 0
    found: int = 0
    missing: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)     # custom_ids with > 1 object
    invalid: list[str] = field(default_factory=list)        # "key: reason"
    unexpected: list[str] = field(default_factory=list)     # keys answering no produced job
    error_records: int = 0
    conflict_records: int = 0
    silently_replaced: list[str] = field(default_factory=list)  # conflicts without a record
    bad_conflicts: list[str] = field(default_factory=list)      # records that should not exist

    @property
    def ok(self) -> bool:
        """True when nothing is missing, duplicated, invalid, unexpected or replaced."""
        return not (self.missing or self.duplicates or self.invalid or self.unexpected
                    or self.silently_replaced or self.bad_conflicts)


def list_keys(s3: Any, bucket: str, prefix: str) -> list[str]:
    """Every key under ``prefix`` in ``bucket`` (paginated)."""
    keys: list[str] = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys += [o["Key"] for o in page.get("Contents", [])]
    return keys


def error_code(rec: Any) -> str | None:
    """The error code of a failed result line (either OpenAI shape), None for a 200."""
    err, resp = rec.get("error"), rec.get("response")
    if isinstance(err, dict):
        return str(err.get("code"))
    if isinstance(resp, dict) and resp.get("status_code") != 200:
        return str(((resp.get("body") or {}).get("error") or {}).get("code"))
    return None


def _problem(rec: Any, jobs: JobSet, key: str, key_of: Callable[[str], str],
             winners: dict[str, str]) -> str | None:
    """Why ``rec`` (stored under ``key``) is not a valid answer to its job, or None.

    For a custom_id two requests share, ``winners`` learns which one the result answers
    (``"first"`` or ``"second"``).
    """
    if not isinstance(rec, dict):
        return "not a JSON object"
    cid = rec.get("custom_id")
    if cid not in jobs.expected:
        return f"custom_id {cid!r} was never produced"
    if key != key_of(cid):
        return f"key does not match custom_id {cid!r}"
    if rec.get("batch_id") != jobs.batch_id:
        return f"batch_id {rec.get('batch_id')!r}"
    if not str(rec.get("id", "")).startswith("batch_req_"):
        return "id is not batch_req_*"
    want = jobs.expected[cid]
    resp, err = rec.get("response"), rec.get("error")
    if want == "ok":
        if err is not None or not isinstance(resp, dict) or resp.get("status_code") != 200:
            return f"expected a 200 response, got error={err!r}"
        body = resp.get("body") or {}
        choices = body.get("choices") or []
        if not choices or "usage" not in body:
            return "response body lacks choices or usage"
        text = choices[0].get("text")
        if text is None:
            text = (choices[0].get("message") or {}).get("content")
        if not isinstance(text, str):
            return "choice has no text/content string"
        # The echo engine answers with the prompt; a wrong job's answer carries another nonce.
        second = jobs.conflict_nonces.get(cid)
        if second is not None and second in text:
            winners[cid] = "second"
            return None
        if "nonce" in text and jobs.nonces[cid] not in text:  # (a real model says anything)
            return "answer carries another job's nonce"
        winners[cid] = "first"
        return None
    if error_code(rec) != want:
        return f"expected error {want!r}, got response={resp!r} error={err!r}"
    return None


def check_results(s3: Any, bucket: str, prefix: str, jobs: JobSet,
                  key_of: Callable[[str], str],
                  conflict_key_of: Callable[[dict], str] | None = None) -> CheckResult:
    """Read every object of the batch and compare with ``jobs``.

    ``key_of(custom_id)`` is the worker's key function (``qworker.schema.result_key``
    bound to the prefix and batch id): a result under any other key is invalid.
    ``conflict_key_of(job_line)`` is where a conflict record for that request belongs.
    """
    res = CheckResult(expected=len(jobs.expected))
    by_cid: dict[str, list[str]] = defaultdict(list)
    winners: dict[str, str] = {}
    keys = list_keys(s3, bucket, prefix)
    conflicts = [k for k in keys if "/_conflicts/" in k]
    keys = [k for k in keys if not any(p.startswith("_") for p in k[len(prefix):].split("/"))]
    res.objects = len(keys)
    for key in keys:
        raw = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        try:
            rec = json.loads(raw)
        except ValueError as exc:
            res.invalid.append(f"{key}: does not parse ({exc})")
            continue
        why = _problem(rec, jobs, key, key_of, winners)
        cid = rec.get("custom_id") if isinstance(rec, dict) else None
        if why is not None:
            if cid not in jobs.expected:
                res.unexpected.append(f"{key}: {why}")
            else:
                res.invalid.append(f"{key}: {why}")
        if cid in jobs.expected:
            by_cid[cid].append(key)
            if isinstance(rec, dict) and error_code(rec) is not None:
                res.error_records += 1
    res.found = len(by_cid)
    res.missing = sorted(c for c in jobs.expected if c not in by_cid)
    res.duplicates = sorted(c for c, ks in by_cid.items() if len(ks) > 1)
    _check_conflicts(s3, bucket, conflicts, jobs, winners, conflict_key_of, res)
    return res


def _check_conflicts(s3: Any, bucket: str, keys: list[str], jobs: JobSet,
                     winners: dict[str, str], conflict_key_of: Callable[[dict], str] | None,
                     res: CheckResult) -> None:
    res.conflict_records = len(keys)
    firsts = {line["custom_id"]: line for line in jobs.lines}
    expected: set[str] = set()
    for second in jobs.conflict_lines:
        cid = second["custom_id"]
        loser = firsts[cid] if winners.get(cid) == "second" else second
        want = conflict_key_of(loser) if conflict_key_of is not None else None
        if want is None or want not in keys:
            res.silently_replaced.append(cid)
        else:
            expected.add(want)
    for key in keys:
        if key in expected:
            rec = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
            if error_code(rec) != "duplicate_custom_id":
                res.bad_conflicts.append(f"{key}: code {error_code(rec)!r}")
        else:
            res.bad_conflicts.append(f"{key}: no conflict was expected here")
