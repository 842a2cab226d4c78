# syntax=docker/dockerfile:1
# qworker GPU image: `qworker run` on a CUDA 13.0 runtime, as a non-root user.
#
#   docker build -t qworker:0.1.0 .
#   docker run --gpus all -e QWORKER_SOURCE=sqs://jobs -e QWORKER_SINK=s3://bucket/results qworker:0.1.0
#
# Nothing secret is baked in: AWS credentials come from the task/pod role (IRSA,
# Batch job role), Kafka credentials from the environment at run time.
#
# Pins (tests/deploy/test_image.py holds them to pyproject.toml and the Makefile; how to
# move them: deploy/README.md, "Pinned versions"):
# - the base image by digest: nvidia/cuda 13.0.2 runtime on Ubuntu 24.04 (Python 3.12);
#   it needs an NVIDIA driver >= 580 on the host;
# - torch ${TORCH_VERSION} (the line the test suite runs on, Makefile) from the PyTorch
#   index's cu130 build, matching the base's CUDA 13.0;
# - cupy for CUDA 13 (qworker[gpu]'s cupy is the CUDA 12 build; the image's CUDA is 13);
# - dumb-init as PID 1.
# For hosts with an older driver (CUDA 12.8, driver >= 570): the 12.8.1 base, cu128 and
# cupy-cuda12x, e.g. --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# --build-arg CUPY=cupy-cuda12x==14.2.0 (and edit both FROM lines).
FROM nvidia/cuda:13.0.2-runtime-ubuntu24.04@sha256:6a0e31b59e70890446f2c17356d6efc0d54260090a8c63d6ca7c2ad049db95d2 AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ARG CUPY=cupy-cuda13x==14.2.0
ARG DUMB_INIT=dumb-init==1.2.5.post1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Ubuntu's python3 versions move with security updates; pinning them would break
# the build on every point release, so the base image digest is the pin.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/qworker/venv
ENV PATH=/opt/qworker/venv/bin:$PATH
# The CUDA torch wheel first, from its own index, so qworker's `torch>=2.4,<3`
# requirement is already met and pip does not pull another build.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
# The source tree keeps its layout: qworker finds the CUDA kernels in ../cuda next to
# the package (qworker/attention/cuda_kernels.py), so it is installed in place (-e).
WORKDIR /opt/qworker/src
COPY pyproject.toml README.md ./
COPY cuda ./cuda
COPY qworker ./qworker
COPY deploy/docker/entrypoint.sh /opt/qworker/entrypoint.sh
# The package's own dependencies are bounded by pyproject.toml; pin them with a
# constraints file in your own build if you need bit-for-bit rebuilds.
RUN pip install --no-cache-dir -e . "${CUPY}" "${DUMB_INIT}"

FROM nvidia/cuda:13.0.2-runtime-ubuntu24.04@sha256:6a0e31b59e70890446f2c17356d6efc0d54260090a8c63d6ca7c2ad049db95d2
LABEL org.opencontainers.image.title="qworker" \
      org.opencontainers.image.description="GPU batch-inference worker: Kafka/SQS jobs to S3 results" \
      org.opencontainers.image.licenses="Apache-2.0"
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# python3 runs the venv (same path as in the build stage: the venv and the editable
# install refer to it). Versions follow the base image (see above).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 qworker \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/qworker qworker
COPY --from=build /opt/qworker /opt/qworker
# Caches go under /cache so a read-only root filesystem only needs one writable
# volume (an emptyDir in deploy/k8s); cupy's kernel cache must be writable.
ENV PATH=/opt/qworker/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
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
# SIGTERM starts a drain (stop admitting, finish within QWORKER_DRAIN_SECONDS, commit)
# and the exit code says what is left: 0 nothing, 75 work possibly left
# (docs/operations.md); give it `docker stop -t 120` or the orchestrator's grace period.
STOPSIGNAL SIGTERM
# /healthz answers from the start and fails while an outage or an engine hang lasts
# (the worker ends those itself after its 300 s budgets); urllib raises on any
# non-2xx answer, so the exit code is the health.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=14 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('QWORKER_METRICS_PORT', '9400') + '/healthz', timeout=4)"]
# dumb-init is PID 1 (signals forwarded, zombies reaped); the script execs qworker, so
# exit codes pass through unchanged. Arguments starting with "-" go to `qworker run`.
ENTRYPOINT ["dumb-init", "--", "/opt/qworker/entrypoint.sh"]
CMD ["run"]
