"""The README's two local shell walkthroughs, run as written (bash, processes, files).

Each ```bash block under "The real path, locally" and "Walkthrough: a secured Kafka" is
taken from README.md and run by bash in a scratch folder holding `examples/` and a
`.venv` link to this interpreter's environment. Only what would collide on a shared
machine is rewritten: the ports (19092, 19093, 15000) become free ones, `/tmp/qworker-tls`
a scratch folder, and `--until-idle` is shortened. The model is the echo engine through
`QWORKER_MODEL` (the README's own hint), so no command line changes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("aiokafka")
pytest.importorskip("boto3")
pytest.importorskip("cryptography")

from tests.fixtures.servers import free_port, tansu_binary
from tests.schema.openai_types import validate_line

ROOT = Path(__file__).resolve().parents[2]


def _block(heading: str) -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index(heading):]
    match = re.search(r"```bash\n(.*?)```", section, re.S)
    assert match, f"no bash block under {heading!r}"
    return match.group(1)


def _run_block(script: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    tansu_binary()  # skips without the broker
    work = tmp_path / "work"
    (work / "examples").mkdir(parents=True)
    (work / "examples" / "requests.jsonl").write_bytes(
        (ROOT / "examples" / "requests.jsonl").read_bytes())
    (work / ".venv").symlink_to(Path(sys.prefix))
    for port in ("19092", "19093", "15000"):
        script = script.replace(port, str(free_port()))
    script = script.replace("/tmp/qworker-tls", str(tmp_path / "tls"))
    script = re.sub(r"--until-idle \d+", "--until-idle 3", script)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "QWORKER_MODEL": "echo://", "QWORKER_METRICS_PORT": "0",
           "QWORKER_SPOT_METADATA_URL": "", "QWORKER_KAFKA_SESSION_TIMEOUT_MS": "3000",
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    # -e: the first failing command fails the walkthrough. The servers it starts in the
    # background are in its process group, ended with it whatever happens.
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("w") as stdout, err.open("w") as stderr:
        bash = subprocess.Popen(["bash", "-e", "-c", script], cwd=work, env=env,
                                stdout=stdout, stderr=stderr, start_new_session=True)
        try:
            code = bash.wait(timeout=180)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(bash.pid, signal.SIGKILL)
            bash.wait()
    return subprocess.CompletedProcess(bash.args, code, out.read_text(), err.read_text()), work


def _check_results(work: Path) -> None:
    ids = [json.loads(x)["custom_id"]
           for x in (work / "examples" / "requests.jsonl").read_text().splitlines()]
    lines = [json.loads(x) for x in (work / "results.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in lines] == ids
    assert all(validate_line(r) in ("chat", "completion") for r in lines)
    assert (work / "errors.jsonl").read_text() == ""


def test_the_readme_local_path_runs_as_written(tmp_path: Path) -> None:
    proc, work = _run_block(_block("## The real path, locally"), tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check_results(work)


def test_the_readme_secured_walkthrough_runs_as_written(tmp_path: Path) -> None:
    proc, work = _run_block(_block("## Walkthrough: a secured Kafka"), tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    status = json.loads(proc.stdout[proc.stdout.index("{"):proc.stdout.rindex("}") + 1])
    assert status["status"] == "completed" and status["request_counts"]["failed"] == 0
    _check_results(work)
