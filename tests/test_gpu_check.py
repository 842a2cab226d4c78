"""scripts/gpu_check.sh's plumbing without a GPU: the plan of calls (by priority, within the
budget), and a run of toy stages through the real driver proving the incremental report,
the file rules of $OUT, timeouts, skips, failures and the commands for what is left."""

from __future__ import annotations

import ast
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts import gpu_check_helpers, gpu_check_stages  # noqa: E402
from scripts.gpu_check import run_check  # noqa: E402
from scripts.gpu_check_report import ALLOWED_FILES, MAX_OUT_FILES, pytest_summary, targets  # noqa: E402
from scripts.gpu_check_stages import Stage, discover_pytest_stages, plan_calls  # noqa: E402


def test_the_first_call_fits_its_budget_in_order_of_value() -> None:
    stages = discover_pytest_stages(gpu_check_stages.STAGES)
    calls = plan_calls(stages, gpu_check_stages.BUDGET)
    setup = [s for s in stages if s.priority == 0]
    assert {s.name for s in setup} == {"info", "deps", "precompile"}
    for call in set(calls.values()) - {0}:
        total = sum(s.limit for s in stages if calls[s.name] in (0, call))
        assert total <= gpu_check_stages.BUDGET, (call, total)
    first = [s.name for s in sorted(stages, key=lambda s: s.priority) if calls[s.name] == 1]
    assert first[:2] == ["pytest:attention/test_selftest", "pytest:engine/test_engine_tensor_cores"]
    assert first.index("kernels") < first.index("step_time")
    order = [s.name for s in sorted(stages, key=lambda s: s.priority)]
    assert order.index("step_time") < order.index("fixed_len") < order.index("engine")
    # every test file with gpu tests is a stage (one process each), named by the table
    files = {p.relative_to(ROOT / "tests").with_suffix("").as_posix()
             for p in (ROOT / "tests").rglob("test_*.py")
             if gpu_check_stages.GPU_MARK.search(p.read_text())}
    assert {f"pytest:{f}" for f in files} <= {s.name for s in stages}
    assert all(s.priority != gpu_check_stages.DEFAULT_PYTEST_PRIORITY for s in stages), \
        "a gpu test file has no line in STAGES: give it a limit and a priority"


def test_a_new_stage_is_one_line() -> None:
    stages = [Stage("setup", 50, 0, "true"), Stage("a", 200, 10, "true"),
              Stage("b", 100, 20, "true"), Stage("big", 400, 30, "true"), Stage("c", 10, 5, "true")]
    calls = plan_calls(stages, 330)
    assert calls == {"setup": 0, "c": 1, "a": 1, "b": 2, "big": 3}


def _toy_stages(tmp: Path) -> list[Stage]:
    check_report = (
        'import json, os; r = json.load(open(os.environ["OUT"] + "/report.json")); '
        's = {x["stage"]: x["state"] for x in r["stages"]}; '
        'assert s["setup"] == "passed" and s["measure"] == "running", s; '
        'open(os.environ["STAGE_JSON"], "w").write(json.dumps({"tok_s": 5}) + "\\n")')
    junit = ('<testsuite tests="2" failures="0" errors="0" skipped="2"><testcase classname="t" '
             'name="a"><skipped message="needs a CUDA device"/></testcase><testcase '
             'classname="t" name="b"><skipped message="needs a CUDA device"/></testcase>'
             '</testsuite>')
    return [
        Stage("setup", 5, 0, "echo ready"),
        Stage("measure", 5, 10, f"{sys.executable} -c '{check_report}'"),
        Stage("hang", 1, 11, "sleep 30 & wait"),
        Stage("guarded", 5, 12, '[ "$GPU_COUNT" -ge 2 ] || skip "needs 2 GPUs, has $GPU_COUNT"'),
        Stage("litter", 5, 13, 'for i in 1 2 3; do echo x > "$OUT/extra$i.txt"; done; '
                               'mkdir -p "$OUT/sub"; exit 3'),
        Stage("pytest:toy/test_skips", 5, 14, f"echo '{junit}' > \"$STAGE_DIR/junit.xml\""),
        Stage("excluded", 5, 15, "exit 9"),
        Stage("next", 300, 20, "exit 9"),
    ]


