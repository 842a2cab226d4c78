# The jobs queue and its dead-letter queue. A message received
# var.max_receive_count times without being deleted (a worker crashed or was
# reclaimed each time) moves to the DLQ; so do messages the worker itself
# dead-letters (not a JSON object).

resource "aws_sqs_queue" "dlq" {
  name                              = "${local.name}-jobs-dlq"
  message_retention_seconds         = 1209600
  kms_master_key_id                 = aws_kms_key.this.arn
  kms_data_key_reuse_period_seconds = 3600
}

resource "aws_sqs_queue" "jobs" {
  name = "${local.name}-jobs"
  # Must equal QWORKER_SQS_VISIBILITY_TIMEOUT: the worker heartbeats long jobs
  # and sets visibility 0 on the jobs it abandons at drain.
  visibility_timeout_seconds        = var.visibility_timeout_seconds
  message_retention_seconds         = 345600
  receive_wait_time_seconds         = 20
  max_message_size                  = 262144
  kms_master_key_id                 = aws_kms_key.this.arn
  kms_data_key_reuse_period_seconds = 3600
  redrive_policy = jsonencode({
    deadLetterTargetArn = aws_sqs_queue.dlq.arn
    maxReceiveCount     = var.max_receive_count
  })
}

resource "aws_sqs_queue_redrive_allow_policy" "dlq" {
  queue_url = aws_sqs_queue.dlq.id
  redrive_allow_policy = jsonencode({
    redrivePermission = "byQueue"
    sourceQueueArns   = [aws_sqs_queue.jobs.arn]
  })
}
