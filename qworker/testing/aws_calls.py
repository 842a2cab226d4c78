"""Record every AWS API call a process makes through botocore: a test-only client plugin.

The test suite checks the shipped IAM policies against what the code really calls
(tests/deploy/test_iam_policies.py, tests/e2e/test_iam_enforced.py). It switches this
recorder on for its own process and every subprocess it starts through two variables:

- ``BOTOCORE_EXPERIMENTAL__PLUGINS=qworker_aws_calls=qworker.testing.aws_calls``:
  botocore imports this module for every client it creates and calls
  ``initialize_client_plugin(client)`` (botocore >= 1.36's client plugins);
- ``QWORKER_TEST_AWS_CALLS_DIR=<dir>``: where each process appends its calls, one JSON
  line per call, to ``calls-<pid>.jsonl``.

Nothing in qworker imports this module and without both variables it does nothing, so
production processes never record. A client is recorded only when qworker's own code
created it (the innermost frame outside botocore, boto3, s3transfer, the standard
library and ``qworker.worker.aws`` / ``qworker.testing`` is in a ``qworker`` module);
clients a test or a script creates for its own setup are left alone. Each line says
which qworker functions were on the stack when the client was created (the checker
derives the caller's identity and the resource's role from them), the operation, the
parameters that name a resource, and the HTTP status (``null`` when no response came).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

PLUGIN_ENV = "BOTOCORE_EXPERIMENTAL__PLUGINS"
PLUGIN_VALUE = "qworker_aws_calls=qworker.testing.aws_calls"
DIR_ENV = "QWORKER_TEST_AWS_CALLS_DIR"

#: API parameters that name a resource (or say how much a batch call carries).
_RESOURCE_PARAMS = ("Bucket", "Key", "Prefix", "Delimiter", "QueueUrl", "QueueName",
                    "QueueOwnerAWSAccountId", "IfNoneMatch")
_LIBRARIES = ("botocore", "boto3", "s3transfer", "urllib3", "qworker.worker.aws",
              "qworker.testing")

_lock = threading.Lock()
_fd: int | None = None
_fd_pid: int | None = None


def _is_library(module: str) -> bool:
    top = module.split(".", 1)[0]
    return (top in sys.stdlib_module_names or module.startswith(_LIBRARIES)
            or module in ("__main__", "<frozen runpy>"))


def creation_stack() -> list[str] | None:
    """``module:function`` of the qworker frames creating a client, outermost first.

    None when the innermost frame that is not a library is not qworker's (a test's or a
    script's own client).
    """
    frame = sys._getframe(1)
    names: list[str] = []
    owner: str | None = None
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if owner is None and not _is_library(module):
            owner = module
        if module.startswith("qworker.") and not module.startswith(_LIBRARIES[4:]):
            names.append(f"{module}:{frame.f_code.co_name}")
        frame = frame.f_back
    if owner is None or not owner.startswith("qworker."):
        return None
    names.reverse()
    return names


def _write(line: dict[str, Any]) -> None:
    global _fd, _fd_pid
    directory = os.environ.get(DIR_ENV)
    if not directory:
        return
    data = (json.dumps(line, sort_keys=True) + "\n").encode()
    with _lock:
        pid = os.getpid()
        if _fd is None or _fd_pid != pid:  # first call, or a forked child
            os.makedirs(directory, exist_ok=True)
            _fd = os.open(os.path.join(directory, f"calls-{pid}.jsonl"),
                          os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            _fd_pid = pid
        os.write(_fd, data)  # one unbuffered write per line: a killed process loses none


def initialize_client_plugin(client: Any) -> None:
    """botocore's plugin hook: record the calls of ``client`` if qworker created it."""
    if not os.environ.get(DIR_ENV):
        return
    stack = creation_stack()
    if stack is None:
        return
    service = client.meta.service_model.service_name
    argv = list(sys.argv)
    client_id = f"{os.getpid()}-{id(client):x}"

    def before(params: dict[str, Any], model: Any, context: dict[str, Any], **_: Any) -> None:
        picked: dict[str, Any] = {k: params[k] for k in _RESOURCE_PARAMS
                                  if isinstance(params.get(k), str)}
        if isinstance(params.get("Entries"), list):
            picked["Entries"] = len(params["Entries"])
        context["qworker_call"] = {"service": service, "operation": model.name,
                                   "params": picked, "stack": stack, "argv": argv,
                                   "client": client_id}

    def after(http_response: Any, parsed: Any, context: dict[str, Any], **_: Any) -> None:
        call = context.get("qworker_call")
        if call is not None:
            error = (parsed or {}).get("Error", {}) if isinstance(parsed, dict) else {}
            _write({**call, "status": int(http_response.status_code),
                    "error": str(error.get("Code", "")) or None})

    def failed(exception: BaseException, context: dict[str, Any], **_: Any) -> None:
        call = context.get("qworker_call")
        if call is not None:
            _write({**call, "status": None, "error": type(exception).__name__})

    client.meta.events.register("before-parameter-build", before)
    client.meta.events.register("after-call", after)
    client.meta.events.register("after-call-error", failed)
