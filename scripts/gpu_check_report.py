"""The GPU check's report: ``report.json`` (every stage's record with its JSON result or
pytest summary embedded, the plan of the calls still to make, the verdict of each target)
and ``report.md`` (the same, for people), rewritten after every stage by
``scripts/gpu_check.py`` so a killed run still returns what it measured.

Standard library only. Files under ``$OUT`` are limited to :data:`ALLOWED_FILES` (at most
:data:`MAX_OUT_FILES`, under the device tool's 8): everything else stays in the work folder.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

#: The only files the check leaves in $OUT (flat).
ALLOWED_FILES = ("report.json", "report.md", "gpu_check.log", "decode_step_trace.json.gz")
#: At most this many files in $OUT (the device tool brings back 8).
MAX_OUT_FILES = 6
assert len(ALLOWED_FILES) <= MAX_OUT_FILES

_NAN = float("nan")
_RESULT = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", re.MULTILINE)
_STARTED = re.compile(r"^(tests/\S+::\S+) ", re.MULTILINE)


def load_result(path: Path) -> Any:
    """A stage's JSON result: one JSON value, or its JSON lines (a list when several)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        pass
    values = []
    for line in text.splitlines():
        try:
            values.append(json.loads(line))
        except ValueError:
            continue
    return values[0] if len(values) == 1 else (values or None)


def pytest_summary(stage_dir: Path, output: str) -> dict[str, Any] | None:
    """Counts and failures from the stage's junit XML, or, when the run was killed before
    pytest wrote it, from the ``-v`` lines in its output (with the test that was running)."""
    xml = stage_dir / "junit.xml"
    if xml.exists():
        try:
            root = ET.parse(xml).getroot()
        except ET.ParseError as exc:
            return {"error": f"junit.xml unreadable: {exc}"}
        suites = [root] if root.tag == "testsuite" else list(root)
        counts = {k: sum(int(s.get(k, 0)) for s in suites)
                  for k in ("tests", "failures", "errors", "skipped")}
        failed, skip_reasons = [], []
        for case in root.iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            for tag in ("failure", "error"):
                node = case.find(tag)
                if node is not None:
                    failed.append({"test": name, "kind": tag,
                                   "message": (node.get("message") or "")[:500]})
            node = case.find("skipped")
            if node is not None:
                skip_reasons.append((node.get("message") or "")[:200])
        counts["passed"] = counts["tests"] - sum(counts[k] for k in ("failures", "errors",
                                                                     "skipped"))
        return {**counts, "failed": failed,
                "skip_reasons": sorted(set(skip_reasons))[:5], "source": "junit"}
    results = _RESULT.findall(output)
    if not results and not _STARTED.search(output):
        return None
    tally = {k: sum(1 for _, r in results if r == k) for k in ("PASSED", "FAILED", "ERROR",
                                                              "SKIPPED")}
    done = {t for t, _ in results}
    running = [t for t in _STARTED.findall(output) if t not in done]
    return {"tests": len(results), "passed": tally["PASSED"], "failures": tally["FAILED"],
            "errors": tally["ERROR"], "skipped": tally["SKIPPED"],
            "failed": [{"test": t, "kind": r.lower(), "message": ""} for t, r in results
                       if r in ("FAILED", "ERROR")],
            "running_when_stopped": running[-1] if running else None, "source": "log"}


def stage_entry(rec: Any, log_text: str) -> dict[str, Any]:
    """One stage of report.json."""
    entry: dict[str, Any] = {"stage": rec.stage, "state": rec.state, "call": rec.call,
                             "priority": rec.priority, "limit_s": rec.limit_s, "rc": rec.rc,
                             "seconds": rec.seconds, "reason": rec.reason}
    if not rec.dir:
        return entry
    stage_dir = Path(rec.dir)
    end = log_text.find(f"=== [{rec.stage}] ", rec.log_offset)
    output = log_text[rec.log_offset: end if end >= 0 else None]
    summary = pytest_summary(stage_dir, output) if rec.stage.startswith("pytest:") else None
    if summary is not None:
        entry["pytest"] = summary
    result = load_result(stage_dir / "result.json")
    if result is not None:
        entry["result"] = result
    if entry["state"] in ("failed", "timeout", "killed"):
        entry["output_tail"] = rec.tail[-2000:]
    return entry


