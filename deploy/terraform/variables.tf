variable "project" {
  description = "Cost-allocation tag `project` and the name prefix of every resource."
  type        = string
  default     = "qworker"
}

variable "env" {
  description = "Cost-allocation tag `env` (dev, staging, prod)."
  type        = string
  default     = "dev"
}

variable "extra_tags" {
  description = "More tags for every resource (e.g. team, cost-center)."
  type        = map(string)
  default     = {}
}

variable "region" {
  description = "AWS region for everything."
  type        = string
  default     = "us-east-1"
}

# --- network ---

variable "vpc_cidr" {
  description = "CIDR of the private VPC (split into /20 per AZ for a /16)."
  type        = string
  default     = "10.42.0.0/16"
}

variable "availability_zones" {
  description = "Zones that get a private subnet (in var.region); more zones, more spot pools. Listed, not looked up, so the set never changes under a plan."
  type        = list(string)
  default     = ["us-east-1a", "us-east-1b", "us-east-1c"]
}

variable "interface_endpoints" {
  description = "Interface VPC endpoints the private subnets need (S3 is a gateway endpoint)."
  type        = list(string)
  default     = ["sqs", "sts", "logs", "monitoring", "ecr.api", "ecr.dkr", "ecs", "ecs-agent", "ecs-telemetry"]
}

# --- storage and queues ---

variable "results_prefix" {
  description = "Key prefix (no slashes at the ends) the worker may write results under."
  type        = string
  default     = "results"
}

variable "model_prefix" {
  description = "Key prefix (no slashes at the ends) the worker may read model files from."
  type        = string
  default     = "models"
}

variable "model_name" {
  description = "Folder under model_prefix holding the model (HF dir or *.gguf); QWORKER_MODEL points there."
  type        = string
  default     = "smollm2"
}

variable "results_retention_days" {
  description = "Days result objects are kept; collect them before then."
  type        = number
  default     = 30
}

variable "visibility_timeout_seconds" {
  description = "SQS visibility timeout; QWORKER_SQS_VISIBILITY_TIMEOUT must be the same."
  type        = number
  default     = 300
}

variable "max_receive_count" {
  description = "Deliveries of one message before SQS moves it to the DLQ."
  type        = number
  default     = 5
}

variable "log_retention_days" {
  description = "Days the Batch job log is kept."
  type        = number
  default     = 365
}

# --- AWS Batch ---

variable "image" {
  description = "Worker image, pinned by digest: <account>.dkr.ecr.<region>.amazonaws.com/qworker@sha256:..."
  type        = string
}

variable "batch_instance_types" {
  description = "Spot instance types (or families) Batch may launch; more types, fewer interruptions."
  type        = list(string)
  default     = ["g5.xlarge", "g5.2xlarge", "g6.xlarge", "g6.2xlarge", "g6e.xlarge"]
}

variable "batch_max_vcpus" {
  description = "Cost ceiling of the compute environment in vCPUs (g5.xlarge = 4 vCPUs, 1 GPU)."
  type        = number
  default     = 64
}

variable "job_vcpus" {
  description = "vCPUs per worker job."
  type        = number
  default     = 3
}

variable "job_memory_mib" {
  description = "Memory per worker job in MiB (leave room for the ECS agent)."
  type        = number
  default     = 12288
}

variable "root_volume_gb" {
  description = "Root EBS volume of Batch instances: image layers, model and cache."
  type        = number
  default     = 200
}

variable "batch_retry_attempts" {
  description = "Attempts per array child, the first included (1-10): a lost host and exits 69, 70, 75 start another; 1 and unknown codes do not."
  type        = number
  default     = 5
  validation {
    condition     = var.batch_retry_attempts >= 1 && var.batch_retry_attempts <= 10
    error_message = "AWS Batch allows 1 to 10 attempts."
  }
}

variable "batch_ami_id" {
  description = "Pin the Batch instances' AMI (an ECS GPU AMI id, ami-...); empty: the ECS_AL2023_NVIDIA AMI current when the compute environment is created."
  type        = string
  default     = ""
  validation {
    condition     = var.batch_ami_id == "" || can(regex("^ami-[0-9a-f]+$", var.batch_ami_id))
    error_message = "batch_ami_id must be empty or an AMI id (ami-...)."
  }
}

variable "batch_attempt_timeout_seconds" {
  description = "Hard limit on one attempt."
  type        = number
  default     = 14400
}

variable "until_idle_seconds" {
  description = "A worker exits 0 after this long without a job (qworker run --until-idle)."
  type        = number
  default     = 300
}

variable "drain_seconds" {
  description = "QWORKER_DRAIN_SECONDS; the ECS stop timeout is this + 20 s (the drain budget)."
  type        = number
  default     = 90
}

variable "gpu_memory_utilization" {
  description = "QWORKER_GPU_MEMORY_UTILIZATION (README.md, Sizing)."
  type        = number
  default     = 0.9
}

variable "max_num_seqs" {
  description = "QWORKER_MAX_NUM_SEQS (README.md, Sizing)."
  type        = number
  default     = 256
}

# --- EKS ---

variable "eks_oidc_provider_arn" {
  description = "The EKS cluster's IAM OIDC provider ARN; empty to skip the IRSA role."
  type        = string
  default     = ""
}

variable "k8s_namespace" {
  description = "Namespace of the qworker ServiceAccount (deploy/k8s)."
  type        = string
  default     = "qworker"
}

# --- cost guardrails ---

variable "monthly_budget_usd" {
  description = "Monthly budget for everything tagged project=<project>; alerts at 80% actual and 100% forecast."
  type        = number
  default     = 1000
}

variable "alert_emails" {
  description = "E-mail addresses for budget and alarm notifications."
  type        = list(string)
  default     = []
}

variable "activate_cost_allocation_tags" {
  description = "Activate project/env as cost-allocation tags (true once the tags show in billing)."
  type        = bool
  default     = false
}

variable "tokens_metric_namespace" {
  description = "CloudWatch namespace of the generated-tokens metric."
  type        = string
  default     = "qworker"
}

variable "tokens_metric_name" {
  description = "CloudWatch name of the generated-tokens metric."
  type        = string
  default     = "generation_tokens"
}

variable "max_generated_tokens_per_hour" {
  description = "Alarm when the fleet generates more tokens than this in one hour."
  type        = number
  default     = 500000000
}

variable "max_job_age_seconds" {
  description = "Alarm when the oldest queued job is older than this."
  type        = number
  default     = 3600
}
