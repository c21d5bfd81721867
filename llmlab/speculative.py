"""Speculative decoding (notebook 12): guess several tokens cheaply, let the model check them in one step.

Why: at batch 1 a decode step is bound by reading the weights (notebook 09's roofline), not by arithmetic, so
checking five tokens costs about as much as producing one.  A *drafter* proposes ``k`` tokens; the model runs once
over all of them and keeps the longest prefix it agrees with, plus one token of its own.  With greedy sampling the
answer is exactly the model's own; with sampling, vLLM's rejection sampler keeps the model's distribution.  The
simplest drafter needs no second model: **n-gram (prompt-lookup) drafting** finds the last few tokens earlier in
the prompt or the answer and proposes what followed them there.

A **draft model** guesses from the language instead: a smaller model of the same vocabulary (the course ships
``llmlab-tiny-draft``) runs ``k`` cheap passes per step.  The server's ``--speculative-config`` takes the method and
``k``; :func:`ngram_args` and :func:`draft_args` build it and refuse a bad one before vLLM does.  vLLM counts
drafts, drafted and accepted tokens on ``/metrics``; :func:`scrape` reads them, :func:`speculation` turns the
difference of two scrapes into the acceptance rate and tokens per step, and :func:`expected_tokens_per_step` is
the textbook prediction to hold them against.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from llmlab import loadtest
from llmlab.serve.metrics import Counters, counters, wait_for_request
from llmlab.serve.paths import DRAFT_MODEL


def _check_tokens(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r}: give a whole number of tokens, at least 1.")
    if values["k"] > 16:
        raise ValueError(f"k={values['k']}: a draft that long is almost never accepted whole and every rejected token "
                         "costs compute; vLLM's examples use 2 to 8.")


def ngram_args(k: int = 4, lookup_min: int = 2, lookup_max: int = 4) -> list[str]:
    """``vllm serve`` flags for n-gram drafting: propose ``k`` tokens after the longest match of the last
    ``lookup_min``..``lookup_max`` tokens found earlier in the sequence."""
    _check_tokens(k=k, lookup_min=lookup_min, lookup_max=lookup_max)
    if lookup_min > lookup_max:
        raise ValueError(f"lookup_min={lookup_min} > lookup_max={lookup_max}: the shortest n-gram to look up "
                         "cannot be longer than the longest.")
    config = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lookup_min,
              "prompt_lookup_max": lookup_max}
    return ["--speculative-config", json.dumps(config)]


def draft_args(k: int = 4, model: str | Path = DRAFT_MODEL) -> list[str]:
    """``vllm serve`` flags for drafting with a small model (default: the course's ``llmlab-tiny-draft``): it runs
    ``k`` passes of its own to propose ``k`` tokens.  It must share the served model's vocabulary: the same token
    ids, or its guesses mean other words."""
    _check_tokens(k=k)
    if not (Path(model) / "config.json").is_file():
        raise FileNotFoundError(f"{model}: no config.json there. Give the folder of a draft model with the served "
                                "model's tokenizer (the course ships llmlab/models/llmlab-tiny-draft).")
    config = {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}
    return ["--speculative-config", json.dumps(config)]


def scrape(client, before: Counters | None = None, requests: int = 1) -> Counters:
    """The server's :class:`~llmlab.serve.metrics.Counters` now.  Given the scrape ``before`` some requests, it first
    waits until the server has counted ``requests`` more finished ones: vLLM records a request just after answering.
    A server that does not speculate exports no drafting counters: they read 0."""
    return counters(client) if before is None else wait_for_request(client, before, requests)


@dataclass(frozen=True)
class Speculation:
    """What the requests between two scrapes drafted and accepted (:func:`speculation` of ``after - before``).

    - ``acceptance_rate``: accepted / drafted tokens;
    - ``mean_accepted``: accepted tokens per draft (0 to k);
    - ``tokens_per_step``: output tokens per forward pass of the model.  Every step yields one token of the
      model's own plus whatever it accepted, so the passes are ``generated - accepted``;
    - ``accepted_at``: per draft position, the share of drafts accepted *up to* that position (falling: a
      rejection ends the draft).
    """

    drafts: int
    draft_tokens: int
    accepted: int
    generated: int
    acceptance_rate: float
    mean_accepted: float
    tokens_per_step: float
    accepted_at: list[float]


def speculation(delta: Counters) -> Speculation:
    """The drafting figures of ``after - before``, two :func:`scrape` s around some requests."""
    if delta.generated <= 0:
        raise ValueError("no output tokens between these scrapes: send the requests between `before` and `after`.")
    drafts = delta.drafts
    return Speculation(drafts, delta.draft_tokens, delta.accepted, delta.generated,
                       acceptance_rate=delta.accepted / delta.draft_tokens if delta.draft_tokens else 0.0,
                       mean_accepted=delta.accepted / drafts if drafts else 0.0,
                       tokens_per_step=delta.generated / (delta.generated - delta.accepted),
                       accepted_at=[a / drafts if drafts else 0.0 for a in delta.accepted_at])


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Tokens per drafting step if each drafted token is accepted with probability ``alpha`` *given that the
    ones before it were* (Leviathan et al., 2023), the same at every position: ``1 + alpha + ... + alpha**k`` =
    ``(1 - alpha**(k+1)) / (1 - alpha)``.

    ``alpha`` is not vLLM's acceptance rate.  vLLM reports ``r`` = accepted / drafted tokens, an average over the
    draft's positions; tokens per drafting step are exactly ``1 + r * k`` whatever the acceptance looks like.
    Since ``alpha**i <= alpha``, feeding ``r`` in here always comes out below that: a fact of the definitions,
    not of the data.  :func:`conditional_acceptance` estimates ``alpha`` from the positions."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha={alpha}: an acceptance rate lies between 0 and 1.")
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"k={k!r}: the draft length is a whole number of tokens, 0 or more.")
    return float(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def conditional_acceptance(spec: Speculation) -> list[float]:
    """Per draft position p, the share of drafts accepted at p among those accepted up to p - 1: ``s_p /
    s_(p-1)`` (``s_0`` at position 0), Leviathan's alpha measured at each position.  Independent acceptance
    keeps it constant; a rise along the draft means acceptance comes in runs."""
    shares = spec.accepted_at
    return [s / prev if prev else 0.0 for s, prev in zip(shares, [1.0, *shares[:-1]], strict=True)]


def position_table(spec: Speculation) -> pd.DataFrame:
    """Per draft position: the share of drafts accepted up to it (``s_p``), the share accepted there among those
    that got there (:func:`conditional_acceptance`), and what independent acceptance at position 0's rate would
    give (``s_0 ** (p + 1)``): the test of independence."""
    shares = spec.accepted_at
    first = shares[0] if shares else 0.0
    return pd.DataFrame({"accepted up to here": shares,
                         "given the one before": conditional_acceptance(spec),
                         "if independent": [first ** (p + 1) for p in range(len(shares))]},
                        index=pd.Index(range(len(shares)), name="draft position")).round(3)


def measure(client, model: str, prompts: list[str], concurrency: int, max_tokens: int = 64) -> dict:
    """Send ``prompts`` greedily (``ignore_eos``: every answer ``max_tokens`` long) through
    :func:`llmlab.loadtest.run` and read the server's counters around them: latency, throughput and, on a
    server that speculates, acceptance and tokens per step (a plain server reports 1 token per step).

    The server must be this client's alone while it runs: the counters are the server's, not the requests'."""
    before = scrape(client)
    result = loadtest.run(client, model, prompts, concurrency=concurrency, max_tokens=max_tokens, temperature=0,
                          ignore_eos=True, progress=False).summary()
    if result["errors"]:
        raise RuntimeError(f"{result['errors']} of {result['requests']} requests failed: see the records of "
                           "llmlab.loadtest.run for the reasons.")
    spec = speculation(scrape(client, before, len(prompts)) - before)
    return {"latency p50 (ms)": result["latency_p50"] * 1e3, "tokens/s": result["output_tokens_per_s"],
            "acceptance": spec.acceptance_rate, "tokens per step": spec.tokens_per_step}


def compare(servers: dict, workloads: dict[str, list[str]], concurrencies=(1, 32), max_tokens: int = 64,
            rounds: int = 1) -> pd.DataFrame:
    """:func:`measure` every workload at every concurrency on every server (``{"name": (client, model)}``),
    alternating the servers so that a busy moment of the machine does not land on one of them only; with
    ``rounds`` > 1 each figure is the median of the rounds."""
    rows = []
    for _ in range(rounds):
        for workload, prompts in workloads.items():
            for c in concurrencies:
                jobs = (list(prompts) * (2 * c // len(prompts) + 1))[:max(2 * c, len(prompts))]
                for name, (client, model) in servers.items():
                    rows.append({"workload": workload, "concurrency": c, "server": name,
                                 **measure(client, model, jobs, c, max_tokens)})
    table = pd.DataFrame(rows).groupby(["workload", "concurrency", "server"], sort=False).median()
    return table.round({"latency p50 (ms)": 0, "tokens/s": 0, "acceptance": 2, "tokens per step": 2})
