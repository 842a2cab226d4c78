"""Kafka connection options: TLS, SASL and compression, built once for every client.

The consumer of the Kafka source, its dead-letter producer and ``qworker produce``
all take their connection keyword arguments from ``KafkaSecurity.client_options()``,
so the same ``QWORKER_KAFKA_*`` settings reach each of them (docs/configuration.md,
"Kafka security"):

- ``security_protocol``: ``PLAINTEXT`` | ``SSL`` | ``SASL_PLAINTEXT`` | ``SASL_SSL``.
  ``SSL``/``SASL_SSL`` verify the broker against ``ssl_cafile`` (a PEM bundle) or,
  without one, the system's trust store (what Amazon MSK's certificates need).
- ``sasl_mechanism``: ``PLAIN`` and ``SCRAM-SHA-256``/``-512`` send
  ``sasl_username``/``sasl_password``; ``OAUTHBEARER`` is AWS MSK IAM: a token
  signed with the process's AWS credentials (the pod's or task's role) for
  ``region``, from ``aws-msk-iam-sasl-signer-python``, renewed before it expires.

``check_connection`` opens one connection with these options before any client starts:
aiokafka's clients log a refused SASL exchange or an untrusted certificate and retry
it as if the broker were down ("Unable to bootstrap"), so the cause would otherwise be
lost; here it becomes an ``AuthError`` naming the setting to check (exit 1 at start,
docs/operations.md).

Compression: aiokafka reads gzip itself and snappy, lz4 and zstd through
``cramjam``; ``check_codecs`` refuses to start without it, because a consumer that
cannot decode a batch would otherwise stall on it forever.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiokafka.abc import AbstractTokenProvider

from qworker.worker.failures import AuthError, SourceUnavailableError, auth_failure

SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER")
CODECS = ("gzip", "snappy", "lz4", "zstd")

#: Renew an MSK IAM token this long before it expires (tokens live 15 minutes).
_TOKEN_MARGIN_S = 60.0


def check_codecs() -> None:
    """Raise ``ValueError`` unless every Kafka codec (gzip, snappy, lz4, zstd) is readable."""
    from aiokafka import codec

    missing = [
        name for name, has in (("snappy", codec.has_snappy), ("lz4", codec.has_lz4),
                               ("zstd", codec.has_zstd)) if not has()
    ]
    if missing:
        raise ValueError(
            f"Kafka codecs {', '.join(missing)} are unavailable (cramjam is not installed): "
            "pip install 'aiokafka[lz4,snappy,zstd]'"
        )


Signer = Callable[[str], tuple[str, int]]


def _msk_signer() -> Signer:
    try:
        from aws_msk_iam_sasl_signer import MSKAuthTokenProvider
    except ImportError as exc:
        raise ValueError(
            "QWORKER_KAFKA_SASL_MECHANISM=OAUTHBEARER (MSK IAM) needs "
            "aws-msk-iam-sasl-signer-python: pip install aws-msk-iam-sasl-signer-python"
        ) from exc
    return MSKAuthTokenProvider.generate_auth_token  # type: ignore[no-any-return]


class MSKIAMTokenProvider(AbstractTokenProvider):
    """OAUTHBEARER tokens for Amazon MSK IAM, signed with the ambient AWS credentials.

    ``signer(region) -> (token, expiry_ms)`` defaults to the AWS MSK signer; it runs on
    a thread (it may call STS). The token is reused until ``_TOKEN_MARGIN_S`` before
    its expiry, so the connections of one client share it.
    """

    def __init__(self, region: str, signer: Signer | None = None) -> None:
        self.region = region
        self._signer = signer or _msk_signer()
        self._token: str | None = None
        self._expires_at = 0.0
        self._lock = asyncio.Lock()

    async def token(self) -> str:
        """A valid token for ``region`` (signed anew when the cached one nears expiry)."""
        async with self._lock:
            if self._token is None or time.time() >= self._expires_at - _TOKEN_MARGIN_S:
                token, expiry_ms = await asyncio.to_thread(self._signer, self.region)
                self._token, self._expires_at = token, expiry_ms / 1000.0
            return self._token


@dataclass(frozen=True, slots=True)
class KafkaSecurity:
    """How to reach the brokers: protocol, SASL mechanism and credentials, CA bundle.

    ``region`` is the AWS region MSK IAM tokens are signed for. Build it with
    ``from_settings`` (validated by ``WorkerSettings``) or directly in tests.
    """

    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = field(default=None, repr=False)
    ssl_cafile: str | None = None
    region: str = "us-east-1"
    signer: Signer | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_settings(cls, settings: Any) -> KafkaSecurity:
        """The security of ``WorkerSettings`` (None or missing fields: plaintext)."""
        password = getattr(settings, "kafka_sasl_password", None)
        if password is not None and hasattr(password, "get_secret_value"):
            password = password.get_secret_value()
        return cls(
            security_protocol=getattr(settings, "kafka_security_protocol", "PLAINTEXT"),
            sasl_mechanism=getattr(settings, "kafka_sasl_mechanism", None),
            sasl_username=getattr(settings, "kafka_sasl_username", None),
            sasl_password=password,
            ssl_cafile=getattr(settings, "kafka_ssl_cafile", None),
            region=getattr(settings, "aws_region", "us-east-1"),
        )

    @property
    def uses_tls(self) -> bool:
        """True for ``SSL`` and ``SASL_SSL``."""
        return self.security_protocol in ("SSL", "SASL_SSL")

    @property
    def uses_sasl(self) -> bool:
        """True for ``SASL_PLAINTEXT`` and ``SASL_SSL``."""
        return self.security_protocol.startswith("SASL_")

    def validate(self) -> None:
        """``ValueError`` naming the setting when the combination cannot connect."""
        if self.security_protocol not in SECURITY_PROTOCOLS:
            raise ValueError(f"kafka_security_protocol must be one of {SECURITY_PROTOCOLS}, "
                             f"got {self.security_protocol!r}")
        if self.uses_sasl:
            if self.sasl_mechanism not in SASL_MECHANISMS:
                raise ValueError(f"kafka_security_protocol={self.security_protocol} needs "
                                 f"kafka_sasl_mechanism, one of {SASL_MECHANISMS}")
            if self.sasl_mechanism != "OAUTHBEARER" and not (
                self.sasl_username and self.sasl_password
            ):
                raise ValueError(f"kafka_sasl_mechanism={self.sasl_mechanism} needs "
                                 "kafka_sasl_username and kafka_sasl_password")
        elif self.sasl_mechanism is not None:
            raise ValueError(f"kafka_sasl_mechanism={self.sasl_mechanism} needs "
                             "kafka_security_protocol SASL_PLAINTEXT or SASL_SSL")
        elif self.sasl_username or self.sasl_password:
            # Checked when a Kafka client is built, not in the settings: an SQS worker may
            # mount the same optional credentials Secret and never talk to Kafka.
            raise ValueError(f"kafka_sasl_username/kafka_sasl_password are set but "
                             f"kafka_security_protocol is {self.security_protocol}: set "
                             "SASL_SSL (or SASL_PLAINTEXT) and kafka_sasl_mechanism")
        if self.ssl_cafile is not None and not self.uses_tls:
            raise ValueError("kafka_ssl_cafile needs kafka_security_protocol SSL or SASL_SSL")

    def ssl_context(self) -> ssl.SSLContext:
        """A verifying client context: ``ssl_cafile`` if set, else the system trust store."""
        try:
            return ssl.create_default_context(cafile=self.ssl_cafile)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"kafka_ssl_cafile {self.ssl_cafile!r}: {exc}") from exc

    def client_options(self) -> dict[str, Any]:
        """Keyword arguments for ``AIOKafkaConsumer``/``AIOKafkaProducer``/the admin client."""
        self.validate()
        options: dict[str, Any] = {"security_protocol": self.security_protocol}
        if self.uses_tls:
            options["ssl_context"] = self.ssl_context()
        if self.uses_sasl:
            options["sasl_mechanism"] = self.sasl_mechanism
            if self.sasl_mechanism == "OAUTHBEARER":
                options["sasl_oauth_token_provider"] = MSKIAMTokenProvider(
                    self.region, self.signer
                )
            else:
                options["sasl_plain_username"] = self.sasl_username
                options["sasl_plain_password"] = self.sasl_password
        return options


async def check_connection(bootstrap: str, security: KafkaSecurity, timeout: float) -> None:
    """Connect (TLS, SASL) to the first bootstrap broker that answers, then disconnect.

    Raises ``AuthError`` naming the cause when a broker refuses the credentials or its
    certificate does not verify; ``SourceUnavailableError`` when no broker answers
    (transient: ridden out like an outage).
    """
    from aiokafka.conn import create_conn

    options = security.client_options()
    last: BaseException | None = None
    for server in bootstrap.split(","):
        host, _, port = server.strip().rpartition(":")
        try:
            conn = await asyncio.wait_for(create_conn(
                host.strip("[]"), int(port), request_timeout_ms=int(timeout * 1000), **options),
                timeout)
        except Exception as exc:
            if auth_failure(exc) is not None:
                raise AuthError(describe_auth_failure(exc, server.strip(), security)) from None
            last = exc
            continue
        conn.close()
        return
    raise SourceUnavailableError(f"kafka brokers {bootstrap} unreachable: {last!r}")


def describe_auth_failure(exc: BaseException, broker: str, security: KafkaSecurity) -> str:
    """One line: what the broker refused and which ``QWORKER_KAFKA_*`` settings to check."""
    cause = auth_failure(exc) or exc
    detail = " ".join(str(cause).split()) or type(cause).__name__
    if isinstance(cause, ssl.SSLCertVerificationError):
        trust = (f"the CA in QWORKER_KAFKA_SSL_CAFILE={security.ssl_cafile}"
                 if security.ssl_cafile else "the system trust store (no QWORKER_KAFKA_SSL_CAFILE)")
        return (f"kafka: TLS verification of broker {broker} failed "
                f"({getattr(cause, 'verify_message', None) or detail}): {trust} does not "
                "verify its certificate; check QWORKER_KAFKA_SSL_CAFILE")
    name = type(cause).__name__
    if "Authorization" in name:
        return (f"kafka: broker {broker} refused access ({name}: {detail}): the principal "
                "lacks an ACL for the topic or group")
    if security.sasl_mechanism == "OAUTHBEARER":
        return (f"kafka: SASL OAUTHBEARER (MSK IAM) authentication failed at {broker} "
                f"({name}): check the role's kafka-cluster:Connect permission and "
                "QWORKER_AWS_REGION")
    if name == "UnsupportedSaslMechanismError":
        return (f"kafka: broker {broker} does not offer SASL mechanism "
                f"{security.sasl_mechanism} ({detail}): check QWORKER_KAFKA_SASL_MECHANISM")
    return (f"kafka: SASL authentication failed for user {security.sasl_username!r} "
            f"(mechanism {security.sasl_mechanism}) at {broker}: check "
            "QWORKER_KAFKA_SASL_USERNAME/_PASSWORD")
