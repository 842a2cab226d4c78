"""Failures that decide how a call, a message or ``qworker run`` ends (docs/operations.md).

``qworker.worker.retry.classify`` turns these into verdicts: ``StartupError`` is a
configuration problem (exit 1), ``AuthError`` (and ``auth_failure``: refused
credentials, untrusted TLS) one too at start and a fatal stop (exit 69) later,
``Refused`` a permanent refusal of one item (not an outage), a fatal
``SourceUnavailableError`` stops the worker (exit 69); anything else
is transient and retried within the outage budget.
"""

from __future__ import annotations

import re


class StartupError(RuntimeError):
    """A configuration problem: a missing queue, topic, bucket, dead-letter target or model.

    Printed as one line, exit 1: retrying the same command cannot help.
    """


class SourceUnavailableError(ConnectionError):
    """The source cannot reach its server now; the worker retries within its outage budget.

    ``fatal`` True means retrying cannot help either (a Kafka batch that cannot be
    decoded): the worker stops at once with exit 69.
    """

    fatal = False


class Refused(Exception):
    """A dependency answered and refuses this one item for good (a 4xx for this message).

    Examples: an SQS dead-letter queue whose size limit the message exceeds, a Kafka
    dead-letter topic refusing a record as too large, an S3 key or body S3 will not
    take. Not retried, not an outage: the item gets another fate (docs/operations.md).
    """


class AuthError(StartupError):
    """A dependency refused our credentials or could not be trusted (docs/operations.md).

    Kafka SASL authentication or authorization refused, a broker certificate that
    ``QWORKER_KAFKA_SSL_CAFILE`` (or the system trust store) does not verify, AWS
    ``AccessDenied`` / ``InvalidClientTokenId`` / ``SignatureDoesNotMatch`` /
    ``ExpiredToken``. At start a configuration error (exit 1, one line naming the cause);
    during the run, after the same credentials worked, the worker stops at once with
    exit 69 (``qworker.worker.retry``): rotated or expired credentials are read afresh
    by the next process, and wrong ones make that start exit 1.
    """


#: aiokafka's errors that mean the broker refused who we are or what we may do.
_KAFKA_AUTH_ERRORS = frozenset({
    "SaslAuthenticationFailed", "AuthenticationFailedError", "AuthenticationMethodNotSupported",
    "UnsupportedSaslMechanismError", "IllegalSaslStateError", "TopicAuthorizationFailedError",
    "GroupAuthorizationFailedError", "ClusterAuthorizationFailedError",
})
#: AWS error codes of refused credentials (the key, its signature or its token).
AWS_CREDENTIAL_CODES = frozenset({
    "InvalidClientTokenId", "SignatureDoesNotMatch", "ExpiredToken", "ExpiredTokenException",
    "InvalidAccessKeyId", "UnrecognizedClientException", "InvalidToken",
    "InvalidSecurity", "MissingAuthenticationToken", "IncompleteSignature",
})
#: AWS error codes of credentials that are valid but not allowed this call.
AWS_DENIED_CODES = frozenset({"AccessDenied", "AccessDeniedException",
                              "AuthorizationError", "KMS.AccessDeniedException"})


def auth_failure(exc: BaseException) -> BaseException | None:
    """The authentication / authorization failure in ``exc`` or its causes, else None.

    Recognised: ``ssl.SSLCertVerificationError``, aiokafka's SASL and authorization
    errors, botocore's ``ClientError`` with an AWS credential or access-denied code and
    ``NoCredentialsError``. Library types are told by name: nothing is imported here.
    """
    import ssl

    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, AuthError | ssl.SSLCertVerificationError):
            return cause
        name = type(cause).__name__
        module = type(cause).__module__
        if module.startswith("aiokafka") and name in _KAFKA_AUTH_ERRORS:
            return cause
        if module.startswith("botocore") and name in ("NoCredentialsError",
                                                      "PartialCredentialsError"):
            return cause
        if aws_error_code(cause) in AWS_CREDENTIAL_CODES | AWS_DENIED_CODES:
            return cause
        if module.startswith("botocore") and _http_status(cause) == 403:
            return cause  # AWS answers 403 only to refused credentials or permissions
        cause = cause.__cause__ or cause.__context__
    return None


def aws_error(exc: BaseException) -> tuple[str, str]:
    """(code, message) of a botocore ``ClientError`` (("", "") for anything else).

    An error document botocore could not parse (an XML answer to a JSON-protocol call,
    as moto and some proxies send: the code is then the HTTP status) is read for its
    ``<Code>`` and ``<Message>``.
    """
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return "", ""
    error = response.get("Error") or {}
    code, message = str(error.get("Code", "")), str(error.get("Message", ""))
    if "<Code>" in message:
        found = re.search(r"<Code>([^<]*)</Code>", message)
        text = re.search(r"<Message>([^<]*)</Message>", message)
        code = found.group(1) if found else code
        message = text.group(1) if text else ""
    return code, message


def aws_error_code(exc: BaseException) -> str:
    """The error code of a botocore ``ClientError`` ("" for anything else); ``aws_error``."""
    return aws_error(exc)[0]


def _http_status(exc: BaseException) -> int:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return 0
    return int((response.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0)
