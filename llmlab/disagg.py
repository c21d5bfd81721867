"""Prefill and decode apart (notebook 18): one engine reads the prompt, another writes the answer, and the KV cache
moves between them.

Why: a request has two phases that want different things.  The prefill computes every prompt token at once
(compute-bound, long steps); the decode adds one token per step (memory-bound, short steps).  On one engine they
share the steps: a long prompt arriving stretches the step that every running answer waits for (lesson 13's
chunked prefill bounds how much, it cannot remove it).  *Disaggregated* serving gives each phase engines of its
own and moves the prompt's KV cache from the prefill engine to the decode engine: what it costs is those bytes on
a link, which :func:`kv_bytes` and :func:`transfer_table` put against the prefill's own time.

Live here with vLLM's ``ExampleConnector`` (``vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py``),
which runs on the CPU build: an engine writes each new prompt's KV cache, one safetensors file per layer, into a
shared folder, and finds a prompt's folder by a hash of its tokens and loads it instead of computing those tokens.
It does both on either engine (it never reads ``kv_role``); the roles here say which engine a client sends what.
A cluster uses a connector that moves GPU memory over the network instead, with a proxy that sends each request to
a prefill engine first; the engines' side is the same.  vLLM 0.32 registers (``kv_connector/factory.py:153-248``)
ExampleConnector, ExampleHiddenStatesConnector, LMCacheConnectorV1, LMCacheMPConnector, NixlConnector (and its
NixlPullConnector and NixlPushConnector modes), MultiConnector, HiSparseConnector, MoRIIOConnector,
OffloadingConnector, DecodeBenchConnector, MooncakeConnector, MooncakeStoreConnector, FlexKVConnectorV1,
SimpleCPUOffloadConnector and HF3FSKVConnector; older releases' ``P2pNcclConnector`` is not among them.
:data:`WHEN_MOVED` says when the ones that move a prefill's cache to a decode engine send it.

    with disagg.Pair() as pair:                  # two engines of the tiny model, a core each, one folder
        first = pair.prefill(prompt)              # on the producer: max_tokens=1, its KV cache written
        answer = pair.decode(prompt, 50)          # on the consumer: the KV loaded, the answer computed
        pair.stored()                             # the files, their bytes, the tokens they hold
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from llmlab import loadtest, memory
from llmlab.cluster.layouts import IB_GBPS, NVLINK_GBPS
from llmlab.connection import connect
from llmlab.replicas import split_cores
from llmlab.serve.embedded import EmbeddedServer
from llmlab.serve.metrics import counters
from llmlab.serve.vllm import BIND, log_messages

__all__ = ["LINKS", "MATMUL_FLOPS", "ROLES", "WHEN_MOVED", "connector_args", "Pair", "kept_tokens", "stored",
           "by_source", "Beside", "decode_beside_prefills", "beside_table", "kv_bytes", "prefill_flops",
           "transfer_table", "break_even_bytes_per_s", "ttft_apart", "pd_ratio"]

# Per direction, nominal (bytes/s).  NVLink and one InfiniBand NDR port as lesson 08 counts them
# (llmlab.cluster.layouts); Ethernet at its line rate (100 and 25 Gb/s), which TCP reaches only in part.
LINKS = {"NVLink 4 (inside a node)": NVLINK_GBPS * 1e9, "InfiniBand NDR (one port)": IB_GBPS * 1e9,
         "Ethernet 100 Gb/s": 100e9 / 8, "Ethernet 25 Gb/s": 25e9 / 8}
# An H100 SXM's dense bf16 Tensor Core rate, a spec, not a measurement: NVIDIA's H100 datasheet gives 1,979 TFLOP/s
# "with sparsity", half of it dense (https://www.nvidia.com/en-us/data-center/h100/).  A prefill's matrix products
# reach less, so prefill times from it are lower bounds.
MATMUL_FLOPS = 989e12
# When a connector sends a prefill's KV cache to the decode engine, in vLLM 0.32 (files under
# vllm/distributed/kv_transfer/kv_connector/v1/).  "layer by layer": during the prefill's forward pass, each layer's
# share once that layer is computed (its save_kv_layer does the work), so the move overlaps the prefill.  "after the
# prefill": once the prefill request has finished, so the whole move adds to that request's time to first token.
WHEN_MOVED = {
    "ExampleConnector": "layer by layer",  # example_connector.py:212-259: a file per layer in save_kv_layer
    "LMCacheConnectorV1": "layer by layer in LMCache's use_layerwise mode, after the forward pass otherwise",
    # lmcache_integration/vllm_v1_adapter.py:948-967 (save_kv_layer returns unless use_layerwise) and 1050-1066
    "MoRIIOConnector": "layer by layer in its WRITE mode, after the prefill in READ mode",
    # moriio/moriio_connector.py:2871-2882: the producer writes each layer's blocks, unless mode is READ
    "NixlConnector": "after the prefill",  # nixl/connector.py:294-306: wait_for_layer_load and save_kv_layer do
    # nothing ("does not do layerwise saving"); nixl/pull_scheduler.py:34-65, the decode side reads every prompt
    # block once the prefill is done; nixl/push_scheduler.py:12-16, the prefill side writes on request_finished
    "MooncakeConnector": "after the prefill",  # mooncake/mooncake_connector.py:831-843: the same two no-ops
}
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")  # vllm:prompt_tokens_by_source
ROLES = ("kv_producer", "kv_consumer")  # the prefill engine, the decode engine


def connector_args(role: str, folder: Path | str) -> list[str]:
    """The ``vllm serve`` flag that gives an engine the ExampleConnector on ``folder`` with role ``kv_producer``,
    ``kv_consumer`` or ``kv_both``.  The ExampleConnector never reads the role: any engine with it writes every new
    prompt's KV cache into ``folder`` and loads what it finds there (other connectors do read it)."""
    if role not in ("kv_producer", "kv_consumer", "kv_both"):
        raise ValueError(f"role={role!r}: vLLM's roles are kv_producer, kv_consumer and kv_both.")
    return ["--kv-transfer-config", json.dumps({"kv_connector": "ExampleConnector", "kv_role": role,
                                                "kv_connector_extra_config": {"shared_storage_path": str(folder)}})]


