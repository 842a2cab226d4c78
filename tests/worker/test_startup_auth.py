"""Startup checks run before the model loads; refused credentials are one line and exit 1.

Regressions (issue 19): a missing queue or spool was reported only after the model had
loaded (minutes for a large model); a wrong Kafka SASL password, a broker certificate
the CA does not verify, or AWS credentials refused (an unknown key, a user without the
permission) were taken for an outage: retried for the whole outage budget (300 s), then
exit 69. A failing start also left aiokafka clients behind ("Unclosed AIOKafkaConsumer"
at exit). Real servers: tansu behind the TLS/SASL edge, moto with IAM enforced.

The workers of the first tests are given a model that cannot load: the line they print
names the source or the sink, so the check ran first; those with refused credentials
load the echo model (the classification alone is under test). The outage budget stays at its default
(300 s); the subprocess timeout is far below it, so a retried failure fails the test.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("aiokafka")
pytest.importorskip("boto3")

from qworker.testing.aws_calls import DIR_ENV, PLUGIN_ENV
from qworker.testing.kafka_edge import KafkaEdge, LocalCA, SaslConfig, make_test_ca
from tests.fixtures.servers import free_port, tansu_broker

ROOT = Path(__file__).resolve().parents[2]
#: Far below the 300 s outage budget a misclassified failure would wait out.
TIMEOUT_S = 90
USERS = {"alice": "s3cret-pw"}


def _env(**extra: str) -> dict[str, str]:
    # Calls made with refused credentials are not the shipped policies' business: keep
    # them out of the session's recording (tests/fixtures/aws_recording.py).
    # AWS_* and QWORKER_* only from ``extra``: another fixture's session token or
    # endpoint must not mix with the credentials under test.
    env = {k: v for k, v in os.environ.items()
           if k not in (DIR_ENV, PLUGIN_ENV) and not k.startswith(("QWORKER_", "AWS_"))}
    env.update({"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "QWORKER_METRICS_PORT": "0",
                "QWORKER_SPOT_METADATA_URL": "", "PYTHONWARNINGS": "default::ResourceWarning",
                **extra})
    return env


def run_worker(tmp: Path, source: str, sink: str | None = None, model: str | None = None,
               **env: str) -> subprocess.CompletedProcess[str]:
    """``qworker run`` (by default with a model that cannot load); default outage budgets."""
    cmd = [sys.executable, "-m", "qworker", "run", "--source", source,
           "--sink", sink or f"file://{tmp}/out", "--model", model or str(tmp / "no-such-model"),
           "--until-idle", "1"]
    return subprocess.run(cmd, env=_env(**env), cwd=ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def assert_one_line(done: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit 1, one ERROR line naming ``needles``, no traceback, no unclosed client."""
    err = done.stderr
    assert done.returncode == 1, err
    assert "Traceback" not in err, err
    assert "Unclosed" not in err and "unclosed" not in err, err
    assert "cannot load model" not in err and "loading model" not in err, err
    lines = [line for line in err.splitlines() if " ERROR " in line]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@contextlib.contextmanager
def secured_broker(tls: LocalCA | None, sasl: SaslConfig | None) -> Iterator[str]:
    """tansu reachable only through a TLS/SASL edge (no topic: the check fails first)."""
    port = free_port()
    with tansu_broker(advertised_port=port) as upstream:
        edge = KafkaEdge(upstream, port=port, tls=tls.server_context() if tls else None,
                         sasl=sasl)
        edge.start()
        try:
            yield f"127.0.0.1:{port}"
        finally:
            edge.stop()


# ----------------------------------------------------------------- item 1: before the model


def test_a_missing_spool_is_reported_before_the_model_loads(tmp_path: Path) -> None:
    done = run_worker(tmp_path, f"file://{tmp_path}/no-such-jobs.jsonl")
    assert_one_line(done, "no-such-jobs.jsonl", "does not exist")


