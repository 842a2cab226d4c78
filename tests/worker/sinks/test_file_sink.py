"""The file:// sink: write-then-link, first write wins, collect (sinks/file.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from qworker.worker.sinks import collect, open_sink, sink_prefix
from qworker.worker.sinks.file import FileSink


def test_first_write_wins_and_a_second_put_is_a_duplicate(tmp_path: Path) -> None:
    sink = FileSink(tmp_path)

    async def main() -> tuple[bool, bool]:
        return await sink.put("b/k.json", b"one"), await sink.put("b/k.json", b"two")

    assert asyncio.run(main()) == (True, False)
    assert (tmp_path / "b" / "k.json").read_bytes() == b"one"
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["k.json"]  # no temp files left


def test_concurrent_puts_of_one_key_store_exactly_one(tmp_path: Path) -> None:
    sink = FileSink(tmp_path)

    async def main() -> list[bool]:
        return list(await asyncio.gather(*(sink.put("b/k.json", b"%d" % i) for i in range(8))))

    assert sorted(asyncio.run(main())) == [False] * 7 + [True]


def test_keys_escaping_the_directory_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unsafe result key"):
        FileSink(tmp_path).put_sync("../x.json", b"")


def test_collect_reads_one_batch(tmp_path: Path) -> None:
    sink = FileSink(tmp_path)
    sink.put_sync("nightly/a.json", b'{"custom_id": "a"}')
    sink.put_sync("nightly/b.json", b'{"custom_id": "b"}')
    sink.put_sync("other/c.json", b'{"custom_id": "c"}')
    got = list(collect(f"file://{tmp_path}", "nightly", None))  # type: ignore[arg-type]
    assert got == [b'{"custom_id": "a"}', b'{"custom_id": "b"}']


def test_factory_and_prefix() -> None:
    assert isinstance(open_sink("file:///tmp/out", None), FileSink)  # type: ignore[arg-type]
    assert sink_prefix("s3://bucket/a/b/") == "a/b"
    assert sink_prefix("s3://bucket") == ""
    assert sink_prefix("file:///tmp/out") == ""
