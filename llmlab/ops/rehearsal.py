"""``llmlab rehearse``: start a serving layout on real GPUs with dummy weights, measure it, write its results.

Why here: notebook 09 (``llmlab.rehearse``) teaches what a rehearsal measures and the arithmetic that must
reproduce it; this module is the runner.  :func:`rehearse` starts the *job script's own* ``vllm serve`` flags
(:func:`llmlab.cluster.vllm_flags` for the job of ``slurm/models.toml``) on a dummy model directory
(``--load-format dummy``: a ``config.json`` and a generated tokenizer, no weights), on a Unix socket behind
llmlab.serve.proxy on 127.0.0.1 as the launcher serves it, then measures the GPU's bandwidth, parses the memory
lines, and runs a batch-1 decode and a concurrency sweep with the course's load generator.  Everything lands in
``rehearsal.json`` (+ ``rehearsal.png`` and the server log).  The server runs in its own process group and is
stopped on every exit path (return, exception, Ctrl-C, SIGTERM).

On the CPU engine (``engine="cpu"``: the CI test with the tiny model) the same steps run; what differs: the KV
budget is ``VLLM_CPU_KVCACHE_SPACE`` rather than a measured remainder, there are no CUDA graphs, and the
"bandwidth" is a host-memory copy.

Exact KV bytes: vLLM logs its memory figures rounded to 0.01 GiB, several KV blocks' worth.  So on GPUs the
server loads a tiny vLLM plugin (:func:`vllm_probe_plugin`, found through a generated ``entry_points.txt``)
that prints the same figures in bytes; it only reads, it changes no setting.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

from llmlab import memory
from llmlab.rehearse import (
    DEFAULT_CONCURRENCY,
    LOG_EXCERPT,
    PROBE_TAG,
    READY_TIMEOUT,
    GiB,
    Layout,
    MemoryLog,
    RehearseError,
    bytes_per_decode_step,
    graph_estimate_subtracted,
    parse_memory_log,
    plot_rehearsal,
    predict_before_launch,
    predict_kv_before_start,
    predict_kv_from_log,
    require_kv,
    roofline_tok_s,
)
from llmlab.serve.info import new_key_file
from llmlab.serve.proxy.command import pair_command, proxy_command, wait_bound
from llmlab.serve.vllm import VLLMProcess, serve_line, vllm_env, vllm_serve

_LLAMA3_SPECIAL = {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128008: "<|eom_id|>",
                   128009: "<|eot_id|>"}


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def make_tokenizer(config: dict, out_dir: Path) -> dict:
    """Write tokenizer.json + tokenizer_config.json whose ids cover ``config["vocab_size"]``, offline.

    Why: a dummy model samples any id of its vocabulary, and vLLM must detokenize each; a dummy run needs no
    real tokenizer, only one of the right size.  The shipped tiny model's byte-level BPE (4,096 tokens) is
    the base; the ids above it are filler tokens, and the config's BOS/EOS ids become special tokens.
    Returns the ids a prompt may use (the BPE's, without its specials).
    """
    base = json.loads((memory.MODELS_DIR / memory.TINY_NAME / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(base["model"]["vocab"])
    size = int(config["vocab_size"])
    by_id = {i: t for t, i in vocab.items()}
    if size < len(vocab):
        vocab = {t: i for t, i in vocab.items() if i < size}
    base_specials = {a["id"] for a in base["added_tokens"]}
    bos, eos = _ids(config.get("bos_token_id")), _ids(config.get("eos_token_id"))
    named = {}
    for i in bos + eos:
        if i in by_id and i < size:
            named[i] = by_id[i]
        else:
            named[i] = _LLAMA3_SPECIAL.get(i) or (f"<|bos_{i}|>" if i in bos else f"<|eos_{i}|>")
    for i in range(len(base["model"]["vocab"]), size):
        vocab[named.get(i, f"<|reserved_{i}|>")] = i
    base["model"]["vocab"] = vocab
    added = [a for a in base["added_tokens"] if a["id"] < size and a["id"] not in named]
    for i, name in sorted(named.items()):
        added.append({"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": False, "special": True})
    base["added_tokens"] = sorted(added, key=lambda a: a["id"])
    if bos:
        b = named[bos[0]]
        base["post_processor"] = {"type": "TemplateProcessing",
                                  "single": [{"SpecialToken": {"id": b, "type_id": 0}},
                                             {"Sequence": {"id": "A", "type_id": 0}}],
                                  "pair": [{"SpecialToken": {"id": b, "type_id": 0}},
                                           {"Sequence": {"id": "A", "type_id": 0}},
                                           {"Sequence": {"id": "B", "type_id": 1}}],
                                  "special_tokens": {b: {"id": b, "ids": [bos[0]], "tokens": [b]}}}
    else:
        base["post_processor"] = None
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(json.dumps(base, ensure_ascii=False))
    tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", "backend": "tokenizers",
            "model_max_length": int(config.get("max_position_embeddings") or 2048)}
    if bos:
        tcfg["bos_token"] = named[bos[0]]
    if eos:
        tcfg["eos_token"] = named[eos[0]]
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))
    specials = base_specials | set(named)
    return {"prompt_ids": [i for i in range(min(len(by_id), size)) if i not in specials]}


def make_dummy_model(model, out_dir: Path) -> dict:
    """A model directory vLLM can load with ``--load-format dummy``: the shipped config.json (no weights)
    and a generated tokenizer.  Returns what :func:`make_tokenizer` returns."""
    config, _ = memory.load_config(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    # A chat template, so that /v1/chat/completions answers as it does for an instruct checkpoint (the tiny
    # model's plain "Role: text" one: a dummy model's words mean nothing in any template).
    shutil.copy(memory.MODELS_DIR / memory.TINY_NAME / "chat_template.jinja", out_dir / "chat_template.jinja")
    return make_tokenizer(config, out_dir)


def vllm_probe_plugin() -> None:
    """vLLM general plugin (loaded in every vLLM process): wrap the GPU worker's memory profiling so that
    it prints its figures in bytes on one line.  Reads attributes only; anything unexpected prints an
    error line instead, and the rehearsal falls back to the rounded log figures."""
    try:
        from vllm.v1.worker import gpu_worker
    except Exception:  # noqa: BLE001 -- a CPU build, or another vLLM layout: no probe
        return
    worker = getattr(gpu_worker, "Worker", None)
    original = getattr(worker, "determine_available_memory", None)
    if original is None or getattr(original, "_llmlab_probe", False):
        return

    def determine_available_memory(self):
        result = original(self)
        try:
            from vllm import envs

            facts = {"rank": int(getattr(self, "rank", 0)), "local_rank": int(getattr(self, "local_rank", 0)),
                     "total": int(self.init_snapshot.total_memory), "free": int(self.init_snapshot.free_memory),
                     "requested": int(self.requested_memory),
                     "weights": int(self.model_runner.model_memory_usage),
                     "activation_peak": int(self.peak_activation_memory), "non_torch": int(self.non_torch_memory),
                     "cudagraph_estimate": int(getattr(self, "cudagraph_memory_estimate", 0)),
                     "cudagraph_estimate_applied": bool(getattr(envs, "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS",
                                                                False)),
                     "available_kv": int(self.available_kv_cache_memory_bytes), "returned": int(result)}
        except Exception as e:  # noqa: BLE001
            facts = {"error": f"{type(e).__name__}: {e}"}
        print(PROBE_TAG + json.dumps(facts), file=sys.stderr, flush=True)
        return result

    determine_available_memory._llmlab_probe = True
    worker.determine_available_memory = determine_available_memory


def write_probe(folder: Path) -> Path:
    """A distribution folder that registers :func:`vllm_probe_plugin` as a vLLM general plugin; vLLM finds it
    through ``importlib.metadata`` when the folder is on the server's PYTHONPATH."""
    info = folder / "llmlab_rehearse_probe-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: llmlab-rehearse-probe\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\n"
                                           "llmlab_rehearse_probe = llmlab.ops.rehearsal:vllm_probe_plugin\n")
    return folder


