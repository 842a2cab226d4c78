#!/usr/bin/env python3
"""The GPU check's driver (``scripts/gpu_check.sh`` runs it): stages in order of value, each
under its own time limit, packed into calls of the device tool that fit its budget, with the
report rewritten after every stage. Standard library only: the GPU machine has no venv.

A stage is one line of :data:`STAGES`: name, time limit (seconds on the H200), priority (lower
first; 0 = setup, run at the start of every call) and a bash command. Commands see
``PYTHON``, ``OUT``, ``STAGE_DIR`` (scratch of this stage), ``STAGE_JSON`` (where a bench
writes its JSON line; the report embeds it), ``DRY_FLAG`` (``--dry-run`` or empty),
``GPU_DEPS``, ``PYDEPS`` (on ``PYTHONPATH``), ``GPU_COUNT``, and ``skip REASON`` (exit 77: the
stage is reported skipped with the reason, never passed). Every ``tests/`` file with ``gpu``
tests is a stage of its own (``pytest:<path>``), one process each, so a sticky CUDA error in
one kernel fails only its file; files the table does not name are added at priority 45.

Calls: stages sorted by priority fill call 1 while setup plus their limits stay within
``--budget`` (330 s), then call 2, and so on; ``--plan`` prints the plan. See the header of
scripts/gpu_check.sh for the usage and docs/gpu/README.md for the rerun plan.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.gpu_check_report import (  # noqa: E402
    ALLOWED_FILES,
    MAX_OUT_FILES,
    pytest_summary,
    write_report,
)

#: Stage limits per call (seconds), setup included: the device tool allows 600 s per
#: command; the machine's start (1-2 min) and a second call must fit the 15-minute lease.
BUDGET = 330
#: Exit status of a stage that skips itself (``skip REASON``).
SKIP_RC = 77
#: The log is cut to this size (head and tail kept) so it always comes back.
MAX_LOG_BYTES = 12 << 20


@dataclass(slots=True)
class Stage:
    """One step of the check: ``limit`` seconds, ``priority`` (0 = setup), bash ``command``."""

    name: str
    limit: int
    priority: int
    command: str


def pytest_stage(path: str, limit: int, priority: int) -> Stage:
    """The ``gpu`` tests of one file in their own process (``-rfE``: each failure named)."""
    name = "pytest:" + path.removeprefix("tests/").removesuffix(".py")
    return Stage(name, limit, priority,
                 f'"$PYTHON" -m pytest -m gpu {path} -v -rfE -p no:cacheprovider '
                 f'--junitxml="$STAGE_DIR/junit.xml"')


_STRUCTURED = (
    '"$PYTHON" -c "import llguidance" 2>/dev/null || skip "llguidance does not import: '
    'fill gpu_deps/ with scripts/pack_gpu_deps.sh and carry it"; '
    'tok=(); [ -f "$GPU_DEPS/smollm2-tokenizer/tokenizer.json" ] && '
    'tok=(--tokenizer "$GPU_DEPS/smollm2-tokenizer"); '
    'if [ -n "$DRY_FLAG" ]; then a=(--dry-run); else a=(--device cuda --dtype bfloat16 '
    '--preset small --num-requests 128 --max-num-seqs 64 --rounds 2); fi; '
    '"$PYTHON" scripts/bench_engine.py --workload structured --out "$STAGE_JSON" '
    '"${a[@]}" "${tok[@]}"')
_ENGINE = (
    'if [ -n "$DRY_FLAG" ]; then a=(--dry-run); else a=(--device cuda --dtype bfloat16 '
    '--preset llama-3.1-8b --dummy --num-requests 64 --max-num-seqs 64 --quick); fi; '
    '"$PYTHON" scripts/bench_engine.py "${a[@]}" --out "$STAGE_JSON" '
    '${QWORKER_GPU_CHECK_MODEL_DIR:+--model "$QWORKER_GPU_CHECK_MODEL_DIR"} '
    '$QWORKER_BENCH_ENGINE_ARGS')

#: Every stage, one line each: name, limit (s), priority, command. Estimates of the H200 time
#: (what each limit allows for) are in docs/gpu/README.md.
STAGES: list[Stage] = [
    # setup, at the start of every call
    Stage("info", 10, 0, '"$PYTHON" scripts/gpu_check.py --info "$STAGE_JSON"'),
    Stage("deps", 10, 0, '"$PYTHON" scripts/gpu_check.py --install-deps "$GPU_DEPS" "$PYDEPS"'),
    Stage("precompile", 35, 0, '"$PYTHON" scripts/gpu_check.py --precompile'),
    # correctness: the start-up self-test and the engine in bf16/fp16, then the kernels
    pytest_stage("tests/attention/test_selftest.py", 20, 10),
    pytest_stage("tests/engine/test_engine_tensor_cores.py", 40, 11),
    pytest_stage("tests/attention/test_decode_tc.py", 45, 12),
    pytest_stage("tests/attention/test_prefill_tc.py", 40, 13),
    # the decode table, then step time and fixed-length throughput
    Stage("kernels", 50, 20, '"$PYTHON" scripts/bench_kernels.py --iters 10 '
          '--out "$STAGE_JSON" $DRY_FLAG'),
    Stage("step_time", 75, 30, '"$PYTHON" scripts/bench_step_time.py --out "$STAGE_JSON" '
          '--trace "$OUT" $DRY_FLAG'),
    Stage("fixed_len", 95, 31, '"$PYTHON" scripts/bench_fixed_len.py --seconds '
          '"${FIXED_SECONDS:-40}" --out "$STAGE_JSON" $DRY_FLAG '
          '${QWORKER_GPU_CHECK_MODEL_DIR:+--model "$QWORKER_GPU_CHECK_MODEL_DIR"}'),
    # the rest of the kernel and engine tests
    pytest_stage("tests/attention/test_cuda_backend.py", 50, 40),
    pytest_stage("tests/attention/test_fp8.py", 20, 41),
    pytest_stage("tests/engine/test_cuda_graphs.py", 30, 42),
    pytest_stage("tests/models/test_fused_kernels.py", 20, 43),
    pytest_stage("tests/models/test_fused_selftest.py", 20, 44),
    pytest_stage("tests/engine/test_model_runner.py", 20, 45),
    pytest_stage("tests/engine/test_sampler.py", 20, 46),
    # end to end against transformers, structured outputs; later issues add theirs below
    Stage("engine", 100, 50, _ENGINE),
    Stage("structured", 90, 60, _STRUCTURED),
    Stage("selftest_margin", 20, 65, '"$PYTHON" scripts/bench_selftest.py --out "$STAGE_JSON" '
          '$DRY_FLAG'),
    # e.g. Stage("tp2", 90, 80, '[ "$GPU_COUNT" -ge 2 ] || skip "needs 2 GPUs"; ...'),
]

#: A test module with ``gpu`` tests: a decorator or a module-level ``pytestmark``.
GPU_MARK = re.compile(r"^\s*(@pytest\.mark\.gpu\b|pytestmark\s*=.*\bgpu\b)", re.MULTILINE)

#: Limit of a ``gpu`` test file the table does not name, and its priority.
DEFAULT_PYTEST_LIMIT, DEFAULT_PYTEST_PRIORITY = 30, 47


def discover_pytest_stages(stages: list[Stage], root: Path = ROOT) -> list[Stage]:
    """``stages`` plus one stage per ``tests/`` file with ``gpu`` tests it does not name."""
    named = {s.name for s in stages}
    extra = []
    for path in sorted((root / "tests").rglob("test_*.py")):
        rel = path.relative_to(root).as_posix()
        stage = pytest_stage(rel, DEFAULT_PYTEST_LIMIT, DEFAULT_PYTEST_PRIORITY)
        if stage.name not in named and GPU_MARK.search(path.read_text(errors="replace")):
            extra.append(stage)
    return [*stages, *extra]


def with_limits(stages: list[Stage], spec: str) -> list[Stage]:
    """``stages`` with limits replaced per ``spec`` (``"kernels=80 step_time=100"``: a rerun
    of a stage that timed out); an unknown name or a bad number is refused."""
    limits: dict[str, int] = {}
    for item in _words(spec):
        name, _, value = item.partition("=")
        if not value.isdigit() or name not in {s.name for s in stages}:
            raise SystemExit(f"QWORKER_GPU_CHECK_LIMITS: {item!r} is not STAGE=SECONDS for a "
                             "stage of the plan (--plan lists them)")
        limits[name] = int(value)
    return [Stage(s.name, limits.get(s.name, s.limit), s.priority, s.command) for s in stages]


def plan_calls(stages: list[Stage], budget: int) -> dict[str, int]:
    """The call each stage runs in (0: setup, every call). Stages go in priority order (ties
    in table order); a call takes them while setup plus their limits fit ``budget``."""
    setup = sum(s.limit for s in stages if s.priority == 0)
    calls: dict[str, int] = {s.name: 0 for s in stages if s.priority == 0}
    call, used = 1, setup
    for stage in sorted((s for s in stages if s.priority > 0), key=lambda s: s.priority):
        if used + stage.limit > budget and used > setup:
            call, used = call + 1, setup
        calls[stage.name] = call
        used += stage.limit
    return calls


def _matches(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _words(text: str | None) -> list[str]:
    return [w for w in re.split(r"[\s,]+", text or "") if w]


@dataclass(slots=True)
class StageRecord:
    """A stage's entry in the report: what happened to it."""

    stage: str
    call: int
    limit_s: int
    priority: int
    state: str = "pending"  # pending running passed failed timeout skipped later excluded killed
    rc: int | None = None
    seconds: float | None = None
    reason: str = ""
    log_offset: int = 0
    tail: str = ""
    dir: str = ""


