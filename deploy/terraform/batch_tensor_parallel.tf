# AWS Batch, multi-GPU variant: one worker over var.tensor_parallel_size GPUs of
# one instance (tensor parallelism, docs/operations.md "Tensor parallelism"), for
# models one GPU cannot hold. Its own spot compute environment of 4- and 8-GPU
# types (a 2-GPU job shares an instance with others), its own queue, and a job
# definition that is batch.tf's worker with N GPUs, the CPUs and memory of N
# ranks and a /dev/shm sized for NCCL. Off unless var.tensor_parallel_size > 1.
#
#   aws batch submit-job --job-name nightly-70b --array-properties size=4 \
#     --job-queue "$(terraform output -raw batch_tp_job_queue)" \
#     --job-definition "$(terraform output -raw batch_tp_job_definition)"

variable "tensor_parallel_size" {
  description = "GPUs (ranks) per multi-GPU worker; 1 creates none of this file's resources."
  type        = number
  default     = 1
  validation {
    condition     = contains([1, 2, 4, 8], var.tensor_parallel_size)
    error_message = "tensor_parallel_size must be 1, 2, 4 or 8."
  }
}

variable "batch_tp_instance_types" {
  description = "Instance types with 4 or 8 GPUs for multi-GPU workers (a multiple of tensor_parallel_size)."
  type        = list(string)
  default     = ["p5.48xlarge", "p5e.48xlarge", "p5en.48xlarge", "p4de.24xlarge", "p4d.24xlarge", "g6e.12xlarge", "g6e.48xlarge"]
}

variable "batch_tp_max_vcpus" {
  description = "Ceiling of the multi-GPU compute environment (192 vCPUs = one p5.48xlarge)."
  type        = number
  default     = 384
}

variable "tp_model_name" {
  description = "Folder under model_prefix holding the model multi-GPU workers serve."
  type        = string
  default     = "llama-3.3-70b-instruct-fp8"
}

locals {
  tp_enabled = var.tensor_parallel_size > 1
  # Per rank: ~3 vCPUs and ~10 GiB of host memory, plus /dev/shm (8 GiB a rank:
  # NCCL's shared-memory buffers and the pinned step buffers).
  tp_vcpus      = 3 * var.tensor_parallel_size
  tp_shm_mib    = 8192 * var.tensor_parallel_size
  tp_memory_mib = 10240 * var.tensor_parallel_size + local.tp_shm_mib
  base_worker   = jsondecode(aws_batch_job_definition.worker.container_properties)
}

resource "aws_batch_compute_environment" "gpu_tp_spot" {
  count                           = local.tp_enabled ? 1 : 0
  compute_environment_name_prefix = "${local.name}-gpu-tp-spot-"
  type                            = "MANAGED"

  compute_resources {
    type                = "SPOT"
    allocation_strategy = "SPOT_PRICE_CAPACITY_OPTIMIZED"
    bid_percentage      = 100
    instance_type       = var.batch_tp_instance_types
    min_vcpus           = 0
    max_vcpus           = var.batch_tp_max_vcpus
    instance_role       = aws_iam_instance_profile.batch_instance.arn
    subnets             = aws_subnet.private[*].id
    security_group_ids  = [aws_security_group.workers.id]
    tags                = local.tags

    ec2_configuration {
      image_type = "ECS_AL2023_NVIDIA"
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

resource "aws_batch_job_queue" "gpu_tp_spot" {
  count    = local.tp_enabled ? 1 : 0
  name     = "${local.name}-gpu-tp-spot"
  state    = "ENABLED"
  priority = 1

  compute_environment_order {
    order               = 1
    compute_environment = aws_batch_compute_environment.gpu_tp_spot[0].arn
  }
}

resource "aws_batch_job_definition" "worker_tp" {
  count                 = local.tp_enabled ? 1 : 0
  name                  = "${local.name}-worker-tp${var.tensor_parallel_size}"
  type                  = "container"
  platform_capabilities = ["EC2"]
  propagate_tags        = true

  retry_strategy {
    attempts = var.batch_retry_attempts
    # Spot reclaim: the host went away under the job. Retry on a new host.
    evaluate_on_exit {
      on_status_reason = "Host EC2*"
      action           = "RETRY"
    }
    evaluate_on_exit {
      on_reason = "*"
      action    = "EXIT"
    }
  }

  timeout {
    attempt_duration_seconds = var.batch_attempt_timeout_seconds
  }

  # batch.tf's worker, with N GPUs and what N ranks need.
  container_properties = jsonencode(merge(local.base_worker, {
    resourceRequirements = [
      { type = "GPU", value = tostring(var.tensor_parallel_size) },
      { type = "VCPU", value = tostring(local.tp_vcpus) },
      { type = "MEMORY", value = tostring(local.tp_memory_mib) },
    ]
    environment = concat(
      [for e in local.base_worker.environment : e if e.name != "QWORKER_MODEL"],
      [
        { name = "QWORKER_MODEL", value = "s3://${aws_s3_bucket.results.bucket}/${var.model_prefix}/${var.tp_model_name}" },
        { name = "QWORKER_TENSOR_PARALLEL_SIZE", value = tostring(var.tensor_parallel_size) },
        # The step watchdog (exit 70) fires before the collective timeout.
        { name = "QWORKER_ENGINE_STEP_TIMEOUT", value = "300" },
        { name = "QWORKER_TENSOR_PARALLEL_TIMEOUT", value = "600" },
      ],
    )
    linuxParameters = merge(local.base_worker.linuxParameters, {
      sharedMemorySize = local.tp_shm_mib
    })
  }))
}

output "batch_tp_job_queue" {
  description = "Job queue of the multi-GPU workers (null with tensor_parallel_size = 1)."
  value       = local.tp_enabled ? aws_batch_job_queue.gpu_tp_spot[0].name : null
}

output "batch_tp_job_definition" {
  description = "Job definition of the multi-GPU worker (null with tensor_parallel_size = 1)."
  value       = local.tp_enabled ? aws_batch_job_definition.worker_tp[0].name : null
}
