"""What a room's learner sends, as the learner's kernel saw it: one JSON line per HTTP request.

Why in the kernel: the latency a room cares about is the one its learners wait for, including their own client
stack and a busy notebook machine; the server's histograms leave that out.  ``llmlab room`` runs a hidden first cell
in every learner kernel that calls :func:`install`; nothing in the lessons changes.  The path reaches the server
through three HTTP stacks, and each is observed where it hands bytes over, without changing what it sends:

- httpx and httpx2 (lesson 02's own ``httpx.get``; the ``openai`` client, which since 3.x sends through httpx2, its
  fork): the transport's response stream is wrapped, so a request ends when its body was read to the end (a
  stream: its last event);
- aiohttp (``llmlab.loadtest``, lesson 06): a ``TraceConfig`` added to every session sees the request body and the
  answer's head; the body's reads are teed, and the request ends at its EOF or when the response is released;
- urllib (``/metrics`` scrapes, ``connect()``'s registration wait): start to the answer's head.

Each line: ``start`` (Unix time), ``lib``, ``method``, ``path``, ``status``, ``ttfb_s`` (to the answer's head),
``elapsed_s`` (to the body's end), ``stream``, ``max_tokens``, ``prompt`` (the prompt, or the chat messages),
``params`` (the other sampling fields), ``prompt_tokens``, ``completion_tokens`` (the server's usage where it sent
one; else the streamed events counted, with ``tokens_counted: true``), ``notebook`` and ``error``.  The key is never
written.  ``room.replay`` sends these prompts again.
"""

from __future__ import annotations

import json
import threading
import time

_LOCK = threading.Lock()
_STATE: dict = {"path": None, "notebook": "", "installed": False}
MAX_BODY = 1 << 20  # bytes of an answer kept to read its usage; a larger one (none on the path) is cut
PARAMS = ("temperature", "top_p", "top_k", "min_p", "seed", "logprobs", "prompt_logprobs", "ignore_eos", "n",
          "stop", "min_tokens", "echo", "stream_options")


class Call:
    """One request from its first byte sent to its last byte read."""

    def __init__(self, lib: str, method: str, url: str, body: bytes | None):
        self.t0 = time.perf_counter()
        self.line: dict = {"start": time.time(), "lib": lib, "method": method, "path": _path_of(url),
                           "notebook": _STATE["notebook"]}
        self.line.update(_request_fields(body))
        self.body = bytearray()
        self.done = False

    def answered(self, status: int) -> None:
        self.line["status"] = status
        self.line["ttfb_s"] = round(time.perf_counter() - self.t0, 6)

    def chunk(self, data: bytes) -> None:
        if len(self.body) < MAX_BODY:
            self.body += data[: MAX_BODY - len(self.body)]

    def finish(self, error: str = "") -> None:
        """Write the line once: the body is complete (or the request failed)."""
        if self.done:
            return
        self.done = True
        self.line["elapsed_s"] = round(time.perf_counter() - self.t0, 6)
        if error:
            self.line["error"] = error
        self.line.update(_usage(bytes(self.body)))
        _write(self.line)


def _path_of(url: str) -> str:
    from urllib.parse import urlsplit

    return urlsplit(str(url)).path


def _request_fields(body: bytes | None) -> dict:
    """What the request asked for: the prompt, max_tokens, streaming and sampling fields (never a header)."""
    try:
        data = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        data = None
    if not isinstance(data, dict):
        return {}
    out = {"stream": bool(data.get("stream")), "max_tokens": data.get("max_tokens", data.get("max_completion_tokens"))}
    if "prompt" in data:
        out["prompt"] = data["prompt"]
    elif "messages" in data:
        out["messages"] = data["messages"]
    out["params"] = {k: data[k] for k in PARAMS if k in data}
    return out


def _usage(body: bytes) -> dict:
    """prompt/completion tokens from a JSON answer, or from a stream's events (its usage event, else a count)."""
    text = body.decode("utf-8", errors="replace").strip()
    if not text:
        return {}
    if not text.startswith("data:"):
        try:
            usage = json.loads(text).get("usage") or {}
        except (ValueError, AttributeError):
            return {}
        return {"prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens")}
    usage, events = None, 0
    for line in text.splitlines():
        payload = line[5:].strip() if line.startswith("data:") else ""
        if not payload or payload == "[DONE]":
            continue
        try:
            event = json.loads(payload)
        except ValueError:
            continue
        usage = event.get("usage") or usage
        events += bool(event.get("choices"))
    if usage:
        return {"prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens")}
    return {"completion_tokens": events, "tokens_counted": True}


def _write(line: dict) -> None:
    path = _STATE["path"]
    if not path:
        return
    text = json.dumps(line, default=str) + "\n"
    with _LOCK, open(path, "a") as f:
        f.write(text)


# --- httpx (and httpx2, the openai client's own fork of it) ------------------------------------------------

