"""``qworker run`` as a real process over file://: until-idle, SIGTERM, SIGKILL, spot notice."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("orjson")
pytest.importorskip("pydantic_settings")

from qworker.schema import error_of
from tests.worker.jobs import acked_lines, chat_job, completion_job, read_results, write_spool

N_JOBS = 24
# One job at a time, each ~4 steps of 40 ms: slow enough to interrupt mid-batch.
SLOW_ECHO = "echo://?delay_ms=40&steps=4"


def _start(tmp_path: Path, model: str, *extra: str, **env: str) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "qworker",
        "run",
        "--source",
        f"file://{tmp_path}/jobs.jsonl",
        "--sink",
        f"file://{tmp_path}/out",
        "--model",
        model,
        "--metrics-port",
        "0",
        *extra,
    ]
    env.setdefault("QWORKER_SPOT_METADATA_URL", "")
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
    log = (tmp_path / "worker.log").open("ab")
    return subprocess.Popen(cmd, cwd=tmp_path, env=full_env, stdout=log, stderr=log)


def _wait_for_results(
    tmp_path: Path, count: int, proc: subprocess.Popen[bytes], timeout: float = 60
) -> None:
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        if len(read_results(tmp_path / "out")) >= count:
            return
        assert proc.poll() is None, _log(tmp_path)
        time.sleep(0.05)
    raise AssertionError("no progress\n" + _log(tmp_path))


def _wait_for_log(tmp_path: Path, proc: subprocess.Popen[bytes], text: str,
                  timeout: float = 60) -> None:
    until = time.monotonic() + timeout
    while text not in _log(tmp_path):
        assert proc.poll() is None and time.monotonic() < until, _log(tmp_path)
        time.sleep(0.05)


def _wait_for_inflight(tmp_path: Path, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    """Until the worker's /metrics shows a job in flight (waits on its state, not a guess)."""
    _wait_for_log(tmp_path, proc, "serving jobs")
    port = re.search(r"metrics on http://0\.0\.0\.0:(\d+)/metrics", _log(tmp_path))
    assert port, _log(tmp_path)
    until = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port.group(1)}/metrics", timeout=5) as r:
            text = r.read().decode()
        found = re.search(r"^qworker_num_requests_running\{[^}]*\} ([0-9.]+)$", text, re.M)
        if found and float(found.group(1)) >= 1:
            return
        assert proc.poll() is None and time.monotonic() < until, _log(tmp_path)
        time.sleep(0.05)


def _log(tmp_path: Path) -> str:
    return (tmp_path / "worker.log").read_text(errors="replace")[-4000:]


def _finish(proc: subprocess.Popen[bytes], timeout: float = 60) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def _jobs(tmp_path: Path) -> list[str]:
    lines = [chat_job(f"job-{i}", f"request number {i}") for i in range(N_JOBS)]
    write_spool(tmp_path / "jobs.jsonl", lines)
    return [line["custom_id"] for line in lines]


def test_run_until_idle_serves_every_job_and_exits_zero(tmp_path: Path) -> None:
    ids = _jobs(tmp_path)
    proc = _start(tmp_path, "echo://", "--until-idle", "0.5")
    assert _finish(proc) == 0, _log(tmp_path)
    assert set(read_results(tmp_path / "out")) == set(ids)
    log = _log(tmp_path)
    assert "qworker run summary" in log and f"completed {N_JOBS}" in log
    assert "kv cache: mean usage" in log


