# Cost guardrails: cost-allocation tags, a monthly budget, and alarms that
# catch a runaway fleet before the bill does. All alerts go to one encrypted
# SNS topic (plus e-mail subscriptions from var.alert_emails).

resource "aws_sns_topic" "alerts" {
  name              = "${local.name}-alerts"
  kms_master_key_id = aws_kms_key.this.arn
}

data "aws_iam_policy_document" "alerts" {
  statement {
    sid       = "BudgetsAndAlarmsPublish"
    actions   = ["sns:Publish"]
    resources = [aws_sns_topic.alerts.arn]
    principals {
      type        = "Service"
      identifiers = ["budgets.amazonaws.com", "cloudwatch.amazonaws.com"]
    }
    condition {
      test     = "StringEquals"
      variable = "aws:SourceAccount"
      values   = [local.account_id]
    }
  }
}

resource "aws_sns_topic_policy" "alerts" {
  arn    = aws_sns_topic.alerts.arn
  policy = data.aws_iam_policy_document.alerts.json
}

resource "aws_sns_topic_subscription" "email" {
  for_each  = toset(var.alert_emails)
  topic_arn = aws_sns_topic.alerts.arn
  protocol  = "email"
  endpoint  = each.value
}

# Activate `project` and `env` as cost-allocation tags. AWS only accepts a tag
# key once it has appeared in billing data (up to 24 h after the first tagged
# resource): apply with activate_cost_allocation_tags = false first, then true.
resource "aws_ce_cost_allocation_tag" "this" {
  for_each = var.activate_cost_allocation_tags ? toset(["project", "env"]) : toset([])
  tag_key  = each.value
  status   = "Active"
}

resource "aws_budgets_budget" "monthly" {
  name         = "${local.name}-monthly"
  budget_type  = "COST"
  limit_amount = format("%.2f", var.monthly_budget_usd)
  limit_unit   = "USD"
  time_unit    = "MONTHLY"

  # Only what carries project=<project>: the fleet, its bucket, queues, logs.
  cost_filter {
    name   = "TagKeyValue"
    values = [join("$", ["user:project", var.project])]
  }

  notification {
    comparison_operator        = "GREATER_THAN"
    threshold                  = 80
    threshold_type             = "PERCENTAGE"
    notification_type          = "ACTUAL"
    subscriber_email_addresses = var.alert_emails
    subscriber_sns_topic_arns  = [aws_sns_topic.alerts.arn]
  }

  notification {
    comparison_operator        = "GREATER_THAN"
    threshold                  = 100
    threshold_type             = "PERCENTAGE"
    notification_type          = "FORECASTED"
    subscriber_email_addresses = var.alert_emails
    subscriber_sns_topic_arns  = [aws_sns_topic.alerts.arn]
  }
}

# Generated tokens as a CloudWatch metric. On AWS Batch: a metric filter on the
# job log group turns each completed job's JSON log line (field
# `completion_tokens`) into the metric. On EKS: the CloudWatch agent's
# Prometheus scrape publishes qworker_generation_tokens_total instead; point
# var.tokens_metric_namespace / tokens_metric_name at it (README.md).
resource "aws_cloudwatch_log_metric_filter" "generated_tokens" {
  name           = "${local.name}-generated-tokens"
  log_group_name = aws_cloudwatch_log_group.jobs.name
  pattern        = "{ $.completion_tokens > 0 }"

  metric_transformation {
    namespace = var.tokens_metric_namespace
    name      = var.tokens_metric_name
    value     = "$.completion_tokens"
    unit      = "Count"
  }
}

# A spike: generated tokens per 5 minutes above the band CloudWatch learned
# for this metric (anomaly detection, 3 standard deviations), 3 periods running.
resource "aws_cloudwatch_metric_alarm" "tokens_spike" {
  alarm_name          = "${local.name}-generated-tokens-spike"
  alarm_description   = "Generated tokens far above their usual level: a runaway producer or max_tokens misuse drives GPU hours."
  comparison_operator = "GreaterThanUpperThreshold"
  evaluation_periods  = 3
  threshold_metric_id = "band"
  treat_missing_data  = "notBreaching"
  alarm_actions       = [aws_sns_topic.alerts.arn]

  metric_query {
    id          = "band"
    expression  = "ANOMALY_DETECTION_BAND(tokens, 3)"
    label       = "expected generated tokens"
    return_data = true
  }

  metric_query {
    id          = "tokens"
    return_data = true
    metric {
      namespace   = var.tokens_metric_namespace
      metric_name = var.tokens_metric_name
      period      = 300
      stat        = "Sum"
    }
  }
}

# A hard ceiling: more tokens in an hour than the budget was sized for.
resource "aws_cloudwatch_metric_alarm" "tokens_ceiling" {
  alarm_name          = "${local.name}-generated-tokens-ceiling"
  alarm_description   = "More generated tokens in one hour than var.max_generated_tokens_per_hour."
  namespace           = var.tokens_metric_namespace
  metric_name         = var.tokens_metric_name
  statistic           = "Sum"
  period              = 3600
  evaluation_periods  = 1
  comparison_operator = "GreaterThanThreshold"
  threshold           = var.max_generated_tokens_per_hour
  treat_missing_data  = "notBreaching"
  alarm_actions       = [aws_sns_topic.alerts.arn]
}

# Jobs landing in the DLQ: poison messages or a worker crash loop.
resource "aws_cloudwatch_metric_alarm" "dlq_not_empty" {
  alarm_name          = "${local.name}-dlq-not-empty"
  alarm_description   = "Messages in the qworker dead-letter queue."
  namespace           = "AWS/SQS"
  metric_name         = "ApproximateNumberOfMessagesVisible"
  dimensions          = { QueueName = aws_sqs_queue.dlq.name }
  statistic           = "Maximum"
  period              = 300
  evaluation_periods  = 1
  comparison_operator = "GreaterThanThreshold"
  threshold           = 0
  treat_missing_data  = "notBreaching"
  alarm_actions       = [aws_sns_topic.alerts.arn]
}

# Jobs waiting too long: no worker consumes (fleet at zero, crash loop, or the
# compute environment cannot get spot capacity). Idle GPUs cost; so do stuck jobs.
resource "aws_cloudwatch_metric_alarm" "queue_stalled" {
  alarm_name          = "${local.name}-jobs-stalled"
  alarm_description   = "The oldest job in the queue is older than var.max_job_age_seconds."
  namespace           = "AWS/SQS"
  metric_name         = "ApproximateAgeOfOldestMessage"
  dimensions          = { QueueName = aws_sqs_queue.jobs.name }
  statistic           = "Maximum"
  period              = 300
  evaluation_periods  = 2
  comparison_operator = "GreaterThanThreshold"
  threshold           = var.max_job_age_seconds
  treat_missing_data  = "notBreaching"
  alarm_actions       = [aws_sns_topic.alerts.arn]
}
