"""A secured front door for a plaintext Kafka broker: TLS termination and SASL, on loopback.

The local test broker (tansu) speaks neither TLS nor SASL PLAIN, and offers SCRAM only
with credentials that nothing here can create. ``KafkaEdge`` stands in front of it the
way an Amazon MSK listener does: it accepts TLS (a certificate from ``make_test_ca``)
and/or runs the SASL exchange itself, then forwards every other request unchanged to
the broker. The broker must advertise the edge's address (``--advertised-listener-url``),
so clients come back through it after the metadata round trip.

SASL, as a Kafka broker does it: the client's ApiVersions goes to the broker; then
``SaslHandshake`` (v0/v1) and ``SaslAuthenticate`` (v0..v2) are answered here:

- ``PLAIN``: ``[authzid] NUL user NUL password`` against ``users``;
- ``SCRAM-SHA-256`` / ``SCRAM-SHA-512``: the full RFC 5802 server side (salted password,
  client proof checked, server signature returned) against ``users``;
- ``OAUTHBEARER``: ``n,,\\x01auth=Bearer <token>\\x01\\x01``; ``check_token(token)``
  decides. Every attempt is kept in ``attempts`` (mechanism, principal, accepted).

Any other request before a successful authentication closes the connection, as a
broker does. Standard library only, except ``make_test_ca`` (``cryptography``).

From a shell (the README walkthrough)::

    python -m qworker.testing.kafka_edge --upstream 127.0.0.1:19092 --port 19093 \\
        --tls-dir /tmp/qworker-tls --scram-user alice:secret
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import datetime
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import signal
import ssl
import struct
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

API_SASL_HANDSHAKE = 17
API_API_VERSIONS = 18
API_SASL_AUTHENTICATE = 36
ERR_UNSUPPORTED_SASL_MECHANISM = 33
ERR_ILLEGAL_SASL_STATE = 34
ERR_SASL_AUTHENTICATION_FAILED = 58
SCRAM_ITERATIONS = 4096
_SCRAM_HASHES = {"SCRAM-SHA-256": hashlib.sha256, "SCRAM-SHA-512": hashlib.sha512}


@dataclass(frozen=True, slots=True)
class LocalCA:
    """Paths of a throwaway CA and a server certificate for 127.0.0.1/localhost (PEM)."""

    ca: Path
    cert: Path
    key: Path

    def server_context(self) -> ssl.SSLContext:
        """A TLS server context presenting the certificate."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cert, self.key)
        return ctx


def make_test_ca(folder: str | os.PathLike[str]) -> LocalCA:
    """Write ``ca.pem``, ``server.pem``, ``server.key`` (valid two days) under ``folder``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "qworker test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))
        ]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = LocalCA(out / "ca.pem", out / "server.pem", out / "server.key")
    paths.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths.key.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ))
    paths.key.chmod(0o600)
    return paths


@dataclass(slots=True)
class AuthAttempt:
    """One SASL authentication seen by the edge."""

    mechanism: str
    principal: str
    accepted: bool


@dataclass(slots=True)
class SaslConfig:
    """What the edge accepts: ``mechanisms`` offered, ``users`` (name -> password) for
    PLAIN/SCRAM, ``check_token`` for OAUTHBEARER (True accepts the token)."""

    mechanisms: tuple[str, ...]
    users: dict[str, str] = field(default_factory=dict)
    check_token: Callable[[str], bool] | None = None


class _Reader:
    """Decodes the primitive types of a (possibly flexible) Kafka message."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ValueError("truncated Kafka message")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def int16(self) -> int:
        return int(struct.unpack(">h", self.take(2))[0])

    def int32(self) -> int:
        return int(struct.unpack(">i", self.take(4))[0])

    def varint(self) -> int:
        shift = value = 0
        while True:
            byte = self.take(1)[0]
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7

    def string(self) -> str | None:
        n = self.int16()
        return None if n < 0 else self.take(n).decode()

    def compact_string(self) -> str | None:
        n = self.varint() - 1
        return None if n < 0 else self.take(n).decode()

    def bytes32(self) -> bytes:
        n = self.int32()
        return b"" if n < 0 else self.take(n)

    def compact_bytes(self) -> bytes:
        n = self.varint() - 1
        return b"" if n < 0 else self.take(n)

    def skip_tags(self) -> None:
        for _ in range(self.varint()):
            self.varint()
            self.take(self.varint())


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _str16(value: str | None) -> bytes:
    if value is None:
        return struct.pack(">h", -1)
    raw = value.encode()
    return struct.pack(">h", len(raw)) + raw


