"""Troubleshooting (notebook 19): a server that does not come up, or comes up and then misbehaves, read from both
sides -- what the client got, and what vLLM's log says -- then named and fixed.

Why: on a cluster the failures a learner or an instructor meets most are not subtle.  A flag that cannot work
(a tensor-parallel size the heads do not divide), a path with a typo, a context the KV cache cannot hold, a served
name the client spells differently, a missing key, a prompt past the context, a server that dies under a request.
Each has one sentence of its own in vLLM's log or in the error the client gets; this module keeps those sentences
(:data:`SIGNS`, each with the file and line of the installed vLLM 0.32 that writes it, so that
``tests/unit/test_troubleshoot.py`` fails the day vLLM rewords one) and says which one a text holds
(:func:`diagnose`).  The notebook produces each fault live on the CPU build and reads it with these.

    attempts = troubleshoot.try_starts({"TP=3": ["--tensor-parallel-size", "3"]})   # vLLM refuses: its log
    troubleshoot.diagnose(attempts["TP=3"].error)                                 # which sign, cause, fix
    reply = troubleshoot.ask(client, model="llama3.1-8b", prompt="Hi")            # the client's side: 404
    troubleshoot.revoke_learner(room)                                             # a room's learner shut out: 401
    troubleshoot.stop_reading(client, model)                                      # vLLM generates on for nobody
"""

from __future__ import annotations

import atexit
import importlib.util
import math
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from llmlab import memory
from llmlab.serve import metrics
from llmlab.serve.paths import RESULTS_DIR, TINY_MODEL
from llmlab.serve.proc import group_alive, terminate
from llmlab.serve.vllm import VLLMProcess, cpu_flags, engine_env, log_messages, serve_line, vllm_serve

__all__ = ["Sign", "SIGNS", "sign", "signs", "diagnose", "source_line", "Attempt", "try_starts", "LONG_CONTEXT",
           "refusal", "refusal_sentence", "Reply", "ask", "ask_without_key", "LogMark", "engine_core_pid",
           "die_mid_stream", "room", "register_learner", "revoke_learner", "learners", "ask_until", "stop_reading",
           "never_read", "PENDING_REASONS", "committed"]


@dataclass(frozen=True)
class Sign:
    """One sentence a failure leaves: ``quote``, a literal piece of it as the source writes it (on one line of
    ``where``: ``package/path.py:line`` of the installed package), ``pattern`` (a regex for the text a log or an
    error shows, where the source's text is a format string), ``side`` (``start``: the server refuses to start;
    ``request``: the client's error; ``running``: a server that was serving), what causes it and the fix."""

    name: str
    quote: str
    where: str
    side: str
    cause: str
    fix: str
    pattern: str = ""

    def matches(self, text: str) -> re.Match | None:
        return re.search(self.pattern or re.escape(self.quote), text)


