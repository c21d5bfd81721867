"""The embedded server: the real vLLM engine (CPU build) serving the shipped tiny model on this machine.

Why: on a laptop or in CI there is no GPU, yet the notebooks must talk to a real vLLM server.  This
module starts ``vllm serve`` (:func:`vllm_serve`) as a :class:`~llmlab.serve.vllm.VLLMProcess`, waits until
``/health`` answers, and records where it listens in ``~/.llmlab/embedded.json`` (a
:class:`~llmlab.serve.info.ServerInfo`) so that every notebook kernel finds the one running server.

Security (docs/security.md): vLLM listens on a Unix socket in a private (0700) directory, so no other user of
the machine can reach it, not even through 127.0.0.1; the only TCP listener is ``llmlab.serve.proxy`` on 127.0.0.1,
which checks a random key (kept in a 0600 file that ``llmlab.connect()`` reads) on every request and forwards
only ``/v1/*``, ``/health`` and ``/metrics``.  No secret is ever in ``ps``-visible arguments.
"""

from __future__ import annotations

import contextlib
import fcntl
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

from llmlab.serve.info import ServerError, ServerInfo, llmlab_home, new_key_file, read_key
from llmlab.serve.paths import TINY_MODEL, TINY_NAME
from llmlab.serve.proc import free_port, health, pid_alive
from llmlab.serve.proxy.command import pair_command, proxy_command, proxy_cpus, wait_bound
from llmlab.serve.vllm import VLLMProcess, cpu_kv_space, engine_command, engine_env

DEFAULT_TIMEOUT = 300.0


def state_file() -> Path:
    return llmlab_home() / "embedded.json"


