"""deploy/: rendered Kustomize manifests, alert rules, dashboard and image agree with the worker.

The worker's contract (env names, port, probes, drain budget, metric names)
lives in docs/configuration.md and docs/formats.md; these tests hold deploy/ to it. Schema
validation of the core kinds is scripts/lint.sh's job (kubernetes-validate);
the KEDA and Karpenter CRDs have no bundled schema there, so their fields are
checked here.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

DESIGN_METRICS = {
    "qworker_num_requests_running", "qworker_num_requests_waiting", "qworker_kv_cache_usage_perc",
    "qworker_num_preemptions_total", "qworker_prompt_tokens_total",
    "qworker_generation_tokens_total", "qworker_prefix_cache_hits_total",
    "qworker_time_to_first_token_seconds", "qworker_e2e_request_latency_seconds",
    "qworker_jobs_received_total", "qworker_jobs_completed_total", "qworker_jobs_duplicate_total",
    "qworker_jobs_dead_lettered_total", "qworker_inflight_jobs", "qworker_uncommitted_offsets",
    "qworker_sink_put_seconds", "qworker_sink_retries_total", "qworker_draining",
    "qworker_spot_interruptions_total", "qworker_prefix_cache_queries_total",
    "qworker_inter_token_latency_seconds", "qworker_request_queue_time_seconds",
    "qworker_info", "qworker_batch_jobs_completed_total", "qworker_jobs_conflict_total",
}
_HISTOGRAM_SUFFIX = re.compile(r"_(bucket|sum|count)$")


def _kustomize_cmd() -> list[str] | None:
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    return None


def render(path: str) -> list[dict[str, Any]]:
    """Render one kustomization (skips the test where no kustomize is installed)."""
    cmd = _kustomize_cmd()
    if cmd is None:
        pytest.skip("neither kubectl nor kustomize installed")
    out = subprocess.run(
        [*cmd, str(DEPLOY / "k8s" / path)], check=True, capture_output=True, text=True, timeout=60
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = by_kind(docs, kind)
    return doc


@pytest.fixture(scope="module", params=["overlays/kafka", "overlays/sqs"])
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


@pytest.fixture(scope="module")
def karpenter() -> list[dict[str, Any]]:
    return render("karpenter")


def _config(docs: list[dict[str, Any]]) -> dict[str, str]:
    return one(docs, "ConfigMap")["data"]


def pod_template(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The worker's pod template: the ScaledJob's Job template (a Deployment's before)."""
    workloads = by_kind(docs, "ScaledJob") + by_kind(docs, "Deployment")
    (workload,) = workloads
    spec = workload["spec"]
    return spec["jobTargetRef"]["template"] if "jobTargetRef" in spec else spec["template"]


def _container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = pod_template(docs)["spec"]["containers"]
    return container


def test_grace_period_covers_the_drain_budget(overlay: tuple[str, list]) -> None:
    from qworker.worker.drain import drain_budget

    _, docs = overlay
    pod = pod_template(docs)["spec"]
    budget = drain_budget(float(_config(docs)["QWORKER_DRAIN_SECONDS"]))
    # every drain phase, closing the source included, and the process exit
    assert pod["terminationGracePeriodSeconds"] >= budget.grace_seconds
    # and it fits inside the 2-minute spot notice
    assert pod["terminationGracePeriodSeconds"] <= 120


def test_batch_stop_timeout_covers_the_drain_budget() -> None:
    from qworker.worker.drain import drain_budget

    tf = {p.name: p.read_text() for p in (DEPLOY / "terraform").glob("*.tf")}
    variable = tf["variables.tf"].split('variable "drain_seconds"')[1].split("\n}")[0]
    drain = float(re.search(r"default\s*=\s*(\d+)", variable).group(1))
    stop = re.search(r"ECS_CONTAINER_STOP_TIMEOUT=\$\{var\.drain_seconds \+ (\d+)\}s",
                     tf["batch.tf"])
    assert stop, "the ECS stop timeout must be derived from var.drain_seconds"
    env = re.search(r'name = "QWORKER_DRAIN_SECONDS", value = tostring\(var\.drain_seconds\)',
                    tf["batch.tf"])
    assert env, "the job's QWORKER_DRAIN_SECONDS must be var.drain_seconds"
    for seconds in (drain, 30.0, 300.0):  # any drain_seconds, not only the default
        assert seconds + int(stop.group(1)) >= drain_budget(seconds).grace_seconds


