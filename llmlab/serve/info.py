"""Where a server is, written down: the connection file, the key file, and ``~/.llmlab``.

Why a leaf module: the embedded server, the SLURM launcher, sharing, ``llmlab status`` and ``connect()`` all
read or write these files; keeping their one format here (importing nothing of llmlab) is what lets every other
module depend on it without a circle.  :class:`ServerInfo` is that format, typed: ``ServerInfo.read(path)``,
``info.write(path)``, ``info.base_url``, ``info.key()``.

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

import hashlib
import json
import os
import secrets
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

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


KEY_DIGESTS = "LLMLAB_KEY_DIGESTS"  # a file where every key made here is noted, as a digest (the course's tests)


def key_digest(key: str) -> str:
    """``sha256:<hex>`` of a key: what may be written down where the key itself must not be."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def new_key_file(path: Path, nbytes: int = 32) -> str:
    """A random API key in a new 0600 file at ``path`` (:func:`write_private`); returns the key.

    Why one function for every engine's key: the course's own test run must find every key that the notebooks'
    engines used in what the notebooks printed, also the keys of engines that stopped long ago, whose files are
    gone, and of those that keep their key outside ``LLMLAB_HOME`` (a router's run folder).  So each key made here
    is noted, as its length and digest, never the key, in the file ``$LLMLAB_KEY_DIGESTS`` names (set by the
    course's pytest plugin, ``llmlab.ops.testing``; unset, nothing is noted)."""
    key = secrets.token_urlsafe(nbytes)
    write_private(Path(path), key + "\n")
    note_key(key)
    return key


def note_key(key: str) -> None:
    """Append ``<length> sha256:<hex>`` of ``key`` to ``$LLMLAB_KEY_DIGESTS`` (nothing when it is unset): one
    ``O_APPEND`` write per key, so engines started side by side do not mix their lines."""
    log = os.environ.get(KEY_DIGESTS)
    if not log:
        return
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{len(key)} {key_digest(key)}\n".encode())
    finally:
        os.close(fd)


def noted_keys(path: Path) -> dict[int, set[str]]:
    """The digests :func:`note_key` wrote to ``path``, by key length (empty when there is no such file)."""
    out: dict[int, set[str]] = {}
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return out
    for line in lines:
        length, _, digest = line.partition(" ")
        if length.isdigit() and digest.startswith("sha256:"):
            out.setdefault(int(length), set()).add(digest)
    return out


def root_url(host: str, port: int) -> str:
    """``http://host:port``: where ``/health``, ``/metrics`` and ``/version`` answer (the OpenAI API is under
    ``/v1``).  The one place llmlab builds a server's address."""
    return f"http://{host}:{port}"


class Address:
    """``root_url`` and ``base_url`` of anything that has a ``host`` and a ``port`` (a ServerInfo, a VLLMProcess,
    the launcher's rendered job)."""

    @property
    def root_url(self) -> str:
        return root_url(self.host, self.port)

    @property
    def base_url(self) -> str:
        """The OpenAI-compatible API's base URL, ``http://host:port/v1``: what ``openai.OpenAI`` takes."""
        return self.root_url + "/v1"


