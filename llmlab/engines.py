"""A second engine beside the server ``connect()`` finds: what lessons 11-15 start to compare one setting with another.

Why: some settings are chosen when vLLM starts, not per request -- an fp8 KV cache (lesson 11), a drafter (12), a
small token budget (13), a replica (15) -- so a lesson that shows one starts an engine of its own with the flag,
next to the server everyone shares.  :func:`start` is that one step, the same engine as the embedded server (the
real vLLM CPU build behind llmlab's key-checking proxy, on a port of its own); notebooks reach it here, not in the
machinery of ``llmlab.serve``.

    fp8 = engines.start(["--kv-cache-dtype", "fp8"])      # about half a minute on two cores
    client, model = llmlab.connect(fp8.base_url, fp8.api_key)
    ...
    fp8.stop()                                             # or: with engines.start(...) as fp8:
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from llmlab.serve.embedded import DEFAULT_TIMEOUT, EmbeddedServer, embedded_status
from llmlab.serve.info import ServerInfo
from llmlab.serve.paths import DRAFT_MODEL, TINY_MODEL, TINY_NAME
from llmlab.serve.proc import free_port

__all__ = ["start", "embedded", "unused_port", "TINY_MODEL", "TINY_NAME", "DRAFT_MODEL", "EmbeddedServer"]


def start(extra_args: list[str] = (), *, model: Path | str = TINY_MODEL, name: str | None = None,
          kv_cache_gib: int = 1, max_model_len: int | None = None, env: Mapping[str, str] | None = None,
          log_path: Path | None = None, timeout: float = DEFAULT_TIMEOUT, progress: bool = True,
          keys: Path | str | None = None) -> EmbeddedServer:
    """Start an engine of ``model`` (default: the tiny model) with ``extra_args`` added to its ``vllm serve`` line,
    and return it once it answers.  A start that fails stops what it started and says why (with its log).

    ``env``: vLLM's environment on top of this process's (lesson 15 binds a replica to a core).  ``keys``: a file or
    folder of registered learners' key digests (a room's ``keys/``, :mod:`llmlab.serve.keyring`'s rules), which the
    engine's proxy accepts besides the owner's key and re-reads as it changes: a learner registered, then revoked
    (lesson 19).  The engine keeps running until ``.stop()`` (or the end of a ``with`` block); it outlives the kernel
    otherwise, like the embedded server."""
    model = Path(model)
    server = EmbeddedServer(model, name or (TINY_NAME if model == TINY_MODEL else model.name),
                            kv_cache_gib=kv_cache_gib, max_model_len=max_model_len, extra_args=list(extra_args),
                            log_path=log_path, env=env, keys=keys)
    try:
        return server.start().wait_ready(timeout, progress)
    except BaseException:
        server.stop()
        raise


def embedded() -> ServerInfo | None:
    """The embedded server this machine runs (its ``log``, ``pid``, ``status``), or None: ``connect()`` may have
    found another server (a cluster's), which has no log here to read."""
    return embedded_status()


def unused_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now: where a request meets no server (lesson 06)."""
    return free_port("127.0.0.1")
