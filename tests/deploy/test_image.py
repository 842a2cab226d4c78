"""The Dockerfile: pins that agree with pyproject.toml and the Makefile, a build context
holding everything the package needs at run time, and an entrypoint whose exit codes
and signals pass through dumb-init unchanged (run here, outside a container, with a
stand-in ``qworker`` that exits as told).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
ENTRYPOINT = ROOT / "deploy" / "docker" / "entrypoint.sh"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _arg(name: str) -> str:
    (value,) = re.findall(rf"^ARG {name}=(\S+)$", DOCKERFILE, re.MULTILINE)
    return value


def _requirement(name: str, group: list[str]) -> Requirement:
    (req,) = [Requirement(r) for r in group if Requirement(r).name == name]
    return req


def test_both_stages_use_one_base_pinned_by_digest_with_a_matching_cuda_torch() -> None:
    froms = re.findall(r"^FROM (\S+)", DOCKERFILE, re.MULTILINE)
    assert len(froms) == 2 and froms[0] == froms[1]  # the venv's interpreter path matches
    match = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-runtime-ubuntu(\d+\.\d+)"
                         r"@sha256:[0-9a-f]{64}", froms[0])
    assert match, froms[0]
    major, minor, ubuntu = match.groups()
    # the torch wheel is the build for the base's CUDA
    assert _arg("TORCH_INDEX_URL") == f"https://download.pytorch.org/whl/cu{major}{minor}"
    # and cupy the package for that CUDA major
    cupy = Requirement(_arg("CUPY"))
    assert cupy.name == f"cupy-cuda{major}x"
    # Ubuntu's python3 (24.04: 3.12) meets requires-python
    python = {"22.04": "3.10", "24.04": "3.12"}[ubuntu]
    assert python in SpecifierSet(PROJECT["requires-python"])


def test_image_pins_agree_with_pyproject_and_the_makefile() -> None:
    torch = _arg("TORCH_VERSION")
    (tested,) = re.findall(r"pip install -q torch==(\S+)", (ROOT / "Makefile").read_text())
    assert torch == tested  # the line the suite runs on
    assert torch in _requirement("torch", PROJECT["dependencies"]).specifier
    cupy = Requirement(_arg("CUPY"))
    (version,) = [s.version for s in cupy.specifier]
    gpu = PROJECT["optional-dependencies"]["gpu"]
    (cupy_range,) = [Requirement(r).specifier for r in gpu if Requirement(r).name.startswith(
        "cupy-cuda")]
    assert version in cupy_range
    dumb = Requirement(_arg("DUMB_INIT"))
    assert dumb == _requirement("dumb-init", PROJECT["optional-dependencies"]["dev"])
    # qworker itself installs from pyproject.toml (its bounds), after the torch wheel
    install = DOCKERFILE.index('pip install --no-cache-dir -e . "${CUPY}" "${DUMB_INIT}"')
    assert DOCKERFILE.index('"torch==${TORCH_VERSION}" --index-url') < install


def _ignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore's rule: the last matching pattern wins, ``!`` re-includes."""
    import fnmatch

    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        bare = pattern.lstrip("!").rstrip("/")
        regex = fnmatch.translate(bare.replace("**/", "*"))
        if re.match(regex, path) or path.startswith(bare + "/"):
            ignored = not negate
    return ignored


def test_the_build_context_holds_what_the_package_reads_at_run_time() -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    sources = [s for line in re.findall(r"^COPY (?!--from)(.+)$", DOCKERFILE, re.MULTILINE)
               for s in line.split()[:-1]]
    for source in sources:
        assert (ROOT / source).exists(), source
        assert not _ignored(source, patterns), f"{source} is excluded by .dockerignore"
    # the CUDA kernels are read from ../cuda beside the package (cuda_kernels.CUDA_DIR)
    from qworker.attention.cuda_kernels import CUDA_DIR

    assert CUDA_DIR == ROOT / "cuda" and "cuda" in sources
    assert "-e ." in DOCKERFILE  # installed in place, so that path still holds
    assert re.search(r'^ENTRYPOINT \["dumb-init", "--", "/opt/qworker/entrypoint.sh"\]$',
                     DOCKERFILE, re.MULTILINE)


FAKE_QWORKER = """#!{python}
import os, signal, sys, time
with open(os.environ["FAKE_ARGV"], "w") as f:
    f.write(" ".join(sys.argv[1:]))
if os.environ.get("FAKE_WAIT"):
    def drained(signum, frame):
        open(os.environ["FAKE_ARGV"] + ".signal", "w").write(str(signum))
        sys.exit(75)
    signal.signal(signal.SIGTERM, drained)
    open(os.environ["FAKE_ARGV"] + ".ready", "w").close()
    time.sleep(60)
    sys.exit(3)
sys.exit(int(os.environ["FAKE_EXIT"]))
"""


def _dumb_init() -> str:
    path = Path(sys.executable).with_name("dumb-init")
    if not path.exists():
        pytest.skip("dumb-init (dev extra) is not installed")
    return str(path)


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "qworker"
    fake.write_text(FAKE_QWORKER.format(python=sys.executable))
    fake.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin",
            "FAKE_ARGV": str(tmp_path / "argv"), **extra}


@pytest.mark.parametrize("code", [0, 1, 69, 70, 75])
def test_entrypoint_exit_codes_pass_through_dumb_init_unchanged(tmp_path: Path,
                                                                code: int) -> None:
    env = _env(tmp_path, FAKE_EXIT=str(code))
    done = subprocess.run([_dumb_init(), "--", str(ENTRYPOINT), "--until-idle", "300"],
                          env=env, timeout=30)
    assert done.returncode == code
    assert (tmp_path / "argv").read_text() == "run --until-idle 300"  # options go to `run`


def test_entrypoint_runs_other_subcommands_and_defaults_to_run(tmp_path: Path) -> None:
    env = _env(tmp_path, FAKE_EXIT="0")
    subprocess.run([_dumb_init(), "--", str(ENTRYPOINT), "produce", "-i", "x"], env=env,
                   timeout=30, check=True)
    assert (tmp_path / "argv").read_text() == "produce -i x"
    subprocess.run([_dumb_init(), "--", str(ENTRYPOINT)], env=env, timeout=30, check=True)
    assert (tmp_path / "argv").read_text() == "run"


def test_sigterm_to_pid_1_reaches_qworker_and_its_drain_code_comes_back(
    tmp_path: Path,
) -> None:
    env = _env(tmp_path, FAKE_WAIT="1")
    proc = subprocess.Popen([_dumb_init(), "--", str(ENTRYPOINT), "run"], env=env)
    try:
        deadline = time.monotonic() + 20
        while not (tmp_path / "argv.ready").exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 75
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (tmp_path / "argv.signal").read_text() == str(int(signal.SIGTERM))
