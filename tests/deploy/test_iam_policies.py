"""deploy/terraform/policies/: rendered as terraform renders them, wired to the right roles.

What the worker, produce, status and collect call is checked against these documents in
tests/e2e/test_iam_enforced.py (moto with IAM enforcement, and every recorded call of the
session). Here: the templates and iam.tf agree, the roles get the documents meant for
them, the KEDA and IRSA pieces match the Kubernetes manifests, and the evaluator those
checks use agrees with moto's own on the decisions moto makes.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.deploy.test_manifests import one, render
from tests.fixtures.iam_policies import (
    POLICIES,
    TERRAFORM,
    deployment,
    evaluate,
    template_variables,
)
from tests.fixtures.iam_policies import (
    render as render_policy,
)

IAM_TF = (TERRAFORM / "iam.tf").read_text()
TEMPLATES = sorted(p.name.removesuffix(".json.tftpl") for p in POLICIES.glob("*.json.tftpl"))


def _templatefile_calls() -> dict[str, str]:
    """template name -> the variables expression iam.tf passes to templatefile()."""
    calls = re.findall(r'templatefile\("\$\{path\.module\}/policies/(\w+)\.json\.tftpl",\s*'
                       r"(local\.policy_vars|\{.*?\})\)", IAM_TF, re.S)
    return dict(calls)


def _policy_vars() -> set[str]:
    block = re.search(r"policy_vars = \{(.*?)\n  \}", IAM_TF, re.S)
    assert block
    return set(re.findall(r"^\s*(\w+)\s*=", block.group(1), re.MULTILINE))


def test_every_template_is_used_by_iam_tf_with_the_variables_it_needs() -> None:
    calls = _templatefile_calls()
    assert sorted(calls) == TEMPLATES
    for name, expression in calls.items():
        given = (_policy_vars() if expression == "local.policy_vars"
                 else set(re.findall(r"^\s*(\w+)\s*=", expression, re.MULTILINE)))
        assert template_variables(name) <= given, name
        assert not (POLICIES / f"{name}.json.tftpl").read_text().count("%{")
        policy = render_policy(name)
        assert policy["Version"] == "2012-10-17"
        # a malformed template would fail terraform's jsondecode at plan time
        assert f'jsondecode(templatefile("${{path.module}}/policies/{name}.json.tftpl"' in IAM_TF


def test_the_worker_policy_has_no_wildcard_and_reaches_only_deployment_resources() -> None:
    dep = deployment()
    policy = render_policy("worker")
    for statement in policy["Statement"]:
        assert statement["Effect"] == "Allow"
        for action in statement["Action"] if isinstance(statement["Action"], list) else [
                statement["Action"]]:
            assert "*" not in action
        resources = statement["Resource"] if isinstance(statement["Resource"], list) else [
            statement["Resource"]]
        for resource in resources:
            assert resource != "*" and (dep.bucket in resource or ":sqs:" in resource
                                        or resource == dep.kms_key_arn), resource


def _attachments() -> dict[str, str]:
    """role resource -> the aws_iam_policy its attachment names."""
    out = {}
    for body in re.findall(r'resource "aws_iam_role_policy_attachment" "\w+" \{(.*?)\n\}',
                           IAM_TF, re.S):
        role = re.search(r"role\s*=\s*aws_iam_role\.(\w+)", body)
        policy = re.search(r"policy_arn\s*=\s*aws_iam_policy\.(\w+)\.arn", body)
        if role and policy:
            out[role.group(1)] = policy.group(1)
    return out


def test_the_batch_job_role_and_the_irsa_role_hold_the_worker_policy() -> None:
    attachments = _attachments()
    assert attachments["batch_job"] == "worker" and attachments["eks_worker"] == "worker"
    batch = (TERRAFORM / "batch.tf").read_text()
    assert "jobRoleArn       = aws_iam_role.batch_job.arn" in batch
    trust = render_policy("ecs_tasks_trust")["Statement"][0]
    assert trust["Principal"] == {"Service": "ecs-tasks.amazonaws.com"}
    assert trust["Condition"]["StringEquals"]["aws:SourceAccount"] == "123456789012"


def test_the_irsa_role_trusts_exactly_the_workers_service_account() -> None:
    docs = render("overlays/sqs")
    sa = one(docs, "ServiceAccount")
    pod = one(docs, "ScaledJob")["spec"]["jobTargetRef"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    (statement,) = render_policy("irsa_trust")["Statement"]
    assert statement["Action"] == "sts:AssumeRoleWithWebIdentity"
    conditions = statement["Condition"]["StringEquals"]
    issuer = deployment().variables()["oidc_issuer"]
    assert conditions[f"{issuer}:sub"] == (
        f"system:serviceaccount:{sa['metadata']['namespace']}:{sa['metadata']['name']}")
    assert conditions[f"{issuer}:aud"] == "sts.amazonaws.com"
    arn = sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"]
    assert arn.endswith(f"/{deployment().name}-eks-worker")  # terraform's role name


def test_keda_may_read_the_length_of_the_queue_it_scales_on_and_nothing_else() -> None:
    dep = deployment()
    (trigger,) = one(render("overlays/sqs"), "ScaledJob")["spec"]["triggers"]
    queue = trigger["metadata"]["queueURL"].rsplit("/", 1)[-1]
    assert queue == dep.jobs_queue
    policy = render_policy("keda_queue_reader")
    (statement,) = policy["Statement"]
    assert statement["Action"] == "sqs:GetQueueAttributes"
    assert statement["Resource"] == dep.queue_arn(queue)
    assert "keda_queue_reader_policy_arn" in (TERRAFORM / "outputs.tf").read_text()


def test_the_execution_role_allows_what_the_ecs_agent_needs_for_this_image_and_log() -> None:
    """The ECS agent pulls the image and writes the awslogs stream (nothing recordable here)."""
    actions = set()
    for statement in render_policy("batch_execution")["Statement"]:
        acts = statement["Action"] if isinstance(statement["Action"], list) else [
            statement["Action"]]
        actions |= set(acts)
        if acts != ["ecr:GetAuthorizationToken"]:  # the one action without resource scoping
            assert statement["Resource"] != "*"
    assert actions == {"ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer",
                       "ecr:BatchCheckLayerAvailability", "ecr:GetAuthorizationToken",
                       "kms:Decrypt", "logs:CreateLogStream", "logs:PutLogEvents"}


def test_producer_and_collector_policies_are_outputs_for_their_users() -> None:
    outputs = (TERRAFORM / "outputs.tf").read_text()
    assert "aws_iam_policy.producer.arn" in outputs and "aws_iam_policy.collector.arn" in outputs


_CASES = [
    ("worker", "s3:PutObject", "arn:aws:s3:::{bucket}/results/b/x.json"),
    ("worker", "s3:PutObject", "arn:aws:s3:::{bucket}/models/x"),
    ("worker", "s3:GetObject", "arn:aws:s3:::{bucket}/models/smollm2/config.json"),
    ("worker", "s3:GetObject", "arn:aws:s3:::{bucket}/other/x"),
    ("worker", "s3:DeleteObject", "arn:aws:s3:::{bucket}/results/b/x.json"),
    ("worker", "sqs:SendMessage", "arn:aws:sqs:us-east-1:123456789012:{jobs}"),
    ("worker", "sqs:SendMessage", "arn:aws:sqs:us-east-1:123456789012:{dlq}"),
    ("worker", "sqs:ReceiveMessage", "arn:aws:sqs:us-east-1:123456789012:{jobs}"),
    ("worker", "sqs:ReceiveMessage", "arn:aws:sqs:us-east-1:123456789012:other"),
    ("producer", "sqs:SendMessage", "arn:aws:sqs:us-east-1:123456789012:{jobs}"),
    ("producer", "s3:PutObject", "arn:aws:s3:::{bucket}/results/b/_manifest.json"),
    ("producer", "s3:PutObject", "arn:aws:s3:::{bucket}/results/b/x.json"),
    ("collector", "s3:GetObject", "arn:aws:s3:::{bucket}/results/b/x.json"),
    ("collector", "s3:PutObject", "arn:aws:s3:::{bucket}/results/b/x.json"),
]


@pytest.mark.parametrize(("name", "action", "resource"), _CASES)
def test_the_evaluator_agrees_with_motos_on_actions_and_resources(
    name: str, action: str, resource: str
) -> None:
    """Where moto decides (action and resource; it ignores most conditions), we agree."""
    pytest.importorskip("moto")
    from moto.iam.access_control import IAMPolicy, PermissionResult

    dep = deployment()
    arn = resource.format(bucket=dep.bucket, jobs=dep.jobs_queue, dlq=dep.dlq)
    policy = render_policy(name)
    # only statements without conditions: moto does not evaluate StringLike and friends
    plain = {**policy, "Statement": [s for s in policy["Statement"] if "Condition" not in s]}
    theirs = IAMPolicy(json.dumps(plain)).is_action_permitted(action, arn)
    assert evaluate(plain, action, arn) == (theirs == PermissionResult.PERMITTED)


def test_the_evaluator_applies_conditions_as_iam_does() -> None:
    """AWS's documented semantics: a missing key fails a condition unless ...IfExists."""
    dep = deployment()
    worker = render_policy("worker")
    bucket = f"arn:aws:s3:::{dep.bucket}"
    assert evaluate(worker, "s3:ListBucket", bucket)  # HeadBucket: no s3:prefix
    assert evaluate(worker, "s3:ListBucket", bucket, {"s3:prefix": "models/smollm2/"})
    assert not evaluate(worker, "s3:ListBucket", bucket, {"s3:prefix": "results/b/"})
    via_s3 = {"kms:ViaService": f"s3.{dep.region}.amazonaws.com"}
    assert evaluate(worker, "kms:Decrypt", dep.kms_key_arn, via_s3)
    assert not evaluate(worker, "kms:Decrypt", dep.kms_key_arn)  # not through a service
    assert not evaluate(worker, "kms:Decrypt", dep.kms_key_arn,
                        {"kms:ViaService": f"ecr.{dep.region}.amazonaws.com"})
    deny = {"Statement": [*worker["Statement"], {"Effect": "Deny", "Action": "s3:*",
                                                  "Resource": "*"}]}
    assert not evaluate(deny, "s3:PutObject", f"{bucket}/results/b/x.json")
    with pytest.raises(NotImplementedError):
        evaluate({"Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*",
                                 "Condition": {"NumericLessThan": {"k": "1"}}}]},
                 "s3:GetObject", "x", {"k": "0"})


def test_the_policy_before_this_change_refuses_the_workers_start() -> None:
    """The issue's finding: ListBucket only under models/* refused HeadBucket (exit 1)."""
    dep = deployment()
    old = {"Statement": [{"Effect": "Allow", "Action": "s3:ListBucket",
                          "Resource": f"arn:aws:s3:::{dep.bucket}",
                          "Condition": {"StringLike": {"s3:prefix": ["models/*"]}}}]}
    assert not evaluate(old, "s3:ListBucket", f"arn:aws:s3:::{dep.bucket}")
    assert evaluate(render_policy("worker"), "s3:ListBucket", f"arn:aws:s3:::{dep.bucket}")

