"""produce's two passes over the input: duplicate ids refused, batch id settled, order kept."""

from __future__ import annotations

import io
import json
import re

import pytest

pytest.importorskip("orjson")

from qworker.batch.manifest import (
    DuplicateCustomIdError,
    JobTooLargeError,
    Manifest,
    job_items,
    scan_input,
)


def _file(*lines: object) -> io.BytesIO:
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines)
    return io.BytesIO(text.encode() + b"\n")


def _job(cid: str, **extra: object) -> dict[str, object]:
    return {"custom_id": cid, "url": "/v1/completions", "body": {"prompt": "x"}, **extra}


def test_duplicate_custom_ids_are_refused_naming_lines() -> None:
    f = _file(_job("a"), _job("b"), _job("a"), "", _job("b"))
    with pytest.raises(DuplicateCustomIdError) as err:
        scan_input(f, None, "in.jsonl")
    assert "2 duplicate custom_id(s): 'a' on lines 1 and 3; 'b' on lines 2 and 5" in str(err.value)
    assert "nothing was sent" in str(err.value)


def test_a_batch_id_is_assigned_and_set_on_every_job() -> None:
    f = _file(_job("a"), "not json", _job("b"), [1, 2])
    manifest = scan_input(f, None, "in.jsonl")
    assert re.fullmatch(r"batch_[0-9a-f]{32}", manifest.batch_id)
    assert (manifest.total, manifest.custom_ids, manifest.skipped_lines) == (2, ["a", "b"], 2)
    assert manifest.endpoint == "/v1/completions"
    f.seek(0)
    items = list(job_items(f, manifest.batch_id))
    assert [k for k, _ in items] == ["a", None, "b", None]
    assert json.loads(items[0][1])["batch_id"] == manifest.batch_id
    assert items[1][1] == b"not json"  # sent unchanged: the worker dead-letters it


def test_the_files_own_batch_id_is_kept_and_a_mix_needs_the_flag() -> None:
    same = scan_input(_file(_job("a", batch_id="n1"), _job("b", batch_id="n1")), None, "f")
    assert same.batch_id == "n1"
    with pytest.raises(ValueError, match=r"different batch_ids.*--batch-id"):
        scan_input(_file(_job("a", batch_id="n1"), _job("b")), None, "f")
    forced = scan_input(_file(_job("a", batch_id="n1"), _job("b")), "mine", "f")
    assert forced.batch_id == "mine"


def test_manifest_round_trips() -> None:
    manifest = Manifest("b1", 2, "s3://in/x.jsonl", 123, ["x", "y"], "/v1/chat/completions",
                        "kafka://h:1/t")
    assert Manifest.from_json(manifest.to_json()) == manifest
    with pytest.raises(ValueError, match="not a qworker manifest"):
        Manifest.from_json(b'{"custom_id": "x"}')


def _sized(cid: str, size: int, **extra: object) -> str:
    line = json.dumps(_job(cid, metadata={"pad": ""}, **extra), separators=(",", ":"))
    return line.replace('"pad":""', '"pad":"' + "x" * (size - len(line)) + '"')


def test_jobs_over_max_job_bytes_as_sent_are_refused_before_anything_is_sent() -> None:
    limit = 4096
    # exactly the limit, batch id already its own: sent unchanged, accepted
    ok = scan_input(_file(_sized("a", limit, batch_id="n1")), None, "in.jsonl", limit)
    assert ok.custom_ids == ["a"]
    # exactly the limit on disk, but produce adds the batch id: too long as sent
    with pytest.raises(JobTooLargeError) as err:
        scan_input(_file(_job("ok"), _sized("b", limit)), None, "in.jsonl", limit)
    assert "1 line(s) over max_job_bytes (4096): line 2 (" in str(err.value)
    assert "nothing was sent" in str(err.value)
    with pytest.raises(JobTooLargeError, match="line 1"):
        scan_input(_file(_sized("c", limit, batch_id="n1")), "other", "in.jsonl", limit)
    # what job_items sends is what was measured
    f = _file(_sized("d", limit - 60))
    manifest = scan_input(f, None, "in.jsonl", limit)
    f.seek(0)
    ((_, body),) = list(job_items(f, manifest.batch_id))
    assert limit - 60 < len(body) <= limit


def test_an_empty_batch_id_is_refused() -> None:
    # every job would carry batch_id "" and be answered with an invalid_request line
    with pytest.raises(ValueError, match="--batch-id must not be empty"):
        scan_input(_file(_job("a")), "", "in.jsonl")
