"""Many LoRA adapters, one server (notebook 17): the shipped adapters, what they change, and what mixing costs.

Why: a fine-tune that changes every weight is a second model to store and to serve.  A LoRA adapter changes none:
each adapted matrix ``W`` gains ``A`` (rank x in) and ``B`` (out x rank), the layer computes
``W x + (alpha / rank) B A x``, and only ``A`` and ``B`` are trained and shipped -- 3.8 % of the tiny model's
parameters at rank 8, 0.3 % of Llama 3.1 70B's at rank 16 (:mod:`llmlab.memory.lora`).  vLLM serves many of them
beside one copy of the base weights (``--enable-lora --lora-modules NAME=DIR``): a request names an adapter as its
``model``, and one engine step can run requests of different adapters side by side, up to ``--max-loras`` of them
(each holds a slot of ``--max-lora-rank`` for every adapted layer).  Requests of an adapter that finds no free slot
wait, which :func:`send_mixed` and the engine's step counter (:func:`llmlab.batching.counters`) make visible.

The two shipped adapters (``llmlab/models/adapters``, ``python -m llmlab.ops.tinylora``) teach the tiny model, which
learnt modern English from the World English Bible, two other voices of the same book: ``kjv`` (the King James
Version's English) and ``rv1909`` (the Spanish of the Reina-Valera of 1909).  :func:`voice` tells them apart, and
:func:`merge` proves what an adapter is: the base weights plus ``scale x B A``, which transformers then runs to the
same greedy tokens as vLLM's adapter.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from llmlab import batching, loadtest
from llmlab.memory import lora as mlora
from llmlab.serve.metrics import LORA_INFO, fetch_metrics  # LORA_INFO: a gauge per state of the slots
from llmlab.serve.paths import TINY_MODEL

ADAPTERS_DIR = TINY_MODEL.parent / "adapters"
# Words that mark a voice: the King James' pronouns and verb endings; the commonest short Spanish words.
MARKERS = {"kjv": frozenset("thee thou thy thine ye hath doth saith unto shalt art hast didst".split()),
           "rv1909": frozenset("el la los las de del que y en su por á fué para con se".split())}

__all__ = ["AdapterError", "Adapter", "read", "shipped", "serve_args", "merge", "voice", "side_by_side",
           "first_token_choices", "send_mixed", "slot_states"]


class AdapterError(ValueError):
    """An adapter folder that vLLM would refuse, said before an engine starts (and with the fix)."""


@dataclass(frozen=True)
class Adapter:
    """One PEFT-format LoRA adapter as its files say: rank, alpha, target modules and its matrices' shapes."""

    name: str
    path: Path
    rank: int
    alpha: int
    targets: tuple[str, ...]
    shapes: dict = field(repr=False)        # tensor name -> shape

    @property
    def scale(self) -> float:
        """What ``B A x`` is multiplied by: ``alpha / rank``."""
        return self.alpha / self.rank

    @property
    def params(self) -> int:
        return sum(a * b for a, b in self.shapes.values())

    @property
    def training(self) -> dict:
        """The adapter's ``training.json`` (held-out losses, recipe) when it has one."""
        p = self.path / "training.json"
        return json.loads(p.read_text()) if p.is_file() else {}


