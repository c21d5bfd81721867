"""The proxy as a process: ``python -m llmlab.serve.proxy`` (:func:`main`, :func:`serve`), the one builder of its argv
(:func:`proxy_command`), the proxy and the engine as one process group (:func:`pair_command`), and the wait for its
ready file before anything is published (:func:`wait_bound`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from llmlab.serve.info import write_private
from llmlab.serve.proc import raise_fd_limit
from llmlab.serve.proxy.answers import ProxyError
from llmlab.serve.proxy.keys import KeyRing
from llmlab.serve.proxy.limits import BACKLOG, LogBudget, fd_budget
from llmlab.serve.proxy.relay import Client, Proxy
from llmlab.serve.proxy.router import BALANCE, PREFIX_CHARS, ROUTES, split_upstream

log = logging.getLogger("llmlab.serve.proxy")  # one name for the whole package: its log lines are the proxy's


async def _watch_pid(pid: int, stop: asyncio.Event) -> None:
    """Stop serving once the process we front (vLLM) has gone: a proxy for nothing would only answer 503."""
    from llmlab.serve.proc import pid_alive

    while pid_alive(pid):
        await asyncio.sleep(1.0)
    log.warning("upstream process %d has exited; the proxy stops", pid)
    stop.set()



def write_ready(ready_file: Path, sockets: list) -> None:
    """Say, in a 0600 file, where the proxy listens, once it does: ``{"host", "port", "pid"}``."""
    ports = {s.getsockname()[1] for s in sockets}
    if len(ports) != 1:  # a host name with several addresses and port 0: the system picked one port for each
        raise ProxyError(f"--listen picked several ports ({sorted(ports)}); give one address, e.g. 127.0.0.1:0.")
    host = sockets[0].getsockname()[0]
    write_private(Path(ready_file), json.dumps({"host": host, "port": ports.pop(), "pid": os.getpid()}) + "\n")


def wait_bound(ready_file: Path, alive, log_path: Path, timeout: float = 60.0) -> dict:
    """Wait until the proxy listens, as its ready file says, and return what the file holds.

    Why: a port is published (a connection file, a job's output) and the owner's key is sent there (the /health
    check) only once the proxy holds it: until then another user may be listening on it.  ``alive()`` turns
    False when the proxy (or the process group it is part of) has exited: then the proxy's own sentence, the
    last lines of ``log_path``, is the error, and nothing was sent anywhere."""
    from llmlab.serve.info import ServerError
    from llmlab.serve.proc import last_lines

    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError, ValueError):
            return json.loads(Path(ready_file).read_text())
        if not alive():
            tail = last_lines(log_path, 20)
            said = [line for line in tail.splitlines() if line.startswith("llmlab proxy:")]  # its one sentence
            raise ServerError(f"The key-checking proxy could not start, so nothing was published and no key was "
                              f"sent. {said[-1] if said else tail}")
        if time.monotonic() > deadline:
            raise ServerError(f"The key-checking proxy did not listen within {timeout:.0f} s; its log {log_path} "
                              f"ends:\n{last_lines(log_path, 5)}")
        time.sleep(0.05)


def upstream_keys(specs: Path | str | list | None, models: set) -> tuple[str | None, dict[str, str]]:
    """The ``--upstream-key-file`` values read: ``(the key of every upstream, {model: its own key})``.  ``MODEL=FILE``
    gives one model's upstream its key (each job of a set has its own); a bare ``FILE``, every upstream's."""
    every, own = None, {}
    for spec in [] if specs is None else [specs] if isinstance(specs, (str, Path)) else specs:
        model, sep, path = str(spec).partition("=")
        if sep and model in models:
            own[model] = _read_secret(Path(path))
        else:
            every = _read_secret(Path(spec))
    return every, own


def _read_secret(path: Path) -> str:
    try:
        key = path.read_text().strip()
    except OSError as e:
        raise ProxyError(f"Cannot read the upstream key file {path} ({e.strerror}); it must exist and be readable by "
                         "the proxy's user.") from None
    if not key:
        raise ProxyError(f"The upstream key file {path} is empty; give the file the upstream's server was started "
                         "with.")
    return key


def serve(listen: str, upstream: str | list[str], key_file: Path, keys: Path | None = None,
          upstream_key_file: Path | str | list | None = None, watch_pid: int | None = None,
          ready_file: Path | None = None,
          route: str = "least-loaded", prefix_chars: int = PREFIX_CHARS, balance: int = BALANCE,
          shared_prefix_cache: bool = False) -> None:
    """Run the proxy until SIGTERM/SIGINT (or until ``watch_pid`` exits).  Once it listens, ``ready_file`` says
    where (removed again when it stops)."""
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise ProxyError(f"--listen {listen!r}: give HOST:PORT, e.g. 127.0.0.1:8000.")
    models = {split_upstream(u)[0] for u in ([upstream] if isinstance(upstream, str) else upstream)}
    upstream_key, per_model = upstream_keys(upstream_key_file, models)
    proxy = Proxy(upstream, KeyRing(key_file, keys), upstream_key, route, prefix_chars, balance, per_model,
                  shared_prefix_cache)
    if ready_file:
        Path(ready_file).unlink(missing_ok=True)  # a file left by an earlier run must not say "listening"
    limit = raise_fd_limit()

    async def main() -> None:
        loop, stop = asyncio.get_running_loop(), asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            server = await loop.create_server(lambda: Client(proxy), host.strip("[]"), int(port), reuse_address=True,
                                              backlog=BACKLOG)
        except OSError as e:
            raise ProxyError(f"Cannot listen on {listen} ({e.strerror}): another process holds that port; pick a "
                             "free one, or give port 0 to let the system choose.") from None
        proxy.fd_budget = fd_budget(limit)
        keys_watcher = proxy.keys.watch()  # re-reads --keys in a worker thread, never on this loop
        if ready_file:
            write_ready(ready_file, server.sockets)
        log.info("listening on %s, forwarding to %s (%s)", listen, proxy.upstream, route)
        watcher = asyncio.ensure_future(_watch_pid(watch_pid, stop)) if watch_pid else None
        await stop.wait()
        server.close()
        if ready_file:
            Path(ready_file).unlink(missing_ok=True)
        keys_watcher.cancel()
        if watcher:
            watcher.cancel()

    try:
        import uvloop
        factory = uvloop.new_event_loop
    except ImportError:  # asyncio's own loop works too, a little slower
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())


def pin(cpus: str) -> None:
    try:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    except (ValueError, OSError) as e:
        raise ProxyError(f"--cpus {cpus!r}: give CPU numbers this process may use, e.g. 0,1 ({e}).") from None


def upstream_url(where: Path | str) -> str:
    """``--upstream``'s spelling of a vLLM socket (a path) or of a server's URL (``http://host:port``)."""
    where = str(where)
    return where if where.startswith(("http://", "unix:")) else f"unix:{where}"


def proxy_command(listen: str, uds: Path | list[Path] | dict[str, list], key_file: Path, keys: Path | None = None,
                  python: str = sys.executable, cpus: list[int] | None = None,
                  ready_file: Path | None = None, route: str | None = None, *, balance: int | None = None,
                  prefix_chars: int | None = None, watch_pid: int | None = None,
                  upstream_key_files: dict[str, Path] | None = None) -> list[str]:
    """``python -m llmlab.serve.proxy`` in front of the socket (or several, routed by ``route``, with ``balance``
    and ``prefix_chars``), exiting with ``watch_pid``: file paths only, never a key.  ``uds`` as a dict,
    ``{model: [socket or http://host:port, ...]}``, routes by model, each upstream with its key file from
    ``upstream_key_files`` (by model).  The one builder of the proxy's argv, for the embedded server, the launcher,
    rehearsals and ``llmlab.replicas.Router``."""
    cmd = [python, "-m", "llmlab.serve.proxy", "--listen", listen]
    if isinstance(uds, dict):
        for model, places in uds.items():
            cmd += [arg for place in places for arg in ("--upstream", f"{model}={upstream_url(place)}")]
        for model, path in (upstream_key_files or {}).items():
            cmd += ["--upstream-key-file", f"{model}={path}"]
    else:
        for path in uds if isinstance(uds, list) else [uds]:
            cmd += ["--upstream", f"unix:{path}"]
    cmd += ["--key-file", str(key_file)] + (["--route", route] if route else [])
    cmd += ["--keys", str(keys)] if keys else []
    cmd += ["--ready-file", str(ready_file)] if ready_file else []
    cmd += ["--cpus", ",".join(map(str, cpus))] if cpus else []
    for flag, value in (("--balance", balance), ("--prefix-chars", prefix_chars), ("--watch-pid", watch_pid)):
        cmd += [flag, str(value)] if value is not None else []
    return cmd


# The proxy and the engine behind it as one process group: a shell starts the proxy in the background (told to exit
# when the shell's pid does), waits until the proxy's ready file says it listens, then becomes the engine.  So the
# recorded pid is the engine's, stopping that group stops both, and no engine loads behind a proxy that could not
# bind: the shell exits 3 instead, and the proxy's sentence is in its log (wait_bound quotes it).
PAIR = ('proxy_log=$1 ready=$2; shift 2; n=$1; shift; "${@:1:$n}" --watch-pid $$ >"$proxy_log" 2>&1 </dev/null & '
        'proxy=$!; shift "$n"; until [ -e "$ready" ]; do kill -0 "$proxy" 2>/dev/null || exit 3; sleep 0.05; done; '
        'exec "$@"')


def pair_command(proxy: list[str], engine: list[str], proxy_log: Path, ready_file: Path) -> list[str]:
    """``proxy`` (a :func:`proxy_command` with ``ready_file``), then ``engine`` once the proxy listens (``PAIR``)."""
    return ["bash", "-c", PAIR, "llmlab-serve", str(proxy_log), str(ready_file), str(len(proxy)), *proxy, *engine]


def proxy_cpus() -> list[int]:
    """The CPUs for the embedded server's proxy: ours, but not the highest one, which vLLM-CPU reserves for its
    own frontend (API server and scheduler; its log says ``reserved_cpus=[N]``) and binds its compute threads
    away from.  Why: with the tiny model the frontend core is the bottleneck, and a proxy that takes turns on it
    slows every stream.  On 2 cores, pinned: x1.318 [0.841 .. 1.625] of direct throughput at 32 streams, against
    x0.78 unpinned (benchmarks/proxy_overhead.py, docs/security.md).  One CPU, or no affinity API (macOS): no pin."""
    if not hasattr(os, "sched_getaffinity"):
        return []
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[:-1] if len(cpus) > 1 else cpus


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmlab.serve.proxy", description="Key-checking reverse proxy in front "
                                "of a vLLM server (see the module docstring). Secrets only through files.")
    p.add_argument("--listen", required=True, help="HOST:PORT others connect to")
    p.add_argument("--upstream", required=True, action="append",
                   help="unix:/path/vllm.sock, or http://HOST:PORT; give it again for each replica to route to; "
                   "MODEL=... before it routes by the request's model (several models, one endpoint)")
    p.add_argument("--route", choices=ROUTES, default="least-loaded", help="how a replica is picked (ROUTES)")
    p.add_argument("--prefix-chars", type=int, default=PREFIX_CHARS, help="prompt characters that --route prefix "
                   "hashes")
    p.add_argument("--balance", type=int, default=BALANCE, help="--route prefix falls back to least-loaded when "
                   "the prefix's replica has this many more requests in flight")
    p.add_argument("--key-file", required=True, type=Path, help="0600 file with the owner's key")
    p.add_argument("--keys", type=Path, help="file or directory of registered 'sha256:<hex>' lines (re-read)")
    p.add_argument("--upstream-key-file", action="append", help="the key file of an http:// upstream; MODEL=FILE "
                   "for that model's upstreams only (given once per model)")
    p.add_argument("--watch-pid", type=int, help="exit when this process (vLLM) exits")
    p.add_argument("--ready-file", type=Path, help="write {host, port, pid} here (0600) once listening")
    p.add_argument("--log-level", default=os.environ.get("LLMLAB_PROXY_LOG_LEVEL", "warning"))
    p.add_argument("--cpus", help="run on these CPUs only, e.g. 0,1 (see proxy_cpus)")
    p.add_argument("--shared-prefix-cache", action="store_true", help="with --keys: let learners' requests share "
                   "vLLM's prefix cache (no cache_salt per key; SALTED says what that exposes)")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="[llmlab proxy %(asctime)s] %(message)s",
                        datefmt="%H:%M:%S")
    for handler in logging.getLogger().handlers:
        handler.addFilter(LogBudget())
    try:
        if a.cpus:
            pin(a.cpus)
        serve(a.listen, a.upstream, a.key_file, a.keys, a.upstream_key_file, a.watch_pid, a.ready_file, a.route,
              a.prefix_chars, a.balance, a.shared_prefix_cache)
    except ProxyError as e:
        print(f"llmlab proxy: {e}", file=sys.stderr)
        return 2
    return 0
