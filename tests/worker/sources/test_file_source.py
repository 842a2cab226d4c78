"""The file:// spool source: progress log, resume, dead letters, lock (sources/file.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from qworker.worker.sources import open_source, source_scheme
from qworker.worker.sources.file import FileSource, append_jobs
from tests.worker.jobs import acked_lines


def _spool(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "jobs.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"j{i}"}) + "\n" for i in range(n)))
    return path


async def _drain_source(src: FileSource, max_messages: int = 100) -> list:
    return await src.receive(max_messages, 0.05)


def test_acked_lines_are_never_served_again_after_restart(tmp_path: Path) -> None:
    path = _spool(tmp_path, 6)

    async def first() -> None:
        src = FileSource(path)
        await src.start()
        msgs = await _drain_source(src)
        assert [m.message_id for m in msgs] == [f"file:{i}" for i in range(1, 7)]
        for m in (msgs[0], msgs[1], msgs[4]):
            await src.ack(m)
        await src.abandon(msgs[2])
        await src.close()

    async def second() -> list[str]:
        src = FileSource(path)
        await src.start()
        msgs = await _drain_source(src)
        await src.close()
        return [m.message_id for m in msgs]

    asyncio.run(first())
    assert asyncio.run(second()) == ["file:3", "file:4", "file:6"]
    progress = (tmp_path / "jobs.jsonl.progress").read_text().splitlines()
    assert progress[0].startswith("file ")  # which file the progress is about
    assert progress[1:] == ["done_through 2", "5"]  # compacted at the second start


def test_lines_appended_while_running_are_picked_up(tmp_path: Path) -> None:
    path = _spool(tmp_path, 1)

    async def main() -> list[str]:
        src = FileSource(path)
        await src.start()
        got = [m.message_id for m in await _drain_source(src)]
        append_jobs(f"file://{path}", [b'{"custom_id": "late"}'])
        got += [m.message_id for m in await src.receive(10, 1.0)]
        await src.close()
        return got

    assert asyncio.run(main()) == ["file:1", "file:2"]


def test_receive_waits_up_to_timeout_then_returns_empty(tmp_path: Path) -> None:
    path = _spool(tmp_path, 0)

    async def main() -> list:
        src = FileSource(path)
        await src.start()
        try:
            return await src.receive(5, 0.1)
        finally:
            await src.close()

    assert asyncio.run(main()) == []


def test_dead_letter_is_written_with_reason_and_counts_as_done(tmp_path: Path) -> None:
    path = tmp_path / "jobs.jsonl"
    path.write_bytes(b'garbage\n\n{"custom_id": "x"}\n')

    async def main() -> None:
        src = FileSource(path)
        await src.start()
        msgs = await _drain_source(src)
        assert [m.message_id for m in msgs] == ["file:1", "file:3"]  # blank line skipped
        await src.dead_letter(msgs[0], "not valid JSON")
        await src.close()

    asyncio.run(main())
    dlq = json.loads((tmp_path / "jobs.jsonl.dlq").read_text())
    assert dlq == {"message_id": "file:1", "reason": "not valid JSON", "body": "garbage"}
    assert acked_lines(tmp_path / "jobs.jsonl.progress") == {1}


def test_second_worker_on_the_same_spool_is_refused(tmp_path: Path) -> None:
    path = _spool(tmp_path, 1)

    async def main() -> None:
        a, b = FileSource(path), FileSource(path)
        await a.start()
        try:
            with pytest.raises(RuntimeError, match="another worker uses this spool"):
                await b.start()
        finally:
            await a.close()

    asyncio.run(main())


def test_factory_rejects_unknown_schemes() -> None:
    with pytest.raises(ValueError, match="must start with kafka://, sqs:// or file://"):
        source_scheme("http://x")
    assert isinstance(open_source("file:///tmp/x.jsonl", None), FileSource)  # type: ignore[arg-type]


def test_acked_prefix_folds_into_a_watermark_in_memory(tmp_path: Path) -> None:
    path = _spool(tmp_path, 5)

    async def main() -> FileSource:
        src = FileSource(path)
        await src.start()
        msgs = await _drain_source(src)
        for m in (msgs[1], msgs[0], msgs[3]):
            await src.ack(m)
        await src.close()
        return src

    src = asyncio.run(main())
    assert (src._done_through, src._done) == (2, {4})