def read(path, name: str | None = None) -> Adapter:
    """Read and check an adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``)."""
    from safetensors import safe_open

    path = Path(path)
    config_file, weights = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file() or not weights.is_file():
        raise AdapterError(f"{path} is not a LoRA adapter: it needs adapter_config.json and "
                           "adapter_model.safetensors (what peft's save_pretrained writes).")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise AdapterError(f"{config_file} is not valid JSON ({e}): rewrite it, or save the adapter again.") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise AdapterError(f"{config_file}: peft_type must be \"LORA\" (vLLM serves LoRA adapters only).")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float) or alpha <= 0:
        raise AdapterError(f"{config_file}: r={rank!r} and lora_alpha={alpha!r} must be positive numbers "
                           "(r a whole one).")
    targets = config.get("target_modules") or []
    try:
        with safe_open(weights, "pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (no iter)
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError) for a file it cannot read
        raise AdapterError(f"{weights} is not a readable safetensors file ({e}): copy or save the adapter "
                           "again.") from None
    bad = [k for k, s in shapes.items() if ("lora_A" in k and s[0] != rank) or ("lora_B" in k and s[1] != rank)]
    if bad:
        raise AdapterError(f"{weights}: {len(bad)} matrices are not of rank r={rank} (e.g. {bad[0]} "
                           f"{shapes[bad[0]]}): the config and the weights come from different adapters.")
    return Adapter(name or path.name, path, rank, alpha, tuple(targets), shapes)


def shipped() -> dict[str, Path]:
    """The course's adapters of the tiny model: ``{name: folder}``."""
    return {p.name: p for p in sorted(ADAPTERS_DIR.iterdir()) if (p / "adapter_config.json").is_file()}


def serve_args(adapters: dict | None = None, max_loras: int = 2, max_rank: int | None = None) -> list[str]:
    """The ``vllm serve`` flags that serve ``adapters`` (``{name: folder}``; default: the shipped ones) beside the
    base model: one ``--lora-modules`` per adapter, ``--max-loras`` slots of ``--max-lora-rank`` (default: the
    largest rank among them, rounded up to a value vLLM accepts, :data:`llmlab.memory.lora.MAX_LORA_RANKS`; vLLM's
    own default, 16, would reserve twice the memory of rank-8 adapters)."""
    if isinstance(max_loras, bool) or not isinstance(max_loras, int) or max_loras < 1:
        raise AdapterError(f"max_loras={max_loras!r}: the engine needs at least 1 adapter slot (--max-loras), "
                           "a whole number.")
    adapters = shipped() if adapters is None else adapters
    if not adapters:
        raise AdapterError("No adapter to serve: pass {name: folder}, or reinstall llmlab for the shipped ones.")
    read_ = [read(p, n) for n, p in adapters.items()]
    rank = max_rank or mlora.allowed_rank(max(a.rank for a in read_))
    if rank not in mlora.MAX_LORA_RANKS:
        raise AdapterError(f"max_rank={rank}: vLLM's --max-lora-rank takes only "
                           f"{', '.join(map(str, mlora.MAX_LORA_RANKS))}; pass {mlora.allowed_rank(rank)}.")
    too_big = [a.name for a in read_ if a.rank > rank]
    if too_big:
        raise AdapterError(f"{', '.join(too_big)}: rank above max_rank={rank}; vLLM refuses to load them. Pass "
                           f"max_rank={mlora.allowed_rank(max(a.rank for a in read_))}.")
    return ["--enable-lora", "--lora-modules", *(f"{a.name}={a.path}" for a in read_),
            "--max-loras", str(max_loras), "--max-lora-rank", str(rank)]


def merge(model, adapter: Adapter | str | Path):
    """Add ``scale x B A`` to each adapted weight of a transformers ``model``, in place, and return it: the adapter
    as a plain fine-tuned model (what ``peft``'s ``merge_and_unload`` does), which vLLM's served adapter must
    match token for token."""
    import torch
    from safetensors.torch import load_file

    adapter = adapter if isinstance(adapter, Adapter) else read(adapter)
    tensors = load_file(adapter.path / "adapter_model.safetensors")
    weights = dict(model.named_parameters())
    with torch.no_grad():
        for key in [k for k in tensors if k.endswith(".lora_A.weight")]:
            stem = key[:-len(".lora_A.weight")].removeprefix("base_model.model.")
            w = weights.get(stem + ".weight")
            if w is None:
                raise AdapterError(f"{adapter.name} adapts {stem}, which this model does not have: an adapter "
                                   "of another base model.")
            b = tensors[key[:-len("lora_A.weight")] + "lora_B.weight"]
            w += adapter.scale * (b @ tensors[key]).to(w.dtype)
    return model


