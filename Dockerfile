# syntax=docker/dockerfile:1
# qworker GPU image: `qworker run` on a CUDA 12 runtime, as a non-root user.
#
#   docker build -t qworker:0.1.0 .
#   docker run --gpus all -e QWORKER_SOURCE=sqs://jobs -e QWORKER_SINK=s3://bucket/results qworker:0.1.0
#
# Nothing secret is baked in: AWS credentials come from the task/pod role (IRSA,
# Batch job role), Kafka credentials from the environment at run time.
# torch 2.13.0 is the line the test suite runs on (Makefile); the cu128 build matches
# this CUDA 12.8 base and cupy-cuda12x (qworker[gpu]). Not built here (no access to
# the PyTorch index from the dev machines): if that index lacks 2.13.0+cu128, build
# with --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130 on a CUDA 13
# base and cupy-cuda13x (the GPU check machine runs torch 2.11+cu130).
# Ubuntu 24.04 ships Python 3.12 (qworker needs >= 3.11). Both stages use the same
# base so the venv's interpreter path matches.
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04 AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Ubuntu's python3 versions move with security updates; pinning them would break
# the build on every point release, so the base image tag is the pin.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/qworker
ENV PATH=/opt/qworker/bin:$PATH
# The CUDA torch wheel first, from its own index, so qworker's `torch>=2.4,<3`
# requirement is already met and pip does not pull another build.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
WORKDIR /src
COPY pyproject.toml README.md ./
# Kernel sources must ship inside the package (package data) to be found at run time.
COPY qworker ./qworker
# The package's own dependencies are bounded by pyproject.toml; pin them with a
# constraints file in your own build if you need bit-for-bit rebuilds.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[gpu]"

FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04
LABEL org.opencontainers.image.title="qworker" \
      org.opencontainers.image.description="GPU batch-inference worker: Kafka/SQS jobs to S3 results" \
      org.opencontainers.image.licenses="Apache-2.0"
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# python3 runs the venv; cuda-cudart-dev and cuda-nvrtc-dev give NVRTC the CUDA
# headers (cuda_fp16.h, cuda_bf16.h) the attention kernels include when cupy
# compiles them at run time. Versions follow the base image (see above).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
       cuda-cudart-dev-12-8 cuda-nvrtc-dev-12-8 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 qworker \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/qworker qworker
COPY --from=build /opt/qworker /opt/qworker
# Caches go under /cache so a read-only root filesystem only needs one writable
# volume (an emptyDir in deploy/k8s); cupy's kernel cache must be writable.
ENV PATH=/opt/qworker/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/cache/huggingface \
    CUPY_CACHE_DIR=/cache/cupy \
    TRITON_CACHE_DIR=/cache/triton \
    XDG_CACHE_HOME=/cache \
    QWORKER_METRICS_PORT=9400 \
    QWORKER_LOG_FORMAT=json
RUN mkdir -p /cache && chown 10001:10001 /cache
WORKDIR /home/qworker
USER 10001:10001
EXPOSE 9400
# The worker drains on SIGTERM (stop admitting, finish within QWORKER_DRAIN_SECONDS,
# commit, exit 0); give it `docker stop -t 120` or the orchestrator's grace period.
STOPSIGNAL SIGTERM
# Model loading can take minutes on first start: a long start period. urllib
# raises on any non-2xx answer, so the exit code is the health.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('QWORKER_METRICS_PORT', '9400') + '/healthz', timeout=4)"]
ENTRYPOINT ["qworker", "run"]