# Each sentence as the installed release writes it.  A vLLM log carries many lines; these are the ones that name a
# cause.  The order is the order diagnose() reports them in when a text holds several.
SIGNS = [
    Sign("tp-heads", "must be divisible by tensor parallel size", "vllm/config/model.py:1549", "start",
         "the tensor-parallel size does not divide the model's attention heads (each GPU takes an equal share)",
         "a --tensor-parallel-size that divides the heads (the config's num_attention_heads), and pipeline "
         "parallelism (--pipeline-parallel-size) for the rest of the GPUs"),
    Sign("no-model", "Repo id must be in the form", "huggingface_hub/utils/_validators.py:134", "start",
         "the model path does not exist: vLLM took it for a Hugging Face repository name, which a path is not",
         "the folder that holds config.json and the weights (check it with ls); on a cluster, a path every node "
         "sees"),
    Sign("kv-at-start", "To serve at least one request with the model's max seq len",
         "vllm/v1/core/kv_cache_utils.py:1031", "start",
         "one request of the full context needs more KV cache than the memory left for it",
         "--max-model-len at most the estimated maximum the sentence names (or --max-model-len auto); or more "
         "memory for the cache: --gpu-memory-utilization (VLLM_CPU_KVCACHE_SPACE on the CPU build), more GPUs, "
         "an fp8 KV cache"),
    Sign("no-kv-memory", "No available memory for the cache blocks", "vllm/v1/core/kv_cache_utils.py:1011", "start",
         "the weights and the profiled activations take all the memory vLLM may use: nothing is left for the KV "
         "cache",
         "a larger --gpu-memory-utilization (a flag given twice: the last one counts), more GPUs (TP) or smaller "
         "weights (fp8)"),
    Sign("placement-group", "Cannot provide a placement group requiring", "vllm/v1/executor/ray_utils.py:490",
         "start", "Ray has fewer GPUs than the job asks for: a node's Ray never joined, or TP x PP exceeds the "
         "GPUs of the nodes", "`ray status` on the head node; TP x PP = nodes x GPUs per node; the launcher's "
         "Ray logs in the job's log folder"),
    Sign("nccl", "NCCL error: ", "vllm/distributed/device_communicators/pynccl_wrapper.py:448", "running",
         "a collective between GPUs failed (a network interface NCCL cannot use, a GPU or node that went away)",
         "NCCL_DEBUG=INFO for the interface and the peer it names; NCCL_SOCKET_IFNAME / the high-speed network's "
         "interface; the node's health"),
    Sign("wrong-model", "does not exist. ", "vllm/entrypoints/serve/engine/serving.py:78", "request",
         "the request names a model the server does not serve (404)",
         "the served name, as /v1/models lists it (llmlab.connect() returns it as `model`)",
         pattern=r"The model `[^`]*` does not exist\."),
    Sign("prompt-too-long", "This model's maximum context length is", "vllm/renderers/params.py:528", "request",
         "the prompt alone is longer than the context the server was started with (400)",
         "a shorter prompt (truncate or summarise it), or a server with a larger --max-model-len",
         pattern=r"This model's maximum context length is \d+ tokens\. However, your prompt contains"),
    Sign("no-room", "max_tokens must be at least 1, got", "vllm/sampling_params.py:690", "request",
         "the prompt fills the whole context: vLLM lowers max_tokens to the room left (max_model_len minus the "
         "prompt, vllm/entrypoints/serve/utils/api_utils.py:188), here none (400)",
         "a prompt at least one token shorter than the context, or a larger --max-model-len",
         pattern=r"max_tokens must be at least 1, got 0"),
    Sign("too-many-tokens", "cannot be greater than", "vllm/renderers/params.py:263", "request",
         "max_tokens alone is larger than the context (400)",
         "max_tokens at most the context minus the prompt", pattern=r"max_tokens=\d+ cannot be greater than"),
    Sign("bad-key", "Unauthorized: missing or wrong API key", "llmlab/serve/proxy/policy.py:142", "request",
         "no key, or not the server's key: llmlab's proxy refuses the request before vLLM sees it (401)",
         "the key of the server's key file (llmlab.connect() reads it; a room's learners get theirs from "
         "connect() too)"),
    Sign("revoked", "your access to this server was revoked by its owner", "llmlab/serve/proxy/policy.py:140",
         "request", "the learner's key was registered and worked, then the server's owner revoked it (`llmlab revoke "
         "JOB USER`): the proxy refuses it, and closes the connections it had open (401)",
         "ask the instructor: `llmlab revoke JOB USER --undo` gives the learner back, and their next "
         "llmlab.connect() registers their key again"),
    Sign("unread", "left its answers unread for", "llmlab/serve/proxy/relay.py:226", "running",
         "a client stopped reading its streamed answer and kept the connection (a loop left with break, the stream "
         "never closed): the proxy stopped reading vLLM, waited SEND_TIMEOUT, then dropped it",
         "close a stream you stop reading (`with client.completions.create(..., stream=True) as stream:`, or "
         "stream.close()): vLLM then aborts the generation at once; or stream=False when every token is wanted"),
    Sign("engine-died", "EngineCore encountered an issue", "vllm/v1/engine/exceptions.py:16", "running",
         "the engine core process died under the server (killed, out of host memory, a GPU fault)",
         "the log above this line, and the system's (dmesg: the OOM killer); then start the server again"),
    Sign("core-exited", "engine core exited unexpectedly", "vllm/v1/engine/core_client.py:818", "running",
         "the engine core process exited without a word: killed from outside (the kernel's out-of-memory killer, "
         "SIGKILL), so the API server shuts down too",
         "the system's log (dmesg) or the job's memory (sacct -j JOB -o MaxRSS) for the kill; then start the "
         "server again, with room for its memory"),
    Sign("preemption", "Preemptions: %d", "vllm/v1/metrics/loggers.py:311", "running",
         "the KV cache ran out while requests grew: vLLM pushed running requests back and will recompute them",
         "more KV cache (memory, GPUs, fp8 KV), a smaller --max-num-seqs, or fewer requests in flight",
         pattern=r"Preemptions: [1-9]\d*"),
]


