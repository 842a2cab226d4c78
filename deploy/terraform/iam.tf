# Least privilege, one policy per identity. The policy documents live in
# policies/*.json.tftpl and are rendered with templatefile(), so the tests load
# exactly these files (tests/deploy/test_iam_policies.py renders them and
# tests/e2e/test_iam_enforced.py runs the worker, produce, status and collect
# against moto with IAM enforcement as users holding them; every AWS call the
# test suite makes is recorded and checked against them, and every allowed
# action must be needed by some recorded call).
#
# worker (the Batch job role and the IRSA role):
#   ConsumeJobs        receive / delete / heartbeat the jobs queue; GetQueueAttributes
#                      reads its RedrivePolicy at start and the pending counts for
#                      --until-idle; GetQueueUrl when QWORKER_SOURCE names the queue
#                      instead of giving its URL.
#   DeadLetterToQueue  SendMessage to the DLQ; GetQueueUrl resolves the RedrivePolicy's
#                      target when QWORKER_SQS_DLQ_URL is unset; GetQueueAttributes
#                      checks a configured DLQ at start (pending: issue 18's startup
#                      check; the recording confirms it once merged).
#   CheckBucketListModel  HeadBucket at start (s3:ListBucket, no s3:prefix in that
#                      request, hence ...IfExists), the model listing under
#                      <model_prefix>/, and a 404 instead of a 403 for a GET of a key
#                      that does not exist (the batch's _cancel.json marker).
#   ReadModel          GetObject/HeadObject of the model files.
#   WriteAndReadResults  PutObject of results, _conflicts/ records and
#                      <results_prefix>/_dead_letters/ (issue 18's sink fallback,
#                      pending); GetObject for HeadObject on a 412 (redelivery: compare
#                      fingerprints) and for <batch>/_cancel.json (the cancel marker,
#                      looked up for each held batch).
#   UseKeyThroughS3AndSqs  SSE-KMS: GenerateDataKey for PutObject and SendMessage,
#                      Decrypt for GetObject, ReceiveMessage and SendMessage (SQS
#                      reuses cached data keys), only through S3 and SQS.

locals {
  policy_vars = {
    bucket_arn     = aws_s3_bucket.results.arn
    results_prefix = var.results_prefix
    model_prefix   = var.model_prefix
    jobs_queue_arn = aws_sqs_queue.jobs.arn
    dlq_arn        = aws_sqs_queue.dlq.arn
    kms_key_arn    = aws_kms_key.this.arn
    region         = var.region
  }
}

resource "aws_iam_policy" "worker" {
  name        = "${local.name}-worker"
  description = "qworker run: consume jobs, dead-letter, write and read results, read the model"
  # jsondecode/jsonencode: a malformed template fails the plan, not the apply.
  policy = jsonencode(jsondecode(templatefile("${path.module}/policies/worker.json.tftpl", local.policy_vars)))
}

# produce (and cancel): send jobs, write the batch's markers. SendJobs' GetQueueUrl
# is for `--to sqs://NAME`. ReadManifest: produce keeps an existing manifest of the
# same ids (sending a file again) and refuses one of other ids; MissingIsNotFound
# (s3:ListBucket) makes S3 answer that first GET 404 instead of 403. _failed.json
# (produce did not finish; pending until a test fails a produce into S3) and
# _cancel.json (qworker cancel, written once; never read back here) are the batch's
# lifecycle markers (docs/formats.md, "Batch lifecycle"). KMS: SendMessage needs GenerateDataKey and
# Decrypt (SQS reuses data keys), PutObject GenerateDataKey, GetObject Decrypt.
resource "aws_iam_policy" "producer" {
  name        = "${local.name}-producer"
  description = "qworker produce / cancel: send jobs to the queue, write batch markers"
  policy      = jsonencode(jsondecode(templatefile("${path.module}/policies/producer.json.tftpl", local.policy_vars)))
}

# status and collect: list and read a batch's results, markers and conflicts; collect
# records where it wrote the batch in <batch>/_collected.json (status shows them as
# output_file_id / error_file_id), hence PutObject on that one name and GenerateDataKey.
resource "aws_iam_policy" "collector" {
  name        = "${local.name}-collector"
  description = "qworker status / collect: list and read results"
  policy      = jsonencode(jsondecode(templatefile("${path.module}/policies/collector.json.tftpl", local.policy_vars)))
}

