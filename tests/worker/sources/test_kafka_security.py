"""TLS and SASL (PLAIN, SCRAM-SHA-256/512, OAUTHBEARER = MSK IAM) for every Kafka client.

A real tansu broker sits behind ``qworker.testing.kafka_edge`` (TLS termination and the
broker side of SASL, on loopback) and advertises the edge's address, so every
connection of the worker's consumer, its dead-letter producer and ``qworker produce``
goes through the TLS handshake and the SASL exchange before reaching the broker.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiokafka")

from aiokafka import AIOKafkaConsumer

from qworker.config import WorkerSettings
from qworker.testing.kafka_edge import KafkaEdge, LocalCA, SaslConfig, make_test_ca
from qworker.worker.sources.base import Message
from qworker.worker.sources.kafka import DLQ_REASON_HEADER, KafkaSource, open_source, produce
from qworker.worker.sources.kafka_client import KafkaSecurity, MSKIAMTokenProvider
from tests.fixtures.servers import AWS_TEST_ENV, create_topic, free_port, tansu_broker

SESSION_MS = 3000
USERS = {"alice": "s3cret-pw", "bob,=odd": "other"}
ALL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER")


@pytest.fixture(scope="module")
def test_ca(tmp_path_factory: pytest.TempPathFactory) -> LocalCA:
    pytest.importorskip("cryptography")
    return make_test_ca(tmp_path_factory.mktemp("tls"))


@contextlib.contextmanager
def secured_broker(tls: LocalCA | None, sasl: SaslConfig | None) -> Iterator[tuple[str, KafkaEdge]]:
    """A tansu broker reachable only through a TLS/SASL edge; yields (edge address, edge)."""
    port = free_port()
    with tansu_broker(advertised_port=port) as upstream:
        edge = KafkaEdge(upstream, port=port, tls=tls.server_context() if tls else None,
                         sasl=sasl)
        edge.start()
        try:
            yield f"127.0.0.1:{port}", edge
        finally:
            edge.stop()


def _settings(**kafka: Any) -> WorkerSettings:
    return WorkerSettings(**{f"kafka_{k}": v for k, v in kafka.items()})


def _jobs(n: int) -> list[tuple[str | None, bytes]]:
    return [(f"job-{i}", b'{"custom_id": "job-%d"}' % i) for i in range(n)]


async def _receive_n(source: KafkaSource, n: int, timeout: float = 20.0) -> list[Message]:
    got: list[Message] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += await source.receive(n - len(got), 0.5)
    return got


def _roundtrip(bootstrap: str, settings: WorkerSettings, n: int = 3) -> list[Message]:
    """``produce`` n jobs, then read them with the source built from the same settings."""
    topic = f"jobs-{free_port()}"
    create_topic(bootstrap, topic, 1, **KafkaSecurity.from_settings(settings).client_options())

    async def go() -> list[Message]:
        assert await produce(f"kafka://{bootstrap}/{topic}", _jobs(n), settings) == n
        source = open_source(f"kafka://{bootstrap}/{topic}?group=g-sec", settings)
        source.session_timeout_ms, source.poll_timeout_ms = SESSION_MS, 100
        await source.start()
        try:
            msgs = await _receive_n(source, n)
            for msg in msgs:
                await source.ack(msg)
        finally:
            await source.close()
        return msgs

    return asyncio.run(go())


def test_sasl_ssl_scram_512_carries_consumer_dead_letters_and_produce(test_ca: LocalCA) -> None:
    sasl = SaslConfig(("SCRAM-SHA-256", "SCRAM-SHA-512"), USERS)
    with secured_broker(test_ca, sasl) as (bootstrap, edge):
        settings = _settings(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512",
                             sasl_username="alice", sasl_password="s3cret-pw",
                             ssl_cafile=str(test_ca.ca))
        topic = f"jobs-{free_port()}"
        security = KafkaSecurity.from_settings(settings)
        create_topic(bootstrap, topic, 1, **security.client_options())

        async def go() -> None:
            await produce(f"kafka://{bootstrap}/{topic}", _jobs(2), settings)
            source = open_source(f"kafka://{bootstrap}/{topic}?group=g-dlq", settings)
            source.session_timeout_ms, source.poll_timeout_ms = SESSION_MS, 100
            await source.start()
            try:
                msgs = await _receive_n(source, 2)
                await source.dead_letter(msgs[0], "not a job")
                await source.ack(msgs[1])
            finally:
                await source.close()
            dlq = AIOKafkaConsumer(f"{topic}.dlq", bootstrap_servers=bootstrap,
                                   auto_offset_reset="earliest", **security.client_options())
            await dlq.start()
            try:
                batch = await dlq.getmany(timeout_ms=5000)
                records = [r for rs in batch.values() for r in rs]
            finally:
                await dlq.stop()
            assert [r.value for r in records] == [msgs[0].body]
            assert dict(records[0].headers)[DLQ_REASON_HEADER] == b"not a job"

        asyncio.run(go())
        assert edge.attempts and all(
            a.mechanism == "SCRAM-SHA-512" and a.principal == "alice" and a.accepted
            for a in edge.attempts
        )


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256"])
def test_sasl_plaintext_mechanisms_authenticate_and_deliver(mechanism: str) -> None:
    with secured_broker(None, SaslConfig((mechanism,), USERS)) as (bootstrap, edge):
        settings = _settings(security_protocol="SASL_PLAINTEXT", sasl_mechanism=mechanism,
                             sasl_username="bob,=odd", sasl_password="other")
        msgs = _roundtrip(bootstrap, settings)
    assert [m.key for m in msgs] == ["job-0", "job-1", "job-2"]
    assert {(a.mechanism, a.principal, a.accepted) for a in edge.attempts} == {
        (mechanism, "bob,=odd", True)
    }


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-512"])
def test_a_wrong_password_is_refused_and_nothing_is_sent(mechanism: str) -> None:
    with secured_broker(None, SaslConfig((mechanism,), USERS)) as (bootstrap, edge):
        settings = _settings(security_protocol="SASL_PLAINTEXT", sasl_mechanism=mechanism,
                             sasl_username="alice", sasl_password="wrong")
        with pytest.raises(Exception) as err:
            asyncio.run(produce(f"kafka://{bootstrap}/jobs", _jobs(1), settings))
    assert "bootstrap" in str(err.value).lower() or "auth" in str(err.value).lower()
    assert edge.attempts and not any(a.accepted for a in edge.attempts)


def test_tls_verifies_the_broker_against_the_ca_file(test_ca: LocalCA) -> None:
    with secured_broker(test_ca, None) as (bootstrap, _edge):
        ok = _roundtrip(bootstrap, _settings(security_protocol="SSL",
                                             ssl_cafile=str(test_ca.ca)))
        assert len(ok) == 3
        # Without the CA the system trust store does not know the test CA: refused.
        with pytest.raises(Exception, match=r"(?i)bootstrap|certificate|ssl"):
            asyncio.run(produce(f"kafka://{bootstrap}/jobs", _jobs(1),
                                _settings(security_protocol="SSL")))


def _msk_token_fields(token: str) -> dict[str, str]:
    padded = token + "=" * (-len(token) % 4)
    url = base64.urlsafe_b64decode(padded).decode()
    parts = urllib.parse.urlsplit(url)
    fields = dict(urllib.parse.parse_qsl(parts.query))
    fields["host"] = parts.netloc
    return fields


def test_oauthbearer_sends_an_msk_iam_token_signed_for_the_region(
    test_ca: LocalCA, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("aws_msk_iam_sasl_signer")
    for key, value in AWS_TEST_ENV.items():
        monkeypatch.setenv(key, value)
    seen: list[dict[str, str]] = []

    def check(token: str) -> bool:
        fields = _msk_token_fields(token)
        seen.append(fields)
        return (fields["host"] == "kafka.eu-west-1.amazonaws.com"
                and fields["Action"] == "kafka-cluster:Connect"
                and "/eu-west-1/kafka-cluster/aws4_request" in fields["X-Amz-Credential"]
                and fields["X-Amz-Credential"].startswith("testing/"))

    sasl = SaslConfig(("OAUTHBEARER",), check_token=check)
    with secured_broker(test_ca, sasl) as (bootstrap, edge):
        settings = WorkerSettings(kafka_security_protocol="SASL_SSL",
                                  kafka_sasl_mechanism="OAUTHBEARER",
                                  kafka_ssl_cafile=str(test_ca.ca), aws_region="eu-west-1")
        msgs = _roundtrip(bootstrap, settings)
    assert len(msgs) == 3
    assert seen and all(a.accepted and a.mechanism == "OAUTHBEARER" for a in edge.attempts)


def test_librdkafka_speaks_the_same_sasl_ssl_exchange(test_ca: LocalCA) -> None:
    """An independent client (librdkafka) authenticates through the edge too: the edge
    implements the protocol, not aiokafka's reading of it."""
    confluent = pytest.importorskip("confluent_kafka")
    with secured_broker(test_ca, SaslConfig(("SCRAM-SHA-256",), USERS)) as (bootstrap, edge):
        producer = confluent.Producer({
            "bootstrap.servers": bootstrap, "security.protocol": "SASL_SSL",
            "sasl.mechanism": "SCRAM-SHA-256", "sasl.username": "alice",
            "sasl.password": "s3cret-pw", "ssl.ca.location": str(test_ca.ca),
            "enable.idempotence": False, "compression.codec": "lz4",
        })
        producer.produce("rd-jobs", value=b'{"custom_id": "rd-0"}', key=b"rd-0")
        assert producer.flush(20) == 0
    assert edge.attempts and all(a.accepted for a in edge.attempts)


