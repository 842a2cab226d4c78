"""deploy/ against the exit-code contract and the budgets (docs/operations.md).

- AWS Batch: ``retryStrategy.evaluateOnExit`` in batch.tf, replayed with Batch's own
  rules (the first matching condition decides; no match means RETRY; ``*`` only at the
  end of a pattern) for every exit code 0-255 and for a lost host.
- Kubernetes: the rendered overlays' Job failure policy per exit code, the liveness
  window against the outage budgets and the grace period, disruption settings that let
  a spot drain take every pod of a node at once, NodePools that only offer the GPU
  count a pod asks for.
- Pins: the image by digest, the node AMIs by release, the Dockerfile's base by digest.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from qworker.worker.exit_codes import ExitCode
from tests.deploy.test_manifests import _config, _container, by_kind, one, pod_template, render

ROOT = Path(__file__).resolve().parents[2]
TERRAFORM = ROOT / "deploy" / "terraform"
RETRIED = {ExitCode.UNAVAILABLE, ExitCode.ENGINE, ExitCode.DRAINED}
HOST_LOST = "Host EC2 (instance i-0123456789abcdef0) terminated."


def _blocks(text: str, name: str) -> list[str]:
    """The bodies of every ``name { ... }`` block (no nested braces inside)."""
    return re.findall(name + r"\s*\{([^{}]*)\}", text)


def _attributes(body: str) -> dict[str, str]:
    return dict(re.findall(r'^\s*(\w+)\s*=\s*"?([^"\n]*)"?\s*$', body, re.MULTILINE))


def _glob(pattern: str, value: str) -> bool:
    """Batch's patterns: exact, or a prefix when the pattern ends in ``*``."""
    return value.startswith(pattern[:-1]) if pattern.endswith("*") else value == pattern


def batch_action(conditions: list[dict[str, str]], exit_code: int | None,
                 status_reason: str, reason: str = "") -> str:
    """What Batch does with a failed attempt: the first condition whose fields all match."""
    fields = {"on_exit_code": "" if exit_code is None else str(exit_code),
              "on_status_reason": status_reason, "on_reason": reason}
    for condition in conditions:
        tests = {k: v for k, v in condition.items() if k in fields}
        if all(_glob(pattern, fields[k]) for k, pattern in tests.items()):
            return condition["action"]
    return "RETRY"  # Batch: no condition matched


def _batch_conditions() -> tuple[list[dict[str, str]], str]:
    text = (TERRAFORM / "batch.tf").read_text()
    (strategy,) = re.findall(r"retry_strategy \{(.*?)\n  \}\n", text, re.S)
    conditions = [_attributes(b) for b in _blocks(strategy, "evaluate_on_exit")]
    (attempts,) = re.findall(r"^\s*attempts\s*=\s*(\S+)", strategy, re.MULTILINE)
    return conditions, attempts


def test_batch_retries_outages_engine_failures_drains_and_lost_hosts_only() -> None:
    conditions, attempts = _batch_conditions()
    assert 1 <= len(conditions) <= 5  # Batch's limit
    for condition in conditions:
        assert condition["action"] in ("RETRY", "EXIT")
        for key in ("on_exit_code",):
            if key in condition:
                assert re.fullmatch(r"\d+\*?", condition[key]), condition
    for code in range(256):
        expected = "RETRY" if code in RETRIED else "EXIT"
        got = batch_action(conditions, code, "Essential container in task exited")
        assert got == expected, f"exit {code}: Batch would {got}"
    assert batch_action(conditions, None, HOST_LOST) == "RETRY"
    # a job Batch itself stops (timeout, cancel) is not retried by the catch-all either
    assert batch_action(conditions, None, "Job attempt duration exceeded timeout") == "EXIT"
    # `attempts` is a variable, documented and bounded as AWS allows
    assert attempts == "var.batch_retry_attempts"
    variables = (TERRAFORM / "variables.tf").read_text()
    block = variables[variables.index('variable "batch_retry_attempts"'):]
    block = block[:block.index("\n}\n")]
    assert "first included" in block and ">= 1" in block and "<= 10" in block
    default = int(re.search(r"default\s*=\s*(\d+)", block).group(1))  # type: ignore[union-attr]
    assert 1 <= default <= 10


def test_the_exit_code_contract_is_what_batch_and_kubernetes_key_on() -> None:
    """0 and 1 are the only "do not retry" codes (docs/formats.md, "Exit codes")."""
    assert {int(c) for c in ExitCode} == {0, 1, 69, 70, 75}
    assert {int(c) for c in ExitCode} - {int(c) for c in RETRIED} == {0, 1}


