"""Hostile input for the campaign: messages built to break a worker, and what each must become.

Each case is a raw message body. A case with a ``custom_id`` must end as exactly one
record under its key with the expected code (``invalid_request`` for input that is too
deep, too large, out of range or not valid unicode; ``ok`` for odd but valid input); a
case without one must reach a dead-letter target (the source's, or the sink's
``_dead_letters/`` when the target refuses it). Every id carries the case's name, and
the batch id is the campaign's (sent first, or last for ``oversized``: a message over
``max_job_bytes`` is answered from a bounded scan of its raw bytes).

The cases (docs/reliability.md, "The hostile-input campaign"): JSON nested thousands of
levels deep in every field a job reaches (``guided_json`` as text, a
``response_format`` schema, message content, ``guided_choice``, ``logit_bias``,
``structured_outputs.json`` as text, ``metadata``), a job over ``max_job_bytes`` with
its batch id at the end, numbers no double holds, a 30-digit seed, 500 stop strings,
``n`` of 100,000, token ids outside the vocabulary, lone surrogate escapes in a
custom_id and in content, duplicate keys, odd unicode, and messages that are no job at
all (nested past any parser, oversized without an id, a bare number, an object without
an id, truncated,
invalid UTF-8, NUL bytes).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class Hostile:
    """One hostile message and its required outcome.

    ``custom_id`` None: it must be dead-lettered. Otherwise ``code`` is the record's
    expected code (``"ok"`` for a served job, whose answer must carry ``nonce``).
    """

    kind: str
    body: bytes
    custom_id: str | None = None
    code: str | None = None
    nonce: str | None = None


def _nest_object(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


def _nest_array(depth: int, leaf: str = "") -> str:
    return "[" * depth + leaf + "]" * depth


def _chat(cid: str, batch: str, extra: str = "", content: str = '"hi"') -> bytes:
    return (f'{{"custom_id":{json.dumps(cid)},"batch_id":{json.dumps(batch)},'
            f'"url":"/v1/chat/completions","body":{{"messages":[{{"role":"user",'
            f'"content":{content}}}],"max_tokens":24{extra}}}}}').encode()


def _completion(cid: str, batch: str, extra: str = "", prompt: str = '"hi"') -> bytes:
    return (f'{{"custom_id":{json.dumps(cid)},"batch_id":{json.dumps(batch)},'
            f'"url":"/v1/completions","body":{{"prompt":{prompt},"max_tokens":24{extra}}}}}'
            ).encode()


Builder = Callable[[str, str, str, int], Hostile]


def _invalid(kind: str, make: Callable[[str, str, int], bytes]) -> Builder:
    def build(cid: str, batch: str, nonce: str, limit: int) -> Hostile:
        return Hostile(kind, make(cid, batch, limit), cid, "invalid_request")
    return build


def _oversized(cid: str, batch: str, nonce: str, limit: int) -> Hostile:
    filler = "x" * (limit + 4096)
    body = (f'{{"custom_id":{json.dumps(cid)},"url":"/v1/completions","body":{{"prompt":'
            f'"{filler}"}},"batch_id":{json.dumps(batch)}}}').encode()
    return Hostile("oversized", body, cid, "invalid_request")


def _odd_unicode(cid: str, batch: str, nonce: str, limit: int) -> Hostile:
    content = json.dumps(f"{nonce} \u202eRTL \u0000NUL 😀 \u200b zero-width", ensure_ascii=True)
    return Hostile("odd_unicode", _chat(cid, batch, content=content), cid, "ok", nonce)


def _duplicate_keys(cid: str, batch: str, nonce: str, limit: int) -> Hostile:
    # Parsers keep the last of duplicate keys; so must every reader of the raw bytes.
    body = (f'{{"custom_id":"decoy-never-answered","batch_id":{json.dumps(batch)},'
            f'"url":"/v1/completions","body":{{"prompt":"{nonce} dup","max_tokens":24}},'
            f'"custom_id":{json.dumps(cid)}}}').encode()
    return Hostile("duplicate_keys", body, cid, "ok", nonce)


def _dead(kind: str, make: Callable[[int, int], bytes], binary: bool = False) -> Builder:
    def build(cid: str, batch: str, nonce: str, limit: int) -> Hostile:
        return Hostile(kind, make(limit, int(cid.rsplit("-", 1)[1])))
    build.binary = binary  # type: ignore[attr-defined]
    return build


CASES: dict[str, Builder] = {
    "deep_guided_json_text": _invalid("deep_guided_json_text", lambda c, b, _: _chat(
        c, b, f',"guided_json":{json.dumps(_nest_object(3000))}')),
    "deep_schema": _invalid("deep_schema", lambda c, b, _: _chat(
        c, b, ',"response_format":{"type":"json_schema","json_schema":{"name":"s","schema":'
        + _nest_object(300) + "}}")),
    "deep_content": _invalid("deep_content", lambda c, b, _: _chat(
        c, b, content=_nest_array(1000))),
    "deep_choice": _invalid("deep_choice", lambda c, b, _: _chat(
        c, b, ',"guided_choice":' + _nest_array(1000, '"a"'))),
    "deep_logit_bias": _invalid("deep_logit_bias", lambda c, b, _: _chat(
        c, b, ',"logit_bias":{"5":' + _nest_array(1000) + "}")),
    "deep_structured_text": _invalid("deep_structured_text", lambda c, b, _: _chat(
        c, b, f',"structured_outputs":{{"json":{json.dumps(_nest_array(5000))}}}')),
    "deep_metadata": _invalid("deep_metadata", lambda c, b, _: _completion(c, b)[:-1]
                              + b',"metadata":{"m":' + _nest_array(200).encode() + b"}}"),
    "oversized": _oversized,
    "infinite_number": _invalid("infinite_number", lambda c, b, _: _chat(
        c, b, ',"temperature":1e400')),
    "huge_seed": _invalid("huge_seed", lambda c, b, _: _chat(
        c, b, ',"seed":123456789012345678901234567890')),
    "many_stops": _invalid("many_stops", lambda c, b, _: _chat(
        c, b, ',"stop":' + json.dumps([f"s{k}" for k in range(500)]))),
    "huge_n": _invalid("huge_n", lambda c, b, _: _chat(c, b, ',"n":100000')),
    "token_ids_out_of_vocab": _invalid("token_ids_out_of_vocab", lambda c, b, _: _completion(
        c, b, prompt=json.dumps([70_000 + k for k in range(2000)]))),
    "lone_surrogate_content": _invalid("lone_surrogate_content", lambda c, b, _: _chat(
        c, b, content='"\\udc80 broken"')),
    "odd_unicode": _odd_unicode,
    "duplicate_keys": _duplicate_keys,
    "lone_surrogate_id": _dead("lone_surrogate_id", lambda limit, k: (
        '{"custom_id":"\\ud800-' + str(k) + '","url":"/v1/completions","body":{"prompt":"x"}}'
    ).encode()),
    "nested_past_any_parser": _dead("nested_past_any_parser",
                                    lambda limit, k: _nest_array(5000 + k).encode()),
    "oversized_without_id": _dead("oversized_without_id", lambda limit, k: (
        '{"url":"/v1/completions","body":{"prompt":"' + "y" * (limit + 4096 + k) + '"}}'
    ).encode()),
    "bare_number": _dead("bare_number", lambda limit, k: f"1e{400 + k}".encode()),
    "no_custom_id": _dead("no_custom_id", lambda limit, k: b'{"n":%d}' % k),
    "truncated": _dead("truncated", lambda limit, k: (
        '{"custom_id":"cut-' + str(k) + '","url":"/v1/completions","body":{"prompt":"x'
    ).encode()),
    "invalid_utf8": _dead("invalid_utf8", lambda limit, k: b'{"custom_id":"\xff\xfe-%d"}' % k,
                          binary=True),
    "nul_bytes": _dead("nul_bytes", lambda limit, k: b"\x00" * (k + 1) + b'{"custom_id":"z"}',
                       binary=True),
}


def make_hostile(n: int, batch_id: str, rng: random.Random, max_job_bytes: int,
                 text_only: bool = False) -> list[Hostile]:
    """``n`` hostile messages cycling through ``CASES`` (``text_only``: none that a text
    queue such as SQS cannot carry: invalid UTF-8, NUL bytes)."""
    kinds = [k for k, b in CASES.items() if not (text_only and getattr(b, "binary", False))]
    out: list[Hostile] = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        nonce = f"nonce{rng.getrandbits(48):012x}"
        out.append(CASES[kind](f"hostile-{kind}-{i}", batch_id, nonce, max_job_bytes))
    return out
