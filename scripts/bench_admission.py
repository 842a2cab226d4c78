"""Admission's peak projection: the O(n log n) form against the quadratic one it replaced.

    .venv/bin/python scripts/bench_admission.py [--jobs 250,1000,4000] [--repeat 3]

Prints a table (milliseconds per projection, both forms, and their ratio) and one
JSON line. The quadratic form is the previous ``Admission.peak_blocks`` (an alive x
moments matrix over every sequence); both must agree on every input.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qworker.worker.admission import Admission, Growth


def quadratic_peak(jobs: list[Growth], step: int, block_size: int) -> int:
    """The previous implementation (one vectorized pass over alive x moments)."""
    seqs = [job.at(step) for job in jobs for _ in range(job.n)]
    cur, rem = np.array(seqs, dtype=np.int64).T
    order = np.argsort(-rem, kind="stable")
    cur, rem = cur[order], rem[order]
    moments = np.maximum(rem - 1, 0)
    blocks = -(-(cur[None, :] + moments[:, None]) // block_size)
    alive = np.tri(len(seqs), dtype=bool)
    return int((blocks * alive).sum(axis=1).max())


def _jobs(n: int) -> list[Growth]:
    rng = np.random.default_rng(n)
    return [Admission.growth(int(rng.integers(50, 2000)), int(rng.integers(16, 1024)),
                             int(rng.integers(1, 3)), 4096, int(rng.integers(0, 40)))
            for _ in range(n)]


def _time(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best * 1000


def main() -> int:
    """Run the comparison; see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--jobs", default="250,1000,4000")
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    rows = []
    for n in (int(x) for x in a.jobs.split(",")):
        jobs = _jobs(n)
        new = Admission.peak_blocks(jobs, 40, 16)
        old = quadratic_peak(jobs, 40, 16)
        assert new == old, (n, new, old)
        t_new = _time(lambda jobs=jobs: Admission.peak_blocks(jobs, 40, 16), a.repeat)
        t_old = _time(lambda jobs=jobs: quadratic_peak(jobs, 40, 16), a.repeat)
        rows.append({"jobs": n, "sequences": sum(j.n for j in jobs), "new_ms": round(t_new, 2),
                     "quadratic_ms": round(t_old, 2), "speedup": round(t_old / t_new, 1)})
    print(f"{'jobs':>6} {'seqs':>6} {'new ms':>9} {'quadratic ms':>13} {'speedup':>8}")
    for r in rows:
        print(f"{r['jobs']:>6} {r['sequences']:>6} {r['new_ms']:>9} {r['quadratic_ms']:>13} "
              f"{r['speedup']:>8}")
    print(json.dumps({"bench": "admission_peak", "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