# --- AWS Batch: the job's role (the worker's identity) ---

locals {
  ecs_tasks_trust = jsonencode(jsondecode(templatefile("${path.module}/policies/ecs_tasks_trust.json.tftpl", {
    account_id = local.account_id
  })))
}

resource "aws_iam_role" "batch_job" {
  name               = "${local.name}-batch-job"
  assume_role_policy = local.ecs_tasks_trust
}

resource "aws_iam_role_policy_attachment" "batch_job" {
  role       = aws_iam_role.batch_job.name
  policy_arn = aws_iam_policy.worker.arn
}

# --- AWS Batch: the execution role (pull the image, write the job log) ---

resource "aws_iam_role" "batch_execution" {
  name               = "${local.name}-batch-execution"
  assume_role_policy = local.ecs_tasks_trust
}

resource "aws_iam_role_policy" "batch_execution" {
  name = "pull-image-write-log"
  role = aws_iam_role.batch_execution.id
  # ecr:GetAuthorizationToken has no resource-level permissions: "*" is the only form.
  #checkov:skip=CKV_AWS_356:ecr:GetAuthorizationToken has no resource-level permissions
  #checkov:skip=CKV_AWS_355:ecr:GetAuthorizationToken has no resource-level permissions
  policy = jsonencode(jsondecode(templatefile("${path.module}/policies/batch_execution.json.tftpl", {
    ecr_repository_arn = aws_ecr_repository.qworker.arn
    log_group_arn      = aws_cloudwatch_log_group.jobs.arn
    kms_key_arn        = aws_kms_key.this.arn
    region             = var.region
  })))
}

# --- AWS Batch: the EC2 instances' role (the ECS agent) ---

data "aws_iam_policy_document" "ec2_assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "batch_instance" {
  name               = "${local.name}-batch-instance"
  assume_role_policy = data.aws_iam_policy_document.ec2_assume.json
}

resource "aws_iam_role_policy_attachment" "batch_instance" {
  role       = aws_iam_role.batch_instance.name
  policy_arn = "arn:${local.partition}:iam::aws:policy/service-role/AmazonEC2ContainerServiceforEC2Role"
}

resource "aws_iam_instance_profile" "batch_instance" {
  name = "${local.name}-batch-instance"
  role = aws_iam_role.batch_instance.name
}

# --- EKS: the IRSA role for the qworker ServiceAccount (deploy/k8s) ---

locals {
  # arn:aws:iam::<account>:oidc-provider/<issuer host/path> -> <issuer host/path>
  oidc_issuer = element(split("oidc-provider/", var.eks_oidc_provider_arn), 1)
}

resource "aws_iam_role" "eks_worker" {
  count = var.eks_oidc_provider_arn == "" ? 0 : 1
  name  = "${local.name}-eks-worker"
  assume_role_policy = jsonencode(jsondecode(templatefile("${path.module}/policies/irsa_trust.json.tftpl", {
    oidc_provider_arn = var.eks_oidc_provider_arn
    oidc_issuer       = local.oidc_issuer
    namespace         = var.k8s_namespace
    service_account   = "qworker"
  })))
}

resource "aws_iam_role_policy_attachment" "eks_worker" {
  count      = var.eks_oidc_provider_arn == "" ? 0 : 1
  role       = aws_iam_role.eks_worker[0].name
  policy_arn = aws_iam_policy.worker.arn
}

# --- EKS: what KEDA's operator role needs to scale on the queue length ---

resource "aws_iam_policy" "keda_queue_reader" {
  name        = "${local.name}-keda-queue-reader"
  description = "KEDA aws-sqs-queue scaler: read the qworker jobs queue length"
  # The aws-sqs-queue scaler reads ApproximateNumberOfMessages (and ...NotVisible with
  # scaleOnInFlight) through GetQueueAttributes, nothing else.
  policy = jsonencode(jsondecode(templatefile("${path.module}/policies/keda_queue_reader.json.tftpl", local.policy_vars)))
}
