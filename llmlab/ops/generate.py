"""``llmlab generate``: offline batch inference in a child process, with load time, TTFT and tokens/s.

Why a child process: a command (and a notebook that wants its kernel small) gets vLLM's whole engine in a
process group of its own that ``close()`` ends, memory and all, without touching the kernel's own imports.
Notebook 07 calls ``vllm.LLM(...)`` and ``llm.generate(prompts, SamplingParams(...))`` in its own cells; here the
same calls run in ``llmlab.ops.engine``'s ``_worker``, which this module starts as ``python -m llmlab.ops.engine
FD`` and talks to over a pipe, after ``llmlab.ops.engine`` has checked the model and the layout.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from llmlab import memory, sampling
from llmlab.offline import BatchResult, Completion, engine_environment, memory_of, vllm_sampling_kwargs
from llmlab.ops.engine import (
    DEFAULT_START_TIMEOUT,
    DEFAULT_TIMEOUT,
    EngineFailed,
    EngineNotInstalled,
    LayoutError,
    LayoutReport,
    OfflineError,
    ResolvedModel,
    check_layout,
    detect_gpu,
    require_engine,
    resolve_model,
    serve_dtype,
)
from llmlab.serve.info import llmlab_home
from llmlab.serve.proc import last_lines
from llmlab.serve.vllm import PHASES as VLLM_PHASES
from llmlab.serve.vllm import VLLMProcess, cpu_kv_space, local_env
from llmlab.serve.vllm import phase as vllm_phase


def _check_prompt(p, where: str):
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return {"prompt_token_ids": p}
    if isinstance(p, Mapping):
        if "messages" in p:
            msgs = p["messages"]
            if not (isinstance(msgs, list) and msgs and all(isinstance(m, Mapping) and "role" in m and "content" in m
                                                            for m in msgs)):
                raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role': ..., 'content': ...}}.")
            return {"messages": [dict(m) for m in msgs]}
        if "prompt_token_ids" in p:
            return _check_prompt(list(p["prompt_token_ids"]), where)
        if "prompt" in p:
            return _check_prompt(p["prompt"], where)
    raise ValueError(f"{where}: a prompt is a string, a list of token ids, or an object with 'prompt' (text or "
                     f"token ids) or 'messages' (a chat); got {str(p)[:80]!r}.")


def normalize_prompts(prompts: Iterable) -> list:
    """Check prompts and give each the form the engine takes: text, ``{"prompt_token_ids": [...]}`` or
    ``{"messages": [...]}`` (templated in the engine process by the model's tokenizer)."""
    out = [_check_prompt(p, f"prompt {i}") for i, p in enumerate(prompts)]
    if not out:
        raise ValueError("no prompts: give at least one.")
    return out


def read_prompts(path: str | os.PathLike) -> tuple[list, list]:
    """Prompts and their ids from a JSONL file: each line a JSON string or an object with ``prompt`` or
    ``messages`` and an optional ``id`` (default: the line's position among the prompts)."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read the prompts file {path}: {e.strerror or e}.") from None
    prompts, ids = [], []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} line {n} is not JSON ({e.msg}): write one JSON object per line, e.g. "
                             '{"prompt": "Hello"} or {"messages": [{"role": "user", "content": "Hi"}]}.') from None
        prompts.append(_check_prompt(item, f"{path} line {n}"))
        ids.append(item.get("id", len(ids)) if isinstance(item, Mapping) else len(ids))
    if not prompts:
        raise ValueError(f"{path} holds no prompts (one JSON object per line).")
    if len({json.dumps(i) for i in ids}) != len(ids):
        raise ValueError(f"{path}: two prompts share an id; ids must be unique (they label the output lines).")
    return prompts, ids


def write_outputs(path: str | os.PathLike, batch: BatchResult, ids: list | None = None) -> Path:
    """One JSON line per prompt: id, text, token counts, finish reason, TTFT.

    Atomic: a temporary file beside ``path`` replaces it only once complete, so a full disk leaves an earlier
    ``path`` as it was; the :class:`OfflineError` then says what was kept and what the batch measured."""
    from llmlab.loadtest.results import replace_file

    path = Path(path)
    ids = ids if ids is not None else list(range(len(batch.completions)))
    lines = [json.dumps({"id": i, "prompt": c.prompt, "text": c.text, "prompt_tokens": c.prompt_tokens,
                         "output_tokens": c.output_tokens, "finish_reason": c.finish_reason,
                         "stop_reason": c.stop_reason, "ttft_s": c.ttft}) + "\n"
             for i, c in zip(ids, batch.completions, strict=True)]
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return replace_file(path, "".join(lines).encode())
    except OSError as e:
        kept = f"{path} is kept as it was" if existed else "no file was created"
        tokens = sum(c.output_tokens for c in batch.completions)
        raise OfflineError(f"Could not write the {len(lines)} outputs to {path} ({e.strerror}): {kept}. The batch "
                           f"itself ran ({tokens} output tokens in {batch.seconds:.1f} s); free some space or choose "
                           "another --output, and run it again.") from e


# The offline engine's start-up: vLLM's own phases (llmlab.serve.vllm.PHASES) between the two lines that
# llmlab.ops.engine's worker prints itself, before it imports vLLM and before it pre-warms the loaded engine.
PHASES = [(re.compile(r"llmlab: importing vLLM"), "importing vLLM"), *VLLM_PHASES,
          (re.compile(r"llmlab: pre-warm"), "pre-warming")]


def phase(log_path: Path) -> str:
    """The offline engine's latest start-up phase (``starting Python`` until its worker prints a line)."""
    return vllm_phase(log_path, PHASES, before="starting Python")


def offline_engine_env(kv_cache_gib: int = 1, build: str = "cpu") -> dict[str, str]:
    """The engine process's environment: this one's (:func:`llmlab.serve.vllm.local_env`), with
    :func:`llmlab.offline.engine_environment`'s settings (nothing downloaded; on the CPU build the KV space and the
    engine core in the engine process), its output unbuffered so that the phases reach the log as they happen."""
    return {**local_env(engine_environment(kv_cache_gib, build)), "PYTHONUNBUFFERED": "1"}


_LIVE: weakref.WeakSet = weakref.WeakSet()


def _close_all() -> None:
    for engine in list(_LIVE):
        with contextlib.suppress(Exception):
            engine.close()


class OfflineEngine:
    """``vllm.LLM`` in a child process: load, pre-warm, then ``generate`` as often as needed; ``close()``
    (or the end of a ``with`` block, or the kernel's exit) ends the process group and frees its memory::

        with OfflineEngine() as engine:                  # the tiny model on vLLM-CPU
            batch = engine.generate(prompts, temperature=0, max_tokens=64)
        batch.summary()["output_tokens_per_s"]

    Engine arguments are those of ``vllm.LLM`` (and of the seed script): ``tp_size``, ``pp_size``,
    ``gpu_memory_utilization``, ``max_model_len``, ``dtype``, ``enforce_eager``.  ``kv_cache_gib`` is the CPU
    build's KV space.  ``gpu`` names the GPU for the memory check (default: ``nvidia-smi``'s, if any;
    ``"none"``: no memory check, only heads, layers and context).
    """

    def __init__(self, model: str | os.PathLike | None = None, *, tp_size: int = 1, pp_size: int = 1,
                 gpu_memory_utilization: float = memory.DEFAULT_UTILIZATION, max_model_len: int | None = None,
                 dtype: str | None = None, enforce_eager: bool = False, kv_cache_gib: int = 1,
                 distributed_executor_backend: str | None = None, seed: int | None = None, gpu=None,
                 warmup: bool = True, log_path: str | os.PathLike | None = None, extra: Mapping | None = None):
        cpu_kv_space(kv_cache_gib)  # a KV space that is not whole GiB fails here, before anything
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization}: a share of memory, in (0, 1].")
        self.model = model
        self.tp_size, self.pp_size = tp_size, pp_size
        self.gpu_memory_utilization, self.max_model_len, self.dtype = gpu_memory_utilization, max_model_len, dtype
        self.enforce_eager, self.kv_cache_gib = enforce_eager, int(kv_cache_gib)
        self.distributed_executor_backend, self.seed, self.gpu, self.warmup = (distributed_executor_backend, seed,
                                                                               gpu, warmup)
        self.extra = dict(extra or {})
        self.log_path = Path(log_path) if log_path else None
        self.engine: VLLMProcess | None = None
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.info: dict = {}
        self.layout: LayoutReport | None = None
        self.resolved: ResolvedModel | None = None
        self.last_memory: dict = {}
        self.build: str | None = None

    # -- start -----------------------------------------------------------------------------------

    def prepare(self) -> dict:
        """Every check that needs no engine, then the ``vllm.LLM`` keyword arguments.  Raises
        :class:`EngineNotInstalled`, :class:`ModelNotFound` or :class:`LayoutError`."""
        build = self.build = require_engine()
        self.resolved = resolve_model(self.model)
        config = self.resolved.config
        gpu = self.gpu
        if str(gpu).lower() == "none":  # the user's way out when the allowance of llmlab.memory is too strict
            gpu = None
        elif gpu is None and build == "gpu":
            found = detect_gpu()
            gpu = found[0] if found else None
        checks = [dict(build="gpu", gpu=gpu)] if gpu is not None else []  # a named GPU is checked on any build
        if build == "cpu":
            checks.append(dict(build="cpu"))
        try:
            dtype = serve_dtype(config, self.dtype)
            for check in checks:
                self.layout = check_layout(config, self.tp_size, self.pp_size, dtype=self.dtype,
                                           max_model_len=self.max_model_len,
                                           gpu_memory_utilization=self.gpu_memory_utilization,
                                           kv_cache_gib=self.kv_cache_gib, **check)
        except (memory.ConfigError, memory.PlanError) as e:
            raise LayoutError(str(e)) from None
        kwargs = {"model": self.resolved.name, "tensor_parallel_size": self.tp_size,
                  "pipeline_parallel_size": self.pp_size, "gpu_memory_utilization": self.gpu_memory_utilization,
                  "max_model_len": self.layout.max_model_len, "dtype": dtype, "enforce_eager": self.enforce_eager,
                  "disable_log_stats": False}  # per-request stats: the TTFT of every completion
        backend = self.distributed_executor_backend or ("mp" if build == "cpu" else None)  # see offline_engine_env
        if backend:
            kwargs["distributed_executor_backend"] = backend
        if self.seed is not None:
            kwargs["seed"] = self.seed
        return {**kwargs, **self.extra}

    def start(self, timeout: float = DEFAULT_START_TIMEOUT, progress: bool | str = True) -> OfflineEngine:
        """Check, spawn the engine process, and wait until it has loaded and pre-warmed (a progress bar names
        the start-up phase).  ``info`` then holds ``load_s`` (the ``vllm.LLM(...)`` call, as the seed script
        measures it), ``import_s``, ``warmup_s``, ``start_s`` (all of it, wall clock) and the KV cache size."""
        if self.proc is not None:
            return self
        kwargs = self.prepare()
        log = self.log_path or llmlab_home() / "logs" / f"offline-{os.getpid()}-{time.time_ns() % 10**9}.log"
        self.log_path = log
        parent, child = socket.socketpair()
        t0 = time.perf_counter()
        self.engine = VLLMProcess([sys.executable, "-m", "llmlab.ops.engine", str(child.fileno())],
                                  offline_engine_env(self.kv_cache_gib, self.build), log, pass_fds=(child.fileno(),),
                                  header=f"$ vllm.LLM({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})")
        self.proc = self.engine.start().proc  # its own process group: close() ends it all
        child.close()
        self.conn = Connection(parent.detach())
        _LIVE.add(self)
        try:
            self.conn.send(("start", {"llm": kwargs, "warmup": self.warmup}))
            reply = self._wait("load", timeout, progress, bar_desc="vLLM (offline)")
        except BaseException:
            self.close()
            raise
        self.info = {**reply, "start_s": time.perf_counter() - t0, "model": self.resolved.name,
                     "tp_size": self.tp_size, "pp_size": self.pp_size, "dtype": kwargs["dtype"],
                     "max_model_len": kwargs["max_model_len"], "enforce_eager": self.enforce_eager,
                     "log": str(self.log_path), "pid": self.proc.pid}
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def load_s(self) -> float | None:
        return self.info.get("load_s")

    @property
    def warmup_s(self) -> float | None:
        return self.info.get("warmup_s")

    def _fail(self, why: str) -> EngineFailed:
        log = self.log_path
        tail = last_lines(log, 20) if log else "(no log)"
        self.close()
        return EngineFailed(f"{why} Last lines of its log {log}:\n{tail}")

    def _wait(self, what: str, timeout: float, progress: bool | str, bar_desc: str, total: int | None = None):
        """Wait for the engine's reply to ``what``, showing progress: a bar (``progress=True`` in a notebook or a
        terminal), one line per start-up phase on stderr (``"lines"``, and ``True`` when stderr is a file or a
        pipe: logs, SLURM output), or nothing.  Fails clearly if the engine exits or the time-out passes (the
        engine is then stopped: its state is unknown)."""
        from tqdm.auto import tqdm

        if progress is True and "ipykernel" not in sys.modules and not sys.stderr.isatty():
            progress = "lines"

        start = deadline = last_line = time.monotonic()
        deadline += timeout
        fmt = None if total else "{desc} [{elapsed}]"
        shown, done = None, 0
        with tqdm(total=total, desc=bar_desc, disable=progress is not True, leave=False, mininterval=0.5,
                  unit="prompt", bar_format=fmt) as bar:
            try:
                while True:
                    if self.conn.poll(0.5):
                        try:
                            kind, payload = self.conn.recv()
                        except (EOFError, OSError):
                            raise self._fail(f"The offline engine exited during {what} "
                                             f"(code {self.proc.wait(timeout=30)}).") from None
                        if kind == "progress":
                            bar.update(payload)
                            done += payload
                            if progress == "lines" and time.monotonic() - last_line > 10:
                                last_line = time.monotonic()
                                print(f"{bar_desc}: {done}/{total} prompts [{last_line - start:.0f} s]",
                                      file=sys.stderr, flush=True)
                            continue
                        if kind == "error":
                            self._raise_child_error(payload)
                        return payload
                    code = self.proc.poll()
                    if code is not None:
                        raise self._fail(f"The offline engine exited (code {code}) during {what}.")
                    if time.monotonic() > deadline:
                        raise self._fail(f"The offline engine did not finish {what} within {timeout:.0f} s; it was "
                                         "stopped. A busy machine is slower: pass a longer timeout, or read its log.")
                    if total is None:
                        now = phase(self.log_path)
                        if progress == "lines" and now != shown:
                            print(f"{bar_desc}: {now} [{time.monotonic() - start:.0f} s]", file=sys.stderr,
                                  flush=True)
                        shown = now
                        bar.set_description_str(f"{bar_desc}: {now}", refresh=False)
                        bar.update(0)
            except KeyboardInterrupt:
                self.close()
                raise

    def _raise_child_error(self, payload: dict):
        kind, message = payload.get("type"), payload.get("message", "")
        if kind == "EngineNotInstalled":
            self.close()
            raise EngineNotInstalled(f"vLLM is installed but does not import in {sys.executable}: {message}. "
                                     "Reinstall it (`make install`).")
        if payload.get("fatal"):
            raise self._fail(f"The offline engine failed: {kind}: {message}")
        raise OfflineError(f"{kind}: {message}")  # the request was refused; the engine is still usable

    # -- generate --------------------------------------------------------------------------------

    def generate(self, prompts: Iterable, params: sampling.SamplingParams | Mapping | None = None, *,
                 progress: bool | str = False, timeout: float = DEFAULT_TIMEOUT, **overrides) -> BatchResult:
        """Run one ``llm.generate`` over all ``prompts`` (texts, token-id lists or ``{"messages": [...]}``
        chats) with one set of sampling parameters: ``params`` and/or their fields as keywords
        (``temperature=0, max_tokens=64``), exactly as an online request takes them."""
        if not self.running:
            if self.proc is None:
                self.start(progress=progress)
            else:
                raise EngineFailed("The offline engine was closed; start a new OfflineEngine.")
        kwargs = vllm_sampling_kwargs(params, **overrides)
        items = normalize_prompts(prompts)
        self.conn.send(("generate", {"prompts": items, "params": kwargs, "progress": bool(progress)}))
        reply = self._wait("generation", timeout, progress, bar_desc="offline batch", total=len(items))
        completions = [Completion(**{**c, "prompt": p if isinstance(p, str) else None})
                       for c, p in zip(reply["completions"], items, strict=True)]
        return BatchResult(completions, reply["seconds"], kwargs)

    def memory(self) -> dict:
        """Memory of the engine process and the processes vLLM started (see :func:`memory_of`)."""
        if self.running:
            self.last_memory = memory_of(self.proc.pid)
        return self.last_memory

    # -- stop ------------------------------------------------------------------------------------

    def close(self, grace: float = 20.0) -> None:
        """Ask the engine to exit, then end its process group (SIGTERM, SIGKILL after ``grace`` s).  The peak
        memory is kept in ``last_memory``.  Safe to call twice."""
        _LIVE.discard(self)
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.memory()
            with contextlib.suppress(OSError, ValueError):
                self.conn.send(("close", None))
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace)
        self.engine.stop(grace)  # vLLM's helper processes share the group; none may outlive the engine
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def __enter__(self) -> OfflineEngine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.running else "not running"
        load = f", loaded in {self.load_s:.1f} s" if self.load_s else ""
        return f"OfflineEngine({self.info.get('model', self.model or memory.TINY_NAME)!r}, {state}{load})"