class EmbeddedServer:
    """Start, wait for, and stop one embedded vLLM server.  Use as a context manager::

        with EmbeddedServer() as srv:          # returns once /health answers
            client, model = llmlab.connect(srv.base_url, srv.api_key)
    """

    def __init__(self, model: Path = TINY_MODEL, name: str = TINY_NAME, *, port: int | None = None,
                 host: str = "127.0.0.1", kv_cache_gib: float = 1.0, max_model_len: int | None = None,
                 extra_args: list[str] = (), log_path: Path | None = None, publish: bool = False,
                 env: Mapping[str, str] | None = None, keys: Path | None = None):
        cpu_kv_space(kv_cache_gib)  # a KV space vLLM cannot read fails here, not minutes into the start
        self.model, self.name, self.host = Path(model), name, host
        self.port = port or free_port(host)
        self.kv_cache_gib, self.max_model_len, self.extra_args = kv_cache_gib, max_model_len, list(extra_args)
        self.log_path = Path(log_path or llmlab_home() / "logs" / f"embedded-{self.port}.log")
        self.key_file = llmlab_home() / "keys" / f"embedded-{self.port}.key"
        self.proxy_log = self.log_path.with_name(f"embedded-{self.port}.proxy.log")
        self.publish = publish  # write ~/.llmlab/embedded.json so that connect() finds this server
        self.env = dict(env or {})  # vLLM's environment on top of ours, e.g. VLLM_CPU_OMP_THREADS_BIND (notebook 15)
        self.engine: VLLMProcess | None = None  # vLLM, with its proxy in the same process group
        self.run_dir: Path | None = None  # the private (0700) directory of vLLM's socket
        self.keys = Path(keys) if keys else None  # registered learners' keys (a room's keys/): the proxy's --keys

    @property
    def uds(self) -> Path:
        return self.run_dir / "vllm.sock"

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.engine.proc if self.engine else None

    @property
    def info(self) -> ServerInfo:
        """This server as its connection file describes it (what ``publish`` writes)."""
        return ServerInfo(kind="embedded", host=self.host, port=self.port, model=self.name, api_key_file=self.key_file,
                          pid=self.engine and self.engine.pid, log=str(self.log_path),
                          extra={"uds": str(self.uds), "proxy_log": str(self.proxy_log)} if self.run_dir else {})

    @property
    def base_url(self) -> str:
        return self.info.base_url

    @property
    def api_key(self) -> str:
        return read_key(self.key_file)

    def start(self) -> EmbeddedServer:
        """Spawn the engine in its own session, so that it outlives the kernel that started it."""
        if not (self.model / "config.json").is_file():
            raise ServerError(f"No model at {self.model} (config.json missing). Pass the directory of a "
                              "Hugging Face model, or reinstall llmlab to get the shipped tiny model.")
        new_key_file(self.key_file)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # Local disk, short path (a socket path has at most 107 bytes), mode 0700 (mkdtemp's).
        self.run_dir = Path(tempfile.mkdtemp(prefix="llmlab-vllm-"))
        cmd = engine_command(self.model, self.name, self.uds, self.max_model_len, self.extra_args)
        ready = self.run_dir / "proxy.ready"  # in the 0700 folder: only we can write it
        proxy = proxy_command(f"{self.host}:{self.port}", self.uds, self.key_file, self.keys, cpus=proxy_cpus(),
                              ready_file=ready)
        # vLLM and its proxy as one process group; vLLM starts only once the proxy listens (proxy.PAIR)
        self.engine = VLLMProcess(pair_command(proxy, cmd, self.proxy_log, ready),
                                  engine_env(self.run_dir, self.kv_cache_gib, self.extra_args, self.env),
                                  self.log_path, host=self.host, port=self.port, api_key=self.api_key,
                                  header=f"$ {' '.join(cmd)}\n$ {' '.join(proxy)}  (log: {self.proxy_log})").start()
        self._wait_bound(ready)
        if self.publish:
            self.info.write(state_file())
        return self

    def _wait_bound(self, ready: Path) -> None:
        """Bind, then publish: the port is written into ``embedded.json``, and the key sent to it (``/health``),
        only once our proxy holds it.  If another process (another user's) holds it, the start fails here with the
        proxy's sentence, before vLLM loads, and nothing ever reaches that port."""
        try:
            wait_bound(ready, lambda: self.engine.alive, self.proxy_log)
        except ServerError:
            self.stop()
            raise

    def wait_ready(self, timeout: float = DEFAULT_TIMEOUT, progress: bool = True) -> EmbeddedServer:
        self.engine.wait_ready(timeout, progress)
        return self

    def stop(self, grace: float = 20.0) -> None:
        if self.engine is not None:
            self.engine.stop(grace)
        if self.publish:
            with contextlib.suppress(Exception):
                if ServerInfo.read(state_file()).pid == (self.engine and self.engine.pid):
                    state_file().unlink()
        self.key_file.unlink(missing_ok=True)
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedServer:
        """``with EmbeddedServer(...) as s`` starts it; ``with engines.start(...) as s`` (already started, and
        ready) only stops it at the end: starting it again would take its own port."""
        if self.engine is not None and self.engine.alive:
            return self
        try:
            return self.start().wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def _start_lock():
    """One embedded server per LLMLAB_HOME, even when several kernels ask at once."""
    with open(llmlab_home() / "embedded.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def embedded_status() -> ServerInfo | None:
    """The published embedded server, its ``status`` "ready" or "loading" (``/health`` asked now), or None if
    none is running."""
    try:
        info = ServerInfo.read(state_file())
    except ServerError:
        return None
    if not pid_alive(info.pid):
        return None
    return info.updated(status="ready" if health(info.host, info.port, api_key=key_of(info)) else "loading")


def key_of(info: ServerInfo | Mapping) -> str | None:
    """The key of a connection file's server, or None if its key file cannot be read (not ours, or gone)."""
    try:
        return ServerInfo.of(info).key()
    except ServerError:
        return None


def _process(info: ServerInfo) -> VLLMProcess:
    return VLLMProcess.attach(info.pid, Path(info.log), host=info.host, port=info.port, api_key=key_of(info))


def ensure_embedded(timeout: float = DEFAULT_TIMEOUT, progress: bool = True) -> ServerInfo:
    """Return the running embedded server (a :class:`ServerInfo`), starting one if none runs."""
    with _start_lock():
        info = embedded_status()
        if info is None:
            srv = EmbeddedServer(publish=True)
            try:
                srv.start()
            except BaseException:  # Ctrl-C or a signal mid-start: no half-started server left behind
                srv.stop()
                raise
            info = ServerInfo.read(state_file()).updated(status="loading")
            print(f"Starting the embedded vLLM server (log: {srv.log_path}); this takes about half a minute.")
    if info.status != "ready":
        _process(info).wait_ready(timeout, progress)
        info = info.updated(status="ready")
    return info


def stop_embedded() -> bool:
    """Stop the published embedded server; returns False if none was running."""
    info = embedded_status()
    if info is None:
        state_file().unlink(missing_ok=True)
        return False
    _process(info).stop()
    state_file().unlink(missing_ok=True)
    Path(info.api_key_file).unlink(missing_ok=True)
    if info.extra.get("uds"):
        shutil.rmtree(Path(info.extra["uds"]).parent, ignore_errors=True)
    return True