def test_msk_token_provider_reuses_a_token_until_it_nears_expiry() -> None:
    calls: list[str] = []
    expiry = [time.time() + 900]

    def signer(region: str) -> tuple[str, int]:
        calls.append(region)
        return f"tok-{len(calls)}", int(expiry[0] * 1000)

    provider = MSKIAMTokenProvider("ap-south-1", signer)

    async def go() -> list[str]:
        first = [await provider.token() for _ in range(3)]
        expiry[0] = time.time() + 30  # inside the renewal margin: the next call re-signs
        provider._expires_at = expiry[0]
        return [*first, await provider.token()]

    assert asyncio.run(go()) == ["tok-1", "tok-1", "tok-1", "tok-2"]
    assert calls == ["ap-south-1", "ap-south-1"]


@pytest.mark.parametrize(
    ("kafka", "message"),
    [
        ({"security_protocol": "SASL_SSL"}, "needs kafka_sasl_mechanism"),
        ({"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-256",
          "sasl_username": "u"}, "needs kafka_sasl_username and kafka_sasl_password"),
        ({"sasl_mechanism": "PLAIN", "sasl_username": "u", "sasl_password": "p"},
         "needs kafka_security_protocol SASL_PLAINTEXT or SASL_SSL"),
        ({"ssl_cafile": "/ca.pem"}, "kafka_ssl_cafile needs kafka_security_protocol SSL"),
        ({"security_protocol": "TLS"}, "kafka_security_protocol"),
    ],
)
def test_settings_that_cannot_connect_fail_at_start_naming_the_setting(
    kafka: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _settings(**kafka)


def test_the_password_never_shows_in_settings_or_security_reprs() -> None:
    settings = _settings(security_protocol="SASL_SSL", sasl_mechanism="PLAIN",
                         sasl_username="u", sasl_password="hunter2")
    assert "hunter2" not in repr(settings) and "hunter2" not in str(settings)
    security = KafkaSecurity.from_settings(settings)
    assert security.sasl_password == "hunter2" and "hunter2" not in repr(security)


def test_a_missing_ca_file_is_a_clear_error(tmp_path: Path) -> None:
    security = KafkaSecurity("SSL", ssl_cafile=str(tmp_path / "nope.pem"))
    with pytest.raises(ValueError, match="kafka_ssl_cafile"):
        security.client_options()


def test_credentials_without_a_sasl_protocol_are_an_error_where_kafka_is_used(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from qworker.cli import main

    # an SQS worker may mount the same optional Secret: the settings alone are fine
    settings = WorkerSettings(source="sqs://q", kafka_sasl_username="u",
                              kafka_sasl_password="p")
    with pytest.raises(ValueError, match="kafka_security_protocol is PLAINTEXT: set SASL_SSL"):
        KafkaSecurity.from_settings(settings).client_options()
    jobs = tmp_path / "in.jsonl"
    jobs.write_text('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}\n')
    assert main(["produce", "-i", str(jobs), "--to", "kafka://127.0.0.1:1/t", "--no-manifest",
                 "--kafka-sasl-username", "u", "--kafka-sasl-password", "p"]) == 1
    assert "kafka_sasl_username/kafka_sasl_password are set but" in capsys.readouterr().err
