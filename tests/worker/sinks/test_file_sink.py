"""The file:// sink: write-then-link, first write wins, fingerprints, collect (sinks/file.py)."""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path

import pytest

from qworker.worker.sinks import collect, open_sink, sink_prefix
from qworker.worker.sinks.base import PutResult
from qworker.worker.sinks.file import FileSink


def test_first_write_wins_and_a_second_put_is_a_duplicate(tmp_path: Path) -> None:
    sink = FileSink(tmp_path)

    async def main() -> tuple[PutResult, PutResult]:
        return await sink.put("b/k.json", b"one"), await sink.put("b/k.json", b"two")

    assert asyncio.run(main()) == (PutResult(True), PutResult(False))
    assert (tmp_path / "b" / "k.json").read_bytes() == b"one"
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["k.json"]  # no temp files left


def test_the_stored_fingerprint_comes_back_on_a_second_put(tmp_path: Path) -> None:
    sink = FileSink(tmp_path)

    async def main() -> list[PutResult]:
        return [await sink.put("b/k.json", b"one", "fp-a"),
                await sink.put("b/k.json", b"again", "fp-a"),
                await sink.put("b/k.json", b"other", "fp-b")]

    assert asyncio.run(main()) == [PutResult(True), PutResult(False, "fp-a"),
                                   PutResult(False, "fp-a")]
    assert (tmp_path / "b" / "k.json").read_bytes() == b"one"
    assert (tmp_path / "b" / "_fingerprints" / "k.json").read_text() == "fp-a"
    assert list(collect(f"file://{tmp_path}", "b", None)) == [b"one"]  # type: ignore[arg-type]


def test_a_missing_record_behind_its_own_fingerprint_is_written_by_the_same_request(
    tmp_path: Path,
) -> None:
    # A writer that died between linking the fingerprint and the record: the same request
    # (a redelivery) completes the write, a different one is told whose key it is.
    (tmp_path / "b" / "_fingerprints").mkdir(parents=True)
    (tmp_path / "b" / "_fingerprints" / "k.json").write_text("fp-a")
    sink = FileSink(tmp_path)
    assert sink.put_sync("b/k.json", b"other", "fp-b") == PutResult(False, "fp-a")
    assert sink.put_sync("b/k.json", b"one", "fp-a") == PutResult(True)
    assert (tmp_path / "b" / "k.json").read_bytes() == b"one"


def test_concurrent_puts_of_one_key_store_exactly_one(tmp_path: Path) -> None:
    sink = FileSink(tmp_path)

    async def main() -> list[bool]:
        puts = await asyncio.gather(*(sink.put("b/k.json", b"%d" % i) for i in range(8)))
        return [p.written for p in puts]

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


def test_a_write_that_fails_midway_leaves_no_temporary_file(tmp_path: Path) -> None:
    # Regression: a failed write (a full disk, a file-size limit) left its .tmp-* file
    # behind. A real failure: the write runs under RLIMIT_FSIZE, so the kernel stops it.
    import subprocess
    import sys

    code = (
        "import resource, signal, sys\n"
        "from pathlib import Path\n"
        "from qworker.worker.sinks.file import FileSink\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))\n"
        "try:\n"
        "    FileSink(Path(sys.argv[1])).put_sync('b/big.json', b'x' * 65536, 'fp')\n"
        "except OSError as exc:\n"
        "    print(exc.errno)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(errno.EFBIG)
    assert not (tmp_path / "b" / "big.json").exists()
    assert not [p.name for p in tmp_path.rglob(".tmp-*")]
