# One customer-managed key for the bucket, the queues, the log groups and the
# alert topic. Services that write encrypted data on the account's behalf
# (CloudWatch Logs, CloudWatch alarms and Budgets publishing to SNS) are
# granted use of the key, each scoped to this account.

data "aws_iam_policy_document" "kms" {
  # In a key policy "*" means "this key", and the account-admin statement is
  # what keeps the key manageable; IAM policies then narrow who may use it.
  #checkov:skip=CKV_AWS_111:key policy; "*" is this key only
  #checkov:skip=CKV_AWS_356:key policy; "*" is this key only
  #checkov:skip=CKV_AWS_109:key policy; account root must administer the key or it becomes unmanageable
  statement {
    sid       = "AccountAdmin"
    actions   = ["kms:*"]
    resources = ["*"]
    principals {
      type        = "AWS"
      identifiers = ["arn:${local.partition}:iam::${local.account_id}:root"]
    }
  }

  statement {
    sid = "CloudWatchLogs"
    actions = [
      "kms:Encrypt*",
      "kms:Decrypt*",
      "kms:ReEncrypt*",
      "kms:GenerateDataKey*",
      "kms:Describe*",
    ]
    resources = ["*"]
    principals {
      type        = "Service"
      identifiers = ["logs.${var.region}.amazonaws.com"]
    }
    condition {
      test     = "ArnLike"
      variable = "kms:EncryptionContext:aws:logs:arn"
      values   = ["arn:${local.partition}:logs:${var.region}:${local.account_id}:log-group:*"]
    }
  }

  statement {
    sid       = "AlarmsAndBudgetsToSns"
    actions   = ["kms:Decrypt", "kms:GenerateDataKey*"]
    resources = ["*"]
    principals {
      type        = "Service"
      identifiers = ["cloudwatch.amazonaws.com", "budgets.amazonaws.com"]
    }
    condition {
      test     = "StringEquals"
      variable = "aws:SourceAccount"
      values   = [local.account_id]
    }
  }
}

resource "aws_kms_key" "this" {
  description             = "${local.name}: results bucket, job queues, logs, alerts"
  enable_key_rotation     = true
  deletion_window_in_days = 30
  policy                  = data.aws_iam_policy_document.kms.json
}

resource "aws_kms_alias" "this" {
  name          = "alias/${local.name}"
  target_key_id = aws_kms_key.this.key_id
}