_GPU_SCRIPT = r"""
import json, sys, torch
if not torch.cuda.is_available():
    print(json.dumps({"count": 0})); sys.exit(0)
n = torch.cuda.device_count()
props = torch.cuda.get_device_properties(0)
total = [torch.cuda.mem_get_info(i)[1] for i in range(n)]
size = int(sys.argv[1])
x = torch.empty(size // 2, dtype=torch.bfloat16, device="cuda:0").uniform_()
y = torch.empty_like(x)
for _ in range(3):
    y.copy_(x)
times = []
for _ in range(int(sys.argv[2])):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); y.copy_(x); b.record(); b.synchronize()
    times.append(a.elapsed_time(b) / 1000)
times.sort()
print(json.dumps({"count": n, "name": props.name, "total_bytes": total, "copy_bytes": 2 * x.numel() * 2,
                  "copy_s": times[len(times) // 2], "torch": torch.__version__}))
"""


def gpu_facts(copy_bytes: int = 4 * GiB, repeats: int = 20, timeout: float = 300.0) -> dict:
    """GPU count, name, memory, and the bandwidth of a device-to-device copy of ``copy_bytes`` on GPU 0
    (bytes read + bytes written over the median time), from a child process."""
    if shutil.which("nvidia-smi") is None and not Path("/dev/nvidia0").exists():
        return {"count": 0}
    try:
        out = subprocess.run([sys.executable, "-c", _GPU_SCRIPT, str(copy_bytes), str(repeats)],
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RehearseError(f"Measuring the GPUs took over {timeout:.0f} s: check nvidia-smi.") from None
    if out.returncode != 0:
        raise RehearseError("PyTorch could not use the GPU here: " + (out.stderr.strip().splitlines() or ["?"])[-1])
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    if facts.get("count"):
        facts["bandwidth_bytes_s"] = facts["copy_bytes"] / facts["copy_s"]
    return facts


def host_facts(copy_bytes: int = GiB // 2, repeats: int = 7) -> dict:
    """The CPU engine's "bandwidth": a host-memory copy of ``copy_bytes`` (read + write over the median)."""
    import numpy as np

    x = np.random.default_rng(0).random(copy_bytes // 8)
    y = np.empty_like(x)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(y, x)
        times.append(time.perf_counter() - t)
    copy_s = statistics.median(times)
    import platform

    return {"count": 0, "name": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
            "copy_bytes": 2 * x.nbytes, "copy_s": copy_s, "bandwidth_bytes_s": 2 * x.nbytes / copy_s}


def gpu_label(name: str) -> str:
    """A short folder label for a device name: 'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA H200' -> 'h200'."""
    m = re.search(r"\b([A-Z]{1,3}\d{2,4}[A-Z]?)\b", name.upper())
    return m[1].lower() if m else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def rehearsal_job(model: str, *, tp: int | None = None, pp: int | None = None, max_model_len: int | None = None,
                  gpu_memory_utilization: float | None = None, engine: str = "gpu", kv_cache_gib: int = 1):
    """The job to rehearse: the settings of ``slurm/models.toml`` when ``model`` names a job there (the
    launcher's exact layout), else one node with the given layout; overrides applied; all GPUs on one node."""
    from llmlab import cluster

    jobs = cluster.load_settings()
    if model in jobs and jobs[model].engine == engine:
        base = jobs[model].as_dict()
    else:
        memory.model_spec(model)  # a clear error for an unknown model, before anything starts
        base = {"name": Path(model).stem if model not in memory.shipped_models() else model, "model": model,
                "nodes": 1, "gpus_per_node": 1, "tp": 1, "pp": 1, "engine": engine}
    over = {"tp": tp, "pp": pp, "max_model_len": max_model_len, "gpu_memory_utilization": gpu_memory_utilization}
    base.update({k: v for k, v in over.items() if v is not None})
    if engine == "cpu":
        if base["tp"] * base["pp"] != 1:
            raise RehearseError("The CPU engine rehearses TP=1 x PP=1 only: drop --tp/--pp, or rehearse on GPUs.")
        base.update(engine="cpu", gpus_per_node=0, kv_cache_gib=kv_cache_gib)
    else:
        base["gpus_per_node"] = base["tp"] * base["pp"]
    base.update(nodes=1, extra_args=tuple(base.get("extra_args", ())))
    try:
        job = cluster.JobSettings(**base)
        cluster.check_settings(job, Path("rehearsal"))
    except cluster.SettingsError as e:
        raise RehearseError(str(e)) from None
    return job


def serve_argv(job, model_dir: Path, port: int, uds: Path | None = None) -> tuple[list[str], dict[str, str], str]:
    """The launcher's ``vllm serve`` line for ``job`` (``cluster.job_flags``: the flags the job script uses) on
    the dummy model, with ``--load-format dummy``, served on 127.0.0.1:port, or on the Unix socket ``uds`` as the
    launcher serves it behind llmlab.serve.proxy.

    One change for a rehearsal on one node: PP uses vLLM's own processes (``mp``) instead of Ray, which the
    launcher needs only to span nodes.  Returns (argv, extra environment, the ``vllm serve`` line); the
    environment is :func:`llmlab.serve.vllm.vllm_env`'s: offline (dummy weights need no download), the engine's
    sockets beside ``uds``, and on a GPU without FlashInfer its sampler off."""
    import importlib.util

    from llmlab import cluster

    listen = ["--uds", str(uds)] if uds else ["--host", "127.0.0.1", "--port", str(port)]
    # the planner's Ray for PP: on one node, vLLM's own processes
    flags = cluster.job_flags(job, listen, ["--load-format", "dummy"], backend="mp")
    env = vllm_env(job.engine, kv_cache_gib=job.kv_cache_gib, run_dir=uds.parent if uds else None,
                   flashinfer=importlib.util.find_spec("flashinfer") is not None)
    return vllm_serve(sys.executable, model_dir, flags), env, serve_line(model_dir, flags)


def server(argv: list[str], env: dict[str, str], log_path: Path, run_dir: Path) -> VLLMProcess:
    """The rehearsal's vLLM (``argv`` serves on ``run_dir/vllm.sock``) behind llmlab.serve.proxy on a port of
    127.0.0.1 that the system picks, with a key of its own (a 0600 file in the 0700 ``run_dir``, never in argv), in
    one process group: ``stop()`` ends all of it (proxy, API server, engine core, GPU workers).

    Why the proxy: vLLM's own TCP port answers /pause, /invocations, ... without a key to every user of the node,
    and a port chosen before anyone binds it may be another user's by then (who would get the key with the first
    /health).  The caller reads the bound port with :func:`bound_port` before it sends anything."""
    key_file = run_dir / "key"
    key = new_key_file(key_file, 24)
    proxy = proxy_command("127.0.0.1:0", run_dir / "vllm.sock", key_file, ready_file=run_dir / "proxy.ready")
    return VLLMProcess(pair_command(proxy, argv, log_path.with_name("proxy.log"), run_dir / "proxy.ready"),
                       env, log_path, host="127.0.0.1", api_key=key,
                       header=f"$ {' '.join(argv)}\n$ {' '.join(proxy)}")


def bound_port(srv: VLLMProcess, run_dir: Path) -> int:
    """The port the started :func:`server`'s proxy listens on, once it does (its ready file); an error that quotes
    the proxy if it could not listen."""
    srv.port = wait_bound(run_dir / "proxy.ready", lambda: srv.alive, srv.log_path.with_name("proxy.log"))["port"]
    return srv.port


@contextlib.contextmanager
def _signals_raise():
    """SIGTERM and SIGHUP (scancel, a closed terminal) raise SystemExit, so that ``finally`` stops the server."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, _frame):
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def workload(n: int, prompt_ids: list[int], input_len: int, output_len: int, seed: int = 0) -> list:
    """``n`` prompts of exactly ``input_len`` random token ids (from the tokenizer's ordinary tokens), each
    asking for ``output_len`` tokens.  Token ids, not text: the length is exact, no re-tokenizing."""
    import numpy as np

    from llmlab import loadtest

    rng = np.random.default_rng(seed)
    pool = np.asarray(prompt_ids)
    return [loadtest.Job(id=i, prompt=rng.choice(pool, size=input_len).tolist(), max_tokens=output_len,
                         input_len=input_len) for i in range(n)]


def _row(summary: dict) -> dict:
    keys = ("concurrency", "requests", "ok", "errors", "output_tokens_per_s", "ttft_p50", "ttft_p99", "tpot_p50",
            "latency_p50", "max_outstanding", "max_concurrency_seen", "duration_s")
    return {k: summary.get(k) for k in keys}


def benchmark(srv: VLLMProcess, name: str, prompt_ids: list[int], *, concurrency=DEFAULT_CONCURRENCY,
              input_len: int = 64, output_len: int = 256, batch1_requests: int = 5, min_requests: int = 4,
              timeout: float = 600.0, progress: bool = True, say=print) -> dict:
    """Batch-1 decode (``batch1_requests`` streamed requests one after another) and a sweep: at each
    concurrency c, max(min_requests, 2c) requests with c in flight, after one warm-up request."""
    import openai

    from llmlab import loadtest

    client = openai.OpenAI(base_url=srv.base_url, api_key=srv.api_key, max_retries=0)
    opts = {"max_tokens": output_len, "timeout": timeout, "progress": progress, "temperature": 0,
            "ignore_eos": True}
    loadtest.run(client, name, workload(2, prompt_ids, input_len, output_len, seed=99), concurrency=1,
                 **{**opts, "progress": False})
    b1 = loadtest.run(client, name, workload(batch1_requests, prompt_ids, input_len, output_len, seed=1),
                      concurrency=1, **opts).summary()
    say(f"batch 1: TPOT p50 {b1['tpot_p50'] * 1000:.2f} ms -> {1 / b1['tpot_p50']:.1f} tok/s")
    rows = []
    for c in concurrency:
        loadtest.run(client, name, workload(1, prompt_ids, input_len, output_len, seed=7), concurrency=1,
                     **{**opts, "progress": False})
        res = loadtest.run(client, name, workload(max(min_requests, 2 * c), prompt_ids, input_len, output_len,
                                                  seed=100 + c), concurrency=c, **opts)
        rows.append(_row(res.summary()))
        r = rows[-1]
        say(f"c={c}: {r['output_tokens_per_s']:,.0f} tok/s, TTFT p50 {r['ttft_p50'] * 1000:.0f} ms, "
            f"TPOT p50 {r['tpot_p50'] * 1000:.2f} ms ({r['ok']}/{r['requests']} ok, "
            f"{r['max_concurrency_seen']} in flight at most)")
    return {"batch1": _row(b1), "sweep": rows, "input_len": input_len, "output_len": output_len}


def result_dir_name(gpu: str, model: str, tp: int, pp: int = 1) -> str:
    """``<gpu>-<model>-tp<N>`` (``-pp<M>`` added for pipeline layouts): the benchmarks/results folder name."""
    return f"{gpu}-{model}-tp{tp}" + (f"-pp{pp}" if pp > 1 else "")


def rehearse(model: str, *, tp: int | None = None, pp: int | None = None, max_model_len: int | None = None,
             gpu_memory_utilization: float | None = None, concurrency=DEFAULT_CONCURRENCY,
             out: str | Path | None = None, engine: str = "gpu", kv_cache_gib: int = 1, input_len: int = 64,
             output_len: int = 256, batch1_requests: int = 5, min_requests: int = 4,
             ready_timeout: float = READY_TIMEOUT, progress: bool = True, plots: bool = True, say=print) -> dict:
    """Start ``model``'s serving layout with dummy weights, check memory and speed, write ``rehearsal.json``.

    ``model``: a job of ``slurm/models.toml`` (its exact layout) or any shipped model / config.json; ``tp``,
    ``pp``, ``max_model_len``, ``gpu_memory_utilization`` override the job's.  ``engine="cpu"`` rehearses on
    vLLM's CPU build (the tiny model in CI).  Returns the dict written to ``<out>/rehearsal.json``.
    """
    job = rehearsal_job(model, tp=tp, pp=pp, max_model_len=max_model_len,
                        gpu_memory_utilization=gpu_memory_utilization, engine=engine, kv_cache_gib=kv_cache_gib)
    layout = Layout(job.model, job.tp, job.pp, job.max_model_len, job.gpu_memory_utilization, job.dtype,
                    job.kv_dtype, job.engine, job.kv_cache_gib)
    if engine == "gpu":
        facts = gpu_facts()
        if not facts.get("count"):
            raise RehearseError("No GPU on this machine (nvidia-smi/PyTorch see none): run `llmlab rehearse` on a "
                                "GPU node (e.g. inside `srun --gpus=N`), or use --engine cpu for the tiny model.")
        if facts["count"] < job.tp * job.pp:
            raise RehearseError(f"TP={job.tp} x PP={job.pp} needs {job.tp * job.pp} GPUs but this machine has "
                                f"{facts['count']}: ask for more GPUs, or rehearse a smaller --tp/--pp.")
        gpu_bytes = facts["total_bytes"][0]
    else:
        facts, gpu_bytes = host_facts(), None
    label = gpu_label(facts["name"]) if engine == "gpu" else "cpu"
    out = Path(out or Path.cwd() / "rehearsals" / result_dir_name(label, job.model, job.tp, job.pp))
    out.mkdir(parents=True, exist_ok=True)
    say(f"rehearsing {job.model} TP={job.tp} x PP={job.pp} on {facts.get('count') or 'no'} x {facts['name']}; "
        f"output in {out}")
    before = predict_kv_before_start(layout, gpu_bytes)
    # the model of every reserved byte (llmlab.memory.startup), made here, before vLLM starts
    before_launch = predict_before_launch(layout, gpu_bytes / GiB).kv_tokens if engine == "gpu" else before
    model_dir = out / "model"
    tok = make_dummy_model(job.model, model_dir)
    run_dir = Path(tempfile.mkdtemp(prefix="llmlab-vllm-"))  # 0700: vLLM's socket, the key, the proxy's ready file
    argv, env, line = serve_argv(job, model_dir, 0, uds=run_dir / "vllm.sock")
    env = {**os.environ, **env}
    if engine == "gpu":
        probe = write_probe(out / "probe")
        package_root = str(Path(__file__).resolve().parent.parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(probe), package_root, env.get("PYTHONPATH")) if p)
    srv = server(argv, env, out / "server.log", run_dir)
    released = False
    with _signals_raise():
        try:
            t0 = time.monotonic()
            srv.start()
            bound_port(srv, run_dir)
            srv.wait_ready(ready_timeout, progress)
            startup_s = time.monotonic() - t0
            say(f"/health answered after {startup_s:.0f} s")
            version = srv.version()
            mem = parse_memory_log(srv.log_path.read_text(errors="replace"))
            logged = require_kv(mem)
            predicted, basis = predict_kv_from_log(layout, mem)
            say(f"KV tokens: logged {logged:,}, predicted {predicted:,} ({basis}), before start-up {before:,} "
                f"(fixed allowance), {before_launch:,} (llmlab.memory.predict_kv_before_launch)")
            bench = benchmark(srv, job.name, tok["prompt_ids"], concurrency=tuple(concurrency), input_len=input_len,
                              output_len=output_len, batch1_requests=batch1_requests, min_requests=min_requests,
                              progress=progress, say=say)
        finally:
            released = srv.stop(grace=30)
            shutil.rmtree(run_dir, ignore_errors=True)
    mem = parse_memory_log(srv.log_path.read_text(errors="replace"))
    result = _result(job, layout, facts, label, line, version or mem.vllm_version, startup_s, mem, logged, predicted,
                     basis, before, bench, released, before_launch)
    (out / "rehearsal.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / LOG_EXCERPT).write_text(log_excerpt(srv.log_path))
    if plots:
        plot_rehearsal(result, path=out / "rehearsal.png")
    shutil.rmtree(out / "probe", ignore_errors=True)
    say(f"decode at batch 1: {result['decode_tok_s_batch1']:.1f} tok/s = {result['decode_vs_roofline']:.2f} of the "
        f"{result['roofline_tok_s']:.1f} tok/s roofline ({result['bandwidth_tb_s']:.2f} TB/s); wrote "
        f"{out / 'rehearsal.json'}")
    return result


def _result(job, layout: Layout, facts: dict, label: str, line: str, version, startup_s: float, mem: MemoryLog,
            logged: int, predicted: int, basis: str, before: int, bench: dict, released: bool,
            before_launch: int | None = None) -> dict:
    bw = facts["bandwidth_bytes_s"]
    roof = roofline_tok_s(layout, bw)
    b1 = bench["batch1"]
    decode = 1 / b1["tpot_p50"] if b1.get("tpot_p50") else None
    probe = [p for p in mem.probe if "weights" in p]
    r0 = probe[0] if probe else {}
    weights_gib = r0["weights"] / GiB if r0 else mem.weights_gib
    act_gib = r0["activation_peak"] / GiB if r0 else mem.activation_peak_gib
    return {
        "gpu": facts["name"], "gpu_label": label, "gpu_count": job.tp * job.pp if job.engine == "gpu" else 0,
        "gpus_on_machine": facts.get("count", 0), "engine": job.engine, "model": job.model, "job": job.name,
        "tp": job.tp, "pp": job.pp, "max_model_len": layout.context, "gpu_memory_utilization": layout.utilization,
        "vllm_version": version, "serve_line": line, "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "startup_s": round(startup_s, 1),
        "gpu_memory_gib": (facts["total_bytes"][0] / GiB) if facts.get("total_bytes") else None,
        "weights_gib": weights_gib, "weights_gib_predicted": max(layout.weights_per_stage()) / GiB,
        "activation_peak_gib": act_gib,
        "non_torch_gib": r0["non_torch"] / GiB if r0 else mem.non_torch_gib,
        "cuda_graph_gib": mem.cuda_graph_gib or mem.graph_gib,
        "cuda_graph_estimate_subtracted": (graph_estimate_subtracted(r0) if r0 else
                                           bool(mem.cuda_graph_estimate_applied)),  # from the bytes, not the setting
        "available_kv_gib": mem.available_kv_gib,
        "kv_bytes_per_token_per_gpu": max(layout.kv_per_token_per_stage()),
        "kv_tokens_logged": logged, "kv_tokens_predicted": predicted, "kv_prediction_basis": basis,
        "kv_tokens_predicted_before_start": before,
        "kv_error_before_start": (before - logged) / logged if logged else None,
        "kv_tokens_predicted_before_launch": before_launch,
        "kv_error_before_launch": (before_launch - logged) / logged if logged and before_launch is not None else None,
        "max_concurrency_logged": mem.max_concurrency,
        "memory_probe": probe,
        "bandwidth_tb_s": bw / 1e12, "bandwidth_method": ("device-to-device copy on GPU 0" if job.engine == "gpu"
                                                           else "host-memory copy (numpy)"),
        "bytes_per_token_gb": bytes_per_decode_step(layout) / 1e9, "roofline_tok_s": roof,
        "decode_tok_s_batch1": decode, "decode_vs_roofline": decode / roof if decode else None,
        "batch1": b1, "input_len": bench["input_len"], "output_len": bench["output_len"],
        "sweep": bench["sweep"], "server_stopped": released,
    }


def log_excerpt(log_path: Path, limit: int = 200) -> str:
    """The command and the lines worth keeping (memory, KV cache, graphs, version, errors) of a server log."""
    keep = re.compile(r"^\$ |Model loading took|KV cache|Maximum concurrency|Graph captur|Free memory on device|"
                      r"CUDA graph|torch.compile|version \d|Starting vLLM|non-default args|Error|error:|"
                      + re.escape(PROBE_TAG.strip()))
    lines = [ln.rstrip() for ln in Path(log_path).read_text(errors="replace").splitlines()
             if keep.search(ln) and "%|" not in ln]  # not the progress bars
    return "\n".join(lines[:limit]) + "\n"
