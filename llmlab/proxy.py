"""The key-checking reverse proxy in front of every llmlab vLLM server.

Why: vLLM's ``--api-key`` guards only some path prefixes (``/v1``, ``/v2``, ``/inference``, ``/cohere`` in
0.32: ``vllm/entrypoints/serve/middleware/authenticate.py``); ``/invocations``, ``/tokenize``, ``/pause``,
``/abort_requests``, ``/update_weights``, ``/docs`` ... answer anyone who reaches the port.  On a shared
cluster that is everyone.  So vLLM listens on a Unix socket in a 0700 directory (only its user can connect),
and the one listener others can reach is this proxy, which

- checks the key on **every** request: the owner's key (a 0600 file) or any key whose sha256 is registered
  in a keys file or directory (a workshop's learners: each learner makes a key of their own and hands in
  only its hash; deleting the hash revokes that learner within a second, without restarting the server).
  Comparisons are ``hmac.compare_digest`` over sha256 digests, against every registered digest;
- forwards only an allow-list: ``/v1/...``, ``/health`` and ``/metrics`` (for ``llmlab status``/``metrics``),
  after refusing paths that are not already normal (``..``, ``.``, ``//``, backslashes, percent-encoded
  separators or dots, double encoding): the path that was checked is the path vLLM gets;
- streams the answer chunk by chunk as it arrives (server-sent events unbuffered), and cancels the upstream
  request when the client goes away, so that vLLM aborts the generation instead of finishing it for nobody.

Why this and not nginx: nginx would be a second server to install (Debian or conda-forge) on laptops, OOD
nodes and clusters where learners have neither root nor conda, and it cannot read a directory of key hashes
that changes while it runs without a reload or a Lua/njs module.  This is ~250 lines on libraries vLLM
already depends on and installs everywhere it runs: uvicorn (with httptools + uvloop, the same HTTP stack
vLLM's own server runs on) for the listening side, and aiohttp's ``UnixConnector`` (C-accelerated parser,
streaming reads) for the upstream side.  ``benchmarks/proxy_overhead.py`` measures what it costs.

Run: ``python -m llmlab.proxy --listen HOST:PORT --upstream unix:/run/dir/vllm.sock --key-file FILE
[--keys DIR_OR_FILE] [--watch-pid PID]``.  Secrets only through files (never the command line): ``--key-file``
holds the owner's key; an older vLLM without ``--uds`` is reached as ``--upstream http://127.0.0.1:PORT``
with its internal key in ``--upstream-key-file``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import sys
import time
from pathlib import Path

log = logging.getLogger("llmlab.proxy")

ALLOWED_EXACT = ("/health", "/metrics")
ALLOWED_PREFIX = "/v1/"
MAX_BODY = 32 * 2**20  # bytes of one request body; a prompt of a million tokens is ~4 MB
# Headers that describe one hop, not the message (RFC 9110 7.6.1), plus the client's credentials and the
# server's own Server/Date (uvicorn's are switched off: the upstream's pass through once).
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "transfer-encoding", "upgrade", "host", "authorization"}
DIGEST_LINE = re.compile(r"^(?:sha256:)?([0-9a-fA-F]{64})\b")
# Percent-encodings that change how a path splits or normalises: '.', '/', '\', '%' (double encoding), NUL.
ENCODED_SEPARATOR = re.compile(r"%(2e|2f|5c|25|00)", re.IGNORECASE)


class ProxyError(RuntimeError):
    """The proxy cannot start; the message says what to fix."""


def digest(key: str) -> bytes:
    return hashlib.sha256(key.strip().encode()).digest()


def key_digest_line(key: str, comment: str = "") -> str:
    """The line a learner registers for a key: ``sha256:<hex>  comment`` (the key itself never leaves them)."""
    return f"sha256:{digest(key).hex()}" + (f"  {comment}" if comment else "")


class KeyRing:
    """The keys the proxy accepts: the owner's (from a 0600 file, read once) and registered sha256 digests.

    The registered ones live in a file or a directory of files (one ``sha256:<hex> [comment]`` per line;
    blank lines, ``#`` comments and files starting with ``.`` are ignored).  They are re-read when a file's
    name, size or mtime changes, checked at most every ``recheck`` seconds, so a revocation (deleting a line or
    a file) takes effect within that time while a request costs no file-system calls.
    """

    def __init__(self, owner_key_file: Path, registered: Path | None = None, recheck: float = 1.0):
        try:
            owner = Path(owner_key_file).read_text().strip()
        except OSError as e:
            raise ProxyError(f"Cannot read the key file {owner_key_file} ({e.strerror}); it must exist and be "
                             "readable by the proxy's user (mode 0600).") from None
        if len(owner) < 16:
            raise ProxyError(f"The key in {owner_key_file} is shorter than 16 characters; write a random one, "
                             "e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'.")
        self.owner = digest(owner)
        self.registered_path = Path(registered) if registered else None
        self.recheck = recheck
        self._digests: tuple[bytes, ...] = ()
        self._signature: tuple = ()
        self._checked = float("-inf")
        self.refresh(force=True)

    def _files(self) -> list[Path]:
        p = self.registered_path
        if p is None or not p.exists():
            return []
        if p.is_dir():
            return sorted(f for f in p.iterdir() if not f.name.startswith(".") and f.is_file())
        return [p]

    def refresh(self, force: bool = False) -> None:
        """Re-read the registered digests if the files changed (at most every ``recheck`` seconds)."""
        now = time.monotonic()
        if not force and now - self._checked < self.recheck:
            return
        self._checked = now
        files = self._files()
        try:
            signature = tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in files)
        except OSError:  # a file went away between listing and stat: read again next time
            self._checked = float("-inf")
            return
        if signature == self._signature and not force:
            return
        digests = []
        for f in files:
            try:
                lines = f.read_text(errors="replace").splitlines()
            except OSError as e:
                log.warning("cannot read registered keys %s (%s)", f, e.strerror)
                continue
            for n, line in enumerate(lines, 1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                m = DIGEST_LINE.match(line)
                if m:
                    digests.append(bytes.fromhex(m[1]))
                else:
                    log.warning("%s:%d is not a 'sha256:<64 hex digits>' line; ignored", f, n)
        self._digests, self._signature = tuple(digests), signature
        log.info("%d registered key(s) from %s", len(digests), self.registered_path)

    @property
    def registered(self) -> int:
        return len(self._digests)

    def accepts(self, authorization: str | None) -> bool:
        """True for ``Bearer <key>`` with a known key.  Compares the digest against every known one (no early
        exit), so the time taken says nothing about which, or how much of, a key matched."""
        if not authorization:
            return False
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return False
        self.refresh()
        given = digest(key)
        ok = hmac.compare_digest(given, self.owner)
        for known in self._digests:
            ok |= hmac.compare_digest(given, known)
        return ok


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


def allowed(path: str) -> bool:
    return path in ALLOWED_EXACT or (path.startswith(ALLOWED_PREFIX) and len(path) > len(ALLOWED_PREFIX))


async def _json(send, status: int, message: str, extra_headers: list | None = None) -> None:
    body = json.dumps({"error": {"message": message, "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(extra_headers or [])]})
    await send({"type": "http.response.body", "body": body})


class Proxy:
    """The ASGI application (``uvicorn`` serves it).  One aiohttp session holds the upstream connections."""

    def __init__(self, upstream: str, keys: KeyRing, upstream_key: str | None = None):
        if upstream.startswith("unix:"):
            self.uds, self.base = upstream[5:], "http://vllm"
        elif upstream.startswith("http://"):
            self.uds, self.base = None, upstream.rstrip("/")
        else:
            raise ProxyError(f"--upstream {upstream!r}: give unix:/path/to/vllm.sock or http://127.0.0.1:PORT.")
        self.keys, self.upstream_key = keys, upstream_key
        self.session = None

    async def _startup(self) -> None:
        import aiohttp

        connector = (aiohttp.UnixConnector(path=self.uds, limit=0) if self.uds
                     else aiohttp.TCPConnector(limit=0))
        # No read time-out: a long generation may take minutes between request and last token.
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                             timeout=aiohttp.ClientTimeout(total=None, sock_connect=30))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await self._startup()
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    if self.session is not None:
                        await self.session.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":  # websockets: nothing on the allow-list speaks them
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
            return
        path = scope["path"]
        why = check_path(scope.get("raw_path") or path.encode(), path)
        if why:
            return await _json(send, 400, f"Refused: {why}.")
        headers = scope["headers"]
        authorization = next((v.decode("latin-1") for k, v in headers if k == b"authorization"), None)
        if not self.keys.accepts(authorization):
            return await _json(send, 401, "Unauthorized: missing or wrong API key (send 'Authorization: Bearer "
                                          "<key>'; llmlab.connect() reads it from the server's key file).",
                               [(b"www-authenticate", b"Bearer")])
        if not allowed(path):
            return await _json(send, 404, f"Not Found: this server forwards only {ALLOWED_PREFIX}*, "
                                          f"{' and '.join(ALLOWED_EXACT)}.")
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > MAX_BODY:
                return await _json(send, 413, f"Request body larger than {MAX_BODY // 2**20} MiB.")
            if not message.get("more_body"):
                break
        forward = asyncio.ensure_future(self._forward(scope, bytes(body), send))
        watch = asyncio.ensure_future(_disconnected(receive))
        done, _ = await asyncio.wait({forward, watch}, return_when=asyncio.FIRST_COMPLETED)
        if forward in done:
            watch.cancel()
            forward.result()
            return
        # The client went away: cancelling the forward closes the upstream connection, and vLLM aborts the request.
        forward.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await forward

    async def _forward(self, scope, body: bytes, send) -> None:
        import aiohttp

        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
                   if k.decode("latin-1").lower() not in HOP_BY_HOP and k != b"content-length"]
        if self.upstream_key:
            headers.append(("Authorization", f"Bearer {self.upstream_key}"))
        raw = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
        url = self.base + raw + (f"?{scope['query_string'].decode('latin-1')}" if scope.get("query_string") else "")
        try:
            async with self.session.request(scope["method"], url, headers=headers, data=body or None,
                                            allow_redirects=False, skip_auto_headers=("User-Agent",
                                                                                       "Accept-Encoding")) as up:
                out = [(k.lower(), v) for k, v in up.raw_headers
                       if k.decode("latin-1").lower() not in HOP_BY_HOP]
                await send({"type": "http.response.start", "status": up.status, "headers": out})
                async for chunk in up.content.iter_any():  # what arrived, as it arrived: no buffering
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
        except (aiohttp.ClientConnectionError, OSError) as e:
            log.info("upstream %s: %s", self.uds or self.base, e)  # expected while vLLM loads
            await _json(send, 503, "The vLLM server behind this proxy does not answer (still loading, or it "
                                   "stopped); `llmlab status` shows which.")


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _watch_pid(pid: int, server) -> None:
    """Stop serving once the process we front (vLLM) has gone: a proxy for nothing would only answer 503."""
    from llmlab.server import pid_alive

    while pid_alive(pid):
        await asyncio.sleep(1.0)
    log.warning("upstream process %d has exited; the proxy stops", pid)
    server.should_exit = True


def serve(listen: str, upstream: str, key_file: Path, keys: Path | None = None, upstream_key_file: Path | None = None,
          watch_pid: int | None = None, log_level: str = "warning") -> None:
    """Run the proxy until SIGTERM/SIGINT (or until ``watch_pid`` exits)."""
    import uvicorn

    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise ProxyError(f"--listen {listen!r}: give HOST:PORT, e.g. 127.0.0.1:8000.")
    upstream_key = None
    if upstream_key_file:
        try:
            upstream_key = Path(upstream_key_file).read_text().strip()
        except OSError as e:
            raise ProxyError(f"Cannot read the upstream key file {upstream_key_file} ({e.strerror}).") from None
    app = Proxy(upstream, KeyRing(key_file, keys), upstream_key)
    config = uvicorn.Config(app, host=host.strip("[]"), port=int(port), http="httptools",
                            lifespan="on", access_log=False, log_level=log_level, server_header=False,
                            date_header=False, timeout_keep_alive=30)
    server = uvicorn.Server(config)

    async def main() -> None:
        watcher = asyncio.ensure_future(_watch_pid(watch_pid, server)) if watch_pid else None
        try:
            await server.serve()
        finally:
            if watcher:
                watcher.cancel()

    try:
        import uvloop
        factory = uvloop.new_event_loop
    except ImportError:  # uvicorn's plain asyncio loop works too, a little slower
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmlab.proxy", description="Key-checking reverse proxy in front "
                                "of a vLLM server (see the module docstring). Secrets only through files.")
    p.add_argument("--listen", required=True, help="HOST:PORT others connect to")
    p.add_argument("--upstream", required=True, help="unix:/path/vllm.sock, or http://127.0.0.1:PORT")
    p.add_argument("--key-file", required=True, type=Path, help="0600 file with the owner's key")
    p.add_argument("--keys", type=Path, help="file or directory of registered 'sha256:<hex>' lines (re-read)")
    p.add_argument("--upstream-key-file", type=Path, help="the internal key of an http:// upstream")
    p.add_argument("--watch-pid", type=int, help="exit when this process (vLLM) exits")
    p.add_argument("--log-level", default=os.environ.get("LLMLAB_PROXY_LOG_LEVEL", "warning"))
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="[llmlab proxy %(asctime)s] %(message)s",
                        datefmt="%H:%M:%S")
    try:
        serve(a.listen, a.upstream, a.key_file, a.keys, a.upstream_key_file, a.watch_pid, a.log_level)
    except ProxyError as e:
        print(f"llmlab proxy: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