@dataclass
class OfflineRun:
    """What ``llmlab generate`` reports: the engine's start-up, the batch, and peak memory."""

    info: dict
    batch: BatchResult
    memory: dict
    ids: list
    output: str | None = None

    def report(self) -> dict:
        s = self.batch.summary()
        return {"model": self.info.get("model"), "tp_size": self.info.get("tp_size"),
                "pp_size": self.info.get("pp_size"), "dtype": self.info.get("dtype"),
                "max_model_len": self.info.get("max_model_len"), "load_s": self.info.get("load_s"),
                "import_s": self.info.get("import_s"), "warmup_s": self.info.get("warmup_s"),
                "start_s": self.info.get("start_s"), "kv_cache_tokens": self.info.get("kv_cache_tokens"),
                "prompts": s["requests"], "prompt_tokens": s["prompt_tokens"], "output_tokens": s["output_tokens"],
                "generation_s": s["duration_s"], "output_tokens_per_s": s["output_tokens_per_s"],
                "ttft_s": self.batch.completions[0].ttft if len(self.batch.completions) == 1 else s["ttft_p50"],
                "ttft_p50_s": s["ttft_p50"], "tpot_p50_s": s["tpot_p50"], "peak_rss_bytes": self.memory.get("peak_rss"),
                "output": self.output, "log": self.info.get("log")}


def run(prompts: Iterable, params: sampling.SamplingParams | Mapping | None = None, *, ids: list | None = None,
        output: str | os.PathLike | None = None, progress: bool | str = True, timeout: float = DEFAULT_START_TIMEOUT,
        **engine_args) -> OfflineRun:
    """Start an engine, generate every prompt in one batch, write ``output`` (JSONL) if given, and stop it:
    the whole life of a batch job (``llmlab generate``).  ``engine_args`` go to :class:`OfflineEngine`."""
    items = normalize_prompts(prompts)
    vllm_sampling_kwargs(params)  # a wrong sampling parameter fails before minutes of loading
    engine = OfflineEngine(**engine_args)
    try:
        engine.start(timeout=timeout, progress=progress)
        batch = engine.generate(items, params, progress=progress, timeout=timeout)
        mem = engine.memory()
        info = dict(engine.info)
    finally:
        engine.close()
    path = write_outputs(output, batch, ids) if output else None
    return OfflineRun(info, batch, mem, ids if ids is not None else list(range(len(items))),
                      str(path) if path else None)


atexit.register(_close_all)