# The connection file's fields that ServerInfo types; every other field the file carries lands in ``extra``.
_TYPED = ("kind", "host", "port", "model", "api_key_file", "job_id", "started", "status", "pid", "log")
_ALWAYS = ("kind", "host", "port", "model", "api_key_file", "job_id", "started")  # written even when None


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@dataclass(frozen=True, kw_only=True)
class ServerInfo(Address):
    """One server, as its connection file describes it: where it listens, what it serves, where its key is.

    ``ServerInfo.read(path)`` / ``info.write(path)`` are the one way llmlab reads and writes the file (format in
    the module docstring); ``info.base_url`` is what an OpenAI client takes, ``info.key()`` the key from its
    0600 file.  Fields are read by attribute (``info.host``); what the file carries beyond the typed fields is in
    ``info.extra`` (``info.extra.get("nodes")``), and ``info.as_dict()`` is the file's JSON object.
    """

    kind: str | None = None         # "slurm" | "embedded" | "shared"
    host: str
    port: int
    model: str
    api_key_file: str               # a 0600 file holding the key (never the key)
    job_id: str | None = None
    started: str = field(default_factory=_now)
    status: str | None = None       # "loading" makes connect() say so; embedded_status() sets "ready"/"loading"
    pid: int | None = None
    log: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)  # nodes, tp, pp, uds, share_dir, group, phase, ...

    def __post_init__(self):
        object.__setattr__(self, "port", int(self.port))
        object.__setattr__(self, "api_key_file", str(self.api_key_file))
        object.__setattr__(self, "extra", dict(self.extra))

    def key(self) -> str:
        """The API key, read from ``api_key_file``; :class:`AuthenticationFailed` says why it cannot be read."""
        return read_key(self.api_key_file)

    # -- the file ------------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping, source: Path | str | None = None) -> ServerInfo:
        """Check a connection file's fields; a missing one is an error that names the file and the field."""
        missing = [f for f in REQUIRED_FIELDS if not isinstance(data, Mapping) or f not in data]
        if missing:
            raise ServerError(f"The connection file {source or '(given)'} lacks the field(s) {', '.join(missing)}. "
                              "Delete it and restart the server that writes it.")
        typed = {k: data[k] for k in _TYPED if k in data and (k != "started" or data[k])}
        return cls(**typed, extra={k: v for k, v in data.items() if k not in _TYPED})

    @classmethod
    def of(cls, info: ServerInfo | Mapping) -> ServerInfo:
        """``info`` itself, or the ServerInfo of a connection file's fields given as a dict."""
        return info if isinstance(info, ServerInfo) else cls.from_dict(info)

    @classmethod
    def read(cls, path: Path | str) -> ServerInfo:
        """Read and check a connection file; each way it can be unusable is one sentence naming the fix."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ServerUnavailable(f"The connection file {path} does not exist: its server is not ready yet (a "
                                    "workshop's file appears once its job is READY) or the job that wrote it has "
                                    "ended (its clean-up removes it). Ask the server's owner (`llmlab status` shows "
                                    "the job), or unset LLMLAB_CONNECTION_FILE to use the embedded tiny "
                                    "model.") from None
        except PermissionError:
            raise ServerError(f"You cannot read the connection file {path} (permission denied): a shared server's "
                              "file is readable by its group only; ask its owner to add you to the group.") from None
        except json.JSONDecodeError as e:
            raise ServerError(f"The connection file {path} is not valid JSON ({e}). Delete it and restart "
                              "the server that writes it.") from None
        return cls.from_dict(data, path)

    def write(self, path: Path | str, mode: int = 0o600) -> Path:
        """Publish this server atomically, readable by its owner only (``mode``); the key stays in its file."""
        return write_private(Path(path), json.dumps(self.as_dict(), indent=2) + "\n", mode=mode)

    def as_dict(self) -> dict[str, Any]:
        """The connection file's JSON object."""
        out = {k: getattr(self, k) for k in _TYPED if k in _ALWAYS or getattr(self, k) is not None}
        return {**out, **self.extra}

    def updated(self, **changes) -> ServerInfo:
        """A copy with ``changes`` applied, to typed fields or to ``extra`` (``info.updated(kind="shared",
        share_dir=...)``)."""
        return ServerInfo.from_dict({**self.as_dict(), **changes})


def write_connection_file(path: Path, *, kind: str, host: str, port: int, model: str, api_key_file: Path,
                          job_id: str | None = None, **extra) -> Path:
    """Publish where a server listens (``ServerInfo(...).write(path)``); the key itself stays in ``api_key_file``."""
    return ServerInfo.from_dict(dict(kind=kind, host=host, port=port, model=model, api_key_file=api_key_file,
                                     job_id=job_id, **extra)).write(path)


def read_connection_file(path: Path) -> ServerInfo:
    """``ServerInfo.read(path)``: a malformed file is an error that names the file and the field."""
    return ServerInfo.read(path)


def ended_marker(job_id: str) -> Path:
    """``servers/job-ID.ended`` (the served model's name in it): what a SLURM job leaves when it ends, in place of
    its connection file, so that ``connect()`` says the job ended instead of starting the embedded tiny model."""
    return servers_dir() / f"job-{job_id}.ended"


def ended_jobs() -> list[Path]:
    """The :func:`ended_marker` files, newest first: jobs that ended since the last ``llmlab launch`` or
    ``llmlab stop`` (both remove them)."""
    return sorted(servers_dir().glob("job-*.ended"), key=lambda p: p.stat().st_mtime, reverse=True)


def find_connection_file() -> Path | None:
    """``$LLMLAB_CONNECTION_FILE``, else the newest SLURM connection file under ``~/.llmlab/servers``."""
    if os.environ.get("LLMLAB_CONNECTION_FILE"):
        return Path(os.environ["LLMLAB_CONNECTION_FILE"]).expanduser()
    files = sorted(servers_dir().glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    return files[0] if files else None


def base_url_of(info: ServerInfo | Mapping) -> str:
    """``ServerInfo.of(info).base_url``, for code that holds a connection file's fields as a dict."""
    return ServerInfo.of(info).base_url


def read_key(path: str | Path) -> str:
    """The API key in ``path`` (a 0600 file); the one way llmlab reads a key file."""
    try:
        return Path(path).expanduser().read_text().strip()
    except OSError as e:
        raise AuthenticationFailed(f"Cannot read the API key file {path} ({e.strerror}). It must exist and be "
                                   "readable by you (mode 0600).") from None
