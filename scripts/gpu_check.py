#!/usr/bin/env python3
"""The GPU check's driver (``scripts/gpu_check.sh`` runs it): the stages of
``scripts/gpu_check_stages.py`` in order of value, each under its own time limit (its process
group killed past it), one call of the plan at a time, the report
(``scripts/gpu_check_report.py``) rewritten before and after every stage, ``$OUT`` kept to
the report's files. Standard library only: the GPU machine has no venv. See the header of
scripts/gpu_check.sh for the usage and docs/gpu/README.md for the plan.
"""

from __future__ import annotations

import argparse
import fnmatch
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
from scripts.gpu_check_stages import (  # noqa: E402
    BUDGET,
    STAGES,
    Stage,
    discover_pytest_stages,
    plan_calls,
    with_limits,
    words,
)

#: Exit status of a stage that skips itself (``skip REASON``).
SKIP_RC = 77
#: The log is cut to this size (head and tail kept) so it always comes back.
MAX_LOG_BYTES = 12 << 20


def _matches(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


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
    args = p.parse_args(argv)
    stages = with_limits(discover_pytest_stages(STAGES),
                         os.environ.get("QWORKER_GPU_CHECK_LIMITS", ""))
    only = words(os.environ.get("QWORKER_GPU_CHECK_ONLY"))
    skip = words(os.environ.get("QWORKER_GPU_CHECK_SKIP"))
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