def test_a_run_reports_after_every_stage_and_keeps_out_small(tmp_path: Path) -> None:
    out = tmp_path / "out"
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        rc = run_check(_toy_stages(tmp_path), out, sys.executable, dry=False, call=1, budget=100,
                       only=[], skip=["excluded"], work=tmp_path / "work")
    finally:
        signal.signal(signal.SIGTERM, handlers[0])
        signal.signal(signal.SIGINT, handlers[1])
    assert rc == 1
    files = sorted(p.name for p in out.iterdir())
    assert set(files) <= set(ALLOWED_FILES) and len(files) <= MAX_OUT_FILES
    assert all(p.is_file() for p in out.iterdir())
    report = json.loads((out / "report.json").read_text())
    states = {s["stage"]: s["state"] for s in report["stages"]}
    assert states == {"setup": "passed", "measure": "passed", "hang": "timeout",
                      "guarded": "skipped", "litter": "failed", "pytest:toy/test_skips": "skipped",
                      "excluded": "excluded", "next": "later"}
    by = {s["stage"]: s for s in report["stages"]}
    assert by["measure"]["result"] == {"tok_s": 5}  # the stage's JSON, embedded
    assert by["hang"]["seconds"] < 15  # its process group was killed at the limit
    assert by["guarded"]["reason"] == "needs 2 GPUs, has 0"
    assert by["pytest:toy/test_skips"]["pytest"]["skipped"] == 2
    assert "every test skipped: needs a CUDA device" in by["pytest:toy/test_skips"]["reason"]
    assert sorted(report["dropped_files"]) == ["extra1.txt", "extra2.txt", "extra3.txt", "sub"]
    assert report["verdict"] == "failed" and report["final"]
    assert report["next"]["later_calls"] == [
        {"call": 2, "command": "QWORKER_GPU_CHECK_CALL=2 scripts/gpu_check.sh",
         "stages": ["next"]}]
    assert report["next"]["rerun_failed"] == (
        "QWORKER_GPU_CHECK_ONLY='hang litter' scripts/gpu_check.sh")
    md = (out / "report.md").read_text()
    assert "| hang | 1 | timeout |" in md and "QWORKER_GPU_CHECK_CALL=2" in md
    log = (out / "gpu_check.log").read_text()
    assert "=== [litter] failed rc=3" in log and "ready" in log


def test_only_reruns_the_named_stages_after_setup(tmp_path: Path) -> None:
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        rc = run_check(_toy_stages(tmp_path), tmp_path / "o", sys.executable, dry=False, call=1,
                       budget=100, only=["gu*"], skip=[], work=tmp_path / "w")
    finally:
        signal.signal(signal.SIGTERM, handlers[0])
        signal.signal(signal.SIGINT, handlers[1])
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    ran = [s["stage"] for s in report["stages"] if s["state"] not in ("later", "excluded")]
    assert ran == ["setup", "guarded"] and rc == 3 and report["verdict"] == "incomplete"


def test_a_pytest_file_killed_midway_is_summarised_from_its_log(tmp_path: Path) -> None:
    log = ("tests/a.py::test_one PASSED\ntests/a.py::test_two FAILED\n"
           "tests/a.py::test_three[x] SKIPPED (needs)\ntests/a.py::test_four ")
    summary = pytest_summary(tmp_path, log)
    assert summary is not None
    assert (summary["tests"], summary["passed"], summary["failures"], summary["skipped"]) == (
        3, 1, 1, 1)
    assert summary["running_when_stopped"] == "tests/a.py::test_four"


def test_targets_are_judged_on_the_measured_tables() -> None:
    dec = [{"batch": 32, "ctx": 4096, "pct_copy": 88.0, "kernel_vs_sdpa": 1.2, "kernel_ms": 0.5,
            "fp8_vs_bf16": 0.55},
           {"batch": 1, "ctx": 512, "pct_copy": 5.0, "kernel_ms": 0.04, "graph_ms": 0.02}]
    pre = [{"paged_ms": 1.0, "sdpa_ms": 1.5, "faster": "paged"}]
    stages = [{"stage": "kernels", "result": {"decode": dec, "prefill": pre}},
              {"stage": "fixed_len", "result": {"output_tok_per_s": 9000.0}}]
    verdicts = {t["target"]: t["verdict"] for t in targets(stages)}
    assert verdicts["decode >= 85% of copy bandwidth at batch >= 32 x ctx >= 2k"] == "met"
    assert verdicts["batch 1 x 512 decode < 0.03 ms"] == "met"  # the graph replay counts
    assert verdicts["1000/1000 fixed-length >= 10,000 output tok/s"] == "NOT met"
    assert verdicts["CUDA graphs on vs off measured"] == "not measured"


def test_fused_kernels_are_in_the_precompile_list() -> None:
    names = gpu_check_helpers.precompile_names()
    assert ("fused_ops.cu", "rotary_neox<2>") in names
    assert ("paged_decode_tc.cu", "paged_decode_tc<2, 0, 128, 1>") in names
    assert len(names) == len(set(names))


@pytest.mark.parametrize("script", sorted((ROOT / "scripts").glob("bench_*.py")),
                         ids=lambda p: p.name)
def test_every_bench_script_runs_directly(script: Path) -> None:
    # `python3 scripts/bench_x.py` on the GPU machine (qworker not installed): the repository
    # root goes on sys.path before the first qworker/scripts import, and there is a main
    tree = ast.parse(script.read_text())
    insert = next((n.lineno for n in tree.body if "sys.path.insert" in ast.unparse(n)), None)
    ours = [n.lineno for n in tree.body if isinstance(n, ast.ImportFrom | ast.Import)
            and any((getattr(n, "module", None) or a.name).split(".")[0] in ("qworker", "scripts")
                    for a in n.names)]
    if ours:
        assert insert is not None and insert < min(ours), script.name
    assert any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)


def test_the_shell_entry_point_prints_the_plan() -> None:
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--plan"],
                          capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("call 1: ") and "call 2: " in done.stdout
