"""Where a server is, written down: the connection file, the key file, and ``~/.llmlab``.

Why a leaf module: the embedded server, the SLURM launcher, sharing, ``llmlab status`` and ``connect()`` all
read or write these files; keeping their one format here (importing nothing of llmlab) is what lets every other
module depend on it without a circle.

Connection file format (JSON, one object, written atomically with mode 0600)::

    {"kind": "slurm" | "embedded" | "shared",  # who started the server; shared: a room's (llmlab.serve.share)
     "host": "node042", "port": 8123,  # where it listens; base URL = http://host:port/v1
     "model": "llama3.1-70b",          # the served model name
     "api_key_file": "/home/me/.llmlab/keys/123.key",  # a 0600 file holding the key (never the key)
     "job_id": "123" | null, "started": "2026-11-22T17:00:00+00:00",
     "status": "ready" | "loading",    # optional; "loading" makes connect() say so instead of falling back
     "share_dir": "/shared/ws", "group": "ws",  # kind "shared" only: see llmlab.serve.share (one key per learner)
     ...}                              # optional extras: pid, log, nodes, tp, pp, phase

``~/.llmlab`` can be moved with ``LLMLAB_HOME`` (the tests do, so they never touch a learner's server).
"""

from __future__ import annotations

import json
import os
import tempfile
from datetime import UTC, datetime
from pathlib import Path

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