def test_run_with_a_tiny_model_writes_chat_completions(
    tmp_path: Path, tiny_chat_model_dir: Path
) -> None:
    write_spool(
        tmp_path / "jobs.jsonl",
        [
            chat_job("t1", "Hello there", max_tokens=4),
            chat_job(
                "t2", "Summarize: cats sleep a lot.", max_tokens=4, n=2, seed=3, temperature=0.8
            ),
            completion_job("t3", "Once upon a time", max_tokens=3, logprobs=2),
            chat_job("t4", "x " * 400, max_tokens=4),  # longer than max_model_len
        ],
    )
    proc = _start(
        tmp_path,
        str(tiny_chat_model_dir),
        "--until-idle",
        "0.5",
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--num-kv-blocks",
        "64",
        "--max-model-len",
        "256",
    )
    assert _finish(proc, 240) == 0, _log(tmp_path)
    results = read_results(tmp_path / "out")
    body = results["t1"]["response"]["body"]
    assert body["object"] == "chat.completion"
    assert body["usage"]["completion_tokens"] == 4
    assert isinstance(body["choices"][0]["message"]["content"], str)
    assert len(results["t2"]["response"]["body"]["choices"]) == 2
    lp = results["t3"]["response"]["body"]["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 3 and len(lp["top_logprobs"][0]) == 2
    assert error_of(results["t4"])["code"] == "context_length_exceeded"


def test_sigterm_drains_commits_only_finished_work_and_a_rerun_completes(tmp_path: Path) -> None:
    ids = _jobs(tmp_path)
    proc = _start(tmp_path, SLOW_ECHO, "--max-inflight-jobs", "1", "--drain-seconds", "0.05")
    _wait_for_results(tmp_path, 4, proc)
    port = re.search(r"metrics on http://0\.0\.0\.0:(\d+)/metrics", _log(tmp_path))
    assert port, _log(tmp_path)
    base = f"http://127.0.0.1:{port.group(1)}"
    with urllib.request.urlopen(base + "/readyz", timeout=5) as resp:
        assert resp.status == 200  # model loaded, not draining
    with urllib.request.urlopen(base + "/metrics", timeout=5) as resp:
        assert b"qworker_jobs_completed_total" in resp.read()
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert _finish(proc) == 75, _log(tmp_path)  # drained with work left
    assert time.monotonic() - sent < 15
    first = read_results(tmp_path / "out")
    acked = acked_lines(tmp_path / "jobs.jsonl.progress")
    # Exactly the jobs whose result is stored are marked done; the rest were left unacked.
    assert acked == {ids.index(cid) + 1 for cid in first}
    assert 4 <= len(first) < N_JOBS
    assert "drain requested: signal" in _log(tmp_path)

    rerun = _start(tmp_path, "echo://", "--until-idle", "0.5")
    assert _finish(rerun) == 0, _log(tmp_path)
    final = read_results(tmp_path / "out")
    assert set(final) == set(ids)
    assert all(final[cid]["id"] == first[cid]["id"] for cid in first)
    assert acked_lines(tmp_path / "jobs.jsonl.progress") == set(range(1, N_JOBS + 1))


def test_sigkill_mid_batch_then_restart_gives_exactly_one_result_each(tmp_path: Path) -> None:
    ids = _jobs(tmp_path)
    proc = _start(tmp_path, SLOW_ECHO, "--max-inflight-jobs", "2")
    _wait_for_results(tmp_path, 5, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    first = read_results(tmp_path / "out")
    assert len(first) < N_JOBS

    rerun = _start(tmp_path, "echo://", "--until-idle", "0.5")
    assert _finish(rerun) == 0, _log(tmp_path)
    final = read_results(tmp_path / "out")  # asserts one file per custom_id
    assert set(final) == set(ids)
    assert all(final[cid]["id"] == first[cid]["id"] for cid in first)
    assert not list((tmp_path / "out").rglob(".tmp-*"))


class _Imds(BaseHTTPRequestHandler):
    notice: bool = False
    polls: int = 0

    def do_PUT(self) -> None:
        if self.path == "/latest/api/token" and self.headers.get(
            "X-aws-ec2-metadata-token-ttl-seconds"
        ):
            self._send(200, b"test-token")
        else:
            self._send(400, b"")

    def do_GET(self) -> None:
        if self.headers.get("X-aws-ec2-metadata-token") != "test-token":
            self._send(401, b"")
        elif self.path == "/latest/meta-data/spot/instance-action":
            type(self).polls += 1
            if type(self).notice:
                self._send(
                    200,
                    json.dumps({"action": "terminate", "time": "2026-11-29T23:59:59Z"}).encode(),
                )
            else:
                self._send(404, b"")
        else:
            self._send(404, b"")

    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_spot_interruption_notice_starts_a_drain(tmp_path: Path) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Imds)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        ids = _jobs(tmp_path)
        cmd_extra = (
            "--max-inflight-jobs",
            "1",
            "--drain-seconds",
            "5",
            "--spot-poll-seconds",
            "0.1",
        )
        proc = _start(
            tmp_path,
            SLOW_ECHO,
            *cmd_extra,
            QWORKER_SPOT_METADATA_URL=f"http://127.0.0.1:{server.server_port}",
        )
        _wait_for_results(tmp_path, 2, proc)
        assert _Imds.polls >= 1  # polled and saw 404 = no notice, kept serving
        _Imds.notice = True
        assert _finish(proc) == 75, _log(tmp_path)  # drained with work left
        log = _log(tmp_path)
        assert "spot interruption notice" in log and "drain requested: spot_interruption" in log
        results = read_results(tmp_path / "out")
        assert len(results) < len(ids)
        assert acked_lines(tmp_path / "jobs.jsonl.progress") == {
            ids.index(cid) + 1 for cid in results
        }
    finally:
        server.shutdown()
        server.server_close()


def test_second_sigterm_stops_at_once_without_acking_unfinished_work(tmp_path: Path) -> None:
    ids = _jobs(tmp_path)
    proc = _start(tmp_path, "echo://?delay_ms=40&steps=100000", "--drain-seconds", "120")
    _wait_for_inflight(tmp_path, proc)  # an event: jobs are inside the engine
    proc.send_signal(signal.SIGTERM)
    _wait_for_log(tmp_path, proc, "drain requested: signal")
    assert proc.poll() is None  # draining: waits for in-flight work (up to 120 s)
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    assert _finish(proc, 30) == 75, _log(tmp_path)
    assert time.monotonic() - sent < 10
    assert read_results(tmp_path / "out") == {}
    assert acked_lines(tmp_path / "jobs.jsonl.progress") == set()
    assert len(ids) == N_JOBS and "second signal SIGTERM: stopping at once" in _log(tmp_path)


def test_json_log_format_writes_one_object_per_line_with_job_ids(tmp_path: Path) -> None:
    write_spool(tmp_path / "jobs.jsonl", [chat_job("j1"), "not json"])
    proc = _start(tmp_path, "echo://", "--until-idle", "0.3", "--log-format", "json")
    assert _finish(proc) == 0, _log(tmp_path)
    records = [json.loads(line) for line in _log(tmp_path).splitlines() if line.strip()]
    job_lines = [r for r in records if r.get("message_id")]
    assert {"file:1", "file:2"} <= {r["message_id"] for r in job_lines}
    assert any(r.get("custom_id") == "j1" for r in job_lines)
    summary = [r for r in records if r["msg"] == "qworker run summary"]
    assert summary and summary[0]["completed"] == {"success": 1}
