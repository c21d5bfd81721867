"""The servers running now, and how far one has come in its start-up: the second half of notebook 08.

- **A server's start-up, read from its log** (:func:`load_progress`): the phase and the weight shards, what
  ``llmlab status`` and the job's output print.
- **The servers you published** (:func:`servers`): one :class:`RunningServer` per connection file, read by
  attribute, with :meth:`RunningServer.key` for ``llmlab.connect(server.url, server.key())``.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path

from llmlab.serve.info import ServerInfo, llmlab_home, read_connection_file, read_key, servers_dir

SHARDS = re.compile(r"Loading (?:safetensors|pt|bin)? ?checkpoint shards:\s*(\d+)% Completed \|\s*(\d+)/(\d+) "
                    r"\[([\d:]+)<([\d:?]+)")


# One record of vLLM's log ("(EngineCore pid=7) INFO 11-22 21:02:38 [model_runner.py:305] ...").  vLLM prints a
# handful while it imports; many more with none of the phase markers that llmlab knows means a release whose
# lines changed: `llmlab status` then says the phase is unknown, never a stale or wrong one.
VLLM_RECORD = re.compile(r"^(?:\(\w+ pid=\d+\) )?(?:INFO|WARNING|DEBUG|ERROR) \d", re.M)
UNKNOWN_AFTER = 12
PHASE_UNKNOWN = "phase unknown (vLLM's log has no start-up line llmlab knows: `llmlab logs` shows it)"


@dataclass
class LoadProgress:
    """Where a vLLM server is in its start-up, from its log."""

    phase: str
    shards_done: int | None = None
    shards_total: int | None = None
    elapsed: str | None = None
    eta: str | None = None
    ready: bool = False

    def __str__(self) -> str:
        if self.ready:
            return "ready"
        if self.shards_total and self.phase == "loading weights":
            return (f"loading weights: {self.shards_done}/{self.shards_total} shards "
                    f"({100 * self.shards_done // self.shards_total}%), elapsed {self.elapsed}, ETA {self.eta}")
        return self.phase


def load_progress(log: str | Path) -> LoadProgress:
    """Parse a vLLM log into the start-up phase and the weight-shard progress: a ``Path`` is read, a ``str``
    is the log's text.  vLLM redraws its shard progress bar with carriage returns; the last one counts.
    """
    from llmlab.serve.vllm import WEIGHTS_LOADED, phases_seen

    if isinstance(log, Path):
        try:
            text = log.read_text(errors="replace")
        except OSError:
            return LoadProgress("waiting for the job to start vLLM")
    else:
        text = log
    done = phases_seen(text)
    phase_name = done[-1] if done else "importing vLLM"
    if not done and len(VLLM_RECORD.findall(text)) > UNKNOWN_AFTER:
        phase_name = PHASE_UNKNOWN  # a vLLM whose lines llmlab does not know: say so rather than guess
    shards = list(SHARDS.finditer(text))
    if shards and not WEIGHTS_LOADED.search(text):
        phase_name = "loading weights"
    ready = "Application startup complete" in text
    if not shards:
        return LoadProgress(phase_name, ready=ready)
    m = shards[-1]
    return LoadProgress(phase_name, int(m[2]), int(m[3]), m[4], m[5], ready)


# --------------------------------------------------------------------------------------------------
# Finding servers
# --------------------------------------------------------------------------------------------------

def is_alive(info: ServerInfo, timeout: float = 2.0) -> bool:
    """Does the server of a connection file answer ``/health``?  Asked with the server's key (its proxy wants
    the key on every request), read from the connection file's key file."""
    from llmlab.serve.embedded import key_of
    from llmlab.serve.proc import health

    return health(info.host, info.port, timeout, api_key=key_of(info))


@dataclass(frozen=True)
class RunningServer:
    """One server you published (a connection file), as :func:`servers` lists it; read by attribute.

    ``alive`` is None when not asked (``servers(check=False)``); ``error`` says why a broken file could not be
    read (then only ``file`` is known).  The key is not in it, only ``api_key_file``: :meth:`key` reads it.
    """

    file: str
    kind: str | None = None
    model: str | None = None
    url: str | None = None          # None while a job waits in SLURM's queue (no address yet)
    job_id: str | None = None
    started: str | None = None
    nodes: list[str] | None = None
    tp: int | None = None
    pp: int | None = None
    api_key_file: str | None = None
    status: str | None = None       # "ready", or "loading" while it starts
    alive: bool | None = None
    error: str | None = None

    def key(self) -> str:
        """The server's API key, read from its 0600 file: ``llmlab.connect(server.url, server.key())``."""
        if not self.api_key_file:
            raise ValueError(f"{self.file} names no key file ({self.error or 'no api_key_file'}).")
        return read_key(self.api_key_file)

    def as_dict(self) -> dict:
        """A row of :func:`servers_table`: ``alive`` only when asked, ``error`` only for a broken file."""
        row = asdict(self)
        for name in ("alive", "error"):
            if row[name] is None:
                del row[name]
        return row


def servers(check: bool = True, embedded: bool = True) -> list[RunningServer]:
    """Every llmlab server this user has published: SLURM jobs' connection files, newest first, then the
    embedded server.  ``alive`` says whether it answers now.  The key never appears, only its file."""
    from llmlab.serve.embedded import state_file

    files = sorted(servers_dir().glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    if embedded and state_file().exists():
        files.append(state_file())
    out = []
    for path in files:
        try:
            info = read_connection_file(path)
        except Exception as e:  # a broken file is listed, not fatal: the table says what is wrong
            out.append(RunningServer(file=str(path), error=str(e).split(". ")[0]))
            continue
        out.append(RunningServer(
            file=str(path), kind=info.kind, model=info.model, url=info.base_url if info.port else None,
            job_id=info.job_id, started=info.started, nodes=info.extra.get("nodes"), tp=info.extra.get("tp"),
            pp=info.extra.get("pp"), api_key_file=info.api_key_file, status=info.status or "ready",
            # a job still in SLURM's queue has no address yet
            alive=(bool(info.port) and is_alive(info)) if check else None))
    return out


def servers_table(check: bool = True):
    """:func:`servers` as a pandas table."""
    import pandas as pd

    return pd.DataFrame([s.as_dict() for s in servers(check)])


def job_log_dir(job_id: str) -> Path:
    """Where the launcher keeps a job's vLLM and Ray logs (private to the user)."""
    return llmlab_home() / "logs" / f"job-{job_id}"


def job_progress(job_id: str) -> LoadProgress:
    """The load progress of a SLURM job's server, from the vLLM log the launcher writes."""
    return load_progress(job_log_dir(job_id) / "vllm.log")


def connection_file_of(job_id: str) -> Path:
    return servers_dir() / f"job-{job_id}.json"
