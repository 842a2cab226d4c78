"""`make run`'s workload on a baseline tree and on this tree, side by side, in one go.

Each round runs ``python -m qworker run --until-idle 5`` (exactly what ``make run`` runs)
once per tree, alternating, each in a fresh temporary folder holding a copy of
``examples/requests.jsonl`` (so no progress file is left over) with that tree first on
``PYTHONPATH``. The figure is the worker's own run summary line,
``tokens: prompt P, generated G in S s = X tok/s``: generated tokens over the seconds
from the worker's start (engine loaded) to its last stored result (the ``--until-idle``
wait afterwards is not counted). The process wall time, model load included, is printed
beside it. The nine answers of both trees are compared and any difference is reported.
Prints a table, the ratio of the medians, and one JSON line. Never asserts on speed.

    python scripts/bench_make_run.py --baseline /tmp/base [--rounds 3] [--threads N]

``--baseline`` is a checkout of the tree to compare against (``git worktree add
/tmp/base ca47ce0``). ``--threads`` sets ``OMP_NUM_THREADS`` for both runs (default:
unset, each tree's own choice).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_SUMMARY = re.compile(
    r"tokens: prompt (\d+), generated (\d+) in ([\d.]+)s = ([\d.]+) tok/s"
)


def run_once(tree: Path, python: str, threads: int | None) -> dict:
    """One ``qworker run --until-idle 5`` of ``tree`` in a fresh folder; its figures."""
    with tempfile.TemporaryDirectory(prefix="bench_make_run_") as tmp:
        work = Path(tmp)
        (work / "examples").mkdir()
        shutil.copy(ROOT / "examples" / "requests.jsonl", work / "examples" / "requests.jsonl")
        env = dict(os.environ, PYTHONPATH=str(tree), QWORKER_METRICS_PORT="0")
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        started = time.monotonic()
        proc = subprocess.run(
            [python, "-m", "qworker", "run", "--until-idle", "5"],
            cwd=work, env=env, capture_output=True, text=True, timeout=600,
        )
        wall = time.monotonic() - started
        match = _SUMMARY.search(proc.stderr)
        if proc.returncode != 0 or match is None:
            raise RuntimeError(f"{tree}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        answers = {}
        for path in sorted((work / "results").rglob("*.json")):
            if "_fingerprints" in path.parts:
                continue
            record = json.loads(path.read_text())
            if isinstance(record, dict) and "custom_id" in record:
                answers[record["custom_id"]] = _answer(record)
        return {
            "prompt_tokens": int(match.group(1)),
            "generated_tokens": int(match.group(2)),
            "window_s": float(match.group(3)),
            "tok_s": float(match.group(4)),
            "process_wall_s": round(wall, 2),
            "answers": answers,
        }


def _answer(record: dict) -> str:
    """The generated text of one result record (chat or completion shape)."""
    body = record.get("response", {}).get("body", record)
    choices = body.get("choices") or [{}]
    choice = choices[0]
    if "message" in choice:
        return str(choice["message"].get("content"))
    return str(choice.get("text"))


def main() -> None:
    """Parse flags, run the rounds, print the table and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, required=True,
                        help="checkout of the tree to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP_NUM_THREADS for both trees (default: unset)")
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args()
    trees = {"baseline": args.baseline.resolve(), "current": ROOT}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name, tree in trees.items():
            res = run_once(tree, args.python, args.threads)
            runs[name].append(res)
            print(f"round {r + 1} {name:8s}: {res['generated_tokens']} tokens in "
                  f"{res['window_s']:.1f}s = {res['tok_s']:.1f} tok/s "
                  f"(process {res['process_wall_s']:.1f}s)", flush=True)
    med = {name: statistics.median(x["tok_s"] for x in rs) for name, rs in runs.items()}
    ratio = med["current"] / med["baseline"]
    base_answers = runs["baseline"][0]["answers"]
    differ = sorted(
        k for rs in runs["current"] for k, v in rs["answers"].items() if base_answers.get(k) != v
    )
    print(f"\nmake run tok/s (median of {args.rounds}): baseline {med['baseline']:.1f}, "
          f"current {med['current']:.1f}, ratio {ratio:.2f}x")
    print("answers: " + ("identical" if not differ else f"DIFFER in {sorted(set(differ))}"))
    print(json.dumps({
        "bench": "make_run",
        "rounds": args.rounds,
        "threads": args.threads,
        "baseline_tok_s": [x["tok_s"] for x in runs["baseline"]],
        "current_tok_s": [x["tok_s"] for x in runs["current"]],
        "baseline_window_s": [x["window_s"] for x in runs["baseline"]],
        "current_window_s": [x["window_s"] for x in runs["current"]],
        "median_ratio": round(ratio, 3),
        "answers_identical": not differ,
    }))


if __name__ == "__main__":
    main()