def verdict(stages: list[dict[str, Any]], final: bool) -> str:
    """Over the stages of this call: ``running`` until the end (the last report of a run
    killed from outside says so), then ``failed`` (a failure, timeout or kill),
    ``incomplete`` (a stage skipped) or ``passed``."""
    states = {s["state"] for s in stages if s["state"] not in ("later", "excluded")}
    if not final:
        return "running"
    if states & {"failed", "timeout", "killed"}:
        return "failed"
    return "incomplete" if states & {"skipped", "pending", "running"} else "passed"


def _result(stages: list[dict[str, Any]], name: str) -> Any:
    for s in stages:
        if s["stage"] == name and isinstance(s.get("result"), dict):
            return s["result"]
    return None


def targets(stages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Issue 23's targets (from the two GPU issues before it) on the measured tables."""
    rows: list[dict[str, str]] = []

    def add(target: str, measured: list[Any], ok: bool, figure: str) -> None:
        rows.append({"target": target, "verdict": "not measured" if not measured else
                     ("met" if ok else "NOT met"), "figure": figure if measured else ""})

    k = _result(stages, "kernels")
    dec = (k or {}).get("decode", [])
    pre = (k or {}).get("prefill", [])
    big = [r for r in dec if r["batch"] >= 32 and r["ctx"] >= 2048]
    add("decode >= 85% of copy bandwidth at batch >= 32 x ctx >= 2k", big,
        all(r["pct_copy"] >= 85 for r in big),
        f"min {min((r['pct_copy'] for r in big), default=_NAN):.1f}%")
    add("decode >= 1.0x torch SDPA at batch >= 32 x ctx >= 2k", big,
        all(r.get("kernel_vs_sdpa", 0) >= 1.0 for r in big),
        f"min {min((r.get('kernel_vs_sdpa', _NAN) for r in big), default=_NAN):.2f}x")
    small = [r for r in dec if r["batch"] == 1 and r["ctx"] == 512]
    best = [min(r["kernel_ms"], r.get("graph_ms", math.inf)) for r in small]
    add("batch 1 x 512 decode < 0.03 ms", small, all(b < 0.03 for b in best),
        f"{best[0]:.3f} ms (kernel {small[0]['kernel_ms']:.3f}, graph "
        f"{small[0].get('graph_ms', _NAN):.3f})" if small else "")
    add("paged prefill >= gather + SDPA on every shape", pre,
        all(r["paged_ms"] <= r["sdpa_ms"] for r in pre),
        f"paged faster on {sum(r['faster'] == 'paged' for r in pre)}/{len(pre)}")
    long8 = [r for r in dec if r["batch"] >= 32 and r["ctx"] >= 4096]
    add("FP8 KV decode <= 0.6x bf16 at batch >= 32 x ctx >= 4k", long8,
        all(r.get("fp8_vs_bf16", math.inf) <= 0.6 for r in long8),
        f"max {max((r.get('fp8_vs_bf16', _NAN) for r in long8), default=_NAN):.2f}")
    f = _result(stages, "fixed_len")
    rate = (f or {}).get("output_tok_per_s")
    add("1000/1000 fixed-length >= 10,000 output tok/s", [f] if f else [],
        bool(rate and rate >= 10_000), f"{rate or _NAN:.0f} output tok/s")
    st = _result(stages, "step_time")
    one = [r for r in (st or {}).get("rows", []) if r["batch"] == 1 and r.get("x_bound")]
    add("batch-1 decode step within 1.3x of the weight-read bound", one,
        all(r["x_bound"] <= 1.3 for r in one), f"{one[0]['x_bound']:.2f}x" if one else "")
    both = [r for r in (st or {}).get("rows", []) if r.get("graphs_ms") and r.get("eager_ms")]
    add("CUDA graphs on vs off measured", both, bool(both),
        ", ".join(f"batch {r['batch']}: {r['graphs_ms']:.2f} vs {r['eager_ms']:.2f} ms"
                  for r in both))
    return rows


def next_calls(stages: list[dict[str, Any]], call: int | None) -> dict[str, Any]:
    """The commands that run what this call did not: later calls, and failed stages again."""
    later: dict[int, list[str]] = {}
    for s in stages:
        if s["state"] == "later" and s["call"] and s["call"] != call:
            later.setdefault(s["call"], []).append(s["stage"])
    redo = [s["stage"] for s in stages if s["state"] in ("failed", "timeout", "killed")]
    out: dict[str, Any] = {"later_calls": [
        {"call": c, "command": f"QWORKER_GPU_CHECK_CALL={c} scripts/gpu_check.sh",
         "stages": names} for c, names in sorted(later.items())]}
    if redo:
        out["rerun_failed"] = f"QWORKER_GPU_CHECK_ONLY='{' '.join(redo)}' scripts/gpu_check.sh"
    return out


def build_report(check: Any, final: bool) -> dict[str, Any]:
    """report.json's content for the state of ``check`` (scripts/gpu_check.py ``Check``)."""
    log_text = check.log.read_text(errors="replace") if check.log.exists() else ""
    stages = [stage_entry(rec, log_text) for rec in check.records]
    info = _result(stages, "info")
    return {
        "check": "qworker scripts/gpu_check.sh", "dry_run": check.dry,
        "call": check.call, "budget_s": check.budget,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(check.started)),
        "elapsed_s": round(time.time() - check.started, 1), "final": final,
        "verdict": verdict(stages, final), "machine": info, "stages": stages,
        "targets": targets(stages), "next": next_calls(stages, check.call),
        "files": sorted(p.name for p in check.out.iterdir()), "dropped_files": check.dropped,
    }


