# qworker on AWS: private VPC, results bucket, jobs queue + DLQ, least-privilege
# roles, an AWS Batch spot GPU fleet, and cost guardrails. See README.md here
# for the apply steps and ../README.md for the whole walk-through.

provider "aws" {
  region = var.region
  # Cost-allocation tags on every resource this module creates (activated for
  # billing in cost.tf), so Cost Explorer and the budget can filter on them.
  default_tags {
    tags = local.tags
  }
}

data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}

locals {
  name       = "${var.project}-${var.env}"
  account_id = data.aws_caller_identity.current.account_id
  partition  = data.aws_partition.current.partition
  tags = merge(var.extra_tags, {
    project = var.project
    env     = var.env
  })
  azs           = var.availability_zones
  results_arn   = "${aws_s3_bucket.results.arn}/${var.results_prefix}/*"
  models_arn    = "${aws_s3_bucket.results.arn}/${var.model_prefix}/*"
  sink_uri      = "s3://${aws_s3_bucket.results.bucket}/${var.results_prefix}"
  model_uri     = "s3://${aws_s3_bucket.results.bucket}/${var.model_prefix}/${var.model_name}"
  job_log_group = "/aws/batch/${local.name}"
}
