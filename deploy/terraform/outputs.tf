output "results_bucket" {
  description = "Bucket for results (and the model under model_prefix)."
  value       = aws_s3_bucket.results.bucket
}

output "sink_uri" {
  description = "QWORKER_SINK for workers."
  value       = local.sink_uri
}

output "model_uri" {
  description = "QWORKER_MODEL for workers; upload the model here."
  value       = local.model_uri
}

output "jobs_queue_url" {
  description = "Jobs queue; QWORKER_SOURCE is sqs://<this>."
  value       = aws_sqs_queue.jobs.url
}

output "dlq_url" {
  description = "Dead-letter queue; QWORKER_SQS_DLQ_URL."
  value       = aws_sqs_queue.dlq.url
}

output "ecr_repository_url" {
  description = "Push the worker image here."
  value       = aws_ecr_repository.qworker.repository_url
}

output "batch_job_queue" {
  description = "AWS Batch job queue for `aws batch submit-job`."
  value       = aws_batch_job_queue.gpu_spot.name
}

output "batch_job_definition" {
  description = "AWS Batch job definition (name:revision)."
  value       = "${aws_batch_job_definition.worker.name}:${aws_batch_job_definition.worker.revision}"
}

output "eks_worker_role_arn" {
  description = "IRSA role for the qworker ServiceAccount (empty without eks_oidc_provider_arn)."
  value       = one(aws_iam_role.eks_worker[*].arn)
}

output "keda_queue_reader_policy_arn" {
  description = "Attach to the KEDA operator's IRSA role for the SQS scaler."
  value       = aws_iam_policy.keda_queue_reader.arn
}

output "producer_policy_arn" {
  description = "Attach to whoever runs qworker produce / cancel against this deployment."
  value       = aws_iam_policy.producer.arn
}

output "collector_policy_arn" {
  description = "Attach to whoever runs qworker status / collect against this deployment."
  value       = aws_iam_policy.collector.arn
}

output "kms_key_arn" {
  description = "Key encrypting the bucket, queues, logs and alerts; producers need kms:GenerateDataKey on it."
  value       = aws_kms_key.this.arn
}

output "alerts_topic_arn" {
  description = "SNS topic receiving budget and alarm notifications."
  value       = aws_sns_topic.alerts.arn
}