@dataclass(slots=True)
class Check:
    """One run of the check: where it writes, what it runs, the records so far."""

    out: Path
    work: Path
    python: str
    dry: bool
    call: int | None
    budget: int
    records: list[StageRecord] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    dropped: list[str] = field(default_factory=list)
    current: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> Path:
        """The one log of every stage's output."""
        return self.out / "gpu_check.log"

    def report(self, final: bool = False) -> None:
        """Enforce the file rules of ``out``, then rewrite report.json and report.md."""
        self.dropped += enforce_out(self.out, self.work / "dropped")
        cap_log(self.log)
        write_report(self, final)


def select(stages: list[Stage], calls: dict[str, int], call: int | None,
           only: list[str], skip: list[str]) -> list[StageRecord]:
    """Records of every stage with its fate: run now (pending), ``later`` (another call),
    ``excluded`` (QWORKER_GPU_CHECK_SKIP). ``only`` picks stages by name or glob (setup stages
    always run unless skipped); ``call`` None runs every call's stages."""
    records = []
    for stage in sorted(stages, key=lambda s: s.priority):
        rec = StageRecord(stage.name, calls[stage.name], stage.limit, stage.priority)
        if _matches(stage.name, skip):
            rec.state, rec.reason = "excluded", "QWORKER_GPU_CHECK_SKIP"
        elif only:
            if stage.priority != 0 and not _matches(stage.name, only):
                rec.state, rec.reason = "later", "not in QWORKER_GPU_CHECK_ONLY"
        elif call is not None and rec.call not in (0, call):
            rec.state, rec.reason = "later", f"call {rec.call}"
        records.append(rec)
    return records