def sign(name: str) -> Sign:
    """The sign called ``name`` (:data:`SIGNS`)."""
    for s in SIGNS:
        if s.name == name:
            return s
    raise KeyError(f"{name!r} is not a sign; the signs are {', '.join(s.name for s in SIGNS)}.")


def signs() -> pd.DataFrame:
    """:data:`SIGNS` as a table: name, side, where the sentence is written, the cause and the fix."""
    return pd.DataFrame([{"sign": s.name, "side": s.side, "written at": s.where, "cause": s.cause, "fix": s.fix}
                         for s in SIGNS]).set_index("sign")


def diagnose(text: str) -> pd.DataFrame:
    """The signs ``text`` (a log, an error's message) holds, one row each: the line it is on, the cause and the fix.
    No row: none of the known sentences is there (read the log's last error line yourself)."""
    rows = []
    lines = [m for _, m in log_messages(str(text))]
    for s in SIGNS:
        line = next((ln for ln in lines if s.matches(ln)), None)
        if line is not None:
            rows.append({"sign": s.name, "line": _short(line), "cause": s.cause, "fix": s.fix})
    return pd.DataFrame(rows, columns=["sign", "line", "cause", "fix"]).set_index("sign")


def _short(line: str, n: int = 240) -> str:
    line = line.strip()
    return line if len(line) <= n else line[:n - 3] + "..."


def source_line(s: Sign, before: int = 0) -> str:
    """The line of the installed package's source that ``s.where`` names (where the sentence is written), with
    ``before`` lines above it (the condition that raises it)."""
    path, line = s.where.rsplit(":", 1)
    top, rest = path.split("/", 1)
    spec = importlib.util.find_spec(top)  # without importing it: vLLM takes seconds to import
    if spec is None or not spec.origin:
        raise FileNotFoundError(f"{top} is not installed here, so {s.where} cannot be read.")
    lines = (Path(spec.origin).parent / rest).read_text().splitlines()
    return "\n".join(lines[max(0, int(line) - 1 - before):int(line)])


# --------------------------------------------------------------------------------------------------
# The server's side: starts that fail
# --------------------------------------------------------------------------------------------------

ERROR = re.compile(r"^\s*(?:[\w.]+\.)?(\w*(?:Error|Exception)): (.*)$")


@dataclass
class Attempt:
    """One ``vllm serve`` that was expected to refuse: its command line, exit code (None: it was still running at
    the time-out, and was stopped), seconds, and log."""

    line: str
    returncode: int | None
    seconds: float
    log: str

    @property
    def errors(self) -> list[str]:
        """Every ``SomethingError: message`` line of the log, in order, once each (pydantic puts vLLM's config
        errors on a ``Value error, ...`` line under its own ``ValidationError`` line: that line is taken instead)."""
        found = []
        for _, msg in log_messages(self.log):
            m = ERROR.match(msg) or re.match(r"^\s*Value error, ", msg)
            line = msg.strip()
            if m and line not in found and not line.startswith("pydantic_core"):
                found.append(line)
        return found

    @property
    def error(self) -> str:
        """The first error line: the root cause.  The last one is the API server's "Engine core initialization
        failed. See root cause above." when the engine core refused: a log is read from its first error down."""
        return self.errors[0] if self.errors else "(no error line: read the log)"

    @property
    def refused(self) -> bool:
        return self.returncode not in (None, 0)


