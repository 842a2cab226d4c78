"""The ``qworker`` command line: generate, produce / collect over file://, cost, help."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("orjson")
pytest.importorskip("pydantic_settings")

from qworker.cli import main
from qworker.schema import error_of
from tests.worker.jobs import chat_job, completion_job, write_spool


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_generate_with_echo_keeps_input_order_and_reports_errors_inline(
    tmp_path: Path, capsys
) -> None:
    write_spool(
        tmp_path / "in.jsonl",
        [
            completion_job("a", "alpha"),
            "not json",
            "",
            chat_job("b", temperature=-1),
            completion_job("c", "gamma"),
        ],
    )
    code = main(
        [
            "generate",
            "-i",
            str(tmp_path / "in.jsonl"),
            "-o",
            str(tmp_path / "out.jsonl"),
            "--model",
            "echo://",
            "--window",
            "2",
        ]
    )
    assert code == 0
    out = _lines(tmp_path / "out.jsonl")
    assert [r["custom_id"] for r in out] == ["a", None, "b", "c"]
    assert out[0]["response"]["body"]["choices"][0]["text"] == "alpha"
    assert error_of(out[1])["code"] == "invalid_request"
    assert error_of(out[1])["message"].startswith("line 2: not valid JSON")
    assert error_of(out[2])["message"] == "body.temperature must be a finite number >= 0, got -1"
    err = capsys.readouterr().err
    assert "generate: 4/4 done (2 ok, 2 errors)" in err


def test_generate_with_a_tiny_model_as_a_process(tmp_path: Path, tiny_chat_model_dir: Path) -> None:
    write_spool(
        tmp_path / "in.jsonl",
        [
            chat_job("q1", "What is 2+2?", max_tokens=3),
            {"custom_id": "bad", "url": "/v1/chat/completions", "body": {"messages": []}},
            completion_job("q2", "The sky is", max_tokens=2, n=2, temperature=0.7, seed=1),
        ],
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "qworker",
            "generate",
            "-i",
            "in.jsonl",
            "-o",
            "out.jsonl",
            "--model",
            str(tiny_chat_model_dir),
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--num-kv-blocks",
            "32",
            "--max-model-len",
            "128",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    out = _lines(tmp_path / "out.jsonl")
    assert [r["custom_id"] for r in out] == ["q1", "bad", "q2"]
    assert out[0]["response"]["body"]["usage"]["completion_tokens"] == 3
    assert out[1]["response"]["body"]["error"] == {
        "code": "invalid_request",
        "message": "body.messages must be a non-empty list, got an array []",
        "param": "messages",
        "type": "invalid_request_error",
    }
    assert len(out[2]["response"]["body"]["choices"]) == 2
    assert "generate: 3/3 done (2 ok, 1 errors)" in proc.stderr


def test_produce_then_run_then_collect_over_files(tmp_path: Path) -> None:
    write_spool(
        tmp_path / "batch.jsonl",
        [completion_job(f"j{i}", f"p{i}") for i in range(5)]
        + [completion_job("bad", "x", temperature=9)],
    )
    spool = f"file://{tmp_path}/spool.jsonl"
    assert (
        main(
            ["produce", "-i", str(tmp_path / "batch.jsonl"), "--to", spool, "--batch-id", "nightly",
             "--results", f"file://{tmp_path}/out"]
        )
        == 0
    )
    sent = _lines(tmp_path / "spool.jsonl")
    assert len(sent) == 6 and {r["batch_id"] for r in sent} == {"nightly"}
    assert (
        main(
            [
                "run",
                "--source",
                spool,
                "--sink",
                f"file://{tmp_path}/out",
                "--model",
                "echo://",
                "--until-idle",
                "0.3",
                "--metrics-port",
                "0",
                "--spot-metadata-url",
                "",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "collect",
                "--from",
                f"file://{tmp_path}/out",
                "--batch-id",
                "nightly",
                "-o",
                str(tmp_path / "results.jsonl"),
                "--errors",
                str(tmp_path / "errors.jsonl"),
            ]
        )
        == 0
    )
    results = _lines(tmp_path / "results.jsonl")
    errors = _lines(tmp_path / "errors.jsonl")
    assert sorted(r["custom_id"] for r in results) == [f"j{i}" for i in range(5)]
    assert [e["custom_id"] for e in errors] == ["bad"]
    assert error_of(errors[0])["code"] == "invalid_request"


def test_bad_settings_exit_1_with_a_clear_message(capsys) -> None:
    assert main(["run", "--source", "ftp://x/y"]) == 1  # configuration: do not retry
    err = capsys.readouterr().err
    assert "source (--source / QWORKER_SOURCE): source 'ftp://x/y' must be kafka://" in err


def test_a_rule_across_settings_names_them_not_an_empty_flag(capsys) -> None:
    assert main(["run", "--kafka-security-protocol", "SASL_SSL"]) == 1
    err = capsys.readouterr().err
    assert "  kafka_security_protocol=SASL_SSL needs kafka_sasl_mechanism" in err
    assert "(-- / QWORKER_)" not in err


def test_missing_source_file_exits_1_with_one_line(tmp_path: Path, capsys) -> None:
    code = main(
        [
            "run",
            "--source",
            f"file://{tmp_path}/nope.jsonl",
            "--model",
            "echo://",
            "--sink",
            f"file://{tmp_path}/out",
            "--metrics-port",
            "0",
            "--spot-metadata-url",
            "",
        ]
    )
    assert code == 1  # a configuration error: do not retry (docs/operations.md)
    err = capsys.readouterr().err
    assert "nope.jsonl does not exist" in err and "Traceback" not in err


def test_python_dash_m_qworker_shows_help() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "qworker", "run", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0
    assert "--until-idle" in proc.stdout and "QWORKER_DRAIN_SECONDS" in proc.stdout
    gen = subprocess.run(
        [sys.executable, "-m", "qworker", "generate", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "IN INPUT ORDER" in gen.stdout


def test_version_flag_prints_the_package_version(capsys) -> None:
    import qworker

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"qworker {qworker.__version__}"