def enforce_out(out: Path, dropped_dir: Path) -> list[str]:
    """Keep only the report's files (at most :data:`MAX_OUT_FILES`, flat) in ``out``: anything
    else a stage left there moves to ``dropped_dir``; returns what moved."""
    moved = []
    for path in sorted(out.iterdir()):
        if path.name in ALLOWED_FILES and path.is_file():
            continue
        dropped_dir.mkdir(parents=True, exist_ok=True)
        shutil.move(str(path), str(dropped_dir / path.name))
        moved.append(path.name)
    assert len(list(out.iterdir())) <= MAX_OUT_FILES
    return moved


def cap_log(log: Path, limit: int = MAX_LOG_BYTES) -> None:
    """Cut ``log`` to ``limit`` bytes (its first quarter and its end) if it grew past it."""
    if not log.exists() or log.stat().st_size <= limit:
        return
    data = log.read_bytes()
    head, tail = data[: limit // 4], data[-(limit - limit // 4 - 100):]
    log.write_bytes(head + b"\n[... log cut to fit the device tool's file limit ...]\n" + tail)


_PREAMBLE = 'skip() { echo "SKIP: $*"; exit 77; }\n'


def run_stage(check: Check, stage: Stage, rec: StageRecord, env: dict[str, str]) -> None:
    """Run one stage under its limit (its process group killed past it), output to the log."""
    stage_dir = check.work / "stages" / re.sub(r"[^A-Za-z0-9_.-]", "_", stage.name)
    stage_dir.mkdir(parents=True, exist_ok=True)
    limit = rec.limit_s * (3 if check.dry else 1)  # a shared CPU runs the toy sizes slowly
    rec.dir, rec.state = str(stage_dir), "running"
    with check.log.open("ab") as log:
        log.write(f"\n=== [{stage.name}] limit {limit}s: {stage.command}\n".encode())
    rec.log_offset = check.log.stat().st_size
    check.report()
    env = {**env, "STAGE_DIR": str(stage_dir), "STAGE_JSON": str(stage_dir / "result.json")}
    started = time.monotonic()
    with check.log.open("ab") as log:
        proc = subprocess.Popen(["bash", "-c", _PREAMBLE + stage.command], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        check.current = proc
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            _kill(proc)
            rc = 124
        finally:
            check.current = None
    rec.seconds = round(time.monotonic() - started, 1)
    rec.rc = rc
    output = check.log.read_bytes()[rec.log_offset:].decode(errors="replace")
    rec.tail = output[-3000:]
    skipped = re.findall(r"^SKIP: (.*)$", output, re.MULTILINE)
    summary = pytest_summary(stage_dir, output) if stage.name.startswith("pytest:") else None
    if rc == 0 and summary is not None and summary.get("tests") == summary.get("skipped"):
        reasons = summary.get("skip_reasons") or ["no test ran"]
        rec.state, rec.reason = "skipped", f"every test skipped: {reasons[0]}"
    elif rc == 0:
        rec.state = "passed"
    elif rc == SKIP_RC and skipped:
        rec.state, rec.reason = "skipped", skipped[-1][:300]
    elif rc == 124:
        rec.state, rec.reason = "timeout", f"killed at its {limit}s limit"
    else:
        rec.state, rec.reason = "failed", f"exit status {rc}"
    with check.log.open("ab") as log:
        log.write(f"=== [{stage.name}] {rec.state} rc={rc} {rec.seconds}s\n".encode())
    print(f"[{stage.name}] {rec.state} in {rec.seconds}s (limit {limit}s)"
          f"{': ' + rec.reason if rec.reason else ''}", flush=True)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def gpu_count() -> int:
    """GPUs ``nvidia-smi -L`` lists (0 without a driver)."""
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in done.stdout.splitlines() if line.startswith("GPU "))


def run_check(stages: list[Stage], out: Path, python: str, dry: bool, call: int | None,
              budget: int, only: list[str], skip: list[str], work: Path | None = None,
              deps: Path | None = None) -> int:
    """Run the selected stages; returns 0 (all passed), 1 (a failure or timeout) or 3
    (incomplete: a stage skipped itself)."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.iterdir():  # the device tool empties $OUT; a local rerun starts clean
        if stale.name in ALLOWED_FILES:
            stale.unlink()
    work = work or Path(tempfile.mkdtemp(prefix="qworker_gpu_check_"))
    check = Check(out, work, python, dry, call, budget)
    check.records = select(stages, plan_calls(stages, budget), call, only, skip)
    check.log.write_bytes(b"")
    pydeps = work / "pydeps"
    env = {**os.environ, "PYTHON": python, "OUT": str(out), "DRY_FLAG": "--dry-run" if dry else "",
           "GPU_DEPS": str(deps or ROOT / "gpu_deps"), "PYDEPS": str(pydeps),
           "GPU_COUNT": str(0 if dry else gpu_count()), "PYTHONUNBUFFERED": "1",
           "PYTHONDONTWRITEBYTECODE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pydeps), env.get("PYTHONPATH")) if p)
    if dry:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run never touches a GPU, even on one

    def on_signal(signum: int, frame: Any) -> None:
        if check.current is not None:
            _kill(check.current)
        for rec in check.records:
            if rec.state == "running":
                rec.state, rec.reason = "killed", f"the check got signal {signum}"
        check.report(final=True)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    by_name = {s.name: s for s in stages}
    check.report()
    for rec in check.records:
        if rec.state == "pending":
            run_stage(check, by_name[rec.stage], rec, env)
            check.report()
    check.report(final=True)
    states = {r.state for r in check.records}
    if states & {"failed", "timeout", "killed"}:
        return 1
    return 3 if "skipped" in states else 0


# -- helper modes the stage table calls (torch and qworker imported only here) ----------------


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


def main(argv: list[str] | None = None) -> int:
    """Command line of scripts/gpu_check.sh (see its header)."""
    p = argparse.ArgumentParser(description="qworker's one-shot GPU check")
    p.add_argument("--dry-run", action="store_true",
                   default=os.environ.get("QWORKER_GPU_CHECK_DRY_RUN") == "1",
                   help="every stage on the CPU at toy sizes (plumbing)")
    p.add_argument("--call", type=int, default=int(os.environ.get("QWORKER_GPU_CHECK_CALL", 1)),
                   help="which call of the plan to run (default 1)")
    p.add_argument("--all", action="store_true", help="every call's stages in one go")
    p.add_argument("--plan", action="store_true", help="print the plan and exit")
    p.add_argument("--budget", type=int,
                   default=int(os.environ.get("QWORKER_GPU_CHECK_BUDGET", BUDGET)))
    p.add_argument("--info", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--install-deps", nargs=2, type=Path, help=argparse.SUPPRESS)
    p.add_argument("--precompile", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.info is not None:
        return write_info(args.info)
    if args.install_deps is not None:
        return install_deps(*args.install_deps)
    if args.precompile:
        return precompile_kernels()
    stages = with_limits(discover_pytest_stages(STAGES),
                         os.environ.get("QWORKER_GPU_CHECK_LIMITS", ""))
    only = _words(os.environ.get("QWORKER_GPU_CHECK_ONLY"))
    skip = _words(os.environ.get("QWORKER_GPU_CHECK_SKIP"))
    calls = plan_calls(stages, args.budget)
    if args.plan:
        setup = [s for s in stages if s.priority == 0]
        for call in sorted(set(calls.values()) - {0}):
            members = [s for s in stages if calls[s.name] == call]
            total = sum(s.limit for s in setup + members)
            print(f"call {call}: {total}s = setup {' '.join(s.name for s in setup)} + "
                  + " ".join(f"{s.name}({s.limit})" for s in members))
        return 0
    out = Path(os.environ.get("OUT") or ROOT / "out").resolve()
    python = os.environ.get("PYTHON") or "python3"
    deps = Path(os.environ.get("QWORKER_GPU_DEPS") or ROOT / "gpu_deps").resolve()
    return run_check(stages, out, python, args.dry_run, None if args.all else args.call,
                     args.budget, only, skip, deps=deps)


if __name__ == "__main__":
    raise SystemExit(main())