def test_probes_and_scrape_use_the_metrics_port(overlay: tuple[str, list]) -> None:
    _, docs = overlay
    container = _container(docs)
    port = int(_config(docs)["QWORKER_METRICS_PORT"])
    (metrics_port,) = [p for p in container["ports"] if p["name"] == "metrics"]
    assert metrics_port["containerPort"] == port
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    annotations = pod_template(docs)["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == port


def test_pod_requests_a_gpu_and_tolerates_the_gpu_taint(
    overlay: tuple[str, list], karpenter: list[dict[str, Any]]
) -> None:
    _, docs = overlay
    container = _container(docs)
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    tolerations = pod_template(docs)["spec"]["tolerations"]
    for pool in by_kind(karpenter, "NodePool"):
        for taint in pool["spec"]["template"]["spec"]["taints"]:
            assert any(
                t["key"] == taint["key"] and t.get("effect") == taint["effect"]
                for t in tolerations
            ), taint


def test_pod_runs_non_root_on_a_read_only_root_with_writable_caches(
    overlay: tuple[str, list],
) -> None:
    _, docs = overlay
    pod = pod_template(docs)["spec"]
    container = _container(docs)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for path in ("/cache", "/tmp"):
        assert "emptyDir" in volumes[mounts[path]]
    # the image points HF_HOME / CUPY_CACHE_DIR under /cache
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "CUPY_CACHE_DIR=/cache/" in dockerfile and "HF_HOME=/cache/" in dockerfile


def test_config_and_service_account_are_wired(overlay: tuple[str, list]) -> None:
    _, docs = overlay
    pod = pod_template(docs)["spec"]
    env_from = _container(docs)["envFrom"]
    assert env_from[0]["configMapRef"]["name"] == one(docs, "ConfigMap")["metadata"]["name"]
    assert env_from[1]["secretRef"]["optional"] is True
    sa = one(docs, "ServiceAccount")
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    assert sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].startswith("arn:aws:iam::")


def test_pdb_and_network_policy_select_the_worker_pods(overlay: tuple[str, list]) -> None:
    _, docs = overlay
    labels = pod_template(docs)["metadata"]["labels"]
    for kind, key in (("PodDisruptionBudget", "selector"), ("NetworkPolicy", "podSelector")):
        selector = one(docs, kind)["spec"][key]["matchLabels"]
        assert selector.items() <= labels.items(), kind


def test_scaled_job_runs_the_worker_and_matches_the_source(
    overlay: tuple[str, list], karpenter: list[dict[str, Any]]
) -> None:
    name, docs = overlay
    scaled = one(docs, "ScaledJob")
    assert not by_kind(docs, "Deployment") and not by_kind(docs, "ScaledObject")
    assert scaled["metadata"]["namespace"] == one(docs, "ConfigMap")["metadata"]["namespace"]
    assert int(_config(docs)["QWORKER_UNTIL_IDLE"]) > 0  # each Job ends by itself
    pools = by_kind(karpenter, "NodePool")
    gpu_limit = sum(int(p["spec"]["limits"]["nvidia.com/gpu"]) for p in pools)
    assert scaled["spec"]["maxReplicaCount"] <= gpu_limit
    (trigger,) = scaled["spec"]["triggers"]
    source = _config(docs)["QWORKER_SOURCE"]
    if name.endswith("kafka"):
        assert trigger["type"] == "kafka"
        meta = trigger["metadata"]
        assert source == (
            f"kafka://{meta['bootstrapServers']}/{meta['topic']}?group={meta['consumerGroup']}"
        )
    else:
        assert trigger["type"] == "aws-sqs-queue"
        assert source == f"sqs://{trigger['metadata']['queueURL']}"
        auth = one(docs, "TriggerAuthentication")
        assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]


_KEDA_SASL = {"PLAIN": "plaintext", "SCRAM-SHA-256": "scram_sha256",
              "SCRAM-SHA-512": "scram_sha512", "OAUTHBEARER": "aws_msk_iam"}


def test_kafka_trigger_authenticates_like_the_worker() -> None:
    """KEDA reads the lag with the pods' security settings and the same Secret keys."""
    docs = render("overlays/kafka")
    config = _config(docs)
    (trigger,) = one(docs, "ScaledJob")["spec"]["triggers"]
    meta = trigger["metadata"]
    protocol = config["QWORKER_KAFKA_SECURITY_PROTOCOL"]
    assert meta["tls"] == ("enable" if protocol.endswith("SSL") else "disable")
    assert meta["sasl"] == _KEDA_SASL[config["QWORKER_KAFKA_SASL_MECHANISM"]]
    auth = one(docs, "TriggerAuthentication")
    assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
    refs = {r["parameter"]: r for r in auth["spec"]["secretTargetRef"]}
    secret = _container(docs)["envFrom"][1]["secretRef"]["name"]
    assert refs["username"]["key"] == "QWORKER_KAFKA_SASL_USERNAME"
    assert refs["password"]["key"] == "QWORKER_KAFKA_SASL_PASSWORD"
    assert {r["name"] for r in refs.values()} == {secret}
    # the settings the ConfigMap names are ones the worker accepts together
    from qworker.config import WorkerSettings

    WorkerSettings(kafka_security_protocol=protocol,
                   kafka_sasl_mechanism=config["QWORKER_KAFKA_SASL_MECHANISM"],
                   kafka_sasl_username="u", kafka_sasl_password="p")


