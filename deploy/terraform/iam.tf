# Least privilege for the worker: consume the jobs queue, dead-letter to the
# DLQ, write only <results_prefix>/*, read only <model_prefix>/*, and use the
# KMS key only through S3 and SQS. One policy, attached to the Batch job role
# and (when an EKS OIDC provider is given) to the IRSA role.

data "aws_iam_policy_document" "worker" {
  statement {
    sid = "ConsumeJobs"
    actions = [
      "sqs:ReceiveMessage",
      "sqs:DeleteMessage",
      "sqs:ChangeMessageVisibility",
      "sqs:GetQueueAttributes",
      "sqs:GetQueueUrl",
    ]
    resources = [aws_sqs_queue.jobs.arn]
  }

  statement {
    sid       = "DeadLetter"
    actions   = ["sqs:SendMessage", "sqs:GetQueueUrl", "sqs:GetQueueAttributes"]
    resources = [aws_sqs_queue.dlq.arn]
  }

  statement {
    sid       = "WriteResults"
    actions   = ["s3:PutObject"]
    resources = [local.results_arn]
  }

  statement {
    sid       = "ReadModel"
    actions   = ["s3:GetObject"]
    resources = [local.models_arn]
  }

  statement {
    sid       = "ListModelPrefix"
    actions   = ["s3:ListBucket"]
    resources = [aws_s3_bucket.results.arn]
    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = ["${var.model_prefix}/*"]
    }
  }

  statement {
    sid       = "UseKeyThroughS3AndSqs"
    actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
    resources = [aws_kms_key.this.arn]
    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["s3.${var.region}.amazonaws.com", "sqs.${var.region}.amazonaws.com"]
    }
  }
}

resource "aws_iam_policy" "worker" {
  name        = "${local.name}-worker"
  description = "qworker: consume jobs, write results, read the model"
  policy      = data.aws_iam_policy_document.worker.json
}

# --- AWS Batch: the job's role (the worker's identity) ---

data "aws_iam_policy_document" "ecs_tasks_assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ecs-tasks.amazonaws.com"]
    }
    condition {
      test     = "StringEquals"
      variable = "aws:SourceAccount"
      values   = [local.account_id]
    }
  }
}

resource "aws_iam_role" "batch_job" {
  name               = "${local.name}-batch-job"
  assume_role_policy = data.aws_iam_policy_document.ecs_tasks_assume.json
}

resource "aws_iam_role_policy_attachment" "batch_job" {
  role       = aws_iam_role.batch_job.name
  policy_arn = aws_iam_policy.worker.arn
}

# --- AWS Batch: the execution role (pull the image, write the job log) ---

data "aws_iam_policy_document" "batch_execution" {
  statement {
    sid = "PullImage"
    actions = [
      "ecr:BatchGetImage",
      "ecr:GetDownloadUrlForLayer",
      "ecr:BatchCheckLayerAvailability",
    ]
    resources = [aws_ecr_repository.qworker.arn]
  }

  statement {
    #checkov:skip=CKV_AWS_356:ecr:GetAuthorizationToken has no resource-level permissions
    sid       = "EcrLogin"
    actions   = ["ecr:GetAuthorizationToken"]
    resources = ["*"]
  }

  statement {
    sid       = "DecryptImageLayers"
    actions   = ["kms:Decrypt"]
    resources = [aws_kms_key.this.arn]
    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["ecr.${var.region}.amazonaws.com"]
    }
  }

  statement {
    sid       = "WriteJobLog"
    actions   = ["logs:CreateLogStream", "logs:PutLogEvents"]
    resources = ["${aws_cloudwatch_log_group.jobs.arn}:*"]
  }
}

resource "aws_iam_role" "batch_execution" {
  name               = "${local.name}-batch-execution"
  assume_role_policy = data.aws_iam_policy_document.ecs_tasks_assume.json
}

resource "aws_iam_role_policy" "batch_execution" {
  name   = "pull-image-write-log"
  role   = aws_iam_role.batch_execution.id
  policy = data.aws_iam_policy_document.batch_execution.json
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

data "aws_iam_policy_document" "irsa_assume" {
  count = var.eks_oidc_provider_arn == "" ? 0 : 1
  statement {
    actions = ["sts:AssumeRoleWithWebIdentity"]
    principals {
      type        = "Federated"
      identifiers = [var.eks_oidc_provider_arn]
    }
    condition {
      test     = "StringEquals"
      variable = "${local.oidc_issuer}:sub"
      values   = ["system:serviceaccount:${var.k8s_namespace}:qworker"]
    }
    condition {
      test     = "StringEquals"
      variable = "${local.oidc_issuer}:aud"
      values   = ["sts.amazonaws.com"]
    }
  }
}

locals {
  # arn:aws:iam::<account>:oidc-provider/<issuer host/path> -> <issuer host/path>
  oidc_issuer = element(split("oidc-provider/", var.eks_oidc_provider_arn), 1)
}

resource "aws_iam_role" "eks_worker" {
  count              = var.eks_oidc_provider_arn == "" ? 0 : 1
  name               = "${local.name}-eks-worker"
  assume_role_policy = data.aws_iam_policy_document.irsa_assume[0].json
}

resource "aws_iam_role_policy_attachment" "eks_worker" {
  count      = var.eks_oidc_provider_arn == "" ? 0 : 1
  role       = aws_iam_role.eks_worker[0].name
  policy_arn = aws_iam_policy.worker.arn
}

# --- EKS: what KEDA's operator role needs to scale on the queue length ---

data "aws_iam_policy_document" "keda_queue_reader" {
  statement {
    actions   = ["sqs:GetQueueAttributes"]
    resources = [aws_sqs_queue.jobs.arn]
  }
}

resource "aws_iam_policy" "keda_queue_reader" {
  name        = "${local.name}-keda-queue-reader"
  description = "KEDA aws-sqs-queue scaler: read the qworker jobs queue length"
  policy      = data.aws_iam_policy_document.keda_queue_reader.json
}
