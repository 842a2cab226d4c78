"""Repository hygiene: no committed conflict markers, no citations of files users never see."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_MARKER = re.compile(r"^(<{7} |>{7} |={7}$)", re.MULTILINE)


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True,
                         text=True, check=False).stdout.split()
    return [ROOT / p for p in out if (ROOT / p).is_file()]


def test_no_merge_conflict_markers_are_committed() -> None:
    files = _tracked("*.py", "*.md", "*.cu", "*.cuh", "*.sh", "*.toml", "*.yaml", "*.json")
    assert files, "git ls-files found nothing"
    bad = [str(p.relative_to(ROOT)) for p in files
           if _MARKER.search(p.read_text(encoding="utf-8", errors="replace"))]
    assert bad == []


def test_code_and_docs_cite_the_projects_own_docs_only() -> None:
    files = _tracked("qworker", "scripts", "docs", "deploy", "README.md", "cuda")
    bad = [str(p.relative_to(ROOT)) for p in files
           if re.search(r"DESIGN\.md|ENGINE_API|WORKER_API",
                        p.read_text(encoding="utf-8", errors="replace"))]
    assert bad == []