def test_karpenter_pools_are_gpu_spot_first_and_remove_empty_nodes(
    karpenter: list[dict[str, Any]],
) -> None:
    node_classes = {d["metadata"]["name"] for d in by_kind(karpenter, "EC2NodeClass")}
    pools = sorted(by_kind(karpenter, "NodePool"), key=lambda p: -p["spec"]["weight"])
    spot = pools[0]["spec"]
    reqs = {r["key"]: r["values"] for r in spot["template"]["spec"]["requirements"]}
    assert reqs["karpenter.sh/capacity-type"] == ["spot"]
    assert {"g5", "g6"} <= set(reqs["karpenter.k8s.aws/instance-family"])
    for pool in pools:
        assert pool["spec"]["template"]["spec"]["nodeClassRef"]["name"] in node_classes
        # one worker per node: consolidation only removes empty nodes
        assert pool["spec"]["disruption"]["consolidationPolicy"] == "WhenEmpty"
    (node_class,) = by_kind(karpenter, "EC2NodeClass")
    assert node_class["spec"]["metadataOptions"]["httpTokens"] == "required"


def _metric_names(expr: str) -> set[str]:
    return {_HISTOGRAM_SUFFIX.sub("", m) for m in re.findall(r"\bqworker_[a-z0-9_]+", expr)}


def test_alert_rules_use_design_metrics_and_say_what_to_do() -> None:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())
    alerts = [r for g in rules["groups"] for r in g["rules"]]
    names = {a["alert"] for a in alerts}
    assert {"QworkerConsumerStalled", "QworkerDeadLettersGrowing", "QworkerKVThrash"} <= names
    for alert in alerts:
        expr = alert["expr"]
        assert _metric_names(expr) <= DESIGN_METRICS, alert["alert"]
        assert expr.count("(") == expr.count(")"), alert["alert"]
        assert alert["labels"]["severity"] in {"critical", "warning", "info"}
        assert alert["annotations"]["summary"] and alert["annotations"]["description"]


def test_dashboard_queries_design_metrics_and_prices_tokens() -> None:
    dash = json.loads((DEPLOY / "grafana" / "qworker.json").read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    used = set().union(*(_metric_names(e) for e in exprs))
    assert used <= DESIGN_METRICS
    for needed in ("qworker_generation_tokens_total", "qworker_kv_cache_usage_perc",
                   "qworker_num_preemptions_total", "qworker_jobs_completed_total",
                   "qworker_draining", "qworker_jobs_dead_lettered_total"):
        assert needed in used, needed
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert "gpu_hour_price" in variables
    assert any("$gpu_hour_price" in e for e in exprs)
    assert any("kafka_consumergroup_lag" in e for e in exprs)


def test_image_drains_on_sigterm_as_non_root_with_healthcheck() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "STOPSIGNAL SIGTERM" in text
    assert 'ENTRYPOINT ["dumb-init", "--", "/opt/qworker/entrypoint.sh"]' in text
    (user,) = re.findall(r"^USER (\S+)", text, re.MULTILINE)
    assert not user.startswith(("0", "root"))
    assert re.search(r"^HEALTHCHECK .*\n?.*/healthz", text, re.MULTILINE)
    assert "QWORKER_METRICS_PORT" in text


def test_image_builds_the_tested_torch_line_and_declares_every_import() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    (image_torch,) = re.findall(r"^ARG TORCH_VERSION=(\S+)", dockerfile, re.MULTILINE)
    (tested,) = re.findall(r"pip install -q torch==(\S+)", (ROOT / "Makefile").read_text())
    assert image_torch == tested
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[\[<>=!~ ]", d, maxsplit=1)[0].lower().replace("_", "-")
                for d in project["dependencies"]}
    # every third-party module qworker/ imports, mapped to its distribution
    import ast
    import importlib.metadata
    import sys

    owners = importlib.metadata.packages_distributions()
    optional = {"cupy": "gpu extra", "cryptography": "qworker.testing only (dev extra)"}
    for path in (ROOT / "qworker").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module
                     and not node.level else [])
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in ("qworker", "__future__"):
                    continue
                if top in optional:
                    continue
                dists = {d.lower().replace("_", "-") for d in owners.get(top, [top])}
                assert dists & declared, f"{path.relative_to(ROOT)} imports {name}: undeclared"
    bounded = {d.split(">=")[0].split("[")[0]: d for d in project["dependencies"]}
    assert "<" in bounded["transformers"] and "<" in bounded["gguf"]  # internals imported


def test_terraform_retries_spot_reclaims_and_tags_everything() -> None:
    tf = {p.name: p.read_text() for p in (DEPLOY / "terraform").glob("*.tf")}
    batch = tf["batch.tf"]
    assert 'allocation_strategy = "SPOT_PRICE_CAPACITY_OPTIMIZED"' in batch
    assert re.search(r'on_status_reason = "Host EC2\*"\s+action\s+= "RETRY"', batch)
    assert "attempt_duration_seconds" in batch
    assert "default_tags" in tf["main.tf"]
    assert re.search(r"project = var\.project\s+env\s+= var\.env", tf["main.tf"])
    cost = tf["cost.tf"]
    assert "threshold                  = 80" in cost
    assert "aws_cloudwatch_metric_alarm" in cost and "tokens_spike" in cost
    # the worker's role never gets a wildcard action or resource
    worker_policy = (DEPLOY / "terraform" / "policies" / "worker.json.tftpl").read_text()
    assert '"*"' not in worker_policy and ":*\"" not in worker_policy
