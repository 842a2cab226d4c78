# AWS Batch: spot GPU instances (price-capacity-optimized across the allowed
# types), one job queue, and a job definition that runs `qworker run
# --until-idle` against the SQS queue. Submit it as an array job of N children
# for N workers (README.md). A child whose host is reclaimed ("Host EC2 ...
# terminated") or that exits 69, 70 or 75 is retried; its unfinished jobs return to
# the queue anyway.

resource "aws_ecr_repository" "qworker" {
  name                 = var.project
  image_tag_mutability = "IMMUTABLE"
  image_scanning_configuration {
    scan_on_push = true
  }
  encryption_configuration {
    encryption_type = "KMS"
    kms_key         = aws_kms_key.this.arn
  }
}

resource "aws_ecr_lifecycle_policy" "qworker" {
  repository = aws_ecr_repository.qworker.name
  policy = jsonencode({
    rules = [{
      rulePriority = 1
      description  = "keep the last 20 images"
      selection = {
        tagStatus   = "any"
        countType   = "imageCountMoreThan"
        countNumber = 20
      }
      action = { type = "expire" }
    }]
  })
}

resource "aws_cloudwatch_log_group" "jobs" {
  name              = local.job_log_group
  retention_in_days = var.log_retention_days
  kms_key_id        = aws_kms_key.this.arn
}

resource "aws_launch_template" "batch" {
  name_prefix = "${local.name}-batch-"

  metadata_options {
    #checkov:skip=CKV_AWS_341:hop limit 2 lets the worker in its bridge-networked container read the IMDSv2 spot notice (spot/instance-action) and drain
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 2
  }

  block_device_mappings {
    device_name = "/dev/xvda"
    ebs {
      volume_size           = var.root_volume_gb
      volume_type           = "gp3"
      encrypted             = true
      delete_on_termination = true
    }
  }

  # The ECS agent's stop timeout is how long a stopped job gets between
  # SIGTERM and SIGKILL: the whole drain budget plus the process exit
  # (drain_budget(drain_seconds).grace_seconds = drain_seconds + 20).
  user_data = base64encode(<<-EOT
    MIME-Version: 1.0
    Content-Type: multipart/mixed; boundary="==QWORKER=="

    --==QWORKER==
    Content-Type: text/x-shellscript; charset="us-ascii"

    #!/bin/bash
    echo "ECS_CONTAINER_STOP_TIMEOUT=${var.drain_seconds + 20}s" >> /etc/ecs/ecs.config

    --==QWORKER==--
  EOT
  )

  tag_specifications {
    resource_type = "volume"
    tags          = local.tags
  }
}

resource "aws_batch_compute_environment" "gpu_spot" {
  compute_environment_name_prefix = "${local.name}-gpu-spot-"
  type                            = "MANAGED"
  # No service_role: Batch uses its service-linked role.

  compute_resources {
    type                = "SPOT"
    allocation_strategy = "SPOT_PRICE_CAPACITY_OPTIMIZED"
    # Never pay more than on-demand for a spot instance.
    bid_percentage     = 100
    instance_type      = var.batch_instance_types
    min_vcpus          = 0
    max_vcpus          = var.batch_max_vcpus
    instance_role      = aws_iam_instance_profile.batch_instance.arn
    subnets            = aws_subnet.private[*].id
    security_group_ids = [aws_security_group.workers.id]
    # Tags on the instances themselves (default_tags do not reach them).
    tags = local.tags

    # The ECS GPU AMI. Batch resolves the latest ECS_AL2023_NVIDIA AMI when the
    # compute environment is created and keeps it; set batch_ami_id to pin one
    # (deploy/README.md, "Pinned versions": how to read and roll the current one).
    ec2_configuration {
      image_type        = "ECS_AL2023_NVIDIA"
      image_id_override = var.batch_ami_id == "" ? null : var.batch_ami_id
    }

    launch_template {
      launch_template_id = aws_launch_template.batch.id
      version            = aws_launch_template.batch.latest_version
    }
  }

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_batch_job_queue" "gpu_spot" {
  name     = "${local.name}-gpu-spot"
  state    = "ENABLED"
  priority = 1

  compute_environment_order {
    order               = 1
    compute_environment = aws_batch_compute_environment.gpu_spot.arn
  }
}