def kept_tokens(prompt_tokens: int, block_size: int = memory.CPU_BLOCK_SIZE) -> int:
    """The prompt tokens whose KV cache the ExampleConnector moves (the demo connector's rule, not every one's): the
    whole blocks of the prompt's first ``prompt_tokens - 2`` tokens (the connector's
    ``align_to_block_size(len(prompt) - 1)`` rounds ``len - 2`` down).  So never the last token, which the decode
    engine computes itself (its logits give the first answer token): a prompt of 130 tokens moves 128, one of 129
    moves none.  NixlConnector moves every prompt token's KV, the last
    block's part included (``nixl/base_scheduler.py:396-403``), and the decode engine recomputes the last token
    only (``v1/core/sched/scheduler.py:3171-3172``)."""
    return max(prompt_tokens - 2, 0) // block_size * block_size


class Pair:
    """A prefill engine (``kv_producer``) and a decode engine (``kv_consumer``) of the tiny model on one shared folder,
    each bound to its own share of the cores (on a cluster: its own GPUs), started side by side.

    ``prefill``/``decode`` send one prompt to each; ``producer``/``consumer`` are ``(client, model)`` for anything
    else.  Stopping removes the folder (a temporary one unless ``folder`` is given)."""

    def __init__(self, folder: Path | str | None = None, *, extra_args: list[str] = ()):
        self.own_folder = folder is None
        self.folder = Path(folder) if folder else Path(tempfile.mkdtemp(prefix="llmlab-kv-"))
        cores = split_cores(2) if len(os.sched_getaffinity(0)) > 1 else split_cores(1) * 2  # one core: shared
        self.servers = {role: EmbeddedServer(extra_args=[*connector_args(role, self.folder), *extra_args],
                                             env={BIND: c}) for role, c in zip(ROLES, cores, strict=True)}
        self.producer = self.consumer = None

    def start(self, progress: bool = True) -> Pair:
        """Both engines at once (they load side by side), then wait for each."""
        try:
            for server in self.servers.values():
                server.start()
            for role, server in self.servers.items():
                if progress:
                    print(f"{role} (cores {server.env[BIND]}):", end=" ")
                server.wait_ready(progress=progress)
        except BaseException:
            self.stop()
            raise
        self.producer, self.consumer = (connect(s.base_url, s.api_key, quiet=True) for s in self.servers.values())
        return self

    def prefill(self, prompt: str | list[int]):
        """The prefill engine reads ``prompt`` and gives one token: its KV cache is in the folder when this returns
        (the connector writes each layer's share during the forward pass)."""
        client, model = self.producer
        return client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)

    def decode(self, prompt: str | list[int], max_tokens: int):
        """The decode engine answers ``prompt`` greedily: it loads what the folder holds for it and computes the
        rest (``usage.prompt_tokens_details.cached_tokens``: the tokens it did not compute)."""
        client, model = self.consumer
        return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)

    def stored(self) -> pd.DataFrame:
        """:func:`stored` of this pair's folder."""
        return stored(self.folder)

    def connector_log(self, role: str = "kv_consumer") -> list[tuple[str, str]]:
        """What the ExampleConnector logged in one engine so far, ``(process, message)``: its settings, and on the
        consumer ``External Cache Hit!`` (the scheduler found a prompt's files) and the tokens the worker loaded."""
        return log_messages(self.servers[role].log_path.read_text(errors="replace"), "example_connector.py")

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()
        if self.own_folder:
            shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> Pair:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def stored(folder: Path | str) -> pd.DataFrame:
    """What a producer wrote: one row per layer file (its prompt's folder, the layer, the tensor's shape, its bytes
    of KV and the file's bytes on disk).  The shape is (tokens, 2 for K and V, KV heads, head size) on the CPU build,
    so a file holds ``tokens x kv_bytes_per_token / layers`` bytes of KV plus a safetensors header."""
    from safetensors.torch import load_file

    rows = []
    for prompt_dir in sorted(p for p in Path(folder).iterdir() if p.is_dir()):
        for f in sorted(prompt_dir.glob("*.safetensors")):
            t = load_file(f)["kv_cache"]
            rows.append({"prompt": prompt_dir.name[:8], "layer": f.name.removesuffix(".safetensors"),
                         "shape": tuple(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "tokens": t.shape[0],
                         "kv_bytes": t.numel() * t.element_size(), "file_bytes": f.stat().st_size})
    return pd.DataFrame(rows, columns=["prompt", "layer", "shape", "dtype", "tokens", "kv_bytes", "file_bytes"])


def by_source(client) -> dict[str, int]:
    """The engine's prompt tokens so far by where their KV came from (``vllm:prompt_tokens_by_source``): computed
    here, found in its own prefix cache, or loaded through the KV connector."""
    found = counters(client).by_source
    return {s: found.get(s, 0) for s in SOURCES}


@dataclass(frozen=True)
class Beside:
    """One :func:`decode_beside_prefills` run: what the decode engine's counters grew by meanwhile, and the answer.

    ``steps``: as vLLM counts them in ``vllm:iteration_tokens_total``, the steps that gave some request output (a
    step that computed only a chunk of a prompt is not one; these prompts fit one step each); ``mixed_steps``: those
    that computed more than one token (a decode step of one running answer computes 1, so a step above 1 on an engine
    that runs one answer carried prompt tokens beside it); ``computed``: the prompt tokens it computed; ``gaps``: the
    answer's gaps between tokens per range (``vllm:inter_token_latency_seconds``, timed inside the engine core, so a
    slow client cannot blur it); ``answer``: the answer's client record; ``prefill_s``: each prompt's seconds to its
    one token."""

    steps: int
    mixed_steps: int
    computed: int
    gaps: pd.Series
    answer: loadtest.Record
    prefill_s: list[float]


def decode_beside_prefills(decoder, prefiller, *, answer_tokens: int = 300, prompts: int = 4,
                           prompt_tokens: int = 480, delay: float = 0.3, seed: int = 0) -> dict:
    """One greedy answer of ``answer_tokens`` from ``decoder`` (``(client, model)``) while ``prompts`` prompts of
    ``prompt_tokens`` random tokens arrive at ``prefiller``, ``delay`` seconds after the decode engine shows the answer
    running (so that the answer's own prompt step is behind it): the same engine (one engine serves both phases) or
    another (disaggregated).  The prompts fit one step together (4 x 481 tokens under
    the CPU build's 2,048-token budget): the ExampleConnector cannot store a prompt split over steps.

    Returns a :class:`Beside`."""
    (dec, model), (pre, _) = decoder, prefiller
    answer = loadtest.synthetic_workload(1, input_len=16, output_len=answer_tokens, seed=seed)
    long = loadtest.synthetic_workload(prompts, input_len=prompt_tokens, output_len=1, seed=seed + 1)
    before = counters(dec)

    def prefill(job):
        t = time.perf_counter()
        pre.completions.create(model=model, prompt=job.prompt, max_tokens=1, temperature=0)
        return time.perf_counter() - t

    def started() -> bool:  # running now, or already past its first tokens (a slow scrape can miss it running)
        now = counters(dec)
        return now.running >= 1 or now.generated > before.generated

    def send_prompts():  # once the answer runs (so its own prompt's step is behind it), plus ``delay``
        deadline = time.monotonic() + 120
        while not started():
            if time.monotonic() > deadline:
                raise TimeoutError("the answer never showed as running on the decode engine in 120 s: is it alive?")
            time.sleep(0.02)
        time.sleep(delay)
        with ThreadPoolExecutor(prompts) as pool:
            out["prefill_s"] = list(pool.map(prefill, long))

    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(error=_caught(send_prompts)))
    thread.start()
    record = loadtest.run(dec, model, answer, concurrency=1, max_tokens=answer_tokens, progress=False,
                          temperature=0, ignore_eos=True).records[0]
    thread.join()
    if out.get("error"):
        raise out["error"]
    grew = counters(dec) - before
    return Beside(grew.steps, grew.mixed_steps, grew.computed, _ranges(pd.Series(grew.itl.buckets).sort_index()),
                  record, out["prefill_s"])


