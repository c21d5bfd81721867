"""Reading what an OpenAI-compatible vLLM server answers (notebook 03).

The openai client returns typed objects whose fields are easy to print and hard to *understand*.  These
helpers lay a response out as a table with one line per field and what it means, time a streamed request
(time to first token, inter-token gaps), and turn the server's 400 errors into one plain sentence.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

# What each field of a completion / chat completion means.  Keys are dotted paths with the choice index
# and the list index written as [i]; fields not listed here are vLLM extensions and say so.
MEANINGS = {
    "id": "unique id of this request (vLLM: 'cmpl-...' or 'chatcmpl-...'); quote it when reporting a problem",
    "object": "'text_completion' for /v1/completions, 'chat.completion' for /v1/chat/completions",
    "created": "Unix time (seconds) when the server created the response",
    "model": "the served model name that answered (--served-model-name)",
    "system_fingerprint": "the engine build that answered (vLLM puts its version here)",
    "choices[i].index": "which of the n completions this is (n=1 by default)",
    "choices[i].text": "the generated text (prompt not included unless echo=True)",
    "choices[i].message.role": "always 'assistant' for the reply",
    "choices[i].message.content": "the generated reply",
    "choices[i].finish_reason": "'length' = max_tokens reached; 'stop' = end-of-text token or a stop string",
    "choices[i].stop_reason": "what stopped it: the stop string, a stop token id, or None for end-of-text",
    "choices[i].logprobs": "per-token log-probabilities if requested (logprobs=N); see notebook 05",
    "choices[i].prompt_logprobs": "vLLM extension: log-probabilities of the prompt tokens (prompt_logprobs=N)",
    "usage.prompt_tokens": "tokens the model read (after the chat template, if any, and the BOS token)",
    "usage.completion_tokens": "tokens the model generated",
    "usage.total_tokens": "prompt_tokens + completion_tokens: what a request costs",
}


def _flatten(value: Any, path: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [row for k, v in value.items() for row in _flatten(v, f"{path}.{k}" if path else k)]
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return [row for i, v in enumerate(value) for row in _flatten(v, f"{path}[{i}]")]
    return [(path, value)]


def _meaning(path: str) -> str:
    return MEANINGS.get(re.sub(r"\[\d+\]", "[i]", path), "vLLM extension (not in the OpenAI specification)")


def annotate(response: Any, include_empty: bool = False):
    """A pandas table of every field of a response: path, value, and what it means.

    Empty vLLM extension fields (None) are left out unless ``include_empty``, so the table shows what
    this response actually says.
    """
    import pandas as pd

    data = response.model_dump() if hasattr(response, "model_dump") else dict(response)
    rows = []
    for path, value in _flatten(data):
        meaning = _meaning(path)
        if value is None and not include_empty and path not in MEANINGS and "stop_reason" not in path:
            continue
        if path == "created":
            value = f"{value} ({datetime.fromtimestamp(value, UTC):%Y-%m-%d %H:%M:%S} UTC)"
        rows.append({"field": path, "value": value, "meaning": meaning})
    return pd.DataFrame(rows)


@dataclass
class StreamResult:
    """A streamed completion, with the timings a user feels: when the first token came, and the gaps."""

    text: str = ""
    chunks: list[str] = field(default_factory=list)
    ttft: float | None = None  # seconds from sending to the first non-empty chunk
    arrivals: list[float] = field(default_factory=list)  # seconds since sending, one per non-empty chunk
    finish_reason: str | None = None
    usage: Any = None

    @property
    def total(self) -> float:
        return self.arrivals[-1] if self.arrivals else 0.0

    @property
    def inter_token_gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]


def stream_completion(client, model: str, prompt: str, on_text=None, **params) -> StreamResult:
    """Send a streamed /v1/completions request; call ``on_text(piece)`` as each piece arrives."""
    result = StreamResult()
    start = time.perf_counter()
    stream = client.completions.create(model=model, prompt=prompt, stream=True,
                                       stream_options={"include_usage": True}, **params)
    for chunk in stream:
        if chunk.usage is not None:
            result.usage = chunk.usage
        for choice in chunk.choices:
            if choice.text:
                now = time.perf_counter() - start
                result.ttft = now if result.ttft is None else result.ttft
                result.arrivals.append(now)
                result.chunks.append(choice.text)
                if on_text:
                    on_text(choice.text)
            if choice.finish_reason:
                result.finish_reason = choice.finish_reason
    result.text = "".join(result.chunks)
    return result


def describe_error(error: Exception) -> str:
    """One sentence for an error the server returned: status, what it said, and which parameter."""
    status = getattr(error, "status_code", None)
    body = getattr(error, "body", None)
    message = body.get("message") if isinstance(body, dict) else None
    message = message or str(error)
    param = body.get("param") if isinstance(body, dict) else None
    where = f" (parameter {param!r})" if param else ""
    return f"HTTP {status}: the server refused the request{where}: {message.strip()}"