_WORD = re.compile(r"[^\W\d_]+", re.UNICODE)


def voice(text: str) -> dict[str, float]:
    """The share of ``text``'s words that mark each voice (:data:`MARKERS`), and its word count."""
    words = [w.lower() for w in _WORD.findall(text)]
    shares = {name: (sum(w in marks for w in words) / len(words) if words else 0.0) for name, marks in MARKERS.items()}
    return {**shares, "words": len(words)}


def side_by_side(client, prompts: list[str], models: list[str], max_tokens: int = 48) -> pd.DataFrame:
    """Each prompt's greedy answer from each model (the base model's name or an adapter's), with its voice."""
    rows = []
    for prompt in prompts:
        for model in models:
            text = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                             temperature=0).choices[0].text
            rows.append({"prompt": prompt, "model": model, "answer": text.strip(),
                         **{f"{k} words": round(v, 3) for k, v in voice(text).items() if k != "words"}})
    return pd.DataFrame(rows)


def first_token_choices(client, prompt: str, models: list[str], top: int = 5) -> pd.DataFrame:
    """The ``top`` likeliest first tokens after ``prompt`` under each model, with their probabilities: where an
    adapter moves the distribution, not only the greedy pick."""
    import math

    rows = {}
    for model in models:
        lp = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0,
                                       logprobs=top).choices[0].logprobs.top_logprobs[0]
        rows[model] = [f"{t!r} {math.exp(v):.2f}" for t, v in sorted(lp.items(), key=lambda kv: -kv[1])][:top]
    return pd.DataFrame(rows, index=[f"#{i + 1}" for i in range(top)])


def send_mixed(client, counts: dict[str, int], max_tokens: int = 64, prompt: str = "And the angel said") -> \
        loadtest.LoadResult:
    """``counts[model]`` requests of each model (the base model or an adapter), all sent at once, greedy, each
    exactly ``max_tokens`` long; one run of :mod:`llmlab.loadtest` records (their ``model`` says whose)."""
    if not counts or any(not isinstance(n, int) or n < 1 for n in counts.values()):
        raise ValueError(f"counts={counts!r}: give each model a whole number of requests, at least 1.")
    sampling = {"temperature": 0, "ignore_eos": True, "progress": False, "max_tokens": max_tokens}

    async def everyone():
        return await asyncio.gather(*(loadtest.run_async(client, model, [prompt] * n, concurrency=n, **sampling)
                                      for model, n in counts.items()))

    runs = loadtest.in_a_loop(everyone())
    records = []
    for model, run in zip(counts, runs, strict=True):
        for r in run.records:
            r.id = f"{model}:{r.id}"
        records += run.records
    return batching.one_session(records, sum(counts.values()), " + ".join(f"{n} {m}" for m, n in counts.items())) \
        .raise_on_failure()


def slot_states(client) -> pd.DataFrame:
    """Every state of the adapter slots the server has reported since it started (:data:`LORA_INFO`), the latest
    last: the adapters with requests ``running``, those with requests ``waiting`` (each list sorted), and
    ``max_lora``.  A request counts as waiting from its arrival until the step that admits it."""
    def names(text: str) -> str:
        return ", ".join(sorted(n for n in text.split(",") if n))

    m = fetch_metrics(str(client.base_url), client.api_key)
    rows = sorted(m[LORA_INFO], key=lambda s: s.value)  # none from a server started without --enable-lora
    return pd.DataFrame([{"running": names(s.labels.get("running_lora_adapters", "")),
                          "waiting": names(s.labels.get("waiting_lora_adapters", "")),
                          "max_lora": int(s.labels.get("max_lora", 0))} for s in rows],
                        columns=["running", "waiting", "max_lora"])
