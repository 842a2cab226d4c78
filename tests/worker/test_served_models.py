"""No silent model swap: a job naming a model the worker does not serve gets a 404 line.

qworker/worker/served_models.py, applied by ``requests.prepare`` for ``qworker run`` and
``qworker generate`` alike (docs/formats.md, "Model names"). Real file spool and echo
engine; the CLI in-process.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from qworker.cli import main
from qworker.worker.echo_engine import EchoEngine
from qworker.worker.requests import Prepared, prepare
from qworker.worker.served_models import ServedModels
from tests.schema.openai_types import validate_line
from tests.worker.harness import file_source, serve, settings
from tests.worker.jobs import chat_job, completion_job, read_results, write_spool

MESSAGE = ("The model `gpt-4o-mini` does not exist or is not served by this worker "
           "(it serves `echo`).")


def _assert_model_not_found(record: dict[str, Any], message: str = MESSAGE) -> None:
    assert validate_line(record) == "404"
    response = record["response"]
    assert response["status_code"] == 404 and response["request_id"].startswith("req_")
    assert record["error"] is None
    assert response["body"] == {"error": {
        "message": message, "type": "invalid_request_error", "param": "model",
        "code": "model_not_found"}}


def _jobs() -> list[dict[str, Any]]:
    return [
        chat_job("no-model"),                          # older files leave it out: served
        chat_job("served-name", model="echo"),         # engine.model_name
        completion_job("as-given", model="echo://"),   # --model as given
        chat_job("alias", model="smollm2"),            # QWORKER_MODEL_ALIASES
        chat_job("other", model="gpt-4o-mini"),
        completion_job("other-completion", model="gpt-4o-mini"),
        chat_job("not-a-string", model=5),
    ]


def test_a_job_naming_another_model_gets_404_and_its_batch_mates_are_served(
    tmp_path: Path,
) -> None:
    source, uri = file_source(tmp_path, _jobs())
    cfg = settings(tmp_path, uri, model_aliases="smollm2, echo-alias")
    asyncio.run(serve(cfg, source, tmp_path / "out"))
    results = read_results(tmp_path / "out")
    assert set(results) == {j["custom_id"] for j in _jobs()}
    for custom_id in ("no-model", "served-name", "as-given", "alias"):
        assert validate_line(results[custom_id]) in ("chat", "completion"), custom_id
        assert results[custom_id]["response"]["body"]["model"] == "echo"
    _assert_model_not_found(results["other"])
    _assert_model_not_found(results["other-completion"])
    bad = results["not-a-string"]
    assert validate_line(bad) == "400"
    assert bad["response"]["body"]["error"]["param"] == "model"


def test_accept_any_model_serves_every_job(tmp_path: Path) -> None:
    source, uri = file_source(tmp_path, _jobs()[:6])
    cfg = settings(tmp_path, uri, accept_any_model=True)
    asyncio.run(serve(cfg, source, tmp_path / "out"))
    results = read_results(tmp_path / "out")
    assert len(results) == 6
    assert all(validate_line(r) in ("chat", "completion") for r in results.values())


def test_without_settings_only_the_served_name_is_accepted() -> None:
    engine = EchoEngine()
    ok = prepare(engine, json.dumps(chat_job("a", model="echo")).encode(), 1 << 20)
    assert isinstance(ok, Prepared) and ok.job.model == "echo"
    refused = prepare(engine, json.dumps(chat_job("b", model="echo://")).encode(), 1 << 20)
    assert not isinstance(refused, Prepared) and refused.code == "model_not_found"
    assert refused.record is not None
    _assert_model_not_found(refused.record, "The model `echo://` does not exist or is not "
                            "served by this worker (it serves `echo`).")
    served = ServedModels.of("echo", "echo://", " a, ,b ")
    assert served.names == {"echo", "echo://", "a", "b"}
    assert served.check("b") is None and served.check(None) is None
    assert served.check("c") is not None


def _generate(tmp_path: Path, *flags: str) -> list[dict[str, Any]]:
    spool = write_spool(tmp_path / "in.jsonl", _jobs())
    out = tmp_path / "results.jsonl"
    assert main(["generate", "-i", str(spool), "-o", str(out), "--model", "echo://",
                 *flags]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_generate_applies_the_same_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)  # no .env of the caller's
    for name in ("QWORKER_MODEL_ALIASES", "QWORKER_ACCEPT_ANY_MODEL"):
        monkeypatch.delenv(name, raising=False)
    lines = _generate(tmp_path)
    kinds = {r["custom_id"]: validate_line(r) for r in lines}
    assert kinds == {"no-model": "chat", "served-name": "chat", "as-given": "completion",
                     "alias": "404", "other": "404", "other-completion": "404",
                     "not-a-string": "400"}
    _assert_model_not_found(lines[4])
    aliased = _generate(tmp_path, "--model-aliases", "smollm2")
    assert validate_line(aliased[3]) == "chat"
    monkeypatch.setenv("QWORKER_ACCEPT_ANY_MODEL", "true")
    any_model = _generate(tmp_path)
    assert [validate_line(r) for r in any_model[:6]] == ["chat", "chat", "completion", "chat",
                                                         "chat", "completion"]
    monkeypatch.delenv("QWORKER_ACCEPT_ANY_MODEL")
    flagged = _generate(tmp_path, "--accept-any-model")
    assert validate_line(flagged[4]) == "chat"


@pytest.mark.parametrize("source", ["sqs://jobs", "kafka://127.0.0.1:1/jobs?group=g"])
def test_a_queue_source_without_model_is_one_line_and_exit_1(
    source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("QWORKER_MODEL", raising=False)
    code = main(["run", "--source", source, "--sink", f"file://{tmp_path}/out",
                 "--metrics-port", "0"])
    err = capsys.readouterr().err
    assert code == 1
    scheme = source.partition(":")[0]
    assert err == (f"qworker run: --model (QWORKER_MODEL) is required with a {scheme} "
                   "source: name the model this worker serves\n")


def test_the_file_spool_keeps_the_bundled_default(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from qworker.config import WorkerSettings
    from qworker.worker.served_models import check_model_given

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("QWORKER_MODEL", raising=False)
    check_model_given(WorkerSettings(source=f"file://{tmp_path}/jobs.jsonl"))
    with pytest.raises(ValueError, match="required with a sqs source"):
        check_model_given(WorkerSettings(source="sqs://jobs"))
    monkeypatch.setenv("QWORKER_MODEL", "echo://")
    check_model_given(WorkerSettings(source="sqs://jobs"))  # given through the environment
