"""The campaign's job set: mostly valid chat/completion jobs, some invalid, some poison.

Every job carries a nonce in its prompt so the checker can tell that a result
answers *its* job (the echo engine echoes the prompt). ``expected`` maps each
custom_id to the outcome the worker must record: ``"ok"`` or an error code.
Poison messages are not JSON objects: they must end in the dead-letter target and
produce no result object. Engine-poison jobs carry ``ENGINE_POISON`` in their prompt:
every engine step they are in fails, so the worker must find them by bisection and
give them (only them) an ``engine_error`` record. Conflicts are second, different
requests reusing the custom_id of a valid job (``conflict_lines``, produced around
``qworker produce``, which refuses duplicate ids): the stored result must answer one
of the two, and the other must have exactly one ``duplicate_custom_id`` record.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

# custom_ids that stress the key scheme: separators, dot segments, encodings, unicode, size.
ENGINE_POISON = "BOOM-STEP"
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
    conflict_lines: list[dict] = field(default_factory=list)  # a second request per id
    conflict_nonces: dict[str, str] = field(default_factory=dict)  # its nonce, by custom_id

    def write(self, path: Path) -> None:
        """Write the valid-JSON jobs as an OpenAI batch input file."""
        with path.open("w", encoding="utf-8") as f:
            for line in self.lines:
                f.write(json.dumps(line, ensure_ascii=False) + "\n")


def make_jobs(n: int, batch_id: str, rng: random.Random, invalid_share: float = 0.02,
              poison: int = 5, max_tokens: int = 24, engine_poison: int = 0,
              conflicts: int = 0) -> JobSet:
    """Build ``n`` result-producing jobs (a few invalid, ``engine_poison`` breaking the
    engine), ``poison`` poison messages and ``conflicts`` second requests under used ids."""
    js = JobSet(batch_id)
    breakers = set(rng.sample(range(len(_ODD_IDS), n), min(engine_poison, n - len(_ODD_IDS))))
    for i in range(n):
        cid = f"job-{i:06d}"
        if i < len(_ODD_IDS):
            cid = f"{_ODD_IDS[i]}-{i}"
        nonce = f"nonce{rng.getrandbits(48):012x}"
        body: dict = {"model": "echo", "max_tokens": max_tokens, "temperature": 0}
        # The nonce comes first so that the echo's first max_tokens bytes carry it.
        if i % 2:
            url = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": f"{nonce} summarize please"}]
        else:
            url = "/v1/completions"
            body["prompt"] = f"{nonce} complete now"
        outcome = "ok"
        if i in breakers:
            body["prompt" if url == "/v1/completions" else "messages"] = (
                f"{nonce} {ENGINE_POISON}" if url == "/v1/completions"
                else [{"role": "user", "content": f"{nonce} {ENGINE_POISON}"}])
            outcome = "engine_error"
        elif i >= len(_ODD_IDS) and rng.random() < invalid_share:
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
    valid = [line for line in js.lines if js.expected[line["custom_id"]] == "ok"]
    for line in rng.sample(valid, min(conflicts, len(valid))):
        nonce = f"nonce{rng.getrandbits(48):012x}"
        body = {"model": "echo", "max_tokens": max_tokens, "temperature": 0,
                "prompt": f"{nonce} from another batch"}
        js.conflict_lines.append({"custom_id": line["custom_id"], "method": "POST",
                                  "url": "/v1/completions", "body": body, "batch_id": batch_id})
        js.conflict_nonces[line["custom_id"]] = nonce
    return js