def beside_table(runs: dict[str, Beside]) -> pd.DataFrame:
    """:func:`decode_beside_prefills` runs side by side: the decode engine's counts, and the answer's gaps by range."""
    rows = {name: {"decoder steps": r.steps, "steps with prompt tokens": r.mixed_steps,
                   "prompt tokens it computed": r.computed, "answer s": round(r.answer.latency, 2),
                   "prompt s (median)": round(float(pd.Series(r.prefill_s).median()), 3),
                   **{f"gaps {k}": v for k, v in r.gaps.items() if v}} for name, r in runs.items()}
    return pd.DataFrame(rows, dtype=object).fillna(0)  # a column per run; object: counts stay whole numbers


def _caught(fn) -> BaseException | None:
    """``fn()``'s exception, returned instead of raised (a thread's exception would be lost)."""
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 -- handed to the caller, who raises it
        return e
    return None


def _ranges(cumulative: pd.Series) -> pd.Series:
    """A histogram's cumulative bucket counts as counts per range, labelled in milliseconds ("10-25 ms")."""
    per = cumulative.diff().fillna(cumulative.iloc[0]).astype(int)
    edges = [0.0, *cumulative.index[:-1]]
    labels = [f"> {lo * 1000:g} ms" if hi == float("inf") else f"{lo * 1000:g}-{hi * 1000:g} ms"
              for lo, hi in zip(edges, cumulative.index, strict=True)]
    return pd.Series(per.to_numpy(), index=labels)


