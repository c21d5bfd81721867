"""Which vLLM answers a request: replicas of one model (least-loaded, or by the prompt's prefix: notebook 15), or
several models behind one endpoint, routed by each body's ``"model"``, with ``/v1/models`` and ``/health`` gathered
from all of them.  An upstream on the network gets its key only after it proves it holds it (``keys.Identity``).
Lesson 15 imports from here and from ``command``, never from ``policy``."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging

import httptools

from llmlab.serve.proxy.answers import ProxyError, error_response, json_response
from llmlab.serve.proxy.keys import proven_stream
from llmlab.serve.proxy.policy import Request

log = logging.getLogger("llmlab.serve.proxy")  # one name for the whole package: its log lines are the proxy's


class Replica:
    """One vLLM behind the proxy: where it listens, the model it serves (None: the proxy routes by no model), the
    ``Authorization`` line it wants (its own key, sent to it alone), and the requests the proxy has in flight to it
    (what least-loaded routing compares) and has sent it in all."""

    def __init__(self, upstream: str, model: str | None = None, key: str | None = None):
        if upstream.startswith("unix:"):
            self.uds, self.address = upstream[5:], None
        elif upstream.startswith("http://"):
            host, _, port = upstream[7:].rstrip("/").rpartition(":")
            if not host or not port.isdigit():
                raise ProxyError(f"--upstream {upstream!r}: give http://127.0.0.1:PORT.")
            self.uds, self.address = None, (host.strip("[]"), int(port))
        else:
            raise ProxyError(f"--upstream {upstream!r}: give unix:/path/to/vllm.sock or http://127.0.0.1:PORT.")
        self.name, self.in_flight, self.sent = upstream, 0, 0
        self.model = model
        self.key = key
        self.auth = b"authorization: Bearer %b\r\n" % key.encode() if key else b""
        # a keyed upstream on the network (another job's proxy) must prove it holds the key before it gets it
        self.prove = bool(key) and self.address is not None


def unproven(replica: Replica) -> str:
    return (f"The job serving {replica.model or 'this server'} no longer proves it is that job: it has ended, or "
            f"another program now listens on its address ({replica.name}). Nothing of this request was sent there; "
            "`llmlab status` shows the job.")


def split_upstream(spec: str) -> tuple[str | None, str]:
    """``--upstream``'s value as ``(model, url)``: ``MODEL=unix:/path`` or ``MODEL=http://host:port`` name the model
    that upstream serves; a bare URL names none (``model`` None)."""
    if spec.startswith(("unix:", "http://")):
        return None, spec
    model, sep, url = spec.partition("=")
    if not sep or not model.strip() or not url.startswith(("unix:", "http://")):
        raise ProxyError(f"--upstream {spec!r}: give unix:/path/vllm.sock or http://HOST:PORT, or MODEL=... before "
                         "either to route between several models by the request's \"model\".")
    return model, url


class Unroutable(Exception):
    """A request that no upstream may take (no model named, a model not served, a body too large to read the model
    from): ``answer`` is the whole error answer the client gets instead."""

    def __init__(self, answer: bytes):
        super().__init__(answer)
        self.answer = answer


# A router of several models reads the "model" of every request body.  Up to MODEL_PARSE_MAX bytes the body is parsed
# as it is (PREFIX_PARSE_MAX's bound: 256 KiB of empty objects parse in about 5 ms on 2 cores); a larger one only if
# it holds at most MODEL_PARSE_ITEMS of '{', '[' and ',' (counted in C, a MiB at a time, strings included, so never
# fewer than the values it holds).  Parsing costs per value more than per byte: a 32 MiB body of empty objects took
# seconds and 900 MB (security-review-2, finding 6) and is now refused after 1 ms of counting; 32,768 objects and
# a MiB of spaces parse in 4 ms and 3.4 MiB; the largest body, a 32 MiB prompt string, costs about 85 ms of the
# loop (29 of them counting).  A prompt that fits a 128k-token context (~500 KB of text) holds some tens of
# thousands of commas; a body over the bound is refused (413), never parsed.
MODEL_PARSE_MAX = 256 * 2**10
MODEL_PARSE_ITEMS = 2**16


def json_object(body: bytes | bytearray) -> dict | None:
    """The JSON object a request body holds, or None (not JSON, or not an object).  Raises ValueError for a body over
    ``MODEL_PARSE_MAX`` that holds more than ``MODEL_PARSE_ITEMS`` values: reading it would cost the event loop (and
    memory) in proportion to them."""
    if len(body) > MODEL_PARSE_MAX and _items_over(body, MODEL_PARSE_ITEMS):
        raise ValueError(f"more than {MODEL_PARSE_ITEMS:,} JSON values in a body of {len(body) // 2**10:,} KiB")
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return request if isinstance(request, dict) else None


def model_of(body: bytes | bytearray) -> str | None:
    """The ``"model"`` a JSON request body names, or None (not a JSON object, or no string ``model``); ValueError as
    :func:`json_object`."""
    model = (json_object(body) or {}).get("model")
    return model if isinstance(model, str) else None




def salted(body: bytes | bytearray, salt: str) -> bytes | bytearray:
    """``body`` with its ``cache_salt`` prefixed by ``salt`` (the learner's own: a salt they send still separates
    their own requests, as lesson 13 shows, but never meets another learner's), or as it was when it is not a JSON
    object (vLLM refuses it then).  vLLM still checks the whole salt (its characters, 128 at most: a learner's own
    may then be 96).  Raises ValueError as :func:`json_object` does for a body too costly to read."""
    request = json_object(body)
    if request is None:
        return body
    theirs = request.get("cache_salt")
    request["cache_salt"] = salt + theirs if isinstance(theirs, str) else salt if theirs is None else theirs
    return json.dumps(request).encode()


def _items_over(body: bytes | bytearray, limit: int, chunk: int = 2**20) -> bool:
    """True once the body's '{', '[' and ',' exceed ``limit``, counted a MiB at a time (stops as soon as they do)."""
    seen = 0
    for start in range(0, len(body), chunk):
        end = start + chunk
        seen += body.count(b",", start, end) + body.count(b"{", start, end) + body.count(b"[", start, end)
        if seen > limit:
            return True
    return False


def merge_models(answers: list[tuple[int, bytes]]) -> dict | None:
    """One ``/v1/models`` list out of several upstreams' answers (``(status, body)`` each): every model of every
    upstream that answered 200 with a list, in the upstreams' order; None when none did."""
    data, answered = [], False
    for status, body in answers:
        try:
            listed = json.loads(body)["data"] if status == 200 else None
        except (ValueError, KeyError, TypeError):
            listed = None
        if isinstance(listed, list):
            answered = True
            data += [m for m in listed if isinstance(m, dict)]
    return {"object": "list", "data": data} if answered else None


GATHER_MAX = 2**20  # bytes of one upstream's answer to a GATHERED path (a /v1/models list is a few hundred)
GATHER_TIMEOUT = 10.0  # seconds one upstream may take to answer it


class _Collected:
    """``httptools`` callbacks that keep one small answer: its body (a GATHERED path's)."""

    def __init__(self):
        self.body, self.complete = bytearray(), False

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.complete = True


# How a proxy with several replicas picks one (notebook 15).  "least-loaded": the one with the fewest requests in
# flight through this proxy.  "prefix": the same prompt beginning always goes to the same replica (so its prefix
# cache is found there, not computed once per replica), unless that replica has ``balance`` more requests in flight
# than the least loaded one: then least-loaded, so that one popular system prompt cannot pile a room onto one GPU.
ROUTES = ("least-loaded", "prefix")
UDS_RETRY = 30.0  # seconds a connection to a vLLM whose socket's backlog is full is tried again (Routing.connect)
PREFIX_CHARS = 256  # characters of the prompt that choose the replica: a system prompt's worth
BALANCE = 16
# Bytes of a body that prefix routing parses, on the event loop: a body of this size made of the smallest JSON
# objects (the worst case) parses in about 10 ms on a 2-core machine, a 32 MiB one took 1.4-4.2 s and 900 MB
# (security-review-2, finding 6).  A prompt of this size is some 60,000 tokens; a larger body goes least-loaded.
PREFIX_PARSE_MAX = 256 * 2**10


def prefix_key(body: bytes | bytearray, chars: int = PREFIX_CHARS) -> bytes | None:
    """What prefix routing hashes: the request's ``cache_salt`` and the first ``chars`` characters of its prompt
    (``prompt``, or the ``messages`` as sent), or None for a body that is not such a JSON request.  The salt counts
    because requests with different salts never share cached blocks (notebook 13), so grouping them gains nothing.
    A body over ``PREFIX_PARSE_MAX`` is not parsed (None)."""
    if len(body) > PREFIX_PARSE_MAX:
        return None
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):  # not JSON: vLLM will say so; any replica can
        return None
    if not isinstance(request, dict):
        return None
    prompt = request.get("prompt", request.get("messages"))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):  # a batch of prompts: the first
        prompt = prompt[0]
    if prompt is None:
        return None
    text = prompt if isinstance(prompt, str) else _json_start(prompt, chars)
    return f"{request.get('cache_salt', '')}\x00{text[:chars]}".encode("utf-8", "surrogatepass")


def _json_start(value, chars: int) -> str:
    """At least the first ``chars`` characters of ``json.dumps(value, separators=(",", ":"))``: a list is written one
    item at a time, only as far as needed (a chat of thousands of messages is routed by its first few)."""
    if not isinstance(value, list):
        return json.dumps(value, separators=(",", ":"))
    parts, size = ["["], 1
    for i, item in enumerate(value):
        part = ("," if i else "") + json.dumps(item, separators=(",", ":"))
        parts.append(part)
        size += len(part)
        if size >= chars:
            return "".join(parts)
    return "".join(parts) + "]"


def home_replica(key: bytes, replicas: int) -> int:
    """The replica (an index) that prefix routing sends ``key`` to: rendezvous hashing, the index whose hash with
    the key is highest.  Why not ``hash % n``: when a replica is added, only the keys that now prefer it move."""
    return max(range(replicas), key=lambda i: hashlib.sha256(b"%d\x00%b" % (i, key)).digest())


class Routing:
    """How :class:`llmlab.serve.proxy.relay.Proxy` picks the replica for a request, and answers a ``GATHERED`` path
    from every model's; it holds ``replicas``, ``pools`` (model -> replicas), ``by_model``, ``route``,
    ``prefix_chars``, ``balance`` and ``upstreams``."""

    async def connect(self, factory, replica: Replica) -> None:
        """Open a connection to ``replica`` for one request; OSError if it cannot be had.

        Why a Unix socket is tried again: its backlog (vLLM's uvicorn listens with 2048) fills when vLLM accepts
        more slowly than a room sends, and then a connect fails at once with EAGAIN (uvloop) where a TCP client's
        SYN would be retried by the kernel.  A room of 100 replayed on two busy cores lost 3,855 of 16,500 requests
        so, each told the server "does not answer" (benchmarks/results/cpu-room-10-replay-2026-11-29/replay.json).
        Tried again, from 5 ms up to 200 ms apart, for ``UDS_RETRY`` seconds, the request waits instead."""
        loop = asyncio.get_running_loop()
        if not replica.uds:
            await asyncio.wait_for(loop.create_connection(factory, *replica.address), 30)
            return
        deadline, pause = loop.time() + UDS_RETRY, 0.005
        while True:
            try:
                await loop.create_unix_connection(factory, replica.uds)
                return
            except BlockingIOError:  # EAGAIN: vLLM's backlog is full; anything else is not a busy server
                if loop.time() + pause > deadline:
                    raise
                await asyncio.sleep(pause)
                pause = min(2 * pause, 0.2)

    def pick(self, r: Request) -> Replica:
        """The replica that answers ``r``: among the replicas of the model it names (:meth:`pool_of`), the one
        ``ROUTES`` says.  Ties in load go to the replica sent the fewest requests so far, so an idle pool takes
        turns.  ``/metrics`` never reaches here with several replicas (``judge``).  Raises :class:`Unroutable`."""
        pool = self.pool_of(r)
        replica = min(pool, key=lambda x: (x.in_flight, x.sent))
        if self.route == "prefix" and len(pool) > 1:
            key = prefix_key(r.body, self.prefix_chars)
            if key is not None:
                home = pool[home_replica(key, len(pool))]
                if home.in_flight - replica.in_flight < self.balance:
                    replica = home
        replica.sent += 1
        return replica

    @property
    def models(self) -> str:
        return ", ".join(m for m in self.pools if m is not None)

    def pool_of(self, r: Request) -> list[Replica]:
        """The replicas that may answer ``r``: all of them without models, else those of the model its body names.

        Why refuse rather than guess: a request for the 70B that lands on the 8B answers, and nobody notices which
        model wrote it; an unknown name gets the list of those served, as vLLM's own 404 would not."""
        if not self.by_model:
            return self.pools[None]
        try:
            model = model_of(r.body)
        except ValueError as e:
            raise Unroutable(error_response(413, f"Refused: this server routes between models by the request's "
                                                 f"\"model\" and will not read a body with {e}; send a shorter "
                                                 "request.")) from None
        if model is None:
            raise Unroutable(error_response(400, f"Refused: this server serves several models ({self.models}) and "
                                                 "picks one by the request's JSON field \"model\"; this request "
                                                 "names none: add \"model\": one of them."))
        pool = self.pools.get(model)
        if pool is None:
            shown = model if len(model) <= 200 else model[:200] + "..."
            raise Unroutable(error_response(404, f"The model {shown!r} is not served here; this server serves "
                                                 f"{self.models} (GET /v1/models lists them): use one of those."))
        return pool

    async def gathered(self, path: str) -> bytes:
        """The answer to a ``GATHERED`` path from a router of several models: each model's idlest replica is asked
        (with that upstream's own key), at once.  ``/v1/models``: every listed model in one list, 503 when no upstream
        answers; ``/health``: 200 when every model answers, else 503 naming those that do not (a model still
        loading: the others serve meanwhile)."""
        names = list(self.pools)
        answers = await asyncio.gather(*(self.fetch(min(self.pools[m], key=lambda x: x.in_flight), path)
                                         for m in names))
        down = [m for m, (status, _) in zip(names, answers, strict=True) if status != 200]
        if path == "/health":
            if down:
                return error_response(503, f"Not ready: {', '.join(down)} of the models served here "
                                           f"({self.models}) does not answer yet (loading, or stopped).")
            return json_response(200, {"models": names})
        merged = merge_models(answers)
        if merged is None:
            return error_response(503, f"None of the models served here ({self.models}) answers yet (loading, or "
                                       "stopped); `llmlab status` shows which.")
        if down:
            log.info("/v1/models: %s did not answer; listed the others", ", ".join(down))
        return json_response(200, merged)

    async def fetch(self, replica: Replica, path: str) -> tuple[int, bytes]:
        """``GET path`` from one upstream, with its own key: ``(status, body)``, ``(0, b"")`` if it does not answer
        within ``GATHER_TIMEOUT`` or sends more than ``GATHER_MAX`` bytes."""
        self.upstreams += 1  # a file descriptor (admit)
        try:
            return await asyncio.wait_for(self._fetch(replica, path), GATHER_TIMEOUT)
        except (OSError, TimeoutError, httptools.HttpParserError) as e:
            log.info("upstream %s, %s: %s", replica.name, path, e or type(e).__name__)
            return 0, b""
        finally:
            self.upstreams -= 1

    async def _fetch(self, replica: Replica, path: str) -> tuple[int, bytes]:
        if replica.uds:
            reader, writer = await asyncio.open_unix_connection(replica.uds)
        else:
            reader, writer = await asyncio.open_connection(*replica.address)
        try:
            if replica.prove and not await proven_stream(reader, writer, replica.key):
                log.warning("upstream %s (%s) did not prove it holds its key: %s not asked", replica.name,
                            replica.model, path)
                return 0, b""
            writer.write(b"GET %b HTTP/1.1\r\nhost: vllm\r\n%bconnection: close\r\n\r\n" % (path.encode(),
                                                                                            replica.auth))
            collected = _Collected()
            parser, got = httptools.HttpResponseParser(collected), 0
            while not collected.complete and (data := await reader.read(65536)):
                got += len(data)
                if got > GATHER_MAX:
                    return 0, b""
                parser.feed_data(data)
            return (parser.get_status_code(), bytes(collected.body)) if collected.complete else (0, b"")
        finally:
            writer.close()
