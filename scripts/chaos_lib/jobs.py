"""The campaign's job set: mostly valid chat/completion jobs, some invalid, some poison.

Every job carries a nonce in its prompt so the checker can tell that a result
answers *its* job (the echo engine echoes the prompt). ``expected`` maps each
custom_id to the outcome the worker must record: ``"ok"`` or an error code.
Poison messages are not JSON objects: they must end in the dead-letter target and
produce no result object.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

# custom_ids that stress the key scheme: separators, dot segments, encodings, unicode, size.
_ODD_IDS = ["a/b/../c", "../../etc/passwd", "%2e%2e", "..", "sp ace", "new\nline",
            "ünïcødé-ключ", "emoji-😀", "x" * 1100, "nul\x00byte", "back\\slash", "q?a=1#f"]


@dataclass(slots=True)
class JobSet:
    """The jobs of one campaign and what each must produce."""

    batch_id: str
    lines: list[dict] = field(default_factory=list)
    expected: dict[str, str] = field(default_factory=dict)   # custom_id -> "ok" | error code
    nonces: dict[str, str] = field(default_factory=dict)     # custom_id -> prompt nonce
    poison: list[bytes] = field(default_factory=list)

    def write(self, path: Path) -> None:
        """Write the valid-JSON jobs as an OpenAI batch input file."""
        with path.open("w", encoding="utf-8") as f:
            for line in self.lines:
                f.write(json.dumps(line, ensure_ascii=False) + "\n")


def make_jobs(n: int, batch_id: str, rng: random.Random, invalid_share: float = 0.02,
              poison: int = 5, max_tokens: int = 8) -> JobSet:
    """Build ``n`` result-producing jobs (a few of them invalid) plus ``poison`` poison messages."""
    js = JobSet(batch_id)
    for i in range(n):
        cid = f"job-{i:06d}"
        if i < len(_ODD_IDS):
            cid = f"{_ODD_IDS[i]}-{i}"
        nonce = f"nonce{rng.getrandbits(48):012x}"
        body: dict = {"model": "echo", "max_tokens": max_tokens, "temperature": 0}
        if i % 2:
            url = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": f"Summarize {nonce} please"}]
        else:
            url = "/v1/completions"
            body["prompt"] = f"Complete {nonce} now"
        outcome = "ok"
        if i >= len(_ODD_IDS) and rng.random() < invalid_share:
            if rng.random() < 0.5:
                body["tools"] = [{"type": "function", "function": {"name": "f"}}]
            else:
                body["temperature"] = -3
            outcome = "invalid_request"
        js.lines.append({"custom_id": cid, "method": "POST", "url": url, "body": body,
                         "batch_id": batch_id})
        js.expected[cid] = outcome
        js.nonces[cid] = nonce
    for k in range(poison):
        js.poison.append(b"not json %d \xff\xfe {" % k if k % 2 == 0 else b"[%d, 2, 3]" % k)
    return js