# --------------------------------------------------------------------------------------------------
# On paper: what a transfer costs on a cluster, against the prefill it saves
# --------------------------------------------------------------------------------------------------

def kv_bytes(model, prompt_tokens: int, kv_dtype: str = "auto", tp: int = 1) -> int:
    """The bytes a prefill engine hands over for one prompt: its KV cache, every layer (with ``tp``, each GPU's
    share, which its own link moves)."""
    return memory.kv_bytes_per_token(model, kv_dtype, tp=tp) * prompt_tokens


def prefill_flops(model, prompt_tokens: int) -> float:
    """The arithmetic of one prompt's prefill: 2 FLOPs (a multiply and an add) per weight of the layers' matrices per
    token, plus causal attention (scores and weighted values, ``2 x layers x heads x head_dim x tokens^2`` with half
    the pairs masked), plus the output head once (vLLM computes logits for the last token only).  Sliding windows and
    mixture-of-experts routing are left out: the lesson's models have neither."""
    s = memory.model_spec(model)
    parts = memory.param_breakdown(s)
    matrices = memory.active_params(s) - parts.get("embedding", 0) - parts.get("lm_head", 0) - parts.get("norm", 0)
    head = s.vocab_size * s.hidden_size
    return 2.0 * matrices * prompt_tokens + 2.0 * s.num_layers * s.num_heads * s.head_dim * prompt_tokens ** 2 \
        + 2.0 * head