def _fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def render_md(report: dict[str, Any]) -> str:
    """report.md: the stage table, failures, the measured tables, targets, what is left."""
    info = report.get("machine") or {}
    md = [f"# qworker GPU check{' (dry run, CPU)' if report['dry_run'] else ''}: "
          f"{report['verdict']}", "",
          f"Call {report['call'] or 'all'}, budget {report['budget_s']} s, started "
          f"{report['started']}, {report['elapsed_s']} s so far. Machine: "
          f"{info.get('gpu', 'cpu')} x{info.get('gpu_count', 0)}, torch {info.get('torch')}, "
          f"cupy {info.get('cupy')}, NVRTC {info.get('nvrtc')}", "",
          "| stage | call | state | limit s | seconds | note |",
          "| --- | --- | --- | --- | --- | --- |"]
    for s in report["stages"]:
        note = s.get("reason", "")
        p = s.get("pytest")
        if p and "tests" in p:
            note = (f"{p['passed']} passed, {p['failures']} failed, {p['errors']} errors, "
                    f"{p['skipped']} skipped" + (f"; {note}" if note else ""))
        md.append(f"| {s['stage']} | {s['call'] or 'each'} | {s['state']} | {s['limit_s']} | "
                  f"{_fmt(s.get('seconds'), '.0f')} | {note} |")
    for s in report["stages"]:
        for f in (s.get("pytest") or {}).get("failed", []):
            md.append(f"- {s['stage']}: {f['kind'].upper()} {f['test']}: {f['message'][:300]}")
        if (s.get("pytest") or {}).get("running_when_stopped"):
            md.append(f"- {s['stage']}: stopped while running "
                      f"{s['pytest']['running_when_stopped']}")
    k = _result(report["stages"], "kernels")
    if k:
        md += ["", f"Decode (32 q / 8 kv heads, head 128, {k.get('dtype')}, block 16); copy "
               f"bandwidth {_fmt(k.get('copy_gbps'), '.0f')} GB/s", "",
               "| batch | ctx | plan | new ms | graph ms | % copy | old ms | fp8/bf16 | x SDPA |",
               "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        md += [f"| {r['batch']} | {r['ctx']} | {r['plan']} | {_fmt(r.get('kernel_ms'))} | "
               f"{_fmt(r.get('graph_ms'))} | {_fmt(r.get('pct_copy'), '.1f')} | "
               f"{_fmt(r.get('old_ms'))} | {_fmt(r.get('fp8_vs_bf16'), '.2f')} | "
               f"{_fmt(r.get('kernel_vs_sdpa'), '.2f')} |" for r in k.get("decode", [])]
        md += ["", "| prefill chunk | ctx | seqs | gather+SDPA ms | paged ms | fp8 paged ms | "
               "faster | rule |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        md += [f"| {r['chunk']} | {r['ctx']} | {r['seqs']} | {_fmt(r.get('sdpa_ms'))} | "
               f"{_fmt(r.get('paged_ms'))} | {_fmt(r.get('fp8_paged_ms'))} | {r.get('faster')} | "
               f"{r.get('rule')} |" for r in k.get("prefill", [])]
    st = _result(report["stages"], "step_time")
    if st:
        md += ["", f"Decode step ({st.get('model')}, {st.get('dtype')}, backend "
               f"{st.get('attention_backend')}, graphs {st.get('cuda_graphs')}, startup "
               f"{_fmt(st.get('startup_s'), '.1f')} s)", "",
               "| batch | graphs ms | eager ms | bound ms | x bound | tok/s |",
               "| --- | --- | --- | --- | --- | --- |"]
        md += [f"| {r['batch']} | {_fmt(r.get('graphs_ms'), '.2f')} | "
               f"{_fmt(r.get('eager_ms'), '.2f')} | {_fmt(r.get('bound_ms'), '.2f')} | "
               f"{_fmt(r.get('x_bound'), '.2f')} | {_fmt(r.get('output_tok_s'), '.0f')} |"
               for r in st.get("rows", [])]
    f = _result(report["stages"], "fixed_len")
    if f:
        md += ["", f"Fixed length ({f.get('workload')}, {f.get('model')}): "
               f"{_fmt(f.get('output_tok_per_s'), '.0f')} output tok/s, "
               f"{_fmt(f.get('req_per_s'), '.2f')} req/s, backend {f.get('attention_backend')}, "
               f"self-test {f.get('kernel_selftest')}"]
    md += ["", "| target | verdict | figure |", "| --- | --- | --- |"]
    md += [f"| {t['target']} | {t['verdict']} | {t['figure']} |" for t in report["targets"]]
    nxt = report["next"]
    if nxt["later_calls"] or nxt.get("rerun_failed"):
        md += ["", "Still to run:"]
        md += [f"- `{c['command']}`: {' '.join(c['stages'])}" for c in nxt["later_calls"]]
        if nxt.get("rerun_failed"):
            md.append(f"- failed here, again: `{nxt['rerun_failed']}`")
    if report["dropped_files"]:
        md += ["", f"Not brought back (not a report file): {', '.join(report['dropped_files'])}"]
    return "\n".join(md) + "\n"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_report(check: Any, final: bool = False) -> dict[str, Any]:
    """Rewrite report.json and report.md in ``check.out`` (each replaced atomically)."""
    report = build_report(check, final)
    _atomic_write(check.out / "report.json", json.dumps(report, indent=1) + "\n")
    _atomic_write(check.out / "report.md", render_md(report))
    report["files"] = sorted(p.name for p in check.out.iterdir())
    return report
