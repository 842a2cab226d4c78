"""The body of a served ``/v1/responses`` job: OpenAI's ``Response`` object.

docs/formats.md, "Responses jobs": one assistant ``message`` output item holding one
``output_text`` part; ``status`` ``completed``, or ``incomplete`` with
``incomplete_details.reason`` ``max_output_tokens`` when generation was cut by length;
``usage`` in the Responses names. The request fields a ``Response`` echoes come from
``Job.echo`` (``schema/responses.py``). Only the body: the batch line around it is
``records.success_record``'s.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from qworker.engine.outputs import RequestOutput
from qworker.schema.jobs import Job


def response_body(job: Job, output: RequestOutput, model: str, hex_id: str,
                  created: int | None = None) -> dict[str, Any]:
    """The ``Response`` object of a responses job the engine finished (one completion).

    ``hex_id`` is shared with the line's ``request_id``; ``model`` is the served name.
    """
    echo = job.echo or {}
    comp = min(output.outputs, key=lambda c: c.index)
    cut = comp.finish_reason == "length"
    input_tokens = len(output.prompt_token_ids)
    output_tokens = len(comp.token_ids)
    message = {
        "type": "message",
        "id": f"msg_{uuid.uuid4().hex}",
        "status": "incomplete" if cut else "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": comp.text, "annotations": []}],
    }
    return {
        "id": f"resp_{hex_id}",
        "object": "response",
        "created_at": int(time.time()) if created is None else created,
        "status": "incomplete" if cut else "completed",
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "instructions": echo.get("instructions"),
        "max_output_tokens": echo.get("max_output_tokens"),
        "max_tool_calls": None,
        "model": model,
        "output": [message],
        "parallel_tool_calls": echo.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "temperature": job.params.temperature,
        "text": echo.get("text", {"format": {"type": "text"}}),
        "tool_choice": echo.get("tool_choice", "auto"),
        "tools": [],
        "top_p": job.params.top_p,
        "truncation": echo.get("truncation", "disabled"),
        "usage": {
            "input_tokens": input_tokens,
            # cached: prompt tokens served from the prefix cache; nothing is billed for
            # writing it, so cache_write_tokens (required by the SDK's type) is 0.
            "input_tokens_details": {"cached_tokens": output.num_cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens,
        },
        "user": echo.get("user"),
        "metadata": echo.get("metadata") or {},
    }
