"""Listing and fetching a batch against moto S3: parallel ranges lose and repeat nothing."""

from __future__ import annotations

import concurrent.futures

import pytest

pytest.importorskip("boto3")

from qworker.batch.listing import split_points
from qworker.batch.store import DirStore, open_store, ordered_map
from qworker.config import WorkerSettings
from qworker.schema import batch_folder, result_key
from tests.fixtures.servers import boto_client


def _settings(endpoint: str) -> WorkerSettings:
    return WorkerSettings(s3_endpoint_url=endpoint)


def test_parallel_ranged_listing_equals_one_listing(moto_server: str, s3_bucket: str) -> None:
    s3 = boto_client("s3", moto_server)
    ids = [f"doc-{i:05d}" for i in range(2600)] + ["a b", "Z", "%x", "-dash", "_under"]
    keys = [result_key("pre", "night", cid) for cid in ids]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: s3.put_object(Bucket=s3_bucket, Key=k, Body=b"{}"), keys))
    s3.put_object(Bucket=s3_bucket, Key="pre/night/_conflicts/x-123.json", Body=b"{}")
    s3.put_object(Bucket=s3_bucket, Key="pre/nightly/doc-1.json", Body=b"{}")  # other batch
    store = open_store(f"s3://{s3_bucket}/pre", _settings(moto_server))
    folder = batch_folder("pre", "night")
    single = store.list_names(folder)
    assert split_points(keys, 7) == []  # ranges shorter than MIN_RANGE_KEYS
    cuts = sorted(keys)[::400][1:]  # ranges of 400 keys: several pages overshoot
    ranged = store.list_names(folder, cuts)
    assert ranged == single == sorted(keys)
    assert store.list_names(folder + "_conflicts/") == ["pre/night/_conflicts/x-123.json"]


def test_get_many_keeps_order_and_reports_absent_keys(moto_server: str, s3_bucket: str) -> None:
    s3 = boto_client("s3", moto_server)
    for i in range(30):
        s3.put_object(Bucket=s3_bucket, Key=f"p/b/{i}.json", Body=str(i).encode())
    store = open_store(f"s3://{s3_bucket}/p", _settings(moto_server), workers=8)
    wanted = [f"p/b/{i}.json" for i in (29, 3, 99, 0)]
    got = list(store.get_many(wanted, window=2))
    assert got == [(wanted[0], b"29"), (wanted[1], b"3"), (wanted[2], None), (wanted[3], b"0")]


def test_dir_store_lists_only_the_batch_files(tmp_path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x.json").write_text("{}")
    (tmp_path / "b" / ".tmp-123").write_text("")
    (tmp_path / "b" / "_conflicts").mkdir()
    store = DirStore(tmp_path)
    assert store.list_names("b/") == ["b/x.json"]
    store.put("b/_manifest.json", b"m")
    assert store.get("b/_manifest.json") == b"m" and store.get("b/none.json") is None


def test_split_points_cut_equal_runs() -> None:
    keys = [f"k{i:06d}" for i in range(20000)]
    assert split_points(keys, 16) == ["k005000", "k010000", "k015000"]
    assert split_points(keys[:9999], 16) == []


def test_ordered_map_bounds_what_it_holds() -> None:
    assert list(ordered_map(lambda x: x * x, range(100), workers=4, window=3)) == [
        x * x for x in range(100)]


def test_a_bad_results_location_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="s3://bucket/prefix or file:///path/dir"):
        open_store("ftp://x", None)


def test_get_stored_gives_the_bytes_and_when_they_were_stored(
    tmp_path, moto_server: str, s3_bucket: str
) -> None:
    import os
    import time

    before = int(time.time())
    boto_client("s3", moto_server).put_object(Bucket=s3_bucket, Key="p/b/x.json", Body=b"x")
    s3 = open_store(f"s3://{s3_bucket}/p", _settings(moto_server))
    body, stored_at = s3.get_stored("p/b/x.json")
    assert body == b"x" and before - 1 <= stored_at <= time.time() + 1
    assert s3.get_stored("p/b/none.json") == (None, 0)
    local = DirStore(tmp_path)
    local.put("b/x.json", b"y")
    os.utime(tmp_path / "b" / "x.json", (1_700_000_000, 1_700_000_000))
    assert local.get_stored("b/x.json") == (b"y", 1_700_000_000)
    assert local.get_stored("b/none.json") == (None, 0)