def test_a_missing_topic_is_reported_before_the_model_loads(
    tmp_path: Path, kafka_broker: str
) -> None:
    done = run_worker(tmp_path, f"kafka://{kafka_broker}/no-such-topic-q19?group=g")
    assert_one_line(done, "no-such-topic-q19", "does not exist")


def test_a_missing_queue_and_bucket_are_reported_before_the_model_loads(
    tmp_path: Path, moto_server: str
) -> None:
    aws = {"QWORKER_SQS_ENDPOINT_URL": moto_server, "QWORKER_S3_ENDPOINT_URL": moto_server,
           "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    done = run_worker(tmp_path, "sqs://no-such-queue-q19", **aws)
    assert_one_line(done, "no-such-queue-q19", "does not exist")
    (tmp_path / "jobs.jsonl").write_text("")
    done = run_worker(tmp_path, f"file://{tmp_path}/jobs.jsonl", "s3://no-such-bucket-q19/r",
                      **aws)
    assert_one_line(done, "no-such-bucket-q19")


# ----------------------------------------------------------------- item 2: Kafka credentials


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-512"])
def test_a_wrong_sasl_password_exits_1_naming_the_user_and_mechanism(
    tmp_path: Path, mechanism: str
) -> None:
    with secured_broker(None, SaslConfig((mechanism,), USERS)) as edge:
        done = run_worker(tmp_path, f"kafka://{edge}/jobs?group=g", model="echo://",
                          QWORKER_KAFKA_SECURITY_PROTOCOL="SASL_PLAINTEXT",
                          QWORKER_KAFKA_SASL_MECHANISM=mechanism,
                          QWORKER_KAFKA_SASL_USERNAME="alice",
                          QWORKER_KAFKA_SASL_PASSWORD="wrong")
    line = assert_one_line(done, "SASL authentication failed", "'alice'", mechanism,
                           "QWORKER_KAFKA_SASL_USERNAME/_PASSWORD")
    assert "wrong" not in line  # the password is never printed


def test_produce_with_a_wrong_sasl_password_is_one_line_and_exit_1(tmp_path: Path) -> None:
    jobs = tmp_path / "in.jsonl"
    jobs.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", '
                    '"body": {"model": "m", "messages": [{"role": "user", "content": "x"}]}}\n')
    with secured_broker(None, SaslConfig(("SCRAM-SHA-512",), USERS)) as edge:
        done = subprocess.run(
            [sys.executable, "-m", "qworker", "produce", "-i", str(jobs), "--to",
             f"kafka://{edge}/jobs", "--no-manifest"], cwd=ROOT, capture_output=True, text=True,
            timeout=TIMEOUT_S, env=_env(QWORKER_KAFKA_SECURITY_PROTOCOL="SASL_PLAINTEXT",
                                        QWORKER_KAFKA_SASL_MECHANISM="SCRAM-SHA-512",
                                        QWORKER_KAFKA_SASL_USERNAME="alice",
                                        QWORKER_KAFKA_SASL_PASSWORD="wrong"))
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("qworker produce: kafka: SASL authentication failed for "
                                  "user 'alice' (mechanism SCRAM-SHA-512)"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_broker_certificate_the_ca_does_not_verify_exits_1(tmp_path: Path) -> None:
    pytest.importorskip("cryptography")
    server_ca = make_test_ca(tmp_path / "server-ca")
    other_ca = make_test_ca(tmp_path / "other-ca")
    with secured_broker(server_ca, None) as edge:
        done = run_worker(tmp_path, f"kafka://{edge}/jobs?group=g", model="echo://",
                          QWORKER_KAFKA_SECURITY_PROTOCOL="SSL",
                          QWORKER_KAFKA_SSL_CAFILE=str(other_ca.ca))
    assert_one_line(done, "TLS verification", "QWORKER_KAFKA_SSL_CAFILE", str(other_ca.ca))


# ----------------------------------------------------------------- item 2: AWS credentials


@pytest.fixture(scope="module")
def moto_iam(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    pytest.importorskip("moto")
    from tests.fixtures.iam_moto import enforcing_moto

    with enforcing_moto(tmp_path_factory.mktemp("moto-iam") / "moto.log") as moto:
        yield moto


def _aws_env(moto: object, user: str | None, **extra: str) -> dict[str, str]:
    env = dict(moto.env(user or "worker"))  # type: ignore[attr-defined]
    if user is None:  # a key IAM never issued
        env.update({"AWS_ACCESS_KEY_ID": "AKIAUNKNOWNKEY000000",
                    "AWS_SECRET_ACCESS_KEY": "not-a-secret"})
    keep = {k: v for k, v in env.items() if k.startswith(("AWS_", "QWORKER_S3", "QWORKER_SQS"))}
    return {**keep, "QWORKER_AWS_REGION": moto.dep.region, **extra}  # type: ignore[attr-defined]


def test_an_unknown_access_key_exits_1_naming_the_queue_and_the_code(
    tmp_path: Path, moto_iam: object
) -> None:
    done = run_worker(tmp_path, f"sqs://{moto_iam.jobs_url}",  # type: ignore[attr-defined]
                      model="echo://", **_aws_env(moto_iam, None))
    assert_one_line(done, "sqs queue", "InvalidClientTokenId", "AWS_ACCESS_KEY_ID")


def test_a_user_without_the_permission_exits_1_with_access_denied(
    tmp_path: Path, moto_iam: object
) -> None:
    # The collector may read results, not consume the jobs queue.
    dep = moto_iam.dep  # type: ignore[attr-defined]
    done = run_worker(tmp_path, f"sqs://{dep.jobs_queue}", model="echo://",
                      **_aws_env(moto_iam, "collector"))
    assert_one_line(done, "sqs queue", "AccessDenied", "IAM policy")


def test_a_sink_bucket_refusing_the_credentials_exits_1(
    tmp_path: Path, moto_iam: object
) -> None:
    (tmp_path / "jobs.jsonl").write_text("")
    dep = moto_iam.dep  # type: ignore[attr-defined]
    done = run_worker(tmp_path, f"file://{tmp_path}/jobs.jsonl", f"s3://{dep.bucket}/results",
                      model="echo://", **_aws_env(moto_iam, None))
    assert_one_line(done, f"s3 bucket {dep.bucket!r}", "403", "AWS_ACCESS_KEY_ID")


# ----------------------------------------------------------------- item 3: every exit closes


def test_no_kafka_client_is_left_unclosed_by_an_idle_exit_or_a_drain(
    tmp_path: Path, kafka_broker: str, kafka_topic: object
) -> None:
    topic = kafka_topic()  # type: ignore[operator]
    source = f"kafka://{kafka_broker}/{topic}?group=g-closing"
    env = _env(QWORKER_KAFKA_SESSION_TIMEOUT_MS="3000")
    cmd = [sys.executable, "-m", "qworker", "run", "--source", source, "--sink",
           f"file://{tmp_path}/out", "--model", "echo://"]
    idle = subprocess.run([*cmd, "--until-idle", "1"], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert idle.returncode == 0, idle.stderr
    assert "nclosed" not in idle.stderr, idle.stderr
    with subprocess.Popen(cmd, env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stderr is not None
        for line in proc.stderr:  # wait until it serves, then SIGTERM
            if "serving jobs from" in line:
                break
        proc.terminate()
        _, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode in (0, 75), err
    assert "nclosed" not in err and "Traceback" not in err, err


def test_no_kafka_client_is_left_unclosed_when_the_brokers_never_answer(tmp_path: Path) -> None:
    # Regression: the probe consumer whose start failed was never stopped: exit 69 came
    # with "ERROR asyncio: Unclosed AIOKafkaConsumer" lines. A short budget here: the exit
    # path is under test, not the budget.
    done = run_worker(tmp_path, f"kafka://127.0.0.1:{free_port()}/jobs?group=g",
                      model="echo://", QWORKER_SOURCE_OUTAGE_SECONDS="2")
    assert done.returncode == 69, done.stderr
    assert "nclosed" not in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize(("user", "prefix", "action"), [
    ("worker", "elsewhere", "s3:PutObject"),  # its policy writes under results/ only
    ("collector", "results", "s3:PutObject"),  # reads results, writes none
])
def test_a_sink_the_credentials_may_not_write_exits_1_and_nothing_is_stored(
    tmp_path: Path, moto_iam: object, user: str, prefix: str, action: str
) -> None:
    # Regression: HEAD bucket passed, the first result write was refused, and the worker
    # retried it for the whole sink outage budget, then exit 69.
    (tmp_path / "jobs.jsonl").write_text("")
    dep = moto_iam.dep  # type: ignore[attr-defined]
    done = run_worker(tmp_path, f"file://{tmp_path}/jobs.jsonl", f"s3://{dep.bucket}/{prefix}",
                      model="echo://", **_aws_env(moto_iam, user))
    assert_one_line(done, f"s3://{dep.bucket}/{prefix}/*", action, "AccessDenied")
    admin = moto_iam.client("s3")  # type: ignore[attr-defined]
    assert not admin.list_objects_v2(Bucket=dep.bucket, Prefix=prefix).get("Contents")


def test_a_sigterm_during_the_startup_checks_exits_75_before_the_model_loads(
    tmp_path: Path,
) -> None:
    cmd = [sys.executable, "-m", "qworker", "run", "--source",
           f"kafka://127.0.0.1:{free_port()}/jobs?group=g", "--sink", f"file://{tmp_path}/out",
           "--model", str(tmp_path / "no-such-model")]
    with subprocess.Popen(cmd, env=_env(), cwd=ROOT, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:  # the check is being retried: the brokers do not answer
            seen.append(line)
            if "source down" in line:
                break
        proc.terminate()
        _, err = proc.communicate(timeout=TIMEOUT_S)
    err = "".join(seen) + err
    assert proc.returncode == 75, err
    assert "loading model" not in err and "nclosed" not in err and "Traceback" not in err, err


# ----------------------------------------------------------------- credentials revoked mid-run


def test_credentials_revoked_while_serving_exit_69_at_once_not_after_the_budget(
    tmp_path: Path, moto_iam: object
) -> None:
    # They worked at start: rotated, expired or revoked since. Not a configuration error
    # (1 would stop AWS Batch from retrying), not an outage to sit out for 300 s: exit 69
    # at once, so a new process starts with fresh credentials (docs/operations.md).
    from tests.fixtures.iam_moto import Keys, _user, moto_dialect
    from tests.fixtures.iam_policies import render

    iam = moto_iam.client("iam")  # type: ignore[attr-defined]
    name = f"worker-{free_port()}"
    keys: Keys = _user(iam, name, moto_dialect(render("worker")))
    dep = moto_iam.dep  # type: ignore[attr-defined]
    env = _env(**{**_aws_env(moto_iam, "worker"), **keys.env(),
                  "QWORKER_SQS_VISIBILITY_TIMEOUT": "5"})
    cmd = [sys.executable, "-m", "qworker", "run", "--source",
           f"sqs://{moto_iam.jobs_url}", "--sink",  # type: ignore[attr-defined]
           f"s3://{dep.bucket}/{dep.results_prefix}", "--model", "echo://"]
    with subprocess.Popen(cmd, env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if "sqs source started" in line:
                break
        iam.delete_access_key(UserName=name, AccessKeyId=keys.access_key_id)
        try:
            _, err = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    err = "".join(seen) + err
    assert proc.returncode == 69, err
    assert "InvalidClientTokenId" in err and "Traceback" not in err, err
    assert "nclosed" not in err, err
