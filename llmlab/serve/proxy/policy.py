"""Who may reach vLLM, and with what: the whole answer in one module (docs/security.md names it the perimeter).

A request is judged once its head is complete (:func:`judge`, a function of the request, the keys and a few facts
about the proxy, with no I/O): a path that is not already normal is refused before the key is looked at; then the
key (``keys.KeyRing``: the owner's or a registered one; a revoked one is told so); then a learner's share of requests
in progress (``KEY_REQUESTS``); then the allow-list (``/v1/...`` but never :data:`CLOSED`, ``/health``,
``/metrics``) and the methods.  Sizes: ``MAX_HEAD`` of head, ``MAX_BODY`` of body per request, ``MAX_BODIES`` held
by all connections, ``KEY_BODIES`` by one learner's key (enforced by ``limits.Shedding``).  Headers in
``HOP_BY_HOP`` (the client's credentials among them) never pass in either direction.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from urllib.parse import unquote

import httptools

from llmlab.serve.proxy.answers import error_response
from llmlab.serve.proxy.keys import IDENTITY_PATH, NONCE, NONCE_HEADER, PROOF_HEADER

ALLOWED_EXACT = ("/health", "/metrics")
ALLOWED_PREFIX = "/v1/"
MAX_BODY = 32 * 2**20  # bytes of one request body; a prompt of a million tokens is ~4 MB
# Bytes of request bodies the proxy holds at once, all connections together (being received, waiting in a pipeline,
# or on their way to vLLM): four bodies of the largest size.  Beyond it the largest body still arriving is refused
# (503, Shedding.make_room).  A room's requests are kilobytes each; 30 learners sending a 4 MB prompt at once fit.
MAX_BODIES = 4 * MAX_BODY
# A learner's key (a registered one; the owner's has no such limits) may hold a quarter of that, one body of the
# largest size: largest-first alone let one learner's many smaller bodies fill the budget, so that the owner's
# larger body was the one refused (security-review-3, F4).  And it may have at most KEY_REQUESTS requests in progress
# (arriving, waiting in a pipeline, or answered now), all its connections together: the top of the lessons' load
# sweeps; a flood of pipelined requests over many connections had no bound but the connections' (F5).
KEY_BODIES = MAX_BODIES // 4
KEY_REQUESTS = 256

# Percent-encodings that change how a path splits or normalises: '.', '/', '\', '%' (double encoding), NUL.
ENCODED_SEPARATOR = re.compile(r"%(2e|2f|5c|25|00)", re.IGNORECASE)
# Headers that describe one hop, not the message (RFC 9110 7.6.1), plus Host and the client's credentials:
# never passed on in either direction (the proxy writes its own framing and Host).
HOP_BY_HOP = {b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
              b"transfer-encoding", b"upgrade", b"host", b"authorization"}
# Methods the OpenAI-compatible API and /health, /metrics use.  HEAD is not among them: a HEAD answer carries a
# Content-Length and no body, which this proxy would have to special-case for no client that needs it.
METHODS = {"GET", "POST", "DELETE"}
MAX_HEAD = 64 * 2**10  # bytes of a request line + headers; uvicorn's h11 allows 16 KiB, nginx 8 KiB by default

# On a shared server (registered keys) each learner's generation requests get a cache_salt of their own, so that one
# learner cannot tell from cached_tokens (or the time to first token) what another has sent: security-review-3 F6.
# The owner's requests keep the shared cache; `--shared-prefix-cache` turns the salts off (lesson 13's room).
SALTED = ("/v1/completions", "/v1/chat/completions")

# Paths a router of several models answers itself, from every model's upstream: GET only.
GATHERED = ("/v1/models", "/health")


def check_path(raw_path: bytes, path: str) -> str | None:
    """Why a request path is refused before anything else is looked at, or None if it is normal.

    ``raw_path`` is the path as sent, ``path`` as the server decoded it.  Only paths whose decoded form is
    already normal pass, and their raw form may not encode a separator, a dot or a '%': then vLLM's router sees
    the very path that the allow-list saw.
    """
    raw = raw_path.decode("latin-1")
    if ENCODED_SEPARATOR.search(raw):
        return "percent-encoded '.', '/', '\\', '%' or NUL in the path"
    if not path.startswith("/") or "\\" in path or "\x00" in path or "//" in path:
        return "not a normal absolute path"
    segments = path.split("/")[1:]
    if any(s in (".", "..") for s in segments):
        return "'.' or '..' segment in the path"
    return None


# Routes under /v1/ that change what the server serves for everyone.  vLLM opens them only with
# VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, but a key holder of a shared server must never reach them: one learner could
# unload the adapters the others use, or load one by a path on the server's file system (lesson 17).
CLOSED = {"/v1/load_lora_adapter": "loading", "/v1/unload_lora_adapter": "unloading"}


def allowed(path: str) -> bool:
    return path in ALLOWED_EXACT or (path.startswith(ALLOWED_PREFIX) and len(path) > len(ALLOWED_PREFIX))



class Request:
    """One request as the client sent it: collected by ``httptools`` callbacks, judged when its head is complete."""

    def __init__(self):
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = bytearray()
        self.method = b"GET"
        self.refusal: bytes | None = None  # the whole error answer, if the request is refused
        self.keyed = False  # it carried a key the proxy accepts
        self.keep_alive = True
        self.http10 = False
        self.counted = 0  # bytes of its body counted in Shedding.body_bytes (0 once released)
        self.gather: str | None = None  # a path the proxy answers from every model (GATHERED), not one upstream
        self.identity = False  # IDENTITY_PATH: answered by the proxy itself, keyless, and the connection stays open
        self.last = False  # refused 401 (no key, a wrong one, or a revoked one): the connection's last answer
        self.over = False  # refused 429: its key has KEY_REQUESTS in progress (not counted itself)
        self.key: bytes | None = None  # a learner's key digest (KeyRing.learner): what the per-key limits count by
        self.begun = False  # counted in Shedding.key_requests (Shedding.begin)
        self.salt: str | None = None  # the cache_salt the proxy sets in its body (a learner's request, SALTED)


def identity_answer(r: Request, keys) -> bytes:
    """The answer to a router's identity challenge (IDENTITY_PATH): this proxy's proof for the nonce, keyless;
    the connection stays open for the keyed request that follows (a malformed challenge closes it)."""
    nonce = next((v for k, v in r.headers if k.lower() == NONCE_HEADER), b"")
    if r.method != b"GET" or not NONCE.match(nonce):
        return error_response(400, f"Refused: {IDENTITY_PATH} takes GET with a {NONCE_HEADER.decode()} of 64 "
                                   "lowercase hex digits.")
    r.identity = True
    return b"HTTP/1.1 200 OK\r\n%b: %b\r\ncontent-length: 0\r\n\r\n" % (PROOF_HEADER, keys.prove(nonce))


def judge(r: Request, keys, key_requests: Mapping[bytes, int], *, replicas: int = 1, by_model: bool = False,
          salted: bool = False) -> bytes | None:
    """The refusal for a request whose head is complete, or None to forward it.  The order matters: a path
    that is not normal is refused before the key is looked at, and the allow-list only after the key, so
    that nobody without a key learns which routes exist.  Sets ``r.keyed`` when the key is accepted."""
    try:
        url = httptools.parse_url(r.url)
    except httptools.HttpParserInvalidURLError:
        return error_response(400, "Refused: the request target is not a URL path.")
    raw = url.path or b"/"
    path = unquote(raw.decode("latin-1"))
    why = check_path(raw, path)
    if why:
        return error_response(400, f"Refused: {why}.")
    if path == IDENTITY_PATH:
        return identity_answer(r, keys)
    authorization = next((v.decode("latin-1") for k, v in r.headers if k.lower() == b"authorization"), None)
    if not keys.accepts(authorization):
        r.last = True
        if keys.revoked(authorization):
            return error_response(401, "Unauthorized: your access to this server was revoked by its owner "
                                       "(llmlab revoke): ask your instructor.", (b"www-authenticate: Bearer",))
        return error_response(401, "Unauthorized: missing or wrong API key (send 'Authorization: Bearer <key>'; "
                                   "llmlab.connect() reads it from the server's key file).",
                              (b"www-authenticate: Bearer",))
    r.keyed, r.key = True, keys.learner(authorization)
    if r.key and key_requests.get(r.key, 0) >= KEY_REQUESTS:
        r.over = True  # answered in turn, not counted: a pipelining client stays held back by TCP (Client._reading)
        return error_response(429, f"Too many requests: your key has {KEY_REQUESTS} requests in progress on this "
                                   "server (being sent, waiting or being answered), the most one learner's key "
                                   "may; send more once some are answered.", (b"retry-after: 1",))
    if r.key and salted and path in SALTED and r.method == b"POST":
        r.salt = keys.salt_for(r.key)
    if path == "/metrics" and replicas > 1:
        return error_response(404, f"Not Found: this proxy routes between {replicas} vLLM servers, "
                                   "each with counters of its own; read /metrics from each server (notebook 15: "
                                   "llmlab.replicas.Replicas.metrics(); `llmlab metrics` of each model's job).")
    if path in CLOSED:
        return error_response(403, f"Forbidden: {CLOSED[path]} a LoRA adapter while the server runs is closed "
                                   "here, since every key holder shares its adapters; a server serves the "
                                   "adapters named at its start (--lora-modules NAME=DIR).")
    if not allowed(path):
        return error_response(404, f"Not Found: this server forwards only {ALLOWED_PREFIX}*, "
                                   f"{' and '.join(ALLOWED_EXACT)}.")
    method = r.method.decode("latin-1")
    if method not in METHODS:
        return error_response(405, f"Method {method} is not forwarded (only {', '.join(sorted(METHODS))}).")
    r.url = raw + (b"?" + url.query if url.query else b"")  # origin form, even if the client sent a full URL
    if by_model and path in GATHERED:
        if method != "GET":
            return error_response(405, f"Method {method} is not allowed on {path} (GET only).")
        r.gather = path
    return None
