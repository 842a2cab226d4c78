"""The helper steps the GPU check's setup stages run (scripts/gpu_check_stages.py):
``info PATH``, ``install-deps DEPS TARGET``, ``precompile``. torch and qworker are imported
only inside them: the check's driver itself is standard library only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: Exit status of a step that skips itself (scripts/gpu_check.py reports it skipped).
SKIP_RC = 77


def write_info(path: Path) -> int:
    """Versions, the device and what it holds, as JSON (also printed)."""
    import platform

    info: dict[str, Any] = {"python": sys.version.split()[0], "machine": platform.node()}
    try:
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20)
        print(smi.stdout)
    except (OSError, subprocess.TimeoutExpired):
        pass
    import torch

    info.update(torch=torch.__version__, cuda=torch.cuda.is_available(),
                gpu_count=torch.cuda.device_count())
    if info["cuda"]:
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sms=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2**30, 1), torch_cuda=torch.version.cuda)
    try:
        import cupy
        from cupy.cuda import nvrtc

        info["cupy"] = cupy.__version__
        info["nvrtc"] = ".".join(map(str, nvrtc.getVersion()))
    except Exception as exc:  # reported, not fatal: the engine then runs torch
        info["cupy_error"] = f"{type(exc).__name__}: {exc}"
    for name in ("transformers", "safetensors", "triton", "llguidance"):
        try:
            info[name] = __import__(name).__version__
        except Exception as exc:
            info[name] = f"missing ({type(exc).__name__})"
    print(json.dumps(info))
    path.write_text(json.dumps(info) + "\n")
    return 0


def install_deps(deps: Path, target: Path) -> int:
    """Install the carried wheels of ``deps`` into ``target`` (no index: the GPU machine
    reaches none); a wheel is a zip, so unpacking it is the fallback."""
    wheels = sorted(deps.glob("*.whl")) if deps.is_dir() else []
    if not wheels:
        print(f"SKIP: no wheels in {deps} (fill it with scripts/pack_gpu_deps.sh; name it in "
              "the device tool's carry)")
        return SKIP_RC
    target.mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                               "--no-deps", "--no-compile", "--target", str(target), str(wheel)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            import zipfile

            print(f"pip failed for {wheel.name} ({done.stderr.strip()[-300:]}); unzipping")
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(target)
        print(f"installed {wheel.name}")
    return 0


def precompile_names() -> list[tuple[str, str]]:
    """(source, name expression) of every kernel the engine may launch: attention, cache
    ops and the fused small ops."""
    from qworker.attention.cuda_kernels import all_instantiations
    from qworker.models.fused_kernels import SOURCE, instantiations

    names = [(src, n) for src, ns in all_instantiations().items() for n in ns]
    return names + [(SOURCE, n) for n in instantiations()]


def precompile_kernels() -> int:
    """Compile :func:`precompile_names` into cupy's on-disk cache, in parallel; later
    processes load cubins instead of running NVRTC."""
    import torch

    names = precompile_names()
    if not torch.cuda.is_available():
        print(f"SKIP: no CUDA device ({len(names)} kernels compile on first use)")
        return SKIP_RC
    from qworker.attention.kernel_cache import precompile

    took = precompile(names, workers=min(16, os.cpu_count() or 1))
    print(f"compiled {len(names)} kernels into cupy's cache in {took:.1f}s")
    return 0


def main(argv: list[str]) -> int:
    """``info PATH`` | ``install-deps DEPS TARGET`` | ``precompile``."""
    if argv[:1] == ["info"] and len(argv) == 2:
        return write_info(Path(argv[1]))
    if argv[:1] == ["install-deps"] and len(argv) == 3:
        return install_deps(Path(argv[1]), Path(argv[2]))
    if argv == ["precompile"]:
        return precompile_kernels()
    print("usage: gpu_check_helpers.py info PATH | install-deps DEPS TARGET | precompile",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