resource "aws_batch_job_definition" "worker" {
  name                  = "${local.name}-worker"
  type                  = "container"
  platform_capabilities = ["EC2"]
  propagate_tags        = true

  # The worker's exit codes (docs/operations.md): 0 done, 1 configuration error,
  # 69 a source/sink/DLQ outage past its budget, 70 the engine failed, 75 drained
  # (SIGTERM or a spot notice) with work possibly left. Batch takes the first
  # matching condition (at most 5): 69, 70 and 75 and a lost host are retried on a
  # new attempt, up to `batch_retry_attempts` attempts in all (the first included);
  # everything else, 1 and any unknown code, ends the child at once instead of
  # burning GPU hours on a configuration that cannot work. 0 is SUCCEEDED and never
  # retried. tests/deploy/test_probes_and_retries.py replays every code 0-255.
  retry_strategy {
    attempts = var.batch_retry_attempts
    # Spot reclaim: the host went away under the job (no exit code).
    evaluate_on_exit {
      on_status_reason = "Host EC2*"
      action           = "RETRY"
    }
    evaluate_on_exit {
      on_exit_code = "69"
      action       = "RETRY"
    }
    evaluate_on_exit {
      on_exit_code = "70"
      action       = "RETRY"
    }
    evaluate_on_exit {
      on_exit_code = "75"
      action       = "RETRY"
    }
    evaluate_on_exit {
      on_reason = "*"
      action    = "EXIT"
    }
  }

  # A hard ceiling per attempt, whatever the queue holds.
  timeout {
    attempt_duration_seconds = var.batch_attempt_timeout_seconds
  }

  container_properties = jsonencode({
    image   = var.image
    command = ["--until-idle", tostring(var.until_idle_seconds)]
    user    = "10001:10001"

    jobRoleArn       = aws_iam_role.batch_job.arn
    executionRoleArn = aws_iam_role.batch_execution.arn

    resourceRequirements = [
      { type = "GPU", value = "1" },
      { type = "VCPU", value = tostring(var.job_vcpus) },
      { type = "MEMORY", value = tostring(var.job_memory_mib) },
    ]

    environment = [
      { name = "QWORKER_SOURCE", value = "sqs://${aws_sqs_queue.jobs.url}" },
      { name = "QWORKER_SQS_DLQ_URL", value = aws_sqs_queue.dlq.url },
      { name = "QWORKER_SQS_VISIBILITY_TIMEOUT", value = tostring(var.visibility_timeout_seconds) },
      { name = "QWORKER_SINK", value = local.sink_uri },
      { name = "QWORKER_MODEL", value = local.model_uri },
      { name = "QWORKER_AWS_REGION", value = var.region },
      { name = "QWORKER_DRAIN_SECONDS", value = tostring(var.drain_seconds) },
      { name = "QWORKER_GPU_MEMORY_UTILIZATION", value = tostring(var.gpu_memory_utilization) },
      { name = "QWORKER_MAX_NUM_SEQS", value = tostring(var.max_num_seqs) },
      { name = "QWORKER_LOG_FORMAT", value = "json" },
    ]

    readonlyRootFilesystem = true
    privileged             = false
    volumes = [
      { name = "cache" },
      { name = "tmp" },
    ]
    mountPoints = [
      { sourceVolume = "cache", containerPath = "/cache", readOnly = false },
      { sourceVolume = "tmp", containerPath = "/tmp", readOnly = false },
    ]
    linuxParameters = {
      initProcessEnabled = true
      sharedMemorySize   = 4096
    }

    logConfiguration = {
      logDriver = "awslogs"
      options = {
        "awslogs-group"         = aws_cloudwatch_log_group.jobs.name
        "awslogs-region"        = var.region
        "awslogs-stream-prefix" = "qworker"
      }
    }
  })
}