def _patch_httpx(module) -> None:
    class SyncTee(module.SyncByteStream):
        def __init__(self, inner, call: Call):
            self.inner, self.call = inner, call

        def __iter__(self):
            for data in self.inner:
                self.call.chunk(data)
                yield data
            self.call.finish()

        def close(self) -> None:
            self.call.finish()
            self.inner.close()

    class AsyncTee(module.AsyncByteStream):
        def __init__(self, inner, call: Call):
            self.inner, self.call = inner, call

        async def __aiter__(self):
            async for data in self.inner:
                self.call.chunk(data)
                yield data
            self.call.finish()

        async def aclose(self) -> None:
            self.call.finish()
            await self.inner.aclose()

    def body_of(request) -> bytes | None:
        try:
            return request.content
        except module.RequestNotRead:
            return None

    sync_send, async_send = module.HTTPTransport.handle_request, module.AsyncHTTPTransport.handle_async_request

    def handle_request(self, request):
        call = Call(module.__name__, request.method, str(request.url), body_of(request))
        try:
            response = sync_send(self, request)
        except Exception as e:
            call.finish(f"{type(e).__name__}: {e}")
            raise
        call.answered(response.status_code)
        response.stream = SyncTee(response.stream, call)
        return response

    async def handle_async_request(self, request):
        call = Call(module.__name__, request.method, str(request.url), body_of(request))
        try:
            response = await async_send(self, request)
        except Exception as e:
            call.finish(f"{type(e).__name__}: {e}")
            raise
        call.answered(response.status_code)
        response.stream = AsyncTee(response.stream, call)
        return response

    module.HTTPTransport.handle_request = handle_request
    module.AsyncHTTPTransport.handle_async_request = handle_async_request


# --- aiohttp -------------------------------------------------------------------------------------------------
# A TraceConfig sees the request and the answer's head; the body of a streamed answer is read through the
# response's StreamReader, which no trace event covers, so its reads are teed (by the reader's id: it has
# __slots__), and the request ends when the reader says EOF or the response is released.

_OPEN: dict[int, Call] = {}


def _aiohttp_trace():
    import aiohttp

    trace = aiohttp.TraceConfig()

    async def start(session, ctx, params):
        ctx.call = Call("aiohttp", params.method, str(params.url), None)
        ctx.sent = bytearray()

    async def sent(session, ctx, params):
        ctx.sent += params.chunk
        ctx.call.line.update(_request_fields(bytes(ctx.sent)))

    async def answered(session, ctx, params):
        ctx.call.answered(params.response.status)
        _OPEN[id(params.response)] = _OPEN[id(params.response.content)] = ctx.call

    async def failed(session, ctx, params):
        ctx.call.finish(f"{type(params.exception).__name__}: {params.exception}")

    trace.on_request_start.append(start)
    trace.on_request_chunk_sent.append(sent)
    trace.on_request_end.append(answered)
    trace.on_request_exception.append(failed)
    return trace


def _end(*objects) -> None:
    for obj in objects:
        call = _OPEN.pop(id(obj), None)
        if call is not None:
            call.finish()


def _patch_aiohttp() -> None:
    try:
        import aiohttp
        from aiohttp import streams
    except ImportError:
        return
    init = aiohttp.ClientSession.__init__

    def traced_init(self, *args, trace_configs=None, **kwargs):
        init(self, *args, trace_configs=[*(trace_configs or []), _aiohttp_trace()], **kwargs)

    aiohttp.ClientSession.__init__ = traced_init

    def teed(read):
        async def reader(self, *args, **kwargs):
            data = await read(self, *args, **kwargs)
            call = _OPEN.get(id(self))
            if call is not None:
                call.chunk(data)
                if not data or self.at_eof():
                    _end(self)
            return data
        return reader

    streams.StreamReader.readany = teed(streams.StreamReader.readany)
    streams.StreamReader.read = teed(streams.StreamReader.read)
    def ending(original):
        def ended(self):
            _end(self, self.content)
            return original(self)
        return ended

    aiohttp.ClientResponse.release = ending(aiohttp.ClientResponse.release)
    aiohttp.ClientResponse.close = ending(aiohttp.ClientResponse.close)


# --- urllib --------------------------------------------------------------------------------------------------

def _patch_urllib() -> None:
    import urllib.error
    import urllib.request

    urlopen = urllib.request.urlopen

    def traced_urlopen(url, data=None, *args, **kwargs):
        full = url.full_url if isinstance(url, urllib.request.Request) else str(url)
        method = url.get_method() if isinstance(url, urllib.request.Request) else ("POST" if data else "GET")
        call = Call("urllib", method, full, data if isinstance(data, bytes) else None)
        try:
            answer = urlopen(url, data, *args, **kwargs)
        except urllib.error.HTTPError as e:
            call.answered(e.code)
            call.finish()
            raise
        except Exception as e:
            call.finish(f"{type(e).__name__}: {e}")
            raise
        call.answered(answer.status)
        call.finish()
        return answer

    urllib.request.urlopen = traced_urlopen


def install(path: str, notebook: str = "") -> None:
    """Record every request of this process into ``path`` (appended), each tagged with ``notebook``."""
    _STATE.update(path=path, notebook=notebook)
    if _STATE["installed"]:
        return
    import importlib

    for name in ("httpx", "httpx2"):
        try:
            _patch_httpx(importlib.import_module(name))
        except (ImportError, AttributeError):
            continue
    _patch_aiohttp()
    _patch_urllib()
    _STATE["installed"] = True


def read(path) -> list[dict]:
    """A trace file's lines (a line cut by a killed kernel is skipped)."""
    from pathlib import Path

    out = []
    for line in Path(path).read_text().splitlines() if Path(path).exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def is_generation(line: dict) -> bool:
    """A request that makes the server generate (what a room's load is): completions and chat completions."""
    return line.get("method") == "POST" and line.get("path", "").endswith(("/completions", "/chat/completions"))