def try_starts(attempts: dict[str, list[str]], *, model: Path | str = TINY_MODEL, models: dict | None = None,
               timeout: float = 240.0, env: dict | None = None) -> dict[str, Attempt]:
    """Start one ``vllm serve`` per entry of ``attempts`` (name -> extra flags) at once, the course's CPU flags
    first, each on a Unix socket in a private folder (nothing listens on the network if one does start), and wait
    until each exits.  ``models`` gives an entry a model path of its own.  An engine still running after
    ``timeout`` s is stopped (``returncode`` None): it did not refuse."""
    started = {}
    for name, args in attempts.items():
        folder = Path(tempfile.mkdtemp(prefix="llmlab-try-"))
        argv = vllm_serve(sys.executable, (models or {}).get(name, model),
                          ["--served-model-name", "try", "--uds", str(folder / "vllm.sock"), *cpu_flags(),
                           "--distributed-executor-backend", "uni", *args])
        log = folder / "vllm.log"
        proc = VLLMProcess(argv, {**engine_env(folder, 1, args), **(env or {})}, log, header="").start()
        started[name] = (proc, folder, log, time.monotonic(), serve_line(argv[4], argv[5:]))
    out = {}
    for name, (proc, folder, log, t0, line) in started.items():
        try:
            code = proc.proc.wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))
        except Exception:  # noqa: BLE001 -- the time-out: it did not refuse
            code = None
            proc.stop()
        out[name] = Attempt(line, code, time.monotonic() - t0, log.read_text(errors="replace"))
        terminate(proc.pid, grace=5)
        shutil.rmtree(folder, ignore_errors=True)
    return out


# The tiny model as a model that claims a million-token context, as long-context checkpoints do (Llama 3.1: 131,072;
# Llama 4 Scout: 10 million): vLLM serves a model's own context unless --max-model-len says less.
LONG_CONTEXT = ["--hf-overrides", '{"max_position_embeddings": 1048576}']