class _Scram:
    """The server side of one SCRAM exchange (RFC 5802), two client messages."""

    def __init__(self, mechanism: str, users: dict[str, str]) -> None:
        self.hash = _SCRAM_HASHES[mechanism]
        self.users = users
        self.user = ""
        self._first_bare = self._server_first = self._nonce = ""
        self._salted = b""

    def _hmac(self, key: bytes, msg: bytes) -> bytes:
        return hmac.new(key, msg, self.hash).digest()

    def first(self, message: str) -> str:
        parts = message.split(",", 2)
        if len(parts) != 3 or parts[0] not in ("n", "y"):
            raise ValueError("bad SCRAM client-first message")
        self._first_bare = parts[2]
        attrs = dict(p.split("=", 1) for p in self._first_bare.split(","))
        self.user = attrs["n"].replace("=2C", ",").replace("=3D", "=")
        salt = secrets.token_bytes(16)
        self._nonce = attrs["r"] + secrets.token_hex(12)
        password = self.users.get(self.user, secrets.token_hex(8)).encode()
        self._salted = hashlib.pbkdf2_hmac(self.hash().name, password, salt, SCRAM_ITERATIONS)
        self._server_first = (
            f"r={self._nonce},s={base64.b64encode(salt).decode()},i={SCRAM_ITERATIONS}"
        )
        return self._server_first

    def final(self, message: str) -> str | None:
        """The server-final message, or None when the proof is wrong."""
        without_proof, _, proof_part = message.rpartition(",p=")
        attrs = dict(p.split("=", 1) for p in without_proof.split(","))
        if attrs.get("r") != self._nonce or self.user not in self.users:
            return None
        auth = f"{self._first_bare},{self._server_first},{without_proof}".encode()
        client_key = self._hmac(self._salted, b"Client Key")
        stored_key = self.hash(client_key).digest()
        signature = self._hmac(stored_key, auth)
        proof = base64.b64decode(proof_part)
        recovered = bytes(a ^ b for a, b in zip(proof, signature, strict=False))
        if not hmac.compare_digest(self.hash(recovered).digest(), stored_key):
            return None
        server_key = self._hmac(self._salted, b"Server Key")
        return "v=" + base64.b64encode(self._hmac(server_key, auth)).decode()