@pytest.fixture(scope="module", params=["overlays/kafka", "overlays/sqs"])
def docs(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render(request.param)


def test_jobs_fail_fast_on_1_retry_69_70_75_and_replace_evicted_pods(
    docs: list[dict[str, Any]],
) -> None:
    job = one(docs, "ScaledJob")["spec"]["jobTargetRef"]
    assert pod_template(docs)["spec"]["restartPolicy"] == "Never"  # podFailurePolicy needs it
    assert job["backoffLimit"] >= 1
    container = _container(docs)["name"]
    fail, count, ignored = set(), set(), []
    for rule in job["podFailurePolicy"]["rules"]:
        if "onExitCodes" in rule:
            codes = rule["onExitCodes"]
            assert codes["operator"] == "In" and codes["containerName"] == container
            {"FailJob": fail, "Count": count}[rule["action"]].update(codes["values"])
        else:
            assert rule["action"] == "Ignore"
            ignored += [c["type"] for c in rule["onPodConditions"]]
    assert fail == {ExitCode.CONFIG}
    assert count == {int(c) for c in RETRIED}
    assert ignored == ["DisruptionTarget"]  # a spot drain does not use up the retries


def _budgets(config: dict[str, str]) -> dict[str, float]:
    """The budgets the worker runs with: the ConfigMap's, else the settings' defaults."""
    from qworker.config import WorkerSettings  # pydantic: not on the GPU machine

    defaults = WorkerSettings()
    names = ("source_outage_seconds", "sink_outage_seconds", "engine_step_timeout")
    return {n: float(config.get(f"QWORKER_{n.upper()}", getattr(defaults, n))) for n in names}


def test_liveness_rides_out_the_outage_budgets_and_the_drain(docs: list[dict[str, Any]]) -> None:
    """/healthz fails for as long as an outage lasts; the worker ends it by itself."""
    container, pod = _container(docs), pod_template(docs)["spec"]
    budgets = _budgets(_config(docs))
    live = container["livenessProbe"]
    window = live["periodSeconds"] * live["failureThreshold"]
    longest = max(budgets.values())
    assert longest >= 300  # the budgets docs/operations.md promises to ride out
    assert window >= longest + pod["terminationGracePeriodSeconds"], (window, budgets)
    assert live["timeoutSeconds"] < live["periodSeconds"]
    # readiness shows the state (it may fail during an outage); it never restarts anything
    ready = container["readinessProbe"]
    assert ready["httpGet"]["path"] == "/readyz"
    # a startup probe on /healthz would pass at once (it answers before the model loads)
    assert "startupProbe" not in container


def test_a_spot_drain_can_take_every_worker_of_a_node_at_once(
    docs: list[dict[str, Any]],
) -> None:
    pdb = one(docs, "PodDisruptionBudget")["spec"]
    assert pdb.get("maxUnavailable") == "100%" and "minAvailable" not in pdb
    annotations = pod_template(docs)["metadata"]["annotations"]
    assert annotations["karpenter.sh/do-not-disrupt"] == "true"


def test_node_pools_offer_exactly_the_gpus_a_worker_asks_for(docs: list[dict[str, Any]]) -> None:
    gpus = _container(docs)["resources"]["requests"]["nvidia.com/gpu"]
    pools = by_kind(render("karpenter"), "NodePool")
    assert pools
    for pool in pools:
        spec = pool["spec"]
        reqs = {r["key"]: r for r in spec["template"]["spec"]["requirements"]}
        gpu_count = reqs["karpenter.k8s.aws/instance-gpu-count"]
        assert gpu_count["operator"] == "In" and gpu_count["values"] == [gpus], pool["metadata"]
        # voluntary disruption only of empty nodes; expiry waits for the worker, bounded
        assert spec["disruption"]["consolidationPolicy"] == "WhenEmpty"
        assert "terminationGracePeriod" in spec["template"]["spec"]


def test_images_and_amis_are_pinned(docs: list[dict[str, Any]]) -> None:
    image = _container(docs)["image"]
    assert re.fullmatch(r"[\w.-]+(/[\w.-]+)*@sha256:[0-9a-f]{64}", image), image
    (node_class,) = by_kind(render("karpenter"), "EC2NodeClass")
    for term in node_class["spec"]["amiSelectorTerms"]:
        assert re.fullmatch(r"al2023@v\d{8}", term["alias"]), term
    froms = re.findall(r"^FROM (\S+)", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert froms and all(re.search(r"@sha256:[0-9a-f]{64}$", f) for f in froms), froms
    batch = (TERRAFORM / "batch.tf").read_text()
    assert "image_id_override = var.batch_ami_id" in batch