def refusal(model, budget_bytes: int, max_model_len: int, block_size: int = memory.CPU_BLOCK_SIZE,
            kv_dtype: str = "auto", dtype: str | None = None) -> dict:
    """What vLLM 0.32 decides at start for a KV pool of ``budget_bytes``, from lesson 01's arithmetic
    (``vllm/v1/core/kv_cache_utils.py``, ``get_kv_cache_configs``): the whole blocks in the pool, one kept back as
    the null block, the bytes one request of ``max_model_len`` tokens needs (its blocks, rounded up), whether it
    fits, and if not the longest context that does (whole blocks of the usable pool)."""
    per_token = memory.kv_bytes_per_token(model, kv_dtype, dtype)
    per_block = per_token * block_size
    blocks = budget_bytes // per_block
    usable = (blocks - 1) * per_block  # the null block (the BlockPool holds it back)
    needed = math.ceil(max_model_len / block_size) * per_block
    return {"bytes_per_token": per_token, "blocks": blocks, "available_bytes": usable, "needed_bytes": needed,
            "fits": needed <= usable, "estimated_max_len": min(usable // per_block * block_size, max_model_len)}


def refusal_sentence(r: dict, max_model_len: int) -> str:
    """The start of vLLM's refusal (``kv_cache_utils.py:1029-1034``) for :func:`refusal`'s figures, GiB rounded to
    two decimals as vLLM's ``format_gib`` does (``vllm/utils/mem_utils.py:30-31``)."""
    gib = lambda b: f"{round(b / 2**30, 2)}"  # noqa: E731
    return (f"To serve at least one request with the model's max seq len ({max_model_len}), "
            f"({gib(r['needed_bytes'])} GiB KV cache is needed, which is larger than the available KV cache memory "
            f"({gib(r['available_bytes'])} GiB). Based on the available memory, the estimated maximum model length "
            f"is {r['estimated_max_len']}.")


# --------------------------------------------------------------------------------------------------
# The client's side: requests that fail
# --------------------------------------------------------------------------------------------------

@dataclass
class Reply:
    """What a request got: the HTTP ``status`` (None: no answer at all), the error's class in the openai client,
    and the ``message`` (the server's sentence), or the completion's text when it worked."""

    status: int | None
    kind: str
    message: str

    def __str__(self) -> str:
        return f"{self.status or 'no answer'} {self.kind}: {self.message}"


def ask(client, **request) -> Reply:
    """One completion request (``client.completions.create(**request)``, no retries), its outcome as a
    :class:`Reply` instead of an exception: the client's side of a fault."""
    import openai

    try:
        r = client.with_options(max_retries=0).completions.create(**request)
        return Reply(200, "ok", r.choices[0].text)
    except openai.APIStatusError as e:
        body = e.body if isinstance(e.body, dict) else {}
        message = (body.get("error") or {}).get("message") if isinstance(body.get("error"), dict) else None
        return Reply(e.status_code, type(e).__name__, message or body.get("message") or str(body.get("error") or e))
    except openai.APIConnectionError as e:
        return Reply(None, type(e).__name__, str(e.__cause__ or e))


def ask_without_key(base_url: str, model: str) -> Reply:
    """A completion request with no ``Authorization`` header at all, as ``curl`` sends one when the key is left out
    (the openai client refuses to send without a key: "Missing credentials")."""
    import json
    import urllib.error
    import urllib.request

    body = json.dumps({"model": model, "prompt": "Hi", "max_tokens": 2}).encode()
    request = urllib.request.Request(base_url.rstrip("/") + "/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return Reply(r.status, "ok", json.loads(r.read())["choices"][0]["text"])
    except urllib.error.HTTPError as e:
        answer = json.loads(e.read() or b"{}")
        error = answer.get("error")
        return Reply(e.code, "HTTPError", error.get("message") if isinstance(error, dict) else
                     answer.get("message") or str(error))


class LogMark:
    """Where a log file ends now; :meth:`new` gives the lines written since (the server's side of one request)."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.offset = self.path.stat().st_size if self.path.exists() else 0

    def new(self, source: str = "") -> list[str]:
        """The lines written since, without vLLM's prefixes (:func:`llmlab.serve.vllm.log_messages`); with
        ``source``, only those of that file of vLLM's."""
        with open(self.path, errors="replace") as f:
            f.seek(self.offset)
            text = f.read()
        return [m for _, m in log_messages(text, source) if m.strip()]


def engine_core_pid(server) -> int | None:
    """The pid of the engine core of ``server`` (an engine :func:`llmlab.engines.start` started): the process vLLM
    names ``VLLM::EngineCore``, under the API server, which does the model's work."""
    group = server.engine.pid
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            title = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if stat[2] == str(group) and "EngineCore" in title:
            return int(entry.name)
    return None


def die_mid_stream(client, model: str, server, after: int = 20, max_tokens: int = 400, settle: float = 30.0) -> dict:
    """Stream a long answer and, once ``after`` pieces have arrived, kill the server's engine core with SIGKILL
    (what the kernel's out-of-memory killer sends): what the client received, how its stream ended, and whether
    any of the server's processes (API server, proxy) still runs ``settle`` s later at most (an API server
    without its engine shuts down, and llmlab's proxy with it)."""
    import openai

    texts, ended = [], "the stream ended normally"
    pid = engine_core_pid(server)
    if pid is None:
        raise RuntimeError("No engine core process found under this server: is it running?")
    try:
        stream = client.with_options(max_retries=0).completions.create(
            model=model, prompt="Once upon a time", max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        for piece in stream:
            texts.append(piece.choices[0].text if piece.choices else "")
            if len(texts) == after:
                os.kill(pid, signal.SIGKILL)
    except (openai.APIError, openai.APIConnectionError) as e:
        ended = f"{type(e).__name__}: {e}"
    deadline = time.monotonic() + settle  # the API server shuts down, then llmlab's proxy notices (1 s polls)
    while group_alive(server.engine.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return {"pieces": len(texts), "asked": max_tokens, "ended": ended, "killed": pid,
            "server_running": group_alive(server.engine.pid)}


# --------------------------------------------------------------------------------------------------
# A room's learner: a key registered, then revoked
# --------------------------------------------------------------------------------------------------

def room() -> Path:
    """A new private folder laid out as a room's share directory (``DIR/keys/``, :mod:`llmlab.serve.share`), for an
    engine of the lesson's own: ``engines.start(keys=room / "keys")``; its proxy re-reads ``keys/`` as it changes.
    It is removed when the Python process (the notebook's kernel) ends: each run of the lesson made one and left it."""
    root = Path(tempfile.mkdtemp(prefix="llmlab-room-"))
    (root / "keys").mkdir(mode=0o700)
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


def register_learner(room_dir: Path | str, base_url: str | None = None, timeout: float = 15.0) -> str:
    """A learner's key, made and registered as a learner's ``llmlab.connect()`` does it in a room: only the key's
    digest goes into ``keys/<login>`` (the login of whoever registers: here you, as your own learner).  With
    ``base_url``, return once that server accepts the key (its proxy re-reads ``keys/`` about every second)."""
    import urllib.error
    import urllib.request

    from llmlab.serve import share

    key = secrets.token_urlsafe(32)
    path = Path(room_dir) / "keys" / share.user()
    path.write_text(share.key_line(key))
    path.chmod(0o640)
    deadline = time.monotonic() + timeout
    while base_url:
        request = urllib.request.Request(base_url.rstrip("/") + "/models", headers={"Authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(request, timeout=10):
                break
        except urllib.error.HTTPError as e:
            if e.code != 401 or time.monotonic() > deadline:
                raise RuntimeError(f"The server at {base_url} did not accept the registered key within {timeout:g} s "
                                   f"({e.code}): was it started with keys={path.parent}?") from None
        time.sleep(0.2)
    return key


def revoke_learner(room_dir: Path | str) -> None:
    """What ``llmlab revoke JOB USER`` does to the room's ``keys/`` (:func:`llmlab.serve.share.revoke`): the learner's
    file gives way to one of the owner's that lists their digest as revoked.  The proxy notices within about a
    second, refuses the key with a sentence of its own and closes the connections that showed it."""
    from llmlab.serve import share

    share.revoke(room_dir, share.user())


def learners(room_dir: Path | str) -> dict[str, str]:
    """The room's learners, "registered" or "revoked", read as the proxy reads ``keys/``: what ``llmlab status JOB``
    counts for a shared server ("N learner(s) registered, M revoked")."""
    from llmlab.serve import share

    return share.learners(room_dir)


def ask_until(client, status: int, timeout: float = 15.0, **request) -> Reply:
    """:func:`ask` again every 0.2 s until the answer's status is ``status`` (a revocation takes about a second to
    reach the proxy), for at most ``timeout`` seconds; the last reply."""
    deadline = time.monotonic() + timeout
    while (reply := ask(client, **request)).status != status and time.monotonic() < deadline:
        time.sleep(0.2)
    return reply


# --------------------------------------------------------------------------------------------------
# A client that stops reading
# --------------------------------------------------------------------------------------------------

def stop_reading(client, model: str, *, read: int = 5, max_tokens: int = 600, close: bool = False,
                 timeout: float = 60.0) -> dict:
    """Stream an answer of ``max_tokens`` (no early end), read ``read`` pieces, then stop reading: keep the stream
    (a loop left with ``break``, the stream still held: ``close=False``) or close it.  Then watch the server's
    ``/metrics`` until no request runs (at most ``timeout`` s): the tokens the engine generated since the request
    was sent, and the seconds it kept running after the client stopped.  ``stream``: close it when done."""
    before = metrics.counters(client)
    stream = client.with_options(max_retries=0).completions.create(
        model=model, prompt="Once upon a time", max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    pieces = 0
    for _ in stream:
        pieces += 1
        if pieces == read:
            break
    if close:
        stream.close()
    stopped = time.monotonic()
    while (now := metrics.counters(client)).running > 0 and time.monotonic() - stopped < timeout:
        time.sleep(0.1)
    return {"read": pieces, "asked": max_tokens, "generated": (now - before).generated,
            "ran_on_s": time.monotonic() - stopped, "running": now.running, "stream": stream}


def never_read(base_url: str, api_key: str, model: str, *, wait: float, max_tokens: int = 600, n: int = 2,
               logprobs: int = 20, rcvbuf: int = 4096) -> dict:
    """A client that sends a streamed request and reads nothing of the answer for ``wait`` seconds (on a socket of
    its own, as a stuck program would), then reads what it can: the bytes, and whether the answer ended whole (the
    SSE stream's ``data: [DONE]``) or the connection closed before.  ``n`` answers with the ``logprobs`` 20 top tokens
    of each token (about 700 bytes a token) make the stream about 0.8 MB, more than the buffers between the client and
    vLLM's proxy hold: the proxy's send buffer for this client (about 0.5 MB, ``limits.CLIENT_SNDBUF`` doubled by
    Linux) and its transport's 64 KiB; ``rcvbuf`` keeps the client's own receive buffer small (the system's default
    would take about 0.1 MB more).  ``n`` x ``max_tokens`` fits lesson 19's 12-block pool without preemption."""
    import json
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(base_url)
    body = json.dumps({"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "n": n,
                       "temperature": 1.0, "seed": 0, "stream": True, "ignore_eos": True,  # n > 1: sampled, not greedy
                       "logprobs": logprobs}).encode()
    head = (f"POST {url.path.rstrip('/')}/completions HTTP/1.1\r\nhost: {url.netloc}\r\n"
            f"authorization: Bearer {api_key}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connecting: the window is agreed then
        s.settimeout(30)
        s.connect((url.hostname, url.port))
        s.sendall(head + body)
        time.sleep(wait)
        received, tail, ended = 0, b"", "the server closed the connection"
        s.settimeout(5)
        try:
            while chunk := s.recv(2**20):
                received, tail = received + len(chunk), (tail + chunk)[-64:]
        except ConnectionResetError:
            ended = "the server reset the connection"
        except TimeoutError:
            ended = "still open 5 s after the last byte"
    return {"received_bytes": received, "whole": b"data: [DONE]" in tail, "ended": ended}


# --------------------------------------------------------------------------------------------------
# On paper: what the CPU cannot produce
# --------------------------------------------------------------------------------------------------

# SLURM's reasons for a pending job that a course meets most, as squeue(1) explains them ("JOB REASON CODES",
# Slurm 22.05), and what to do.  `llmlab status` shows the reason as "waiting for nodes (SLURM's reason: X)".
PENDING_REASONS = {
    "Resources": ("The job is waiting for resources to become available.",
                  "nothing is wrong: the nodes it asked for are busy; fewer GPUs or a shorter --time may start "
                  "sooner"),
    "Priority": ("One or more higher priority jobs exist for this partition or advanced reservation.",
                 "wait, or use the workshop's reservation (--reservation) if it has one"),
    "ReqNodeNotAvail": ("Some node specifically required by the job is not currently available.",
                        "drop the node list (-w) or pick nodes that are up (sinfo -R says why others are down)"),
    "PartitionTimeLimit": ("The job's time limit exceeds its partition's current time limit.",
                           "a --time within the partition's limit (sinfo -o '%P %l'): it never starts otherwise"),
    "QOSGrp*Limit": ("The job's QOS has reached an aggregate limit on some resource.",
                     "your group's jobs hold the QOS's share (GPUs, jobs): stop one, or wait for one to end"),
}


def committed(path: str) -> str:
    """A committed result file (``benchmarks/results/<path>``), read as text: the logs of real GPU runs."""
    return (RESULTS_DIR / path).read_text(errors="replace")