def transfer_table(models: dict[str, int], links: dict[str, float] = LINKS, flops: float = MATMUL_FLOPS,
                   kv_dtype: str = "auto") -> pd.DataFrame:
    """One row per (model, prompt tokens) of ``models`` (``{model: tokens}``): the KV bytes moved, the fastest the
    prefill can be on one GPU at ``flops``, and the milliseconds each link takes to move those bytes, with the
    transfer's share of the prefill's time."""
    rows = []
    for model, tokens in models.items():
        b, pre = kv_bytes(model, tokens, kv_dtype), prefill_flops(model, tokens) / flops * 1000
        row = {"model": model, "prompt tokens": tokens, "KV MiB": b / 2**20, "prefill ms (at best)": pre}
        for name, rate in links.items():
            row[f"{name} ms"] = b / rate * 1000
        rows.append(row)
    return pd.DataFrame(rows).set_index(["model", "prompt tokens"])


def break_even_bytes_per_s(model, prompt_tokens: int, flops: float = MATMUL_FLOPS, kv_dtype: str = "auto") -> float:
    """The link rate at which moving a prompt's KV takes exactly as long as computing it at ``flops``: the rate a
    prefill GPU that computes such prompts back to back sends KV at.  With a transfer after the prefill
    (NixlConnector, :data:`WHEN_MOVED`) a link at this rate doubles the prefill's part of the time to first token;
    with a layer-by-layer connector it is the slowest link the prefill still hides."""
    return kv_bytes(model, prompt_tokens, kv_dtype) / (prefill_flops(model, prompt_tokens) / flops)


def ttft_apart(model, prompt_tokens: int, link_bytes_per_s: float, first_step_s: float, *, queue_s: float = 0.0,
               tp: int = 1, layer_by_layer: bool = False, flops: float = MATMUL_FLOPS) -> dict[str, float]:
    """A request's time to first token in a disaggregated service, in seconds, part by part: its wait in the
    prefill engine's queue, the prefill (at ``flops`` per GPU over ``tp`` GPUs, a lower bound), the KV transfer
    that the prefill does not hide (each GPU's share over its own link), and the decode engine's first step (which
    computes the last prompt token and samples the first answer token), and their ``total``.

    After the prefill (NixlConnector, MooncakeConnector) the whole transfer adds.  Layer by layer, a layer's share
    leaves once the layer is computed: the last layer's share never hides, and neither does what the link cannot
    move while the prefill runs, so what adds is ``max(t / layers, t - prefill x (layers - 1) / layers)``."""
    prefill = prefill_flops(model, prompt_tokens) / (flops * tp)
    t = kv_bytes(model, prompt_tokens, tp=tp) / link_bytes_per_s
    if layer_by_layer:
        layers = memory.model_spec(model).num_layers
        t = max(t / layers, t - prefill * (layers - 1) / layers)
    parts = {"queue": queue_s, "prefill": prefill, "transfer": t, "first step": first_step_s}
    return {**parts, "total": sum(parts.values())}


def pd_ratio(model, prompt_tokens: int, answer_tokens: int, step_s: float, running: int,
             flops: float = MATMUL_FLOPS) -> float:
    """Prefill GPUs per decode GPU (pools of the same TP) that keep both pools as busy as each other: one request's
    prefill seconds at ``flops`` against its share of the decode engine's time, ``answer_tokens`` steps of
    ``step_s`` each shared by ``running`` answers.  ``flops`` is an upper bound, so this is a lower bound."""
    return prefill_flops(model, prompt_tokens) / flops / (answer_tokens * step_s / running)