class KafkaEdge:
    """TLS and/or SASL in front of ``upstream`` (``host:port``); see the module docstring.

    ``start()`` serves on ``127.0.0.1:port`` (0 = any free port) from a daemon thread and
    returns the port; ``stop()`` closes everything. Thread-safe to read ``attempts``.
    """

    def __init__(
        self,
        upstream: str,
        *,
        port: int = 0,
        tls: ssl.SSLContext | None = None,
        sasl: SaslConfig | None = None,
    ) -> None:
        host, _, up_port = upstream.rpartition(":")
        self.upstream = (host or "127.0.0.1", int(up_port))
        self.port = port
        self.tls = tls
        self.sasl = sasl
        self.attempts: list[AuthAttempt] = []
        self.connections = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    def start(self) -> int:
        """Serve from a background thread; return the listening port."""
        self._thread = threading.Thread(target=self._run, name="kafka-edge", daemon=True)
        self._thread.start()
        self._started.wait(10)
        if self._error is not None:
            raise self._error
        return self.port

    def stop(self) -> None:
        """Close the listener and every connection; idempotent."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        try:
            self._server = loop.run_until_complete(asyncio.start_server(
                self._handle, "127.0.0.1", self.port, ssl=self.tls
            ))
            self.port = int(self._server.sockets[0].getsockname()[1])
        except BaseException as exc:  # reported by start()
            self._error = exc
            self._started.set()
            return
        self._started.set()
        try:
            loop.run_forever()
        finally:
            self._server.close()
            for task in asyncio.all_tasks(loop):
                task.cancel()
            with contextlib.suppress(Exception):
                loop.run_until_complete(asyncio.sleep(0))
            loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        pump = asyncio.create_task(self._pump(up_reader, writer))
        authed = self.sasl is None
        state: dict[str, object] = {}
        try:
            while True:
                frame = await _read_frame(reader)
                if frame is None:
                    return
                api_key, version, correlation = struct.unpack(">hhi", frame[:8])
                if authed or api_key == API_API_VERSIONS:
                    up_writer.write(struct.pack(">i", len(frame)) + frame)
                    await up_writer.drain()
                    continue
                if api_key == API_SASL_HANDSHAKE:
                    writer.write(self._handshake(frame, correlation, state))
                elif api_key == API_SASL_AUTHENTICATE:
                    reply, authed, fail = self._authenticate(frame, version, correlation, state)
                    writer.write(reply)
                    if fail:
                        await writer.drain()
                        return
                else:
                    log.warning("kafka edge: request %d before authentication; closing", api_key)
                    return
                await writer.drain()
        except (ConnectionError, ValueError, asyncio.IncompleteReadError) as exc:
            log.debug("kafka edge connection ended: %r", exc)
        finally:
            pump.cancel()
            for w in (writer, up_writer):
                with contextlib.suppress(Exception):
                    w.close()

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        with contextlib.suppress(Exception):
            dst.close()

    def _handshake(self, frame: bytes, correlation: int, state: dict[str, object]) -> bytes:
        assert self.sasl is not None
        r = _Reader(frame)
        r.take(8)
        r.string()  # client id
        mechanism = r.string() or ""
        enabled = self.sasl.mechanisms
        error = 0 if mechanism in enabled else ERR_UNSUPPORTED_SASL_MECHANISM
        state["mechanism"] = mechanism
        body = struct.pack(">hi", error, len(enabled)) + b"".join(_str16(m) for m in enabled)
        return _response(correlation, body, flexible=False)

    def _authenticate(
        self, frame: bytes, version: int, correlation: int, state: dict[str, object]
    ) -> tuple[bytes, bool, bool]:
        """(reply, authenticated now, close after the reply)."""
        assert self.sasl is not None
        flexible = version >= 2
        r = _Reader(frame)
        r.take(8)
        r.string()  # client id (nullable string in every header version)
        if flexible:
            r.skip_tags()
        payload = r.compact_bytes() if flexible else r.bytes32()
        mechanism = str(state.get("mechanism", ""))
        out, done, principal = self._step(mechanism, payload, state)
        if out is None:
            self.attempts.append(AuthAttempt(mechanism, principal, False))
            return _auth_response(correlation, version, ERR_SASL_AUTHENTICATION_FAILED,
                                  f"authentication failed for {principal!r} ({mechanism})",
                                  b""), False, True
        if done:
            self.attempts.append(AuthAttempt(mechanism, principal, True))
        return _auth_response(correlation, version, 0, None, out), done, False

    def _step(
        self, mechanism: str, payload: bytes, state: dict[str, object]
    ) -> tuple[bytes | None, bool, str]:
        """(server bytes or None = reject, exchange finished, principal)."""
        assert self.sasl is not None
        if mechanism == "PLAIN":
            parts = payload.split(b"\0")
            if len(parts) != 3:
                return None, False, "?"
            user, password = parts[1].decode(), parts[2].decode()
            ok = self.sasl.users.get(user) == password and password != ""
            return (b"" if ok else None), True, user
        if mechanism in _SCRAM_HASHES:
            scram = state.get("scram")
            if not isinstance(scram, _Scram):
                scram = state["scram"] = _Scram(mechanism, self.sasl.users)
                return scram.first(payload.decode()).encode(), False, scram.user
            final = scram.final(payload.decode())
            return (final.encode() if final else None), True, scram.user
        if mechanism == "OAUTHBEARER":
            text = payload.decode()
            fields = dict(
                kv.split("=", 1) for kv in text.split("\x01") if "=" in kv and kv != "n,,"
            )
            token = fields.get("auth", "").removeprefix("Bearer ").strip()
            check = self.sasl.check_token
            ok = bool(token) and check is not None and check(token)
            return (b"" if ok else None), True, token[:16] + "..."
        return None, False, "?"


async def _read_frame(reader: asyncio.StreamReader) -> bytes | None:
    try:
        head = await reader.readexactly(4)
    except asyncio.IncompleteReadError:
        return None
    (size,) = struct.unpack(">i", head)
    return await reader.readexactly(size)


def _response(correlation: int, body: bytes, *, flexible: bool) -> bytes:
    header = struct.pack(">i", correlation) + (b"\0" if flexible else b"")
    return struct.pack(">i", len(header) + len(body)) + header + body


def _auth_response(
    correlation: int, version: int, error: int, message: str | None, data: bytes
) -> bytes:
    if version >= 2:
        raw = (message or "").encode()
        msg = _varint(0) if message is None else _varint(len(raw) + 1) + raw
        body = struct.pack(">h", error) + msg + _varint(len(data) + 1) + data
        body += struct.pack(">q", 0) + b"\0"
        return _response(correlation, body, flexible=True)
    body = struct.pack(">h", error) + _str16(message) + struct.pack(">i", len(data)) + data
    if version >= 1:
        body += struct.pack(">q", 0)
    return _response(correlation, body, flexible=False)


def main(argv: list[str] | None = None) -> int:
    """``python -m qworker.testing.kafka_edge``: serve until SIGINT/SIGTERM."""
    parser = argparse.ArgumentParser(description="TLS/SASL front door for a local Kafka broker")
    parser.add_argument("--upstream", required=True, help="host:port of the plaintext broker")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (0 = any)")
    parser.add_argument("--tls-dir", help="make a test CA and certificate here and serve TLS")
    parser.add_argument("--scram-user", action="append", default=[], metavar="USER:PASSWORD",
                        help="accept SCRAM-SHA-256/512 and PLAIN for this user (repeatable)")
    args = parser.parse_args(argv)
    tls = None
    if args.tls_dir:
        ca = make_test_ca(args.tls_dir)
        tls = ca.server_context()
        print(f"kafka edge: CA bundle at {ca.ca}", file=sys.stderr)
    sasl = None
    if args.scram_user:
        users = dict(u.split(":", 1) for u in args.scram_user)
        sasl = SaslConfig(("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"), users)
    edge = KafkaEdge(args.upstream, port=args.port, tls=tls, sasl=sasl)
    port = edge.start()
    print(f"kafka edge: 127.0.0.1:{port} -> {args.upstream} "
          f"(tls={'on' if tls else 'off'}, sasl={'on' if sasl else 'off'})", file=sys.stderr)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    edge.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
