"""deploy/'s multi-GPU (tensor-parallel) variant agrees with itself and with the worker:
N GPUs per pod and QWORKER_TENSOR_PARALLEL_SIZE=N, a /dev/shm and host memory for N
ranks, nodes with a multiple of N GPUs, the step watchdog before the collective timeout;
the Batch job definition the same."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.deploy.test_manifests import DEPLOY, by_kind, one, pod_template, render


def _gib(quantity: str) -> float:
    number, unit = re.fullmatch(r"(\d+)(Gi|Mi)", quantity).groups()  # type: ignore[union-attr]
    return int(number) / (1024 if unit == "Mi" else 1)


@pytest.fixture(scope="module")
def overlay() -> list[dict[str, Any]]:
    return render("overlays/sqs-tensor-parallel")


def test_the_pod_asks_for_the_gpus_shared_memory_and_host_memory_of_n_ranks(
        overlay: list[dict[str, Any]]) -> None:
    config = one(overlay, "ConfigMap")["data"]
    n = int(config["QWORKER_TENSOR_PARALLEL_SIZE"])
    assert n > 1
    pod = pod_template(overlay)["spec"]
    (container,) = pod["containers"]
    resources = container["resources"]
    gpus = {resources[kind]["nvidia.com/gpu"] for kind in ("requests", "limits")}
    assert gpus == {str(n)}
    volumes = {v["name"]: v for v in pod["volumes"]}
    shm = volumes["dshm"]["emptyDir"]
    assert shm["medium"] == "Memory" and _gib(shm["sizeLimit"]) >= 8 * n
    # /dev/shm is memory-backed: the limit holds it and ~10 GiB per rank besides
    assert _gib(resources["limits"]["memory"]) >= _gib(shm["sizeLimit"]) + 10 * n
    assert float(config["QWORKER_ENGINE_STEP_TIMEOUT"]) < float(
        config["QWORKER_TENSOR_PARALLEL_TIMEOUT"])
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]


def test_pods_land_only_on_nodes_with_a_multiple_of_n_gpus(
        overlay: list[dict[str, Any]]) -> None:
    n = int(one(overlay, "ConfigMap")["data"]["QWORKER_TENSOR_PARALLEL_SIZE"])
    pod = pod_template(overlay)["spec"]
    nodes = render("karpenter-multi-gpu")
    pool = one(nodes, "NodePool")
    template = pool["spec"]["template"]
    for key, value in pod["nodeSelector"].items():
        assert template["metadata"]["labels"][key] == value
    (counts,) = [r["values"] for r in template["spec"]["requirements"]
                 if r["key"] == "karpenter.k8s.aws/instance-gpu-count"]
    assert counts and all(int(c) % n == 0 for c in counts)
    for taint in template["spec"]["taints"]:
        assert any(t["key"] == taint["key"] and t["effect"] == taint["effect"]
                   for t in pod["tolerations"])
    (node_class,) = by_kind(nodes, "EC2NodeClass")
    assert template["spec"]["nodeClassRef"]["name"] == node_class["metadata"]["name"]
    assert node_class["spec"]["metadataOptions"]["httpPutResponseHopLimit"] == 1


def test_the_batch_job_definition_is_the_worker_with_n_gpus() -> None:
    tf = (DEPLOY / "terraform" / "batch_tensor_parallel.tf").read_text()
    assert '{ type = "GPU", value = tostring(var.tensor_parallel_size) }' in tf
    assert 'name = "QWORKER_TENSOR_PARALLEL_SIZE", value = tostring(var.tensor_parallel_size)' in tf
    assert "sharedMemorySize = local.tp_shm_mib" in tf
    assert "jsondecode(aws_batch_job_definition.worker.container_properties)" in tf
    assert re.search(r'on_status_reason = "Host EC2\*"\s+action\s+= "RETRY"', tf)
    assert 'allocation_strategy = "SPOT_PRICE_CAPACITY_OPTIMIZED"' in tf
